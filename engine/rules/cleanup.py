"""Post-decode cleanup: deterministic, non-parsing text steps applied to ``text`` after stop truncation."""

from __future__ import annotations

from engine.rules.json_text import STRING, JsonStringState

SENTENCE_ENDS = ".!?\u3002\uff1f\uff01"
"""Characters that end a sentence: ASCII full stop, question and exclamation marks, and their CJK full-width forms
(\u3002 \uff1f \uff01). The min-length rule's punctuation bias and the sentence trim read this one set."""
PAIRS = {"(": ")", "[": "]", "{": "}"}


def close_unbalanced(text: str) -> str:
    """Close an unterminated double quote, then still-open brackets, innermost first.

    >>> close_unbalanced('{"a": [1, "x')
    '{"a": [1, "x"]}'
    """
    stack: list[str] = []
    strings = JsonStringState()
    for ch in text:
        if strings.step(ch) == STRING:
            continue
        if ch in PAIRS:
            stack.append(PAIRS[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
    if strings.in_string:
        text += '"'
    return text + "".join(reversed(stack))


def trim_to_sentence(text: str) -> str:
    """Cut a trailing unfinished sentence, keeping text through the last sentence end (if there is one).

    >>> trim_to_sentence("First one. Second one! And a third that")
    'First one. Second one!'
    >>> trim_to_sentence("no sentence end at all")
    'no sentence end at all'
    """
    stripped = text.rstrip()
    if not stripped or stripped[-1] in SENTENCE_ENDS:
        return stripped
    last = max(stripped.rfind(c) for c in SENTENCE_ENDS)
    return stripped[: last + 1] if last >= 0 else text


def cleanup(text: str, *, trim_whitespace: bool = True, close_brackets: bool = False,
            sentence_end: bool = False) -> str:
    """Apply the enabled steps in a fixed order: sentence trim, bracket closing, whitespace trim.

    >>> cleanup("  Hello there. Unfinished", sentence_end=True)
    'Hello there.'
    """
    if sentence_end:
        text = trim_to_sentence(text)
    if close_brackets:
        text = close_unbalanced(text)
    return text.strip() if trim_whitespace else text


def stable_prefix(text: str, *, trim_whitespace: bool = True, close_brackets: bool = False,
                  sentence_end: bool = False) -> str:
    """The part of ``cleanup(more)`` fixed for every ``more`` that extends ``text`` (what streaming may emit).

    The sentence trim keeps at least everything through the last sentence end so far (and all of ``text`` when it
    has none: the trim then cuts later, or not at all), less trailing whitespace, which the trim may drop; bracket
    closing only appends; the whitespace trim drops leading whitespace and may drop trailing whitespace, so that
    is held back too.

    >>> stable_prefix("  First one. Second", sentence_end=True)
    'First one.'
    >>> stable_prefix('{"a": [1, ', close_brackets=True)
    '{"a": [1,'
    """
    if sentence_end:  # the trim also drops trailing whitespace (all of a blank text)
        last = max(text.rfind(c) for c in SENTENCE_ENDS)
        text = text[: last + 1] if last >= 0 else text.rstrip()
    del close_brackets  # only appends at the end
    return text.strip() if trim_whitespace else text
