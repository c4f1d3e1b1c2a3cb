"""The id-only repeat rule over a whole batch at once, as tensor operations on the recent window.

:class:`engine.rules.repeat.RepeatRule` is the executable spec, fed one token per row per step in Python.
Adapters that see the whole batch's history as a tensor (the HF logits processor) use this instead when a
rule reads ids only (no ``max_object_keys``): a few tensor operations per step whatever the batch size, no
per-row Python, and no device-to-host copy until the events are read after generation. The semantics are the
spec's, and a property test checks that both fire at the same index with the same reason:

* the last ``N`` generated tokens are one id (``max_consecutive_token_repeats``), or the last ``n * r`` are
  one n-gram repeated back to back (the tail is n-periodic), checked in that order;
* never before ``min_new_tokens`` generated tokens; never once the row emitted a terminal id; at most once.
"""

from __future__ import annotations

from typing import Any

from engine.rules.repeat import CONSECUTIVE, NGRAM, RepeatThresholds

REASONS = {1: CONSECUTIVE, 2: NGRAM}


def vectorizable(thresholds: RepeatThresholds) -> bool:
    """Whether the thresholds read ids only (``max_object_keys`` needs the text).

    >>> vectorizable(RepeatThresholds(ngram_size=3, ngram_repeats=2)), vectorizable(RepeatThresholds(max_object_keys=3))
    (True, False)
    """
    return not thresholds.needs_text


class BatchRepeatGuard:
    """One batch's repeat state; :meth:`step` is called with the generated ids so far, once per step.

    >>> import torch
    >>> guard = BatchRepeatGuard(RepeatThresholds(max_consecutive_token_repeats=2), batch=2, terminal_ids=[0])
    >>> guard.step(torch.tensor([[5], [7]])).tolist()
    [False, False]
    >>> guard.step(torch.tensor([[5, 5], [7, 8]])).tolist()
    [True, False]
    >>> guard.events(0), guard.events(1)
    ({'repeat_terminate': ('consecutive_token_repeats', 2)}, {})
    """

    def __init__(self, thresholds: RepeatThresholds, *, batch: int, terminal_ids: Any, device: Any = None) -> None:
        import torch

        if not vectorizable(thresholds):
            raise ValueError("max_object_keys reads text; use engine.rules.repeat.RepeatRule for it")
        self.t = thresholds
        self.fired_at = torch.full((batch,), -1, dtype=torch.int64, device=device)  # tokens seen when it fired
        self.reason = torch.zeros(batch, dtype=torch.int8, device=device)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.terminal = torch.tensor(sorted(set(terminal_ids)), dtype=torch.int64, device=device)
        self._read: tuple[list[int], list[int]] | None = None

    def step(self, generated: Any) -> Any:
        """Rows that fire now, as a (batch,) bool tensor; ``generated`` is (batch, k) ids after the prompt."""
        import torch

        k = generated.shape[1]
        fire = torch.zeros_like(self.done)
        if k == 0:
            return fire
        last = generated[:, -1]  # (batch,)
        self.done |= torch.isin(last, self.terminal)
        t = self.t
        if k < t.min_new_tokens:
            return fire
        consecutive = fire
        n_rep = t.max_consecutive_token_repeats
        if n_rep is not None and k >= n_rep:
            consecutive = (generated[:, k - n_rep:] == last[:, None]).all(dim=1)
        ngram = fire
        n, r = t.ngram_size, t.ngram_repeats
        if n is not None and r is not None and k >= n * r:
            ngram = (generated[:, k - n * (r - 1):] == generated[:, k - n * r: k - n]).all(dim=1)
        fire = (consecutive | ngram) & ~self.done & (self.fired_at < 0)
        self.fired_at = torch.where(fire, k, self.fired_at)
        code = torch.where(consecutive, 1, 2).to(torch.int8)
        self.reason = torch.where(fire, code, self.reason)
        self._read = None
        return fire

    def events(self, row: int) -> dict[str, Any]:
        """The row's events, as :meth:`RepeatRule.events` reports them (reads the device once per batch)."""
        if self._read is None:
            self._read = (self.fired_at.tolist(), self.reason.tolist())
        fired_at, reason = self._read[0][row], self._read[1][row]
        return {"repeat_terminate": (REASONS[reason], fired_at)} if fired_at >= 0 else {}
