"""HF adapters of row rules: a ``LogitsProcessor`` applying each row's decision to its scores, and the
per-row rule sets the stopping-criteria hook checks (see ``RowFinishRecorder``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.rules.base import RuleSet, RuleSpec, rule_sets

VECTOR_MIN_BATCH = 8
"""Below this many rows the id-only repeat rules run per row: a bank step has a fixed cost (about 30 µs of numpy
calls on the project's CPU machine) that Python per row only exceeds from about 8 rows on (5-6 µs a row)."""


def feed_new_tokens(sets: list[RuleSet], input_ids: Any, prompt_len: int) -> None:
    """Feed every row the tokens generated since the last call (normally one per step)."""
    generated = input_ids.shape[1] - prompt_len  # (batch, prompt + generated)
    start = sets[0].fed if sets else 0
    for step in range(start, generated):
        for row, tok in enumerate(input_ids[:, prompt_len + step].tolist()):
            sets[row].feed(tok)


class HfRowRules:
    """Applies each row's combined decision: force EOS, ban EOS (noting when EOS was the top choice), bias.

    Id-only repeat rules run vectorized over the batch (:class:`engine.rules.repeat_bank.RepeatBank`: array
    operations on the step's new tokens, no per-row Python) from ``VECTOR_MIN_BATCH`` rows on; every other rule
    runs per row through :class:`RuleSet`.

    >>> import torch
    >>> from engine.rules.repeat import RepeatRule, RepeatThresholds
    >>> spec = RepeatRule.spec(RepeatThresholds(max_consecutive_token_repeats=2))
    >>> proc = HfRowRules([spec], prompt_len=1, eos_id=0, terminal_ids=[0], decode=None)
    >>> _ = proc(torch.tensor([[9, 3], [9, 1]]), torch.zeros(2, 4))
    >>> proc(torch.tensor([[9, 3, 3], [9, 1, 2]]), torch.zeros(2, 4)).tolist()
    [[0.0, -inf, -inf, -inf], [0.0, 0.0, 0.0, 0.0]]
    >>> proc.events(0)
    {'repeat_terminate': ('consecutive_token_repeats', 2)}
    """

    def __init__(self, specs: Sequence[RuleSpec], *, prompt_len: int, eos_id: int, terminal_ids: Sequence[int],
                 decode: Any, vectorize: bool = True, vector_min_batch: int = VECTOR_MIN_BATCH,
                 min_new_tokens: int = 0) -> None:
        from engine.rules.repeat_bank import split_vectorizable

        self.all_specs = list(specs)
        self.vector_min_batch = vector_min_batch
        self.min_new_tokens = min_new_tokens
        self.vector_thresholds, self.specs = split_vectorizable(specs) if vectorize else ([], list(specs))
        self.prompt_len = prompt_len
        self.eos_id = eos_id
        self.terminal_ids = list(terminal_ids)
        self.decode = decode
        self.sets: list[RuleSet] = []
        self.banks: list[Any] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import numpy as np

        if self.vector_thresholds and not self.banks and input_ids.shape[0] < self.vector_min_batch:
            self.vector_thresholds, self.specs = [], self.all_specs  # a few rows: Python per row is cheaper
        fire = self._vectorized_fire(input_ids, scores) if self.vector_thresholds else None
        if not self.sets and self.specs:
            self.sets = rule_sets(self.specs, input_ids.shape[0], terminal_ids=self.terminal_ids, decode=self.decode,
                                  min_new_tokens=self.min_new_tokens)
        if self.sets:
            feed_new_tokens(self.sets, input_ids, self.prompt_len)
            # A row a vectorized guard ends now is ended, as a RuleSet's "any force wins" would decide.
            self._apply_row_rules(scores, fire.tolist() if fire is not None else None)
        if fire is not None and fire.any():
            from engine.backends.row_apply import FORCE, apply_decisions

            apply_decisions(scores, [(int(row), self.eos_id, FORCE) for row in np.flatnonzero(fire)])
        return scores

    def _apply_row_rules(self, scores: Any, forced: list[bool] | None) -> None:
        from engine.backends.row_apply import apply_decisions, decide

        rows = [(row, rs, self.eos_id) for row, rs in enumerate(self.sets) if forced is None or not forced[row]]
        apply_decisions(scores, decide(scores, rows))

    def _vectorized_fire(self, input_ids: Any, scores: Any) -> Any:
        import numpy as np

        from engine.rules.repeat_bank import RepeatBank

        batch = input_ids.shape[0]
        if not self.banks:
            for t in self.vector_thresholds:
                bank = RepeatBank()
                for row in range(batch):
                    bank.assign(row, t, terminal_ids=self.terminal_ids)
                self.banks.append(bank)
        if input_ids.shape[1] <= self.prompt_len:
            return None
        last = input_ids[:, -1].cpu().numpy()  # the step's new token of every row (one small copy)
        rows = np.arange(batch)
        fire = np.zeros(batch, dtype=bool)
        for bank in self.banks:
            bank.push(None, last)  # None: rows 0 .. batch - 1, the whole batch
            fire |= bank.has_fired(rows)  # now or before: forced until the EOS lands (a grammar may mask it)
        return fire

    def events(self, row: int) -> dict[str, Any]:
        """The row's rule events (per-row rules and vectorized guards together)."""
        merged: dict[str, Any] = {}
        if self.sets:
            merged.update(self.sets[row].events())
        for bank in self.banks:
            merged.update(bank.events(row))
        return merged
