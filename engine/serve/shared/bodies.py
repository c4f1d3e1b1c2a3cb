"""Every request body the server takes, as a pydantic model: one place for the shape of a body (its fields, their JSON
types, what nests in what), which both checks each body and writes ``/openapi.json``.

Each surface's models live beside its parser (``openai/bodies.py``, ``rollout/bodies.py``,
``pattern_c/bodies.py``), every field marked with what it is to the engine (:mod:`engine.serve.shared.fields`). The
call path (:mod:`engine.serve.shared.calls`) reads a body within ``serve.max_body_bytes`` and calls :func:`check`
with the route's model before any semantic rule; the parser then reads the validated model :func:`check` returns.
A body that does not fit the model is a :class:`~engine.errors.RequestError` naming the field as the client sent
it: the path through the client's own JSON (``infer_requests[0].messages[1].role``, ``prompt[0][2]``), never
pydantic's internal names for the members of a union (``stop.list[str]``). What the models leave to the parsers
after them: rules between fields (``top_logprobs`` needs ``logprobs``), values the engine must validate (its errors
are renamed back through the surface's :class:`~engine.serve.shared.fields.FieldTable`), and values that depend on
the model (token ids in the vocabulary).

Choices written down: the models are strict (JSON's types, no coercion: ``"8"`` is not an integer, ``1`` is not
true; an integer is a number), unknown fields are refused (``additionalProperties: false``, with the closest known
name in the fix), and ``null`` is accepted wherever a field is optional (it means the default, as absent does).
A chat message's own fields are the engine's to check (roles, names, tool calls): a message is an object with a
``role`` and a ``content`` that is text, content parts or null, other keys passed on.

>>> from typing import Annotated
>>> class Tokens(Body):
...     tokens: Annotated[list[int], Wire("the ids to decode")]
>>> check(Tokens, {"tokens": [1, 2]}).tokens
[1, 2]
>>> check(Tokens, {"tokens": [1, "2"]})
Traceback (most recent call last):
...
engine.errors.RequestError: tokens[1] must be an integer, got '2'. Fix: send an integer.
>>> check(Tokens, {"tokens": [1], "tokenz": [1]})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
engine.errors.RequestError: tokenz is not a known field, got [1]. Fix: did you mean 'tokens'? available: ...
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, ValidationError, WithJsonSchema

from engine.errors import RequestError
from engine.serve.shared.fields import Engine, Wire

Number = Annotated[int | float, WithJsonSchema({"type": "number"})]
"""A JSON number, kept as the client sent it (``0`` stays an integer: errors show the value as sent)."""


class Body(BaseModel):
    """A request body or a part of one: JSON's types, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Message(BaseModel):
    """A chat message; the engine checks roles and the rest (other keys are passed on to it)."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Annotated[str, Wire("the engine checks the message")]
    content: Annotated[str | list[dict[str, Any]] | None, Wire("the engine checks the message")] = None


def messages_of(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Validated messages as the client sent them (the keys it set, extras included), for the engine."""
    return [m.model_dump(exclude_unset=True) for m in messages]


def vllm_top_k(value: int) -> int:
    """vLLM's and swift's ``top_k: -1`` is "off", the engine's 0."""
    return 0 if value == -1 else value


class SamplingOptions(Body):
    """The sampling options every generation surface names alike (vLLM's names: OpenAI's bodies and swift's
    ``RequestConfig`` both extend this): a new one is one line here, on every surface at once."""

    temperature: Annotated[Number | None, Engine("generation.temperature")] = None
    top_p: Annotated[Number | None, Engine("generation.top_p")] = None
    top_k: Annotated[int | None, Engine("generation.top_k", convert=vllm_top_k)] = None
    min_p: Annotated[Number | None, Engine("generation.min_p")] = None
    repetition_penalty: Annotated[Number | None, Engine("generation.repetition_penalty")] = None
    seed: Annotated[int | None, Engine("generation.seed")] = None
    stop: Annotated[str | list[str] | None, Engine("stop.strings", read=False)] = None


class EngineExtension(Body):
    """The ``engine`` extension field: any engine option, the full stop policy, the plugins, the repeat guard's fields
    for this request (laid over the server's guard, as the vLLM plugin's ``repeat_terminate.*`` keys are; checked by
    the engine)."""

    options: Annotated[dict[str, Any] | None, Wire("engine options by their engine names")] = None
    stop: Annotated[dict[str, Any] | None, Wire("the engine's stop policy")] = None
    plugins: Annotated[list[dict[str, Any]] | None, Wire("the engine's plugins")] = None
    repeat_terminate: Annotated[dict[str, Any] | None, Wire("the repeat guard's fields for this request")] = None


_EXPECTED = {
    "string_type": "a string", "int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
    "list_type": "an array", "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
}


B = typing.TypeVar("B", bound=BaseModel)


def check(model: type[B], body: Any) -> B:
    """``body`` as a ``model`` (what the parser reads), or a ``RequestError`` naming the first bad field as the client
    sent it."""
    if not isinstance(body, Mapping):
        raise RequestError("body", type(body).__name__, "must be a JSON object",
                           fix=f"send a {model.__name__} object (GET /openapi.json has its schema)")
    unknown = first_unknown(model, body)
    if unknown is not None:  # before pydantic, which would build one error per unknown key (a million: seconds)
        path, value = unknown
        from engine.errors import did_you_mean

        raise RequestError(dotted(path), value, "is not a known field",
                           fix=did_you_mean(str(path[-1]), known_fields(model, path[:-1])))
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise refusal(model, body, err.errors(include_url=False)) from None


def first_unknown(model: type[BaseModel], body: Any, path: tuple[str | int, ...] = ()) -> \
        tuple[list[str | int], Any] | None:
    """The first key of ``body`` (and of the objects nested in it) that ``model`` does not know, with its value, or
    None. A strict body's unknown keys are found in one pass over the keys, however many the client sent; a chat
    message's extra keys are the engine's to check.

    >>> class Tiny(Body):
    ...     tokens: Annotated[list[int] | None, Wire("ids")] = None
    >>> first_unknown(Tiny, {"tokens": [1], **{f"k{i}": i for i in range(10**5)}})
    (['k0'], 0)
    """
    if not isinstance(body, Mapping) or model.model_config.get("extra") != "forbid":
        return None
    fields = _wire_fields(model)
    for key, value in body.items():
        if key not in fields:
            return [*path, key], value
    for key, annotation in fields.items():
        value = body.get(key)
        for nested, listed in _held_models(annotation):
            if listed and isinstance(value, list):
                found = next((f for i, item in enumerate(value)
                              if (f := first_unknown(nested, item, (*path, key, i))) is not None), None)
            elif not listed and isinstance(value, Mapping):
                found = first_unknown(nested, value, (*path, key))
            else:
                continue
            if found is not None:
                return found
    return None


def _held_models(annotation: Any) -> list[tuple[type[BaseModel], bool]]:
    """The models a field holds as a value (False) or as a list's items (True), through ``X | None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, False)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _held_models(arg)]
    if origin is list:
        return [(m, True) for arg in typing.get_args(annotation) for m, listed in _held_models(arg) if not listed]
    return []


def refusal(model: type[Body], body: Mapping[str, Any], errors: Sequence[Mapping[str, Any]]) -> RequestError:
    """The one error to answer with, about the first field pydantic refused. Where that field is a union, each member
    reports; the member that got furthest into the client's value says the most (``prompt: [1, true]`` is refused at
    ``prompt[1]``, by the token-ids member), and members refusing the same place are joined (``stop: 5`` must be a
    string or an array). An unknown field is named before a missing one (most often the same field, misspelled)."""
    located = [(*_walk(body, e["loc"], missing=e["type"] == "missing"), e) for e in errors]
    field = located[0][0][:1]
    firsts: dict[tuple[str | int, ...], tuple[list[str | int], Mapping[str, Any]]] = {}
    for path, member, e in sorted(located, key=lambda x: x[2]["type"] != "extra_forbidden"):
        if path[:1] == field:
            firsts.setdefault(member, (path, e))
    path, first = max(firsts.values(), key=lambda pe: tuple(s if isinstance(s, int) else -1 for s in pe[0]))
    at = [e for p, e in firsts.values() if p == path]
    name, value = dotted(path), first.get("input")
    if first["type"] == "missing":
        return RequestError(name, None, "is required", fix=f"add {name} (GET /openapi.json has the body's schema)")
    if first["type"] == "extra_forbidden":
        from engine.errors import did_you_mean

        return RequestError(name, value, "is not a known field", fix=did_you_mean(str(path[-1]),
                                                                                  known_fields(model, path[:-1])))
    if first["type"] == "literal_error":
        expected = first.get("ctx", {}).get("expected", "")
        return RequestError(name, value, f"must be one of {expected}", fix=f"send one of {expected}")
    wanted = list(dict.fromkeys(_EXPECTED.get(e["type"], e["msg"]) for e in at))
    if "a number" in wanted and "an integer" in wanted:  # a Number (int | float) refused: JSON calls both a number
        wanted.remove("an integer")
    return RequestError(name, value, f"must be {' or '.join(wanted)}", fix=f"send {' or '.join(wanted)}")


def client_path(body: Any, loc: Sequence[str | int], *, missing: bool = False) -> list[str | int]:
    """pydantic's ``loc`` as the path through ``body`` itself: a step is kept where the client's JSON has it (a key
    of an object, an index of an array), and a union member's tag (``list[int]``), which it never has, is dropped.

    >>> client_path({"stop": ["a", 1]}, ("stop", "list[str]", 1))
    ['stop', 1]
    >>> client_path({"infer_requests": [{}]}, ("infer_requests", 0, "messages"), missing=True)
    ['infer_requests', 0, 'messages']
    """
    return _walk(body, loc, missing=missing)[0]


def _walk(body: Any, loc: Sequence[str | int], *, missing: bool) -> tuple[list[str | int], tuple[str | int, ...]]:
    """(the client's path, the steps dropped from ``loc``: which union members the error came through)."""
    path: list[str | int] = []
    dropped: list[str | int] = []
    here: Any = body
    for i, step in enumerate(loc):
        if isinstance(here, Mapping) and isinstance(step, str) and (step in here or (missing and i == len(loc) - 1)):
            path.append(step)
            here = here.get(step)
        elif isinstance(here, list) and isinstance(step, int) and 0 <= step < len(here):
            path.append(step)
            here = here[step]
        else:
            dropped.append(step)
    return path, tuple(dropped)


def dotted(path: Sequence[str | int]) -> str:
    """``["prompt", 0, 2]`` -> ``"prompt[0][2]"``, ``["a", "b"]`` -> ``"a.b"``."""
    out = ""
    for step in path:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else step)
    return out or "body"


def known_fields(model: type[BaseModel], path: Sequence[str | int]) -> list[str]:
    """The field names of the object at ``path`` in a body of ``model`` (by their wire names)."""
    here: list[type[BaseModel]] = [model]
    for step in path:
        if isinstance(step, int):
            continue  # an array's items have the array's model
        nested = [m for current in here if step in _wire_fields(current)
                  for m in _models_in(_wire_fields(current)[step])]
        here = nested or here
    return sorted({name for current in here for name in _wire_fields(current)})


def _wire_fields(model: type[BaseModel]) -> dict[str, Any]:
    return {(f.alias or name): f.annotation for name, f in model.model_fields.items()}


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, dict):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []


def openapi(base: dict[str, Any], routes: Mapping[str, type[BaseModel]]) -> dict[str, Any]:
    """``base`` (FastAPI's own OpenAPI document of the app) with every route of ``routes`` (path -> body model)
    given its body: the model's JSON schema under ``components.schemas``, referenced from the route's
    ``requestBody``."""
    from pydantic.json_schema import models_json_schema

    _, top = models_json_schema([(m, "validation") for m in routes.values()],
                                ref_template="#/components/schemas/{model}")
    doc = {**base, "components": {**base.get("components", {})}}
    doc["components"]["schemas"] = {**doc["components"].get("schemas", {}), **top.get("$defs", {})}
    for path, model in routes.items():
        post = doc.get("paths", {}).get(path, {}).get("post")
        if post is not None:
            post["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return doc
