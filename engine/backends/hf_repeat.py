"""HF adapter of the repeat guard: a ``LogitsProcessor`` that forces EOS for triggered rows only."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.rules.detok import IncrementalDetokenizer
from engine.rules.repeat import RepeatRule, RepeatThresholds


class HfRepeatTerminate:
    """Feeds each row's newest generated token to its :class:`RepeatRule`; a row that fires gets EOS next.

    Rows that already ended (their last token is terminal; HF pads them afterwards) are not fed again.
    ``events[row]`` holds ``(reason, index)`` once the row's rule fired.

    >>> import torch
    >>> guard = HfRepeatTerminate(RepeatThresholds(max_consecutive_token_repeats=2), prompt_len=1, eos_id=0,
    ...                           terminal_ids=[0], decode=None)
    >>> scores = guard(torch.tensor([[9, 3], [9, 1]]), torch.zeros(2, 4))  # one token generated per row
    >>> scores = guard(torch.tensor([[9, 3, 3], [9, 1, 2]]), torch.zeros(2, 4))  # row 0 repeated token 3
    >>> scores.tolist()
    [[0.0, -inf, -inf, -inf], [0.0, 0.0, 0.0, 0.0]]
    >>> guard.events
    {0: ('consecutive_token_repeats', 2)}
    """

    def __init__(self, thresholds: RepeatThresholds, *, prompt_len: int, eos_id: int, terminal_ids: Sequence[int],
                 decode: Callable[[Sequence[int]], str] | None) -> None:
        self.thresholds = thresholds
        self.prompt_len = prompt_len
        self.eos_id = eos_id
        self.terminal = set(terminal_ids)
        self.decode = decode
        self.rules: list[RepeatRule] = []
        self.detoks: list[IncrementalDetokenizer | None] = []
        self.done: list[bool] = []
        self.fed = 0
        self.events: dict[int, tuple[str, int]] = {}

    def _ensure_rows(self, batch: int) -> None:
        while len(self.rules) < batch:
            self.rules.append(RepeatRule(self.thresholds))
            needs = self.thresholds.needs_text and self.decode is not None
            self.detoks.append(IncrementalDetokenizer(self.decode) if needs else None)  # type: ignore[arg-type]
            self.done.append(False)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        batch, total = input_ids.shape  # (batch, prompt + generated)
        self._ensure_rows(batch)
        generated = total - self.prompt_len
        force = []
        while self.fed < generated:  # normally one new token per call
            column = input_ids[:, self.prompt_len + self.fed].tolist()
            self.fed += 1
            for row, tok in enumerate(column):
                if self.done[row]:
                    continue
                if tok in self.terminal:
                    self.done[row] = True
                    continue
                detok = self.detoks[row]
                reason = self.rules[row].push(tok, detok.push(tok) if detok is not None else "")
                if reason is not None:
                    self.events[row] = (reason, self.rules[row].fired_at or 0)
                    force.append(row)
        if force:
            rows = list(force)
            scores[rows] = float("-inf")
            scores[rows, self.eos_id] = 0.0
        return scores
