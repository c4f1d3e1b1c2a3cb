"""Every request body the server takes, as a pydantic model: one place for the shape of a body (its fields, their JSON
types, what nests in what), which both checks each body and writes ``/openapi.json``.

A route still reads its body itself (``limits.read_json``, so ``serve.max_body_bytes`` holds while the body streams
in), then its wire parser calls :func:`check` with the route's model before any semantic rule. A body that does not
fit the model is a :class:`~engine.errors.RequestError` naming the field as the client sent it: the path through the
client's own JSON (``infer_requests[0].messages[1].role``, ``prompt[0][2]``), never pydantic's internal names for the
members of a union (``stop.list[str]``). What the models leave to the parsers after them: rules between fields
(``top_logprobs`` needs ``logprobs``), values the engine must validate (its errors are renamed back through the
surface's :class:`~engine.serve.wire.FieldTable`), and values that depend on the model (token ids in the vocabulary).

Choices written down: the models are strict (JSON's types, no coercion: ``"8"`` is not an integer, ``1`` is not
true; an integer is a number), unknown fields are refused (``additionalProperties: false``, with the closest known
name in the fix), and ``null`` is accepted wherever a field is optional (it means the default, as absent does).
A chat message's own fields are the engine's to check (roles, names, tool calls): a message is an object with a
``role`` and a ``content`` that is text, content parts or null, other keys passed on.

>>> check(DetokenizeRequest, {"tokens": [1, 2]})
>>> check(DetokenizeRequest, {"tokens": [1, "2"]})
Traceback (most recent call last):
...
engine.errors.RequestError: tokens[1] must be an integer, got '2'. Fix: send an integer.
>>> check(ChatCompletionRequest, {"model": "m", "messages": [], "sedd": 1})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
engine.errors.RequestError: sedd is not a known field, got 1. Fix: did you mean 'seed'? available: ...
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import RequestError


class Body(BaseModel):
    """A request body or a part of one: JSON's types, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Message(BaseModel):
    """A chat message; the engine checks roles and the rest (other keys are passed on to it)."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None


class EngineExtension(Body):
    """The ``engine`` extension field: any engine option, the full stop policy, the plugins (checked by the engine)."""

    options: dict[str, Any] | None = None
    stop: dict[str, Any] | None = None
    plugins: list[dict[str, Any]] | None = None


class StreamOptions(Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")  # pydantic reserves ``schema``
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class OpenAISampling(Body):
    """What the chat and text completions bodies share (``openai_wire.parse_sampling`` reads it)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    engine: EngineExtension | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    min_p: float | None = None
    # accepted at their neutral value only (the parser refuses any other)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class ChatCompletionRequest(OpenAISampling):
    """``POST /v1/chat/completions``."""

    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(OpenAISampling):
    """``POST /v1/completions``: ``prompt`` is a string, strings, token ids, or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    add_special_tokens: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class PatternCRequest(Body):
    """Pattern C ``POST /chat``."""

    model: str | None = None
    messages: list[Message]
    min_len: int | None = None
    max_len: int | None = None
    stream: bool | None = None


class RequestConfig(Body):
    """``/infer/``'s ``request_config``: the fields swift's ``RequestConfig`` sends."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    return_details: bool | None = None
    min_p: float | None = None
    # accepted at the value the parser names only
    num_beams: int | None = None
    stream: bool | None = None
    prompt_logprobs: int | None = None
    n: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    length_penalty: float | None = None
    structured_outputs_regex: str | None = None


class InferItem(Body):
    """One of ``/infer/``'s ``infer_requests`` (swift's ``InferRequest``); only text chat is served."""

    messages: list[Message]
    images: list[Any] | None = None
    audios: list[Any] | None = None
    videos: list[Any] | None = None
    tools: list[Any] | None = None
    objects: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    data_dict: dict[str, Any] | None = None
    uuid: str | None = None
    add_eos: bool | None = None


class InferRequest(Body):
    """``POST /infer/`` (ms-swift's rollout protocol)."""

    infer_requests: list[InferItem]
    request_config: RequestConfig | None = None
    metrics: list[Any] | None = None
    use_tqdm: bool | None = None
    adapter_request: dict[str, Any] | None = None
    engine: EngineExtension | None = None


class TokenizeRequest(Body):
    """``POST /tokenize``: ``prompt`` (text) or ``messages`` (a chat, rendered as the engine renders it)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(Body):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


class InitCommunicatorRequest(Body):
    """``POST /init_communicator/`` (swift's weight sync)."""

    host: str
    port: int
    world_size: int
    transport: str | None = None
    client_device_uuid: str | None = None


class UpdateNamedParamRequest(Body):
    """``POST /update_named_param/``: one tensor announced, its data follows over the communicator."""

    name: str
    dtype: str
    shape: list[int]


class UpdateFlattenedParamsRequest(Body):
    """``POST /update_flattened_params/``: tensors announced, one flat buffer follows over the communicator."""

    metadatas: list[dict[str, Any]]


ROUTES: dict[str, type[Body]] = {
    "/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest, "/chat": PatternCRequest,
    "/infer/": InferRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
    "/init_communicator/": InitCommunicatorRequest, "/update_named_param/": UpdateNamedParamRequest,
    "/update_flattened_params/": UpdateFlattenedParamsRequest,
}
"""The body each POST route takes (its ``requestBody`` in ``/openapi.json``)."""

_EXPECTED = {
    "string_type": "a string", "int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
    "list_type": "an array", "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
}


def check(model: type[Body], body: Any) -> None:
    """Refuse ``body`` unless it fits ``model``: a ``RequestError`` naming the first bad field as the client sent it."""
    if not isinstance(body, Mapping):
        raise RequestError("body", type(body).__name__, "must be a JSON object",
                           fix=f"send a {model.__name__} object (GET /openapi.json has its schema)")
    try:
        model.model_validate(body)
    except ValidationError as err:
        raise refusal(model, body, err.errors(include_url=False)) from None


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
        from engine.config.validation import did_you_mean

        return RequestError(name, value, "is not a known field", fix=did_you_mean(str(path[-1]),
                                                                                  known_fields(model, path[:-1])))
    if first["type"] == "literal_error":
        expected = first.get("ctx", {}).get("expected", "")
        return RequestError(name, value, f"must be one of {expected}", fix=f"send one of {expected}")
    wanted = list(dict.fromkeys(_EXPECTED.get(e["type"], e["msg"]) for e in at))
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


def openapi(base: dict[str, Any]) -> dict[str, Any]:
    """``base`` (FastAPI's own OpenAPI document of the app) with every route of :data:`ROUTES` given its body: the
    model's JSON schema under ``components.schemas``, referenced from the route's ``requestBody``."""
    from pydantic.json_schema import models_json_schema

    _, top = models_json_schema([(m, "validation") for m in ROUTES.values()],
                                ref_template="#/components/schemas/{model}")
    doc = {**base, "components": {**base.get("components", {})}}
    doc["components"]["schemas"] = {**doc["components"].get("schemas", {}), **top.get("$defs", {})}
    for path, model in ROUTES.items():
        post = doc.get("paths", {}).get(path, {}).get("post")
        if post is not None:
            post["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return doc
