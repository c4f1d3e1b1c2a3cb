"""Is a JSON Schema one the constrained decoder can build? Asked before any generation, on every backend that
constrains (HF and vLLM both compile with xgrammar), so that a bad schema is a ``RequestError`` naming
``json_schema`` rather than a failure inside the batcher or vLLM's engine core:

* xgrammar's own schema converter is the judge (the one both backends run): ``{"type": 5}``, ``{"type": "banana"}``,
  a pattern that does not parse, a ``$ref`` to nothing, ``minimum`` > ``maximum``, ``minItems`` > ``maxItems`` are
  refused with its reason;
* a pattern's counted repetition (``a{20000}``) above :data:`MAX_REPEAT` is refused first: the converter's time
  grows with the square of the count (20 s for 20000 here);
* the converter runs under a time bound (:data:`CHECK_SECONDS`); a schema that takes longer is refused (the
  conversion finishes in a daemon thread, which releases the GIL while it works).

Checked schemas are remembered (:data:`REMEMBERED` of them, least recently used dropped first), so a client that
sends the same schema every call pays once.

>>> check_schema('{"type":"object","properties":{"a":{"type":"integer"}}}')
>>> check_schema('{"type":"banana"}')
Traceback (most recent call last):
...
engine.errors.RequestError: json_schema cannot be built into a grammar: Unsupported type "banana", \
got '{"type":"banana"}'. Fix: send a JSON Schema of the supported keywords (types object, array, string, integer, \
number, boolean, null), with valid patterns and resolvable $refs.
>>> check_schema('{"type":"string","pattern":"^a{20000}$"}')
Traceback (most recent call last):
...
engine.errors.RequestError: json_schema has a pattern repeating 20000 times (^a{20000}), more than 1000, got \
'{"type":"string","pattern":"^a{20000}$"}'. Fix: use a shorter repetition, or maxLength.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from engine.errors import RequestError

MAX_REPEAT = 1000
"""The largest count of a pattern's ``{n}`` / ``{m,n}``."""
CHECK_SECONDS = 10.0
"""How long the grammar converter may take on one schema."""
REMEMBERED = 256
"""Checked schemas kept (their canonical text)."""
FIX = ("send a JSON Schema of the supported keywords (types object, array, string, integer, number, boolean, null), "
       "with valid patterns and resolvable $refs")
_COUNTED = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")
_checked: OrderedDict[str, None] = OrderedDict()
_lock = threading.Lock()


def check_schema(schema: str) -> None:
    """Refuse ``schema`` (canonical JSON text) unless a grammar can be built from it; see the module's rules."""
    with _lock:
        if schema in _checked:
            _checked.move_to_end(schema)
            return
    for pattern in _patterns(json.loads(schema)):
        for match in _COUNTED.finditer(pattern):
            count = max(int(match.group(1)), int(match.group(2) or 0))
            if count > MAX_REPEAT:
                raise RequestError("json_schema", _short(schema), f"has a pattern repeating {count} times "
                                   f"({_short(pattern[max(0, match.start() - 10):match.end()], 40)}), more than "
                                   f"{MAX_REPEAT}", fix="use a shorter repetition, or maxLength")
    reason = _convert(schema)
    if reason is not None:
        raise RequestError("json_schema", _short(schema), f"cannot be built into a grammar: {reason}", fix=FIX)
    with _lock:
        _checked[schema] = None
        while len(_checked) > REMEMBERED:
            _checked.popitem(last=False)


def _convert(schema: str) -> str | None:
    """xgrammar's reason for refusing ``schema`` (None: it converts); None too where xgrammar is not installed
    (no backend here can constrain then: the engine refuses ``json_schema`` by capability)."""
    try:
        import xgrammar
    except ImportError:
        return None
    outcome: list[str | None] = []

    def convert() -> None:
        try:
            xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":"))
            outcome.append(None)
        except Exception as err:  # xgrammar raises RuntimeError (and others) with its reason
            outcome.append(_reason(err))

    worker = threading.Thread(target=convert, name="schema-check", daemon=True)
    worker.start()
    worker.join(CHECK_SECONDS)
    if not outcome:
        return f"building it took longer than {CHECK_SECONDS:g} s"
    return outcome[0]


def _reason(err: BaseException) -> str:
    """xgrammar's message without its C++ location prefix (``[12:00:00] /project/cpp/x.cc:12: ``)."""
    text = str(err).strip()
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text).splitlines()[0] if text else type(err).__name__


def _patterns(node: Any) -> Iterator[str]:
    """Every regular expression a schema holds: ``pattern`` values and ``patternProperties`` keys."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            if key == "patternProperties" and isinstance(value, dict):
                yield from (k for k in value if isinstance(k, str))
            yield from _patterns(value)
    elif isinstance(node, list):
        for item in node:
            yield from _patterns(item)


def _short(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
