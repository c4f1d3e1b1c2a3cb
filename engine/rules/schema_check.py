"""Is a JSON Schema one the constrained decoder can build? Asked before any generation, on every backend that
constrains (HF and vLLM both compile with xgrammar), so that a bad schema is a ``RequestError`` naming
``json_schema`` rather than a failure inside the batcher or vLLM's engine core:

* xgrammar's own schema converter is the judge (the one both backends run): ``{"type": 5}``, ``{"type": "banana"}``,
  a pattern that does not parse, a ``$ref`` to nothing, ``minimum`` > ``maximum``, ``minItems`` > ``maxItems`` are
  refused with its reason;
* a schema longer than :data:`MAX_SCHEMA_CHARS`, or a pattern whose counted repetitions (``a{20000}``,
  ``(a{999}){999}``) add up past :data:`MAX_REPEAT`, is refused first: the converter's time grows with the square of
  a count (20 s for 20000 here), and hostile round 3's enum of 8,000 strings of 1,000 characters never answered;
* then the grammar is compiled for the model's tokenizer (``compile``: the backend's own compiler, or one built for
  the engine's tokenizer): xgrammar converts ``a{999}`` but cannot compile it for SmolLM2's vocabulary (HF answered
  a 500 and vLLM an empty row before round 3);
* the conversion and the compile run in one worker thread at a time, under a time bound (:data:`CHECK_SECONDS`): a
  schema that takes longer is refused, the work it leaves finishes in its daemon thread (which releases the GIL), and
  until it has, a new schema waits up to the bound and is refused as busy: a client sending slow schemas holds one
  core at most, never the server's event loop.

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
engine.errors.RequestError: json_schema has a pattern repeating 20000 times in all (^a{20000}$), more than 1000, \
got '{"type":"string","pattern":"^a{20000}$"}'. Fix: use a shorter repetition, or maxLength.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from engine.errors import RequestError

MAX_REPEAT = 1000
"""The largest sum of a pattern's ``{n}`` / ``{m,n}`` counts."""
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of objects and arrays a schema may have (hostile round 4: a schema nested thousands deep was a
RecursionError, a 500, on every server); no schema a model is asked to follow is half as deep."""
MAX_SCHEMA_CHARS = 131_072
"""The longest schema (canonical JSON text, in characters)."""
CHECK_SECONDS = 10.0
"""How long building one schema's grammar may take, and how long a new schema waits for the worker."""
REMEMBERED = 256
"""Checked schemas kept (their canonical text)."""
FIX = ("send a JSON Schema of the supported keywords (types object, array, string, integer, number, boolean, null), "
       "with valid patterns and resolvable $refs")
_COUNTED = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")
_checked: OrderedDict[tuple[str, int], None] = OrderedDict()
_lock = threading.Lock()
_worker = threading.BoundedSemaphore(1)
"""Held while a schema is converted and compiled (released by the worker thread when it ends, late or not)."""


def check_schema(schema: str, compile: Callable[[str], Any] | None = None) -> None:
    """Refuse ``schema`` (canonical JSON text) unless a grammar can be built from it, and compiled with ``compile``
    (the model's tokenizer) when given; see the module's rules."""
    key = (schema, _owner(compile))  # compiled for one tokenizer says nothing of another
    with _lock:
        if key in _checked:
            _checked.move_to_end(key)
            return
    if len(schema) > MAX_SCHEMA_CHARS:
        raise RequestError("json_schema", _short(schema), f"is {len(schema)} characters long, more than "
                           f"{MAX_SCHEMA_CHARS}", fix="send a smaller schema (shorter enums, fewer properties)")
    parsed = json.loads(schema)
    if depth(parsed) > MAX_SCHEMA_DEPTH:
        raise RequestError("json_schema", _short(schema), f"nests objects and arrays more than {MAX_SCHEMA_DEPTH} "
                           "levels deep", fix="send a flatter schema ($defs and $ref name a shape once)")
    for pattern in _patterns(parsed):
        counts = [max(int(m.group(1)), int(m.group(2) or 0)) for m in _COUNTED.finditer(pattern)]
        if sum(counts) > MAX_REPEAT:
            raise RequestError("json_schema", _short(schema), f"has a pattern repeating {sum(counts)} times in all "
                               f"({_short(pattern, 40)}), more than {MAX_REPEAT}",
                               fix="use a shorter repetition, or maxLength")
    reason = _build(schema, compile)
    if reason is not None:
        raise RequestError("json_schema", _short(schema), f"cannot be built into a grammar: {reason}", fix=FIX)
    with _lock:
        _checked[key] = None
        while len(_checked) > REMEMBERED:
            _checked.popitem(last=False)


def _build(schema: str, compile: Callable[[str], Any] | None) -> str | None:
    """xgrammar's reason for refusing ``schema`` (None: it converts, and compiles with ``compile``), or the bound's;
    None too where xgrammar is not installed (no backend here can constrain then: the engine refuses ``json_schema``
    by capability)."""
    try:
        import xgrammar
    except ImportError:
        return None
    if not _worker.acquire(timeout=CHECK_SECONDS):
        return f"another schema's grammar was still being built after {CHECK_SECONDS:g} s; send it again later"
    outcome: list[str | None] = []

    def build() -> None:
        try:
            xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":"))
            if compile is not None:
                compile(schema)
            outcome.append(None)
        except Exception as err:  # xgrammar raises RuntimeError (and others) with its reason
            outcome.append(_reason(err))
        finally:
            _worker.release()

    worker = threading.Thread(target=build, name="schema-check", daemon=True)
    worker.start()
    worker.join(CHECK_SECONDS)
    if not outcome:
        return f"building it took longer than {CHECK_SECONDS:g} s"
    return outcome[0]


def _owner(compile: Callable[[str], Any] | None) -> int:
    """Whose compile it is: the backend of a bound method, the tokenizer of :func:`tokenizer_compile`'s (0: none)."""
    if compile is None:
        return 0
    return getattr(compile, "owner", None) or id(getattr(compile, "__self__", compile))


_compilers: dict[int, Any] = {}


def tokenizer_compile(tokenizer: Any) -> Callable[[str], Any]:
    """A compile for :func:`check_schema` with xgrammar's compiler for ``tokenizer`` (a Hugging Face tokenizer),
    built once per tokenizer: what a backend without its own compiler (vLLM compiles in its engine core) is checked
    with."""

    def compile(schema: str) -> Any:
        import xgrammar

        key = id(tokenizer)
        with _lock:
            compiler = _compilers.get(key)
        if compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
            compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=64 * 2**20)
            with _lock:
                _compilers[key] = compiler
        return compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    compile.owner = id(tokenizer)  # type: ignore[attr-defined]
    return compile


def _reason(err: BaseException) -> str:
    """xgrammar's message without its C++ location prefix (``[12:00:00] /project/cpp/x.cc:12: ``)."""
    text = str(err).strip()
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text).splitlines()[0] if text else type(err).__name__


def depth(node: Any) -> int:
    """How deeply ``node`` nests lists and mappings, found without recursion.

    >>> depth({"a": [1, {"b": 2}]}), depth(3)
    (3, 0)
    """
    deepest, todo = 0, [(node, 1)]
    while todo:
        item, level = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        todo.extend((child, level + 1) for child in children)
    return deepest


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
