"""Schema-constrained answers: find the JSON value in generated text, validate it, return canonical JSON.

Pure code (no torch, no lm-eval): :func:`extract_json` reads a bare JSON text, a fenced code block, or the first
balanced object/array in prose (the engine's JSON boundary scanner); :class:`ResponseSchema` validates with
jsonschema (a JSON Schema) or Pydantic (a model class), and :class:`AnswerStats` counts every failure by reason.
What a failure becomes is the ``on_invalid`` strategy (:data:`ON_INVALID`), applied by the lm-eval model.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ConfigError, EngineError
from engine.rules.json_boundary import json_boundary

ON_INVALID = ("error_string", "retry", "raw", "raise")
"""What an answer that is not valid JSON for the schema becomes: ``error_string`` (the model's
``invalid_answer`` text, default ``[invalid]``), ``retry`` (generate again, sampled, up to ``retries`` times,
then the error string), ``raw`` (the generated text as is), ``raise`` (:class:`InvalidAnswerError`)."""

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


class InvalidAnswer(ValueError):
    """Why one answer failed: ``kind`` is no_json, unclosed_json, parse_error or schema_violation; ``reason``
    says where and what."""

    def __init__(self, kind: str, reason: str) -> None:
        self.kind = kind
        self.reason = reason
        super().__init__(f"{kind}: {reason}")


class InvalidAnswerError(EngineError):
    """Raised by ``on_invalid=raise``: names the request and why its answer failed."""


def extract_json(text: str) -> tuple[Any, str]:
    """The JSON value an answer carries and where it was found: ``bare``, ``fence`` or ``prose``.

    >>> extract_json('{"a": 1}')
    ({'a': 1}, 'bare')
    >>> extract_json('Here:\\n```json\\n[1, 2]\\n```\\nDone.')
    ([1, 2], 'fence')
    >>> extract_json('The answer is {"ok": true} as asked.')
    ({'ok': True}, 'prose')
    >>> extract_json('no json here')
    Traceback (most recent call last):
    ...
    engine.lm_eval.schema.InvalidAnswer: no_json: no JSON object or array in the text
    """
    try:
        return json.loads(text), "bare"
    except ValueError:
        pass
    for match in _FENCE.finditer(text):
        try:
            return json.loads(match.group(2)), "fence"
        except ValueError:
            continue
    start = _next_bracket(text, 0)
    first, failure = start, None
    while start is not None:  # the first balanced object/array that parses; "[sic]" in prose is skipped
        end = json_boundary(text[start:])
        if end is None:
            break
        try:
            return json.loads(text[start : start + end]), "prose"
        except ValueError as err:
            failure = failure or f"{err} in {text[start : start + end][:80]!r}"
            start = _next_bracket(text, start + 1)
    if failure is not None:
        raise InvalidAnswer("parse_error", f"a balanced object/array is not JSON: {failure}")
    if first is not None:
        raise InvalidAnswer("unclosed_json", f"a JSON value opens at character {first} but never closes "
                            "(cut off by max_gen_toks or a stop string?)")
    raise InvalidAnswer("no_json", "no JSON object or array in the text")


def _next_bracket(text: str, start: int) -> int | None:
    hits = [i for i in (text.find("{", start), text.find("[", start)) if i >= 0]
    return min(hits) if hits else None


def canonical_json(value: Any) -> str:
    """The one text form of a JSON value: sorted keys, no spaces, non-ASCII kept.

    >>> canonical_json({"b": [1, 2], "a": "é"})
    '{"a":"é","b":[1,2]}'
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class ResponseSchema:
    """What an answer must be: a JSON Schema, or a Pydantic model (whose JSON Schema it then has).

    >>> s = ResponseSchema.load('{"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}')
    >>> s.answer('Sure: ```json\\n{"n": 3}\\n```')
    '{"n":3}'
    >>> s.answer('{"n": "three"}')
    Traceback (most recent call last):
    ...
    engine.lm_eval.schema.InvalidAnswer: schema_violation: at $.n: 'three' is not of type 'integer'
    """

    json_schema: Mapping[str, Any]
    model: Any = None
    _validator: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def load(cls, response_schema: str | Mapping[str, Any] | None = None,
             schema_model: str | type | None = None) -> ResponseSchema:
        """From ``response_schema`` (a file path, inline JSON, or a mapping) and/or ``schema_model`` (a Pydantic
        model or its dotted path ``pkg.module.Class``); when both are given they must agree."""
        if response_schema is None and schema_model is None:
            raise ConfigError("response_schema", None, "is needed (or schema_model)",
                              fix="give a JSON Schema file or inline JSON, or a Pydantic model's dotted path")
        model = _import_model(schema_model) if schema_model is not None else None
        given = _read_schema(response_schema) if response_schema is not None else None
        if model is not None:
            derived = model.model_json_schema()
            if given is not None and canonical_json(given) != canonical_json(derived):
                raise ConfigError("response_schema", response_schema,
                                  f"disagrees with schema_model {schema_model!r} (its JSON Schema is "
                                  f"{canonical_json(derived)})",
                                  fix="give only one of them, or the model's own JSON Schema")
            given = derived
        assert given is not None
        _check_schema(given, response_schema)
        return cls(json_schema=given, model=model)

    @property
    def canonical(self) -> str:
        """The schema as canonical JSON: what backends constrain by and what the hash covers."""
        return canonical_json(self.json_schema)

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.canonical.encode()).hexdigest()

    def validate(self, value: Any) -> Any:
        """``value`` as the schema accepts it (a Pydantic model's JSON dump); raises :class:`InvalidAnswer`."""
        if self.model is not None:
            from pydantic import ValidationError

            try:
                return self.model.model_validate(value).model_dump(mode="json")
            except ValidationError as err:
                first = err.errors()[0]
                where = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
                raise InvalidAnswer("schema_violation", f"at {where}: {first['msg']}") from None
        validator = self._validator or _validator(self.json_schema)
        object.__setattr__(self, "_validator", validator)
        import jsonschema

        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        if error is not None:
            raise InvalidAnswer("schema_violation", f"at {error.json_path}: {error.message}")
        return value

    def answer(self, text: str) -> str:
        """The canonical JSON of the valid value ``text`` carries; raises :class:`InvalidAnswer`."""
        value, _ = extract_json(text)
        return canonical_json(self.validate(value))


def _read_schema(spec: str | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(spec, Mapping):
        return spec
    text = spec.strip()
    if not text.startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ConfigError("response_schema", spec, "is neither inline JSON nor a file that exists",
                              fix="give a path to a JSON Schema file, or the schema as inline JSON")
        text = path.read_text()
    try:
        value = json.loads(text)
    except ValueError as err:
        raise ConfigError("response_schema", spec, f"is not valid JSON ({err})", fix="fix the JSON") from None
    if not isinstance(value, dict):
        raise ConfigError("response_schema", spec, "is not a JSON object", fix='give a schema such as {"type": ...}')
    return value


def _check_schema(schema: Mapping[str, Any], spec: Any) -> None:
    import jsonschema

    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as err:
        raise ConfigError("response_schema", spec, f"is not a valid JSON Schema ({err.message})",
                          fix="fix the schema (see https://json-schema.org)") from None


def _validator(schema: Mapping[str, Any]) -> Any:
    import jsonschema

    return jsonschema.validators.validator_for(schema)(schema)


def _import_model(spec: str | type) -> Any:
    if not isinstance(spec, str):
        target = spec
    else:
        module_name, _, attr = spec.replace(":", ".").rpartition(".")
        try:
            target = getattr(importlib.import_module(module_name), attr) if module_name else None
        except (ImportError, AttributeError) as err:
            raise ConfigError("schema_model", spec, f"cannot be imported ({err})",
                              fix="give the dotted path of a Pydantic model, e.g. mypkg.schemas.Answer") from None
    if not hasattr(target, "model_json_schema") or not hasattr(target, "model_validate"):
        raise ConfigError("schema_model", spec, "is not a Pydantic (v2) model class",
                          fix="give a class derived from pydantic.BaseModel")
    return target


@dataclass
class AnswerStats:
    """Counts of schema answers: how many were checked, valid, recovered by retry, and failures by kind.

    >>> stats = AnswerStats()
    >>> stats.record_failure(InvalidAnswer("no_json", "x"))
    >>> stats.checked += 2; stats.valid += 1
    >>> stats.as_dict()["invalid"], stats.as_dict()["valid_rate"]
    ({'no_json': 1}, 0.5)
    """

    checked: int = 0
    valid: int = 0
    retried: int = 0
    recovered_by_retry: int = 0
    invalid: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)

    def record_failure(self, failure: InvalidAnswer) -> None:
        self.invalid[failure.kind] += 1
        self.examples.setdefault(failure.kind, failure.reason)

    def as_dict(self) -> dict[str, Any]:
        return {"checked": self.checked, "valid": self.valid,
                "valid_rate": self.valid / self.checked if self.checked else None,
                "retried": self.retried, "recovered_by_retry": self.recovered_by_retry,
                "invalid": dict(self.invalid), "first_reason": dict(self.examples)}
