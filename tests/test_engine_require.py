"""``--engine-require``: a required backend that cannot run fails the conformance session instead of skipping."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conformance.kit import availability

ROOT = Path(__file__).resolve().parents[1]


def test_a_required_backend_that_cannot_run_stops_the_session(monkeypatch):
    monkeypatch.setattr(availability, "unavailable_reason",
                        lambda b: "vllm: vllm not installed" if b == "vllm" else None)
    with pytest.raises(pytest.UsageError, match=r"required backends cannot run here \(vllm: vllm not installed\)"):
        availability.check_required("hf,vllm", ["hf", "vllm"])
    availability.check_required("hf", ["hf", "vllm"])  # hf can run: nothing raised


def test_unknown_or_unselected_required_backends_are_usage_errors():
    with pytest.raises(pytest.UsageError, match=r"unknown \['tgi'\]"):
        availability.check_required("tgi", ["hf"])
    with pytest.raises(pytest.UsageError, match=r"lists \['vllm'\], which --engine-backends \(hf\) leaves out"):
        availability.check_required("vllm", ["hf"])


def test_the_pytest_session_fails_before_collecting_tests():
    """Through pytest itself: exit status 4 (usage error), the reason printed; no test ran or was skipped."""
    run = subprocess.run([sys.executable, "-m", "pytest", "conformance", "--collect-only", "-q",
                          "--engine-backends=hf", "--engine-require=vllm", "-p", "no:cacheprovider"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 4, run.stdout + run.stderr
    assert "--engine-require lists ['vllm']" in run.stderr
