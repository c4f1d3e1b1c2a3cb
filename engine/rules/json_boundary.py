"""The balanced-JSON boundary: where the first top-level JSON object or array in a text closes.

Text before the first ``{`` or ``[`` is skipped (a model often writes a preamble or a code fence);
from there brackets are counted outside strings, with backslash escapes respected inside strings.
The boundary is the character after the bracket that brings the depth back to zero.
"""

from __future__ import annotations

from engine.rules.base import CONTINUE, Decision, RowRule
from engine.rules.json_text import STRING, JsonStringState


class JsonBoundaryScanner:
    """Incremental scanner; ``closed_at`` is the boundary's index in the text fed so far, or None.

    >>> s = JsonBoundaryScanner()
    >>> s.feed('Sure: {"a": "}", "b": [1, {"c": 2}]} and more')
    >>> s.closed_at
    36
    """

    def __init__(self) -> None:
        self.depth = 0
        self.started = False
        self.strings = JsonStringState()
        self.seen = 0
        self.closed_at: int | None = None

    def feed(self, text: str) -> None:
        for ch in text:
            self.seen += 1
            if self.closed_at is not None:
                continue
            if not self.started:
                if ch in "{[":
                    self.started, self.depth = True, 1
                continue
            if self.strings.step(ch) == STRING:
                continue
            if ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.closed_at = self.seen


def json_boundary(text: str) -> int | None:
    """Index just past the first balanced top-level JSON value in ``text``, or None.

    >>> text = 'x {"k": [1, 2]} tail'
    >>> text[: json_boundary(text)]
    'x {"k": [1, 2]}'
    """
    scanner = JsonBoundaryScanner()
    scanner.feed(text)
    return scanner.closed_at


class JsonBoundaryRule(RowRule):
    """Ends the row once the first top-level JSON value in its output is balanced."""

    needs_text = True

    def __init__(self) -> None:
        self.scanner = JsonBoundaryScanner()
        self.tokens = 0
        self.closed_at_token: int | None = None

    def push(self, token: int, text: str) -> None:
        self.tokens += 1
        if self.closed_at_token is None:
            self.scanner.feed(text)
            if self.scanner.closed_at is not None:
                self.closed_at_token = self.tokens

    def decision(self) -> Decision:
        return Decision(force_eos=True) if self.closed_at_token is not None else CONTINUE

    def events(self) -> dict[str, object]:
        return {"json_boundary_closed": self.closed_at_token is not None,
                "json_boundary_closed_at": self.closed_at_token}
