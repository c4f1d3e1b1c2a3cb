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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Processing:
    """The sampling steps a distribution went through (a subset of ``GenerationOptions``).

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
        """The processing of a request's ``GenerationOptions`` (or anything with those fields)."""
        return cls(temperature=options.temperature, top_k=options.top_k, top_p=options.top_p, min_p=options.min_p,
                   repetition_penalty=options.repetition_penalty)

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


def process(logits: Any, processing: Processing, seen: Sequence[int] = ()) -> tuple[Any, Any]:
    """One row's processed logits (vocab,) and the kept mass: the penalty (over ``seen``: prompt and output ids so
    far), the temperature, min-p, top-k, top-p. ``logits`` is not changed.

    >>> import torch
    >>> out, kept = process(torch.tensor([2.0, 1.0, 0.0]), Processing(temperature=1.0, top_k=2))
    >>> out.tolist(), round(float(kept), 4)
    ([2.0, 1.0, -inf], 0.91)
    """

    row = penalize(logits.float().clone(), seen, processing.repetition_penalty)
    if processing.temperature not in (0, 1):
        row /= processing.temperature
    before = row.clone()
    row = min_p_mask(row[None, :], processing.min_p)
    row = truncate(row, processing.top_k, processing.top_p)[0]
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

