"""HF adapters of row rules: a ``LogitsProcessor`` applying each row's decision to its scores, and the
per-row rule sets the stopping-criteria hook checks (see ``RowFinishRecorder``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.rules.base import RuleSet, RuleSpec


def rule_sets(specs: Sequence[RuleSpec], batch: int, *, terminal_ids: Sequence[int],
              decode: Callable[[Sequence[int]], str] | None) -> list[RuleSet]:
    """One fresh :class:`RuleSet` per row, built from ``specs``."""
    terminal = frozenset(terminal_ids)
    return [RuleSet([s.build() for s in specs], terminal_ids=terminal, decode=decode) for _ in range(batch)]


def feed_new_tokens(sets: list[RuleSet], input_ids: Any, prompt_len: int) -> None:
    """Feed every row the tokens generated since the last call (normally one per step)."""
    generated = input_ids.shape[1] - prompt_len  # (batch, prompt + generated)
    start = sets[0].fed if sets else 0
    for step in range(start, generated):
        for row, tok in enumerate(input_ids[:, prompt_len + step].tolist()):
            sets[row].feed(tok)


class HfRowRules:
    """Applies each row's combined decision: force EOS, ban EOS (noting when EOS was the top choice), bias.

    >>> import torch
    >>> from engine.rules.base import RuleSpec
    >>> spec = RuleSpec("engine.rules.repeat:RepeatRule", {"thresholds": {"max_consecutive_token_repeats": 2}})
    >>> proc = HfRowRules([spec], prompt_len=1, eos_id=0, terminal_ids=[0], decode=None)
    >>> _ = proc(torch.tensor([[9, 3], [9, 1]]), torch.zeros(2, 4))
    >>> proc(torch.tensor([[9, 3, 3], [9, 1, 2]]), torch.zeros(2, 4)).tolist()
    [[0.0, -inf, -inf, -inf], [0.0, 0.0, 0.0, 0.0]]
    >>> proc.sets[0].events()
    {'repeat_terminate': ('consecutive_token_repeats', 2)}
    """

    def __init__(self, specs: Sequence[RuleSpec], *, prompt_len: int, eos_id: int, terminal_ids: Sequence[int],
                 decode: Callable[[Sequence[int]], str] | None) -> None:
        self.specs = list(specs)
        self.prompt_len = prompt_len
        self.eos_id = eos_id
        self.terminal_ids = list(terminal_ids)
        self.decode = decode
        self.sets: list[RuleSet] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if not self.sets:
            self.sets = rule_sets(self.specs, input_ids.shape[0], terminal_ids=self.terminal_ids, decode=self.decode)
        feed_new_tokens(self.sets, input_ids, self.prompt_len)
        for row, rs in enumerate(self.sets):
            d = rs.decision()
            if d.force_eos:
                scores[row] = float("-inf")
                scores[row, self.eos_id] = 0.0
                continue
            if d.ban_eos:
                if int(scores[row].argmax()) == self.eos_id:
                    rs.note_eos_suppressed()
                scores[row, self.eos_id] = float("-inf")
            for tok, b in d.bias.items():
                scores[row, tok] += b
        return scores
