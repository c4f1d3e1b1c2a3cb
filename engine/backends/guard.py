"""The one answer to "can the repeat guard run here?", asked wherever a guard meets a backend: a vLLM engine before
its slow start (``backends/vllm/backend.py``), ``GenerationEngine.derive`` turning the guard on over a loaded backend,
and the guard attaching to ms-swift's own ``swift rollout`` engine (``swift_rollout/attach.py``).

A backend says why it cannot run row rules (``Capabilities.rules_problem``, or vLLM's runner plan before the start:
no logits-processor interface for its model runner, speculative decoding); an enabled guard on such a backend is
refused by name, never silently left off.

>>> check_guard_can_run(True, "hf", None)
>>> check_guard_can_run(False, "vllm", "no V2 logits processors")
>>> check_guard_can_run(True, "vllm", "no V2 logits processors")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
engine.errors.UnsupportedCapabilityError: repeat_terminate.enabled is true, but the guard cannot be activated: no V2 \
logits processors (backend 'vllm' cannot run row rules here). Fix: use a vLLM with ...
"""

from __future__ import annotations

from engine.errors import UnsupportedCapabilityError

FIXES = {"vllm": "use a vLLM with the logits-processor interface of its model runner (V1 or V2), without speculative "
                 "decoding, or set repeat_terminate.enabled: false"}
"""How to get a guard that runs, by backend (any other: turn it off or pick a backend that can)."""


def guard_refusal(backend: str, problem: str) -> str:
    """Why an enabled guard cannot run on ``backend``, and the fix."""
    fix = FIXES.get(backend, "set repeat_terminate.enabled: false, or use a backend that can")
    return (f"repeat_terminate.enabled is true, but the guard cannot be activated: {problem} (backend {backend!r} "
            f"cannot run row rules here). Fix: {fix}")


def check_guard_can_run(enabled: bool, backend: str, problem: str | None) -> None:
    """Refuse an enabled guard on a backend that cannot run row rules (``problem``: why; None: it can)."""
    if enabled and problem is not None:
        raise UnsupportedCapabilityError(guard_refusal(backend, problem))
