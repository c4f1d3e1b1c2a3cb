"""Character-level JSON lexing shared by the JSON-aware rules: are we inside a string?"""

from __future__ import annotations

CODE, STRING = "code", "string"


class JsonStringState:
    """Feed characters one at a time; :meth:`step` says whether each belongs to a string (its quotes and
    escapes included) or to the surrounding code.

    >>> state = JsonStringState()
    >>> "".join("s" if state.step(c) == STRING else "c" for c in '{"a\\\\"b": 1}')
    'csssssscccc'
    """

    __slots__ = ("escape", "in_string")

    def __init__(self) -> None:
        self.in_string = False
        self.escape = False

    def step(self, ch: str) -> str:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
            return STRING
        if ch == '"':
            self.in_string = True
            return STRING
        return CODE
