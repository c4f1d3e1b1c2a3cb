"""Audit metrics as a neutral payload (metric name -> number), and their global aggregation.

Each metric belongs to a family that says how ranks combine it:

==============================  ========  ===========================================================
metric                          family    global value
==============================  ========  ===========================================================
rollout/repeat_terminate_active flag      max over ranks (1 if any rank had the guard on)
rollout/repeat_terminate_trig…  counter   sum
rollout/gen_new_tokens_p99      p99       max of the rank-local p99s
rollout/parse_truncated_rate    rate      sum(numerator) / sum(denominator); 0 when the denominator is 0
rollout/parse_dropped_invalid   counter   sum (supplied by the caller: the engine never parses)
rollout/generate_seconds        seconds   max
==============================  ========  ===========================================================

A rate travels with its numerator and denominator (``…/num``, ``…/den``) so it can be recombined.
``parse_truncated_rate`` counts sequences that hit the token budget (finish reason "length"): a parser
downstream sees them cut off.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

ACTIVE = "rollout/repeat_terminate_active"
TRIGGERED = "rollout/repeat_terminate_triggered_sequences"
P99 = "rollout/gen_new_tokens_p99"
TRUNCATED_RATE = "rollout/parse_truncated_rate"
DROPPED = "rollout/parse_dropped_invalid"
SECONDS = "rollout/generate_seconds"

FAMILIES: dict[str, str] = {ACTIVE: "flag", TRIGGERED: "counter", P99: "p99", TRUNCATED_RATE: "rate",
                            DROPPED: "counter", SECONDS: "seconds"}


def p99(values: Sequence[float]) -> float:
    """Nearest-rank 99th percentile; 0 for no values.

    >>> p99(list(range(1, 101)))
    99.0
    """
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)])


def rollout_metrics(results: Sequence[Any], *, guard_active: bool, dropped_invalid: int = 0,
                    seconds: float = 0.0) -> dict[str, float]:
    """The payload for one batch of ``GenerationResult``s on this rank.

    >>> from engine.types import GenerationResult
    >>> r = lambda n, reason, trig: GenerationResult("", "", tuple(range(n)), (), reason, None,
    ...                                               meta={"repeat_terminate_triggered": trig})
    >>> m = rollout_metrics([r(3, "stop", 1), r(8, "length", 0)], guard_active=True)
    >>> m[TRIGGERED], m[P99], m[TRUNCATED_RATE]
    (1.0, 8.0, 0.5)
    """
    truncated = sum(1 for r in results if r.finish_reason == "length")
    return {
        ACTIVE: 1.0 if guard_active else 0.0,
        TRIGGERED: float(sum(int(r.meta.get("repeat_terminate_triggered", 0)) for r in results)),
        P99: p99([len(r.token_ids) for r in results]),
        TRUNCATED_RATE: truncated / len(results) if results else 0.0,
        f"{TRUNCATED_RATE}/num": float(truncated),
        f"{TRUNCATED_RATE}/den": float(len(results)),
        DROPPED: float(dropped_invalid),
        SECONDS: float(seconds),
    }


DEVICE_ONLY_BACKENDS = ("nccl", "xccl", "hccl")
"""Collective backends that reduce accelerator tensors only."""


def reduce_device(backend: str) -> str:
    """Where the group's collectives need their tensors: NCCL reduces CUDA tensors only, so a group with no CPU
    backend gets this rank's current CUDA device; gloo and mixed groups (``"cpu:gloo,cuda:nccl"``) use the CPU.

    >>> reduce_device("gloo"), reduce_device("cpu:gloo,cuda:nccl")
    ('cpu', 'cpu')
    """
    entries = [part.split(":", 1) for part in str(backend).lower().split(",")]  # "name" or "device:name"
    if any(len(e) == 2 and e[0] == "cpu" for e in entries):
        return "cpu"
    if not any(e[-1] in DEVICE_ONLY_BACKENDS for e in entries):
        return "cpu"
    import torch

    return f"cuda:{torch.cuda.current_device()}"


def aggregate(payload: Mapping[str, float], group: Any = None) -> dict[str, float]:
    """Combine a payload across ranks by family (see the table); local values when not distributed.

    Works on gloo and NCCL groups: the reduced tensors live where the group's backend needs them
    (:func:`reduce_device`)."""
    out = dict(payload)
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return out
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return out
    sums = [k for k, f in FAMILIES.items() if f == "counter" and k in out]
    sums += [f"{k}/{part}" for k, f in FAMILIES.items() if f == "rate" for part in ("num", "den")
             if f"{k}/{part}" in out]
    maxes = [k for k, f in FAMILIES.items() if f in ("flag", "p99", "seconds") and k in out]
    device = reduce_device(dist.get_backend(group))
    for keys, op in ((sums, dist.ReduceOp.SUM), (maxes, dist.ReduceOp.MAX)):
        if keys:
            t = torch.tensor([out[k] for k in keys], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=op, group=group)
            out.update(zip(keys, t.tolist(), strict=True))
    for k, f in FAMILIES.items():
        if f == "rate" and f"{k}/den" in out:
            den = out[f"{k}/den"]
            out[k] = out[f"{k}/num"] / den if den else 0.0
    return out
