"""Which backends can run here, and ``--engine-require``: a required backend that cannot run stops the session."""

from __future__ import annotations

import importlib.util

import pytest

from engine.backends.registry import SPECS
from engine.config import BACKENDS


def unavailable_reason(backend: str) -> str | None:
    """Why ``backend`` cannot run on this machine, or None when it can."""
    missing = [m for m in SPECS[backend].modules if importlib.util.find_spec(m) is None]
    return f"{backend}: {', '.join(missing)} not installed" if missing else None


def check_required(option: str, backends: list[str]) -> None:
    """``--engine-require``: every listed backend is selected and can run here, or the session stops now."""
    required = [b.strip() for b in option.split(",") if b.strip()]
    unknown = [b for b in required if b not in BACKENDS]
    if unknown:
        raise pytest.UsageError(f"--engine-require: unknown {unknown}; available: {', '.join(BACKENDS)}")
    unselected = [b for b in required if b not in backends]
    if unselected:
        raise pytest.UsageError(f"--engine-require lists {unselected}, which --engine-backends "
                                f"({','.join(backends)}) leaves out; fix: select them or require fewer")
    missing = [reason for b in required if (reason := unavailable_reason(b))]
    if missing:
        raise pytest.UsageError(f"--engine-require: required backends cannot run here ({'; '.join(missing)}); "
                                "fix: install them (nox -s conformance does) or drop them from --engine-require")
