"""The sampling distribution, written once: vLLM's processing steps on a row of logits, and the kept mass.

vLLM's sampler (``vllm/v1/sample/sampler.py``, its class docstring) turns a row of raw logits into the distribution it
draws from in this order: the engine's own masks (min-tokens, rule processors), the repetition penalty, the
temperature, min-p, then top-k and top-p. ``processed_logprobs`` are the log-softmax of the result, renormalised
over the kept support (every other token is -inf). This module is that pipeline for the backends that do not run
vLLM's sampler:

* llama.cpp's row step truncates with :func:`truncate` (llama.cpp's sampler then draws from exactly that), so its
  processed logprobs are the distribution its draw used;
* ``engine.score(..., processing=...)`` re-scores a sequence under the same steps (:func:`reprocess`), which is what
  a trainer matches rollouts against, on HF and vLLM alike.

HF generation draws through HF's own warpers in this same order (``engine.backends.hf.sampling``); the conformance
suite holds all three equal. :func:`kept_mass` is the probability the kept support held before truncation (after the
penalty and temperature): a trainer that re-scores with the temperature only (ms-swift's) differs from processed
logprobs by exactly ``log(kept_mass)`` per token when no penalty applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Processing:
    """The sampling distribution's processing, the one carrier of it: built once when a call is planned
    (``CallPlan.processing``, from the ``GenerationOptions`` fields of the same names) and handed whole to every
    backend, the portable draw and re-scoring. Its steps run in one order, :func:`process`: the penalty
    (:data:`PENALTY`, over the ids seen so far), then :func:`warp` (the temperature, min-p, top-k, top-p).

    A new processing option is a field here and its step in :func:`warp` (with the ``GenerationOptions`` field of the
    same name); HF, llama.cpp, the portable draw and re-scoring run this module's steps, and vLLM's native sampler
    takes it by name (``engine.backends.vllm.backend.VLLM_SAMPLING``). docs/layout.md, "Add a sampling option".

    >>> Processing(temperature=0.7, top_p=0.9).is_identity, Processing().is_identity
    (False, True)
    """

    temperature: float = 1.0
    """Divides the logits; 0 (greedy) divides by 1, as vLLM's greedy path does."""
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def of(cls, options: Any) -> Processing:
        """The processing of a request's ``GenerationOptions`` (or anything with fields of these names)."""
        return cls(**{f.name: getattr(options, f.name) for f in dataclasses.fields(cls)})

    def as_dict(self) -> dict[str, Any]:
        """Every step's setting by name (what travels to vLLM's processors, :meth:`from_dict` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Any) -> Processing:
        """The processing :meth:`as_dict` wrote, each value of its field's type.

        >>> Processing.from_dict(Processing(top_k=3).as_dict()) == Processing(top_k=3)
        True
        """
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        return cls(**{name: (int if kinds[name] == "int" else float)(values[name]) for name in kinds})

    @property
    def is_identity(self) -> bool:
        return (self.temperature in (0, 1) and not self.top_k and self.top_p >= 1 and not self.min_p
                and self.repetition_penalty == 1)


def penalize(logits: Any, seen: Sequence[int], penalty: float) -> Any:
    """The repetition penalty (CTRL's rule, as HF and vLLM apply it) on one row of logits, in place: every seen
    token's logit divided by ``penalty`` when positive, multiplied when negative.

    >>> import torch
    >>> penalize(torch.tensor([2.0, -2.0, 1.0]), [0, 1], 2.0).tolist()
    [1.0, -4.0, 1.0]
    """
    import torch

    if penalty == 1 or not seen:
        return logits
    ids = torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)
    picked = logits[ids]
    logits[ids] = torch.where(picked < 0, picked * penalty, picked / penalty)
    return logits


def min_p_mask(logits: Any, min_p: float) -> Any:
    """Drop tokens less likely than ``min_p`` times the likeliest (vLLM's min-p, after the temperature), in place.

    >>> import torch
    >>> min_p_mask(torch.tensor([[0.0, -1.0, -3.0]]), 0.2).tolist()
    [[0.0, -1.0, -inf]]
    """
    if not min_p:
        return logits
    import torch

    probs = torch.softmax(logits.float(), dim=-1)
    logits.masked_fill_(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def truncate(logits: Any, top_k: int, top_p: float) -> Any:
    """vLLM's top-k then top-p on rows of logits (rows x vocab), in place: top-k keeps every token at least as
    likely as the k-th (ties kept); top-p then drops, from the least likely up, tokens whose cumulative probability
    (over what top-k kept) stays within ``1 - top_p``; the likeliest token is always kept.

    >>> import torch
    >>> truncate(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), top_k=3, top_p=1.0).tolist()
    [[3.0, 2.0, 1.0, -inf]]
    >>> truncate(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), top_k=0, top_p=0.5).tolist()
    [[3.0, -inf, -inf, -inf]]
    """
    import torch

    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits.masked_fill_(logits < kth, float("-inf"))
    if top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=False)
        cumulative = torch.cumsum(torch.softmax(ordered.float(), dim=-1), dim=-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1] = False
        ordered.masked_fill_(drop, float("-inf"))
        logits.scatter_(-1, order, ordered)
    return logits


PENALTY = ("repetition_penalty",)
"""The carrier's fields that act on the ids seen so far (:func:`penalize`, before the rest); every other field is a step
of :func:`warp`."""


def temper(rows: Any, processing: Processing) -> Any:
    """The temperature on rows of logits, in place; 0 (greedy) and 1 change nothing, as on vLLM's greedy path."""
    if processing.temperature not in (0, 1):
        rows /= processing.temperature
    return rows


def cut(rows: Any, processing: Processing) -> Any:
    """min-p, then top-k and top-p, on rows of logits (rows x vocab), in place: the support the draw keeps."""
    min_p_mask(rows, processing.min_p)
    return truncate(rows, processing.top_k, processing.top_p)


def warp(rows: Any, processing: Processing) -> Any:
    """Every step after the penalty, in vLLM's order, on rows of logits (rows x vocab), in place: what HF's sampled
    calls and llama.cpp's row step run after their penalty and rules.

    >>> import torch
    >>> warp(torch.tensor([[2.0, 1.0, 0.0]]), Processing(temperature=2.0, top_k=2)).tolist()
    [[1.0, 0.5, -inf]]
    """
    return cut(temper(rows, processing), processing)


def process(logits: Any, processing: Processing, seen: Sequence[int] = ()) -> tuple[Any, Any]:
    """One row's processed logits (vocab,) and the kept mass: the penalty (over ``seen``: prompt and output ids so
    far), then :func:`warp`'s steps. ``logits`` is not changed.

    >>> import torch
    >>> out, kept = process(torch.tensor([2.0, 1.0, 0.0]), Processing(temperature=1.0, top_k=2))
    >>> out.tolist(), round(float(kept), 4)
    ([2.0, 1.0, -inf], 0.91)
    """

    row = penalize(logits.float().clone(), seen, processing.repetition_penalty)
    before = temper(row[None, :], processing)[0].clone()  # the mass is what the cut keeps of the tempered row
    row = cut(row[None, :], processing)[0]
    return row, kept_mass(before, row)


def kept_mass(before: Any, after: Any) -> Any:
    """The probability the tokens ``after`` keeps (finite) held under ``softmax(before)``: 1 when nothing was cut.

    >>> import torch
    >>> round(float(kept_mass(torch.zeros(4), torch.tensor([0.0, 0.0, float("-inf"), float("-inf")]))), 6)
    0.5
    """
    import torch

    probs = torch.softmax(before.float(), dim=-1)
    return (probs * torch.isfinite(after)).sum(dim=-1)


def reprocess(logprobs: Any, processing: Processing, sequence: Sequence[int], start: int) -> tuple[Any, Any]:
    """Re-score ``sequence[start:]`` under ``processing``: ``logprobs`` (positions x vocab) are the model's raw
    log-probabilities (or logits) at each scored position; row ``i`` predicts ``sequence[start + i]`` after
    ``sequence[:start + i]``. Returns the processed log-probabilities (positions x vocab) and the kept mass per
    position. The penalty is CTRL's on logits, so with ``repetition_penalty`` the input must be logits.
    """
    import torch

    rows, masses = [], []
    for i in range(logprobs.shape[0]):
        row, mass = process(logprobs[i], processing, sequence[: start + i])
        rows.append(torch.log_softmax(row, dim=-1))
        masses.append(mass)
    return torch.stack(rows), torch.stack(masses)

