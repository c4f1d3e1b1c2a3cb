"""Incremental detokenization: text deltas from a growing list of ids, for rules that read text.

Decoding one token at a time breaks multi-byte characters and word-joining spaces; this keeps a small
window (prefix/read offsets, as streaming servers do) and holds a delta back while it ends in an
incomplete character (U+FFFD). ``decode`` is any ``ids -> str`` function (special tokens skipped).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class IncrementalDetokenizer:
    """Feed ids one at a time; get the text each one adds.

    >>> vocab = {1: "Hel", 2: "lo", 3: " world"}
    >>> d = IncrementalDetokenizer(lambda ids: "".join(vocab[i] for i in ids))
    >>> [d.push(t) for t in (1, 2, 3)]
    ['Hel', 'lo', ' world']
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""


def text_stream(decode: Any) -> Any:
    """A row's text stream from a rule's text source: a table with ``stream()`` (the cheap path,
    :class:`engine.rules.token_text.TokenBytes`) or any ``ids -> str`` function (decoded incrementally)."""
    return decode.stream() if hasattr(decode, "stream") else IncrementalDetokenizer(decode)
