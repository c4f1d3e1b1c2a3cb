"""Repeat-aware termination: the rule, written once, fed one generated token (and its text) at a time.

Semantics (identical on every backend, since every backend runs this code):

* Only **generated** tokens count; prompt tokens never do. Counting starts at the first generated token.
* ``max_consecutive_token_repeats = N``: fires once the last N generated tokens are the same token id.
* ``ngram_size = n >= 2, ngram_repeats = r``: fires once the last ``n * r`` generated tokens are one n-gram
  repeated r times back to back (the tail is periodic with period n). A loop with a shorter period that
  divides n counts too: "a a a a" is also "aa aa".
* ``max_object_keys = K``: fires once any single JSON-like object in the decoded output holds more than K
  keys. A key is a double-quoted string directly inside an object (not inside a nested array or object)
  followed by ``:``; string escapes are respected; nested objects count their own keys.
* Nothing fires before ``min_new_tokens`` tokens were generated (the state still follows every token).
* The rule fires at most once per row; the adapter then forces EOS as the row's next token, so the
  trigger index (the position of that EOS in the row's generated ids) is the number of tokens seen.

Both repetition thresholds are "periodic tail" tests answered by one counter per period: ``run[p]`` is the
number of latest positions i with ``token[i] == token[i - p]``; the tail of length L is p-periodic exactly
when ``run[p] >= L - p``. Each token costs O(number of periods) = O(1), the key counter O(characters).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from engine.rules.base import CONTINUE, Decision, RowRule, RuleSpec
from engine.rules.json_text import STRING, JsonStringState

CONSECUTIVE = "consecutive_token_repeats"
NGRAM = "ngram_repeats"
OBJECT_KEYS = "object_keys"
MAX_COUNT = 2**31 - 1
"""Largest count a threshold may hold (``min_new_tokens``, ``max_consecutive_token_repeats``, ``ngram_repeats``,
``max_object_keys``): longer than any row a model generates, and small enough that the banks' int64 counters and
spans (``ngram_size * (ngram_repeats - 1)``) never overflow."""
MAX_NGRAM_SIZE = 1024
"""Largest ``ngram_size``: the banks keep a ring of the last ``ngram_size`` ids for every row of the batch (the
widest row sets the ring's width), so the bound caps that memory (1024 x 8 bytes a row)."""


@dataclass(frozen=True)
class RepeatThresholds:
    """The thresholds of one row: the fields of the ``repeat_terminate`` config subtree, defined once here
    (``engine.config.RepeatTerminateConfig`` adds ``enabled`` and validates them)."""

    min_new_tokens: int = 0
    """No trigger before this many generated tokens exist, in [0, MAX_COUNT]. (Generation's own
    ``min_new_tokens`` is honoured too: the guard never ends a row before it.)"""
    max_consecutive_token_repeats: int | None = None
    """Fire when the last N generated tokens are one token id, N in [2, MAX_COUNT]. None: off."""
    ngram_size: int | None = None
    """n of the repeated n-gram, in [2, MAX_NGRAM_SIZE] (a 1-gram is the consecutive threshold). None: off."""
    ngram_repeats: int | None = None
    """Back-to-back repetitions of the n-gram that fire, in [2, MAX_COUNT]. Set together with ngram_size."""
    max_object_keys: int | None = None
    """Fire when one JSON-like object in the decoded output gets more than K keys, K in [1, MAX_COUNT]. None: off."""

    @property
    def needs_text(self) -> bool:
        return self.max_object_keys is not None


class JsonKeyCounter:
    """Counts keys per JSON-like object in text fed in pieces; O(1) per character.

    >>> c = JsonKeyCounter()
    >>> c.feed('{"a": 1, "b": {"c": 2, "d": "x:y"}, "e": [{"f": 1}]')
    >>> c.max_keys
    3
    """

    def __init__(self) -> None:
        self.stack: list[list[int]] = []  # per open container: [is_object, keys]
        self.strings = JsonStringState()
        self.string_at_object_level = False
        self.awaiting_colon = False
        self.max_keys = 0

    def feed(self, text: str) -> None:
        for ch in text:
            was_in_string = self.strings.in_string
            if self.strings.step(ch) == STRING:
                if not was_in_string:  # an opening quote
                    self.string_at_object_level = bool(self.stack) and self.stack[-1][0] == 1
                    self.awaiting_colon = False
                elif not self.strings.in_string:  # the closing quote
                    self.awaiting_colon = self.string_at_object_level
                continue
            if ch == ":" and self.awaiting_colon:
                self.awaiting_colon = False
                self.stack[-1][1] += 1
                self.max_keys = max(self.max_keys, self.stack[-1][1])
            elif not ch.isspace():
                self.awaiting_colon = False
                if ch in "{[":
                    self.stack.append([1 if ch == "{" else 0, 0])
                elif ch in "}]" and self.stack:
                    self.stack.pop()


class RepeatRule(RowRule):
    """One row's incremental repeat state.

    >>> rule = RepeatRule(RepeatThresholds(max_consecutive_token_repeats=3))
    >>> [rule.push(t) for t in [5, 7, 7, 7, 9]]
    [None, None, None, 'consecutive_token_repeats', None]
    >>> rule.fired_at
    4
    """

    def __init__(self, thresholds: RepeatThresholds | Mapping[str, object]) -> None:
        if isinstance(thresholds, Mapping):
            thresholds = RepeatThresholds(**thresholds)  # type: ignore[arg-type]
        self.t = thresholds
        self.periods: dict[int, int] = {}  # period -> tail length that must be periodic, minus the period
        if thresholds.max_consecutive_token_repeats is not None:
            self.periods[1] = thresholds.max_consecutive_token_repeats - 1
        if thresholds.ngram_size is not None and thresholds.ngram_repeats is not None:
            self.periods[thresholds.ngram_size] = thresholds.ngram_size * (thresholds.ngram_repeats - 1)
        self.history: deque[int] = deque(maxlen=max(self.periods, default=1))
        self.run = dict.fromkeys(self.periods, 0)
        self.needs_text = thresholds.needs_text
        self.keys = JsonKeyCounter() if thresholds.needs_text else None
        self.count = 0
        self.reason: str | None = None
        self.fired_at: int | None = None
        """Tokens seen when the rule fired: the index the forced EOS takes in the generated ids."""

    @staticmethod
    def spec(thresholds: RepeatThresholds) -> RuleSpec:
        """The spec every backend rebuilds this rule from (vLLM in its worker), for one row's thresholds; whether
        adapters run it in a repeat bank (id-only thresholds) is decided here, once per request.

        >>> spec = RepeatRule.spec(RepeatThresholds(ngram_size=3, ngram_repeats=2))
        >>> keys = RepeatRule.spec(RepeatThresholds(max_object_keys=3))
        >>> spec.params["thresholds"]["ngram_size"], spec.bank, keys.bank
        (3, True, False)
        """
        return RuleSpec("engine.rules.repeat:RepeatRule", {"thresholds": asdict(thresholds)},
                        bank=not thresholds.needs_text)

    def push(self, token: int, text: str = "") -> str | None:
        """Feed the next generated token (and its decoded text); return the reason the first time it fires."""
        for p in self.periods:
            same = len(self.history) >= p and self.history[-p] == token
            self.run[p] = self.run[p] + 1 if same else 0
        self.history.append(token)
        self.count += 1
        if self.keys is not None and text:
            self.keys.feed(text)
        if self.reason is not None or self.count < self.t.min_new_tokens:
            return None
        reason = self._check()
        if reason is not None:
            self.reason, self.fired_at = reason, self.count
        return reason

    def decision(self) -> Decision:
        return Decision(force_eos=True) if self.reason is not None else CONTINUE

    def events(self) -> dict[str, object]:
        return {"repeat_terminate": (self.reason, self.fired_at)} if self.reason is not None else {}

    def _check(self) -> str | None:
        if 1 in self.periods and self.run[1] >= self.periods[1]:
            return CONSECUTIVE
        n = self.t.ngram_size
        if n is not None and n in self.periods and self.run[n] >= self.periods[n]:
            return NGRAM
        if self.keys is not None and self.t.max_object_keys is not None and self.keys.max_keys > self.t.max_object_keys:
            return OBJECT_KEYS
        return None


def reference_fire_index(tokens: list[int], thresholds: RepeatThresholds, text_of: object = None) -> int | None:
    """The executable spec: where the rule fires on ``tokens``, recomputed from scratch on every prefix.

    O(n^2); for tests only. ``text_of(prefix)`` decodes a prefix (needed for ``max_object_keys``).
    Returns the number of tokens seen when it fires (the forced EOS's index), or None.

    >>> reference_fire_index([1, 2, 1, 2, 1, 2], RepeatThresholds(ngram_size=2, ngram_repeats=3))
    6
    """
    t = thresholds
    for k in range(1, len(tokens) + 1):
        if k < t.min_new_tokens:
            continue
        prefix = tokens[:k]
        n_rep = t.max_consecutive_token_repeats
        if n_rep is not None and k >= n_rep and len(set(prefix[-n_rep:])) == 1:
            return k
        if t.ngram_size is not None and t.ngram_repeats is not None:
            span = t.ngram_size * t.ngram_repeats
            if k >= span and prefix[-span:] == prefix[-t.ngram_size :] * t.ngram_repeats:
                return k
        if t.max_object_keys is not None and callable(text_of):
            counter = JsonKeyCounter()
            counter.feed(text_of(prefix))
            if counter.max_keys > t.max_object_keys:
                return k
    return None
