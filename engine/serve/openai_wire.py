"""The OpenAI chat-completions wire format (``POST /v1/chat/completions``), both ways, in one place (what every
surface shares: :mod:`engine.serve.wire`).

:func:`parse_completion` checks a request body and turns it into engine arguments, refusing unknown fields and
values this server cannot honour with a :class:`RequestError` that names the field; :func:`completion_body`
and :func:`chunk` build the non-streamed response and the streamed ``chat.completion.chunk`` objects. No web
framework is imported here.

Choices written down (OpenAI's reference leaves them open or this server cannot honour them):

* ``n`` must be 1; sampling parameters OpenAI or vLLM have but the engine does not (``frequency_penalty``,
  ``presence_penalty``, ``logit_bias``, tools) are accepted only at their neutral value, anything else is a 400
  naming the field. ``user`` is accepted and ignored.
* vLLM's top-level sampling extras are taken as ``vllm serve`` takes them: ``top_k`` (-1 or 0: off), ``min_p``,
  ``repetition_penalty``, ``min_tokens`` (the engine's ``min_new_tokens``: EOS and stops held back until then),
  ``stop_token_ids`` (the engine's ``stop.token_ids``), ``seed``.
* ``response_format``: ``text``; ``json_object`` (any JSON object); ``json_schema`` with ``json_schema.schema``
  (``name``, ``description`` and ``strict`` accepted; decoding is always constrained, so always strict). The schema is
  the engine's ``json_schema``: every answer is built to it (HF and vLLM; llama.cpp refuses it).
* ``model`` must name the served model (else 404, as vLLM's server answers).
* ``max_tokens`` and ``max_completion_tokens`` are synonyms; giving both with different values is a 400.
* The engine extension ``engine: {options, stop, plugins}`` (the ``/infer/`` one) reaches every other engine
  option, the full stop policy and the plugins; it is validated like the in-process call.
* Streamed logprobs: the chunk with the ``finish_reason`` carries every token's logprobs (the text deltas are
  cut where stop truncation is safe, not at token boundaries), so all chunks' logprobs together equal the
  non-streamed ``choices[0].logprobs``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.errors import RequestError
from engine.serve.wire import (
    FieldTable,
    chat_messages,
    engine_extension,
    flag,
    logprobs_content,
    stop_strings,
    usage,
)
from engine.types import GenerationResult

NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},), "tools": ([],),
    "tool_choice": ("none",), "parallel_tool_calls": (False, True),
}
"""Fields accepted only at a value that changes nothing (null too)."""
TABLE = FieldTable({
    "max_tokens": "generation.max_new_tokens", "max_completion_tokens": "generation.max_new_tokens",
    "temperature": "generation.temperature", "top_p": "generation.top_p", "seed": "generation.seed",
    "top_logprobs": "generation.logprobs", "stop": "stop.strings", "top_k": "generation.top_k",
    "repetition_penalty": "generation.repetition_penalty", "min_tokens": "generation.min_new_tokens",
    "stop_token_ids": "stop.token_ids", "response_format.json_schema.schema": "json_schema",
    "min_p": "generation.min_p",
})
"""The fields both ways: top-level fields read into generation options; the engine's errors name them, the one
request's ``messages[i]`` and the ``engine`` extension's fields."""


@dataclass(frozen=True)
class CompletionCall:
    """One checked ``/v1/chat/completions`` body: what the engine is asked for and how to answer."""

    model: str
    messages: list[dict[str, Any]]
    options: dict[str, Any] = field(default_factory=dict)
    stop: dict[str, Any] | None = None
    plugins: list[Any] | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int | None = None
    json_schema: Any = None
    """``response_format``'s schema, for the engine's constrained decoding (None: free text)."""


@dataclass(frozen=True)
class Sampling:
    """What a chat and a text completions body share, checked: the model, engine options, stop policy, plugins,
    streaming, and ``response_format``'s schema."""

    model: str
    options: dict[str, Any]
    stop: dict[str, Any] | None
    plugins: list[Any] | None
    stream: bool
    include_usage: bool
    json_schema: Any


def parse_sampling(body: Mapping[str, Any], fields: FieldTable, neutral: Mapping[str, tuple[Any, ...]], *,
                   logprobs: int | None) -> Sampling:
    """The sampling fields of an OpenAI body whose keys were checked: ``n``, the ``neutral`` fields, ``model``,
    ``user``, the token budget, the sampling options (read through ``fields``), ``logprobs`` (already read, as the
    engine's ``generation.logprobs``), ``stream``/``stream_options``, ``stop``/``stop_token_ids``, the ``engine``
    extension and ``response_format``. Raises ``RequestError`` naming the first bad field."""
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or n != 1):
        raise RequestError("n", n, "is not supported by this server",
                           fix="use 1 (send the request several times for several samples)")
    for key, allowed in neutral.items():
        value = body.get(key)
        if value is not None and (value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool)):
            raise RequestError(key, value, "is not supported by this server",
                               fix=f"leave it out or send {allowed[0]!r}")
    model = body["model"]
    if not model:
        raise RequestError("model", model, "must name the served model", fix="send the served model's name "
                           "(GET /v1/models lists it)")
    options: dict[str, Any] = {}
    tokens = _max_tokens(body)
    if tokens is not None:
        options["max_new_tokens"] = tokens
    options.update(fields.read_options(body, ("temperature", "top_p", "seed", "top_k", "repetition_penalty",
                                              "min_tokens", "min_p")))
    if options.get("top_k") == -1 and not isinstance(options["top_k"], bool):
        options["top_k"] = 0  # vLLM's "off"; the engine's is 0
    if logprobs is not None:
        options["logprobs"] = logprobs
    stream = flag(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise RequestError("stream_options", stream_options, "is only allowed with stream: true",
                               fix="set stream to true or leave stream_options out")
        include_usage = flag(stream_options, "include_usage", where="stream_options.")
        if flag(stream_options, "continuous_usage_stats", where="stream_options."):
            raise RequestError("stream_options.continuous_usage_stats", True, "is not supported",
                               fix="use include_usage for one usage chunk at the end")
    stop = stop_strings(body.get("stop"))
    if body.get("stop_token_ids") not in (None, []):
        stop = {**(stop or {}), "token_ids": body["stop_token_ids"]}  # checked by the engine, named back by TABLE
    options, stop, plugins = engine_extension(body, options, stop, options_from="by a top-level field",
                                              stop_field="stop" if body.get("stop") else "stop_token_ids")
    return Sampling(model=model, options=options, stop=stop, plugins=plugins, stream=stream,
                    include_usage=include_usage, json_schema=response_schema(body.get("response_format")))


def parse_completion(body: Any) -> CompletionCall:
    """Check a chat-completions body; raise ``RequestError`` naming the first bad field. Nothing is generated.

    >>> call = parse_completion({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
    ...                          "temperature": 0, "stop": "\\n"})
    >>> call.options, call.stop
    ({'max_new_tokens': 8, 'temperature': 0}, {'strings': ['\\n']})
    >>> parse_completion({"model": "m", "messages": [], "n": 2})
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: n is not supported by this server, got 2. Fix: use 1 (send the request several \
times for several samples).
    >>> parse_completion({"model": "m", "messages": [], "sedd": 1})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: sedd is not a known field, got 1. Fix: did you mean 'seed'? available: ...
    """
    from engine.serve.bodies import ChatCompletionRequest, check

    check(ChatCompletionRequest, body)
    logprobs, top = flag(body, "logprobs"), body.get("top_logprobs")
    if top is not None and not logprobs:
        raise RequestError("top_logprobs", top, "needs logprobs: true", fix="set logprobs to true")
    sampling = parse_sampling(body, TABLE, NEUTRAL, logprobs=(0 if top is None else top) if logprobs else None)
    return CompletionCall(model=sampling.model, messages=chat_messages(body.get("messages")),
                          options=sampling.options, stop=sampling.stop, plugins=sampling.plugins,
                          stream=sampling.stream, include_usage=sampling.include_usage, logprobs=logprobs,
                          top_logprobs=top, json_schema=sampling.json_schema)


def response_schema(value: Any) -> Any:
    """The JSON Schema a ``response_format`` asks for, or None for free text.

    >>> response_schema({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integer"}}})
    {'type': 'integer'}
    >>> response_schema({"type": "json_object"}), response_schema({"type": "text"}), response_schema(None)
    ({'type': 'object'}, None, None)
    >>> response_schema({"type": "json_schema", "json_schema": {"name": "a"}})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: response_format.json_schema.schema is required ...
    """
    example = '{"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}'
    if value is None:
        return None
    kind, spec = value["type"], value.get("json_schema")
    if kind in ("text", "json_object"):
        if spec is not None:
            raise RequestError("response_format.json_schema", spec, f"applies to type json_schema only, not {kind}",
                               fix=f"leave it out, or send e.g. {example}")
        return None if kind == "text" else {"type": "object"}
    if spec is None:
        raise RequestError("response_format.json_schema", spec, "is required with type json_schema",
                           fix=f"e.g. {example}")
    if spec.get("schema") is None:
        raise RequestError("response_format.json_schema.schema", None, "is required (the engine constrains answers "
                           "to it)", fix=f"e.g. {example}")
    return spec["schema"]


def _max_tokens(body: Mapping[str, Any]) -> Any:
    a, b = body.get("max_tokens"), body.get("max_completion_tokens")
    if a is not None and b is not None and a != b:
        raise RequestError("max_completion_tokens", b, f"differs from max_tokens ({a!r})", fix="send one of them")
    return a if a is not None else b


# -- responses ------------------------------------------------------------------------------------------


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _logprobs(result: GenerationResult, call: CompletionCall, tokenizer: Any) -> dict[str, Any] | None:
    if not call.logprobs:
        return None
    return logprobs_content(result, tokenizer, 0 if call.top_logprobs is None else call.top_logprobs)


def completion_body(result: GenerationResult, call: CompletionCall, *, model: str, tokenizer: Any) -> dict[str, Any]:
    """The ``chat.completion`` object for one result."""
    return {
        "id": completion_id(), "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                     "logprobs": _logprobs(result, call, tokenizer), "finish_reason": result.finish_reason}],
        "usage": usage(result), "system_fingerprint": None,
    }


def chunk(cid: str, created: int, model: str, call: CompletionCall, *, delta: dict[str, Any] | None = None,
          result: GenerationResult | None = None, tokenizer: Any = None, usage_only: bool = False) -> dict[str, Any]:
    """One ``chat.completion.chunk``: a delta; with ``result`` the closing one (finish reason, logprobs); with
    ``usage_only`` the trailing usage chunk (``stream_options.include_usage``), whose ``choices`` are empty."""
    body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "system_fingerprint": None}
    if usage_only:
        assert result is not None
        return {**body, "choices": [], "usage": usage(result)}
    choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": None}
    if result is not None:
        choice["finish_reason"] = result.finish_reason
        choice["logprobs"] = _logprobs(result, call, tokenizer)
    body["choices"] = [choice]
    if call.include_usage:
        body["usage"] = None
    return body
