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
    operations on the step's new tokens, no per-row Python) from ``VECTOR_MIN_BATCH`` rows on, and so does
    ``min_length`` when it is the only other rule and the tokenizer has a byte table
    (:class:`engine.rules.min_length_bank.MinLengthBank`); every other rule runs per row through :class:`RuleSet`.

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
        from engine.rules.min_length_bank import MIN_LENGTH_TARGET
        from engine.rules.repeat_bank import split_vectorizable

        self.all_specs = list(specs)
        self.vector_min_batch = vector_min_batch
        self.min_new_tokens = min_new_tokens
        self.vector_thresholds, self.specs = split_vectorizable(specs) if vectorize else ([], list(specs))
        self.min_length_params: Any = None  # min_length alone among the per-row rules: run in a bank
        if (vectorize and len(self.specs) == 1 and self.specs[0].target == MIN_LENGTH_TARGET
                and hasattr(decode, "pieces")):
            self.min_length_params, self.specs = self.specs[0].params, []
        self.min_length: Any = None
        self.prompt_len = prompt_len
        self.eos_id = eos_id
        self.terminal_ids = list(terminal_ids)
        self.decode = decode
        self.sets: list[RuleSet] = []
        self.banks: list[Any] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import numpy as np

        banked = self.vector_thresholds or self.min_length_params is not None
        if banked and not self.banks and self.min_length is None and input_ids.shape[0] < self.vector_min_batch:
            # a few rows: Python per row is cheaper (and every rule then combines in one rule set per row)
            self.vector_thresholds, self.min_length_params, self.specs = [], None, self.all_specs
        fire = self._vectorized_fire(input_ids, scores) if self.vector_thresholds else None
        if self.min_length_params is not None:
            self._min_length_step(input_ids, scores, fire)
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

    def _min_length_step(self, input_ids: Any, scores: Any, fire: Any) -> None:
        import numpy as np
        import torch

        from engine.backends.row_apply import (
            FORCE,
            apply_decisions,
            ban_eos,
            ban_eos_in_every_row,
            rows_with_a_logit_above,
        )
        from engine.rules.base import Decision
        from engine.rules.min_length_bank import MinLengthBank

        bank = self.min_length
        if bank is None:
            bank = self.min_length = MinLengthBank(self.min_length_params, input_ids.shape[0], table=self.decode,
                                                   terminal_ids=self.terminal_ids,
                                                   min_new_tokens=self.min_new_tokens)
        if input_ids.shape[1] - self.prompt_len > bank.fed:
            bank.push(input_ids[:, self.prompt_len + bank.fed:].cpu().numpy())
        force, held, bias = bank.decide(None if fire is None else ~fire)
        eos = self.eos_id
        edits = [(int(row), eos, FORCE) for row in np.flatnonzero(force)]
        if bias.any():
            nudge = Decision(bias=bank.bias)
            edits += [(int(row), eos, nudge) for row in np.flatnonzero(bias)]
        if edits:
            apply_decisions(scores, edits)  # other rows than the held ones: the check below reads those unedited
        if held.all():
            on_top = ban_eos_in_every_row(scores, eos).cpu().numpy()
            if on_top.any():
                bank.note_eos_on_top(np.flatnonzero(on_top))
            return
        rows = np.flatnonzero(held)
        if len(rows):
            # One read answers both questions: a held row where some token beats EOS did not have EOS on top, and
            # keeps a token once EOS is masked.
            index = torch.from_numpy(rows).to(scores.device)
            beaten = rows_with_a_logit_above(scores, index, scores[index, eos])
            on_top = rows[~beaten.cpu().numpy()]
            if len(on_top):
                bank.note_eos_on_top(on_top)
            ban_eos(scores, index, torch.full_like(index, eos), beaten=beaten)

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
        if self.min_length is not None:
            merged.update(self.min_length.events(row))
        return merged
