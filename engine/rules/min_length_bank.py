"""The min-length rule for many rows at once: :class:`~engine.rules.min_length.MinLengthRule`'s decisions without
decoding text while the answer is already known.

The pure rule (the executable spec) counts the decoded characters of its row, one token at a time. A row's
character count can never exceed the bytes its tokens decode from (a character, or the U+FFFD an invalid sequence
becomes, takes at least one byte), and bytes add up per token from a table: so while a row's bytes are below
``min_chars``, its characters are too and the decision is "hold EOS back", known from one array addition per step
for the whole batch. A row whose bytes reach ``min_chars`` gets its exact count from then on (its text decoded
once from the start, then token by token, as the spec does); once it has ``min_chars`` characters and no
``max_chars`` applies, its decision never changes again and nothing more is counted.

The bank mirrors ``RuleSet([MinLengthRule])`` fed token by token exactly (a property test checks decisions,
EOS notes and events on random byte tables, streams and terminal ids): terminal ids end a row (nothing counts
after), ``max_chars`` is noted as capped when it is first reached even while ``min_new_tokens`` keeps the row
going, and "EOS was on top while held back" is noted once per row (:meth:`note_eos_on_top`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

MIN_LENGTH_TARGET = "engine.rules.min_length:MinLengthRule"
"""The spec target a bank stands in for."""


_COUNTS: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()


def byte_counts(table: Any) -> tuple[Any, Any]:
    """Per token id of a byte table: the bytes it adds to a row's text (0 for special tokens) and whether it starts
    with a space. Built once per table (a pass over the vocabulary), then shared by every bank.

    >>> from engine.rules.token_text import TokenBytes
    >>> [a.tolist() for a in byte_counts(TokenBytes([b" a", b"bc", b"<s>"], special={2}))]
    [[2, 2, 0], [True, False, False]]
    """
    if table not in _COUNTS:
        special = np.zeros(len(table.pieces), dtype=bool)
        special[[i for i in table.special if 0 <= i < len(table.pieces)]] = True
        nbytes = np.where(special, 0, np.array([len(p) for p in table.pieces], dtype=np.int64))
        _COUNTS[table] = nbytes, np.array([p[:1] == b" " for p in table.pieces], dtype=bool) & ~special
    return _COUNTS[table]


class MinLengthBank:
    """Min-length state of ``rows`` rows fed together (an HF batch), each with the same parameters.

    ``table`` is the tokenizer's byte table (:class:`engine.rules.token_text.TokenBytes`).

    >>> from engine.rules.token_text import TokenBytes
    >>> table = TokenBytes([b"", b"ab", b"c", b"\\xe2\\x82", b"\\xac"], special={0})
    >>> bank = MinLengthBank({"min_chars": 3, "max_chars": None, "punctuation_bias": 0.0,
    ...                       "sentence_end_ids": ()}, 2, table=table, terminal_ids={0})
    >>> bank.push(np.array([[1], [3]])); bank.decide(None)[1].tolist()  # 2 bytes each: EOS held back
    [True, True]
    >>> bank.push(np.array([[2], [4]])); bank.decide(None)[1].tolist()  # "abc" is 3, "€" is 1 character
    [False, True]
    >>> bank.events(1)["min_length_eos_suppressed"], bank.note_eos_on_top(np.array([1])), bank.events(1)
    (False, None, {'min_length_eos_suppressed': True, 'min_length_capped': False, \
'min_length_eos_suppressed_at': 2, 'min_length_capped_at': None})
    """

    def __init__(self, params: Mapping[str, Any], rows: int, *, table: Any, terminal_ids: Iterable[int],
                 min_new_tokens: int = 0) -> None:
        self.min_chars = int(params["min_chars"])
        self.max_chars = params["max_chars"]
        bias = float(params.get("punctuation_bias") or 0.0)
        self.bias = dict.fromkeys(params.get("sentence_end_ids") or (), bias) if bias else {}
        self.table = table
        self.terminal = np.array(sorted(set(terminal_ids)), dtype=np.int64)
        self.min_new_tokens = min_new_tokens
        self.nbytes, self.space_first = byte_counts(table)
        self.is_terminal = np.zeros(len(self.nbytes), dtype=bool)
        self.is_terminal[[t for t in self.terminal if 0 <= t < len(self.nbytes)]] = True
        self.fed = 0
        self.tokens = np.zeros(rows, dtype=np.int64)
        self.done = np.zeros(rows, dtype=bool)
        self.upper = np.zeros(rows, dtype=np.int64)  # bytes so far: never fewer than the characters
        self.strip_pending = np.full(rows, bool(table.strip_first_space))
        self.strip_any = bool(table.strip_first_space)
        self.exact = np.zeros(rows, dtype=bool)
        self.chars = np.zeros(rows, dtype=np.int64)
        self.streams: dict[int, Any] = {}
        self.history: list[Any] = []  # every column pushed: a row that starts counting decodes its text from it
        self.settled = np.full(rows, self.min_chars <= 0 and self.max_chars is None)
        self.noted = np.zeros(rows, dtype=bool)
        self.suppressed_at = np.full(rows, -1, dtype=np.int64)
        self.capped_at = np.full(rows, -1, dtype=np.int64)

    def push(self, columns: Any) -> None:
        """Feed the next generated ids: ``columns`` is rows x k (k steps, normally one)."""
        for step in range(columns.shape[1]):
            self._push_column(np.asarray(columns[:, step], dtype=np.int64))

    def _push_column(self, tokens: Any) -> None:
        self.history.append(tokens)
        self.fed += 1
        live = ~self.done
        known = (tokens >= 0) & (tokens < len(self.nbytes))
        if known.all():
            safe, ended = tokens, self.is_terminal[tokens]
        else:  # ids past the table add no text (as the spec's stream has it) and may still be terminal
            safe, ended = np.where(known, tokens, 0), np.isin(tokens, self.terminal)
        ended &= live
        self.done |= ended
        pushed = live & ~ended
        self.tokens += pushed
        nbytes = self.nbytes[safe] * (known & pushed)
        if self.strip_any:
            stripped = self.strip_pending & (nbytes > 0)  # the text's first piece loses its leading space
            nbytes -= stripped & self.space_first[safe]
            self.strip_pending &= ~stripped
            self.strip_any = bool(self.strip_pending.any())
        self.upper += nbytes
        counting = pushed & ~self.settled
        for row in np.flatnonzero(counting & self.exact):
            self.chars[row] += len(self.streams[row].push(int(tokens[row])))
        for row in np.flatnonzero(counting & ~self.exact & (self.upper >= self.min_chars)):
            stream = self.streams[row] = self.table.stream()  # the row's text from its start, as the spec has it
            self.chars[row] = sum(len(stream.push(int(column[row]))) for column in self.history)
            self.exact[row] = True
        if self.max_chars is None:
            done_counting = self.exact & ~self.settled & (self.chars >= self.min_chars)
            self.settled |= done_counting
            for row in np.flatnonzero(done_counting):
                del self.streams[row]

    def decide(self, active: Any) -> tuple[Any, Any, Any]:
        """``(force, ban, bias)`` bool arrays over the rows for this step; ``active`` (bool array or None for all)
        are the rows asked (a row another rule ends now is not asked, as a rule set is not). Notes ``max_chars``
        reached (capped) as the spec's decision does."""
        asked = ~self.done if active is None else active & ~self.done
        capped = np.zeros_like(asked)
        if self.max_chars is not None:
            capped = asked & self.exact & (self.chars >= self.max_chars)
            first = capped & (self.capped_at < 0)
            self.capped_at[first] = self.tokens[first]
        # Counted rows compare their characters; the others their bytes, which are below min_chars whenever they
        # are not the exact count (no byte yet).
        held = asked & ~capped & (np.where(self.exact, self.chars, self.upper) < self.min_chars)
        bias = asked & ~capped & ~held if self.bias else np.zeros_like(asked)
        force = capped if self.fed >= self.min_new_tokens else np.zeros_like(capped)
        return force, held, bias

    def note_eos_on_top(self, rows: Any) -> None:
        """EOS was the top choice of these held-back rows' unedited logits (the first sighting counts)."""
        first = rows[~self.noted[rows]]
        self.noted[first] = True
        self.suppressed_at[first] = self.tokens[first]

    def events(self, row: int) -> dict[str, Any]:
        """The row's events, as :meth:`MinLengthRule.events` gives them."""
        suppressed, capped = int(self.suppressed_at[row]), int(self.capped_at[row])
        return {"min_length_eos_suppressed": suppressed >= 0, "min_length_capped": capped >= 0,
                "min_length_eos_suppressed_at": suppressed if suppressed >= 0 else None,
                "min_length_capped_at": capped if capped >= 0 else None}
