"""Min-length control ("Pattern C"): EOS is suppressed while the decoded output is shorter than
``min_chars``; past it, an optional positive bias nudges sentence-ending tokens; ``max_chars`` is a hard
cap that ends the row. The character count follows the decoded text as it grows.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.rules.base import CONTINUE, Decision, RowRule
from engine.rules.cleanup import SENTENCE_ENDS

MAX_PUNCTUATION_BIAS = 100.0
"""Largest ``punctuation_bias``: the bound OpenAI's and vLLM's ``logit_bias`` hold a bias to; a larger one makes a
sentence end certain, and a bias near float32's limit turns the row's logits into infinities."""


def is_sentence_end_token(text: str) -> bool:
    """A token the punctuation bias nudges: its text ends a sentence (``.!?`` or the CJK full stop, question and
    exclamation marks, trailing whitespace aside) or ends a line.

    >>> [is_sentence_end_token(t) for t in [".", " !", "\\u3002", "\\uff1f", ".\\n", "\\n", "Hello", "3.5x"]]
    [True, True, True, True, True, True, False, False]
    """
    return text.endswith("\n") or text.rstrip().endswith(tuple(SENTENCE_ENDS))


def min_length_decision(chars: int, *, min_chars: int, max_chars: int | None, punctuation_bias: float,
                        sentence_end_ids: Iterable[int]) -> Decision:
    """The gate as a pure function of the current character count.

    >>> min_length_decision(3, min_chars=10, max_chars=None, punctuation_bias=0.0, sentence_end_ids=()).ban_eos
    True
    >>> d = min_length_decision(12, min_chars=10, max_chars=None, punctuation_bias=2.0, sentence_end_ids=(13,))
    >>> d.ban_eos, dict(d.bias)
    (False, {13: 2.0})
    >>> min_length_decision(50, min_chars=10, max_chars=40, punctuation_bias=0.0, sentence_end_ids=()).force_eos
    True
    """
    if max_chars is not None and chars >= max_chars:
        return Decision(force_eos=True)
    if chars < min_chars:
        return Decision(ban_eos=True)
    if punctuation_bias:
        return Decision(bias=dict.fromkeys(sentence_end_ids, punctuation_bias))
    return CONTINUE


class MinLengthRule(RowRule):
    """One row's min-length state."""

    needs_text = True

    def __init__(self, *, min_chars: int, max_chars: int | None, punctuation_bias: float,
                 sentence_end_ids: Iterable[int]) -> None:
        self.min_chars = min_chars
        self.max_chars = max_chars
        self.punctuation_bias = punctuation_bias
        self.sentence_end_ids = tuple(sentence_end_ids)
        self.chars = 0
        self.tokens = 0
        self.eos_suppressed = False
        self.capped = False
        self.suppressed_at: int | None = None  # tokens seen when EOS was first held back
        self.capped_at: int | None = None  # tokens seen when max_chars first forced EOS
        self._last: tuple[int, Decision] | None = None  # decision at a character count (it depends on nothing else)

    def push(self, token: int, text: str) -> None:
        self.chars += len(text)
        self.tokens += 1

    def decision(self) -> Decision:
        if self._last is None or self._last[0] != self.chars:
            d = min_length_decision(self.chars, min_chars=self.min_chars, max_chars=self.max_chars,
                                    punctuation_bias=self.punctuation_bias, sentence_end_ids=self.sentence_end_ids)
            self._last = (self.chars, d)
        d = self._last[1]
        if d.force_eos and not self.capped:
            self.capped, self.capped_at = True, self.tokens
        return d

    def note_eos_suppressed(self) -> None:
        if not self.eos_suppressed:
            self.eos_suppressed, self.suppressed_at = True, self.tokens

    def events(self) -> dict[str, object]:
        return {"min_length_eos_suppressed": self.eos_suppressed, "min_length_capped": self.capped,
                "min_length_eos_suppressed_at": self.suppressed_at, "min_length_capped_at": self.capped_at}
