"""Streaming text that never has to be taken back: the one rule every streaming surface uses.

A streamed answer must concatenate to exactly the non-streamed ``text`` of the same request. ``text`` is the
decoded output after stop truncation (:mod:`engine.rules.stop`) and the plugins' post-decode steps, so while
tokens arrive only a prefix of the decoded text is final:

* a suffix that could still grow into a stop string is held back (the stop would cut it away), and so is
  everything once a stop string completes after ``min_end`` (the stream is over there);
* a trailing U+FFFD is held back (an incomplete UTF-8 sequence that the next token may complete);
* each post-decode step says which part of its output is fixed whatever text follows
  (``Plugin.stream_prefix``; a step that cannot say holds everything back until the end).

:class:`TextStream` turns the growing decoded text into deltas; at the end it receives the engine's final ``text``
and emits the rest, checking that what was emitted is a prefix of it (a broken rule fails loudly instead of
streaming a different answer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.rules.stop import find_earliest_stop

REPLACEMENT = "\ufffd"


def stop_safe_prefix(text: str, stops: Sequence[str], *, include_stop: bool = False,
                     min_end: int | None = 0) -> tuple[str, bool]:
    """The part of ``text`` that stop truncation will keep whatever follows, and whether a stop completed.

    ``min_end``: the character length of the first ``min_new_tokens`` tokens' text, or None while fewer tokens
    exist (then no occurrence counts yet, as in the engine's rule).

    >>> stop_safe_prefix("Hello wor", ["world"])        # "wor" may become "world"
    ('Hello ', False)
    >>> stop_safe_prefix("Hello world, again", ["world"])
    ('Hello ', True)
    >>> stop_safe_prefix("a.b", ["."], min_end=None)     # inside min_new_tokens a stop does not count
    ('a.b', False)
    >>> stop_safe_prefix("caf" + REPLACEMENT, [])         # half a UTF-8 character
    ('caf', False)
    """
    stops = [s for s in stops if s]
    if min_end is not None:
        match = find_earliest_stop(text, stops, min_end=min_end)
        if match is not None:
            return text[: match.end if include_stop else match.start], True
    keep = len(text)
    for stop in stops:  # the longest suffix that is a proper prefix of a stop string
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                keep = min(keep, len(text) - size)
                break
    while keep and text[keep - 1] == REPLACEMENT:
        keep -= 1
    return text[:keep], False


class StreamMismatchError(AssertionError):
    """The final text does not start with what was already streamed (a streaming rule is wrong)."""


class TextStream:
    """Deltas of one streamed answer: feed the decoded text as it grows, then ``finish`` with the final text.

    >>> s = TextStream(stops=["\\n\\n"])
    >>> [s.feed(t, min_end=0) for t in ["Hi", "Hi there.\\n", "Hi there.\\n\\nUser"]]
    ['Hi', ' there.', '']
    >>> s.finish("Hi there.")
    ''
    >>> s.emitted
    'Hi there.'
    """

    def __init__(self, *, stops: Sequence[str] = (), include_stop: bool = False,
                 post: Sequence[Callable[[str], str]] = ()) -> None:
        self.stops = list(stops)
        self.include_stop = include_stop
        self.post = list(post)
        """Each post-decode step's ``stream_prefix``, in the order the steps run."""
        self.emitted = ""
        self.stopped = False
        """A stop string completed: nothing after it will be emitted."""

    def _stable(self, text: str, min_end: int | None) -> str:
        prefix, stopped = stop_safe_prefix(text, self.stops, include_stop=self.include_stop, min_end=min_end)
        self.stopped = self.stopped or stopped
        for step in self.post:
            prefix = step(prefix)
        return prefix

    def _advance(self, target: str) -> str:
        if not target.startswith(self.emitted):
            raise StreamMismatchError(f"already streamed {self.emitted!r}, but the text is now {target!r}")
        delta, self.emitted = target[len(self.emitted):], target
        return delta

    def feed(self, text: str, *, min_end: int | None) -> str:
        """The new delta for the decoded text so far ('' when nothing more is final yet)."""
        if self.stopped:
            return ""
        stable = self._stable(text, min_end)
        return self._advance(stable) if len(stable) > len(self.emitted) else ""

    def finish(self, final_text: str) -> str:
        """The last delta: the rest of the engine's final ``text``."""
        return self._advance(final_text)
