"""The engine's error hierarchy.

Every error raised for bad input says what was wrong (the field), the value, and what to do about it.
Catch :class:`EngineError` to catch them all.

>>> from engine.errors import ConfigError
>>> err = ConfigError("generation.top_p", 1.5, "must be in (0, 1]", fix="use a value such as 0.9")
>>> str(err)
'generation.top_p must be in (0, 1], got 1.5. Fix: use a value such as 0.9.'
>>> err.field, err.value
('generation.top_p', 1.5)
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

SHOWN_CHARS = 200
"""Most characters of an offending value an error message repeats (a 50 MB value is named, not echoed back)."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A ``fix`` naming the closest choice (if any) and every available one: what an error about a misspelt name says.

    >>> did_you_mean("hff", ["vllm", "hf"])
    "did you mean 'hf'? available: hf, vllm"
    """
    choices = sorted(choices)
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}available: {', '.join(choices)}"


def shown(value: Any) -> str:
    """``repr(value)``, cut to :data:`SHOWN_CHARS` with the full length said.

    >>> shown("abc")
    "'abc'"
    >>> shown("x" * 1000)[-21:], len(shown("x" * 1000))
    ('... (1002 characters)', 221)
    """
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int beyond Python's digit limit, or nesting too deep to print
        return f"<{type(value).__name__} too large to show>"
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class _FieldError(EngineError, ValueError):
    """An error about one named field with an offending value and a fix."""

    def __init__(self, field: str, value: Any, problem: str, *, fix: str | None = None) -> None:
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix
        message = f"{field} {problem}, got {shown(value)}."
        if fix:
            message += f" Fix: {fix.rstrip('.')}."
        super().__init__(message)


class ConfigError(_FieldError):
    """A configuration key is unknown, missing, of the wrong type, out of range, or conflicts with another."""


class RequestError(_FieldError):
    """A generation request is malformed (empty messages, unknown role, ...). ``field`` names the request."""


class RequestTooLarge(RequestError):
    """A request goes over one of the server's limits on size (its body, prompts per call, stop strings); served
    as HTTP 413 where the body itself is too large, else 400."""


class RequestTimedOut(RequestError):
    """A client stopped sending its request body part-way (HTTP 408)."""


class UnsupportedCapabilityError(EngineError):
    """The selected backend cannot do what the request or config asks for."""


class PluginCompatibilityError(EngineError):
    """A plugin needs a hook or request kind the selected backend or request does not offer."""


class BackendUnavailableError(EngineError, ImportError):
    """A backend cannot be loaded on this machine; the message names the backend and what is missing."""

    def __init__(self, backend: str, missing: str, fix: str) -> None:
        self.backend = backend
        self.missing = missing
        super().__init__(f"backend {backend!r} cannot load: {missing}. Fix: {fix.rstrip('.')}.")
