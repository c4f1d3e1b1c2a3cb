"""Deterministic stop truncation: the one rule that makes ``text`` identical on every backend.

Backends stop early with their native mechanisms (to save compute), but they detect stop strings
differently (HF on token strings, vLLM on incrementally detokenized text). The engine therefore always
re-applies this rule to the fully decoded text:

* the stop occurrence that **completes earliest** in the text wins: the text is cut where a reader
  streaming it would first see a whole stop string (vLLM's streaming check makes the same choice);
* among stops completing at the same position, the **longest** wins (it starts earliest);
* occurrences that complete within the first ``min_end`` characters (the text of the first
  ``min_new_tokens`` tokens) do not count, as in vLLM's ``min_tokens`` handling;
* the text is cut right before the match, or right after it with ``include_stop=True``.

The rule is idempotent: applying it to its own output changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StopMatch:
    """Where a stop string was found.

    >>> find_earliest_stop("ab STOP cd END", ["END", "STOP"])
    StopMatch(start=3, stop='STOP')
    """

    start: int
    """Index in the text where the stop string starts."""
    stop: str
    """The stop string that matched."""

    @property
    def end(self) -> int:
        return self.start + len(self.stop)


def find_earliest_stop(text: str, stops: Iterable[str], *, min_end: int = 0) -> StopMatch | None:
    """The occurrence of any stop string that completes first (ties: the longest), or None.

    Only occurrences ending after character ``min_end`` count.

    >>> find_earliest_stop("xxabcd", ["abcd", "bc", "c"])
    StopMatch(start=3, stop='bc')
    >>> find_earliest_stop("a.b.", ["."], min_end=2)
    StopMatch(start=3, stop='.')
    >>> find_earliest_stop("hello", []) is None
    True
    """
    best: StopMatch | None = None
    for stop in stops:
        if not stop:
            continue
        start = text.find(stop, max(0, min_end - len(stop) + 1))
        if start < 0:
            continue
        match = StopMatch(start, stop)
        if best is None or match.end < best.end or (match.end == best.end and len(stop) > len(best.stop)):
            best = match
    return best


def truncate_at_stop(
    text: str, stops: Iterable[str], *, include_stop: bool = False, min_end: int = 0
) -> tuple[str, str | None]:
    """Cut ``text`` at the first stop string to complete; return the cut text and the matched stop (or None).

    >>> truncate_at_stop("The answer.\\n\\nUser: more", ["\\n\\n", "User:"])
    ('The answer.', '\\n\\n')
    >>> truncate_at_stop("a=1;b=2", [";"], include_stop=True)
    ('a=1;', ';')
    >>> truncate_at_stop("no stop here", ["###"])
    ('no stop here', None)
    """
    match = find_earliest_stop(text, stops, min_end=min_end)
    if match is None:
        return text, None
    return text[: match.end if include_stop else match.start], match.stop


class StopStringWatch:
    """One row's native stop-string check, written once for the backends that check in Python (HF, llama.cpp):
    feed each token as it is sampled; True when a stop string completes in the text that token added (vLLM's
    check on incrementally detokenized text), once more than ``min_new_tokens`` tokens exist.

    ``stream`` is the row's text stream (``push(token) -> new text``: :class:`engine.rules.token_text.TextStream`
    or :class:`engine.rules.detok.IncrementalDetokenizer`). Nothing is built over the vocabulary, so a request's
    stop strings cost no set-up; each token costs its text delta and a search over at most the longest stop
    string's length (HF's ``StopStringCriteria`` spent about 0.13 s per string, plus 8.5 ms per character, building
    tables before the first token, on the one thread every request shares).

    >>> from engine.rules.detok import IncrementalDetokenizer
    >>> vocab = {1: "Hel", 2: "lo", 3: " wor", 4: "ld.", 5: "!"}
    >>> watch = StopStringWatch(["lo w", "."], IncrementalDetokenizer(lambda ids: "".join(vocab[i] for i in ids)))
    >>> [watch.feed(t) for t in (1, 2, 3, 4)]  # "lo w" completes in " wor", the token that holds its last character
    [False, False, True, True]
    >>> late = StopStringWatch(["!"], IncrementalDetokenizer(lambda ids: "".join(vocab[i] for i in ids)),
    ...                        min_new_tokens=2)
    >>> [late.feed(t) for t in (5, 5, 5)]  # stops within the first 2 tokens do not count
    [False, False, True]
    """

    def __init__(self, strings: Iterable[str], stream: Any, *, min_new_tokens: int = 0) -> None:
        self.strings = tuple(strings)
        self.stream = stream
        self.min_new_tokens = min_new_tokens
        self.keep = max(len(s) for s in self.strings) - 1
        """Characters of earlier text kept: enough for a stop string to start there and end in the next delta."""
        self.tail = ""
        self.floor = 0
        """Matches must end after this index of ``tail`` (the text of the first ``min_new_tokens`` tokens)."""
        self.fed = 0

    def feed(self, token: int) -> bool:
        self.fed += 1
        delta = self.stream.push(token)
        text = self.tail + delta
        hit = bool(delta) and self.fed > self.min_new_tokens and find_earliest_stop(
            text, self.strings, min_end=max(len(self.tail), self.floor)) is not None
        if self.fed <= self.min_new_tokens:
            self.floor = len(text)
        cut = max(0, len(text) - self.keep)
        self.tail, self.floor = text[cut:], max(0, self.floor - cut)
        return hit


RULE_END_EVENTS = (("repeat_terminate", "repeat_terminate"), ("json_boundary_closed", "json_boundary"),
                   ("min_length_capped", "min_length"))
"""(event a rule reports, the rule's name): a row whose rules report one of these was ended by that rule."""


def ended_by_rule(events: Mapping[str, Any]) -> str | None:
    """The rule that ended a row, from the events its rules reported (first in ``RULE_END_EVENTS`` order).

    >>> ended_by_rule({"repeat_terminate": ("ngram_repeats", 12), "min_length_capped": False})
    'repeat_terminate'
    >>> ended_by_rule({"json_boundary_closed": False, "min_length_capped": False}) is None
    True
    """
    return next((name for event, name in RULE_END_EVENTS if events.get(event)), None)


def finish_reason(
    token_ids: list[int], *, stop_token_ids: Iterable[int], matched_stop: str | None, ended_by: str | None = None,
    max_new_tokens: int | None = None,
) -> tuple[str, str | int | None]:
    """Classify how a row ended, from what it produced and what its rules reported (never from a backend's own
    finish report).

    Returns ``(finish_reason, stop_reason)``: ``("stop", <stop string>)`` when a stop string matched (the text
    ends there, before anything else), ``("stop", <rule name>)`` when a rule ended the row (``ended_by``: the
    repeat guard, ``json_boundary``, the ``min_length`` cap), ``("stop", <token id>)`` when the last token is
    EOS or a stop token id, otherwise ``("length", None)``. A rule counts only if its end is in the row: its
    forced EOS is the last token, or the row stopped short of ``max_new_tokens`` (HF stopping criteria stop on the
    closing token itself). A rule that asked to end the row on its last budget token, with no room left for its
    EOS, leaves a ``"length"`` row.

    >>> finish_reason([5, 6, 2], stop_token_ids={2}, matched_stop=None)
    ('stop', 2)
    >>> finish_reason([5, 6, 7], stop_token_ids={2}, matched_stop="\\n")
    ('stop', '\\n')
    >>> finish_reason([5, 6, 2], stop_token_ids={2}, matched_stop=None, ended_by="json_boundary")
    ('stop', 'json_boundary')
    >>> finish_reason([5, 6, 7], stop_token_ids={2}, matched_stop=None, ended_by="json_boundary", max_new_tokens=3)
    ('length', None)
    >>> finish_reason([5, 6, 7], stop_token_ids={2}, matched_stop=None)
    ('length', None)
    """
    if matched_stop is not None:
        return "stop", matched_stop
    ends_with_stop_id = bool(token_ids) and token_ids[-1] in set(stop_token_ids)
    stopped_short = max_new_tokens is not None and len(token_ids) < max_new_tokens
    if ended_by is not None and (ends_with_stop_id or stopped_short):
        return "stop", ended_by
    if ends_with_stop_id:
        return "stop", token_ids[-1]
    return "length", None


def special_stop(strings: Iterable[str], specials: Mapping[str, int]) -> tuple[int, str, int] | None:
    """The first stop string that holds a special token's text, as (index, that text, its id); None if none does.

    Outputs are decoded with special tokens skipped, on every backend, so such a stop string could never match:
    the engine refuses it and points at ``stop.token_ids`` instead (a stop string that is exactly a special token's
    text becomes that token's stop id before this is asked: ``GenerationEngine._plan``).

    >>> special_stop(["\\n\\n", "<|im_end|>"], {"<|im_end|>": 2})
    (1, '<|im_end|>', 2)
    >>> special_stop(["Answer:"], {"<|im_end|>": 2}) is None
    True
    """
    for i, s in enumerate(strings):
        for text, token_id in specials.items():
            if text and text in s:
                return i, text, token_id
    return None
