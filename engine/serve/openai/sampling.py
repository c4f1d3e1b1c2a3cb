"""What OpenAI's chat and text completions bodies share, read from the validated body model (``openai/bodies.py``):
the model's name, the neutral fields, the token budget, the sampling options (every ``Engine("generation.*")``
field, by the name it carries), streaming, the stop policy, the ``engine`` extension and ``response_format``.

Choices written down (OpenAI's reference leaves them open or this server cannot honour them):

* ``n`` (default 1) asks for ``n`` choices per prompt, a GRPO group: the prompt is generated ``n`` times in one
  engine call, so with a ``seed`` its rows are seeded as the engine seeds rows of one call (distinct, reproducible,
  never dependent on batch-mates: ``engine.rules.seeding``), and without one they are independent draws. The choices
  count against ``serve.max_prompts_per_call``; a group is not streamed (``stream`` with ``n > 1`` is a 400).
  Fields OpenAI or vLLM have but the engine does not (``frequency_penalty``, ``presence_penalty``,
  ``logit_bias``, tools) are accepted only at their neutral value (``Neutral`` in the body model), anything else is a
  400 naming the field. ``user`` is accepted and ignored.
* vLLM's top-level sampling extras are taken as ``vllm serve`` takes them: ``top_k`` (-1 or 0: off), ``min_p``,
  ``repetition_penalty``, ``min_tokens`` (the engine's ``min_new_tokens``: EOS and stops held back until then),
  ``stop_token_ids`` (the engine's ``stop.token_ids``), ``seed``.
* ``response_format``: ``text``; ``json_object`` (any JSON object); ``json_schema`` with ``json_schema.schema``
  (``name``, ``description`` and ``strict`` accepted; decoding is always constrained, so always strict). The schema is
  the engine's ``json_schema``: every answer is built to it (HF and vLLM; llama.cpp refuses it).
* vLLM's output extras: ``ignore_eos`` (the engine's ``generation.ignore_eos``: EOS does not end a row, as
  ``vllm bench serve --ignore-eos`` needs), ``include_stop_str_in_output`` (the engine's ``stop.include_stop_str``),
  ``skip_special_tokens`` and ``spaces_between_special_tokens`` (true only: answers are decoded without special
  tokens on every backend), ``vllm_xargs`` (empty only: no custom logits processors), and on the chat route
  ``chat_template_kwargs`` with ``enable_thinking`` (off by default).
* RL clients' fields, as vLLM 0.32 answers them: ``return_token_ids`` (each choice's ``token_ids``, the prompt's
  ``prompt_token_ids``: the ids the trainer learns from are the ids sampled, never re-tokenized text) and
  ``return_tokens_as_token_ids`` (logprobs name tokens ``"token_id:<id>"``); ``structured_outputs`` with ``json`` or
  ``json_object`` is the engine's ``json_schema`` (with ``response_format`` too: a 400), its other kinds a 400 naming
  them.
* A stop string that is exactly a special token's text (``stop: ["<|im_end|>"]``, as ChatML clients send) ends the
  row at that token on every backend, recorded in the engine's result (``meta["stop_strings_as_token_ids"]``).
* ``model`` must name the served model: its name, another ``--served-model-name``, or its path (else 404, as vLLM's
  server answers).
* The engine extension ``engine: {options, stop, plugins, repeat_terminate}`` (the ``/infer/`` one) reaches every
  other engine option, the full stop policy, the plugins and the repeat guard's fields for this request (laid over
  the server's guard); it is validated like the in-process call.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import RequestError
from engine.serve.openai.bodies import OpenAISampling
from engine.serve.shared.fields import engine_options, neutral_values
from engine.serve.shared.readers import engine_extension, stop_strings


@dataclass(frozen=True)
class OpenAICall:
    """What a chat and a text completions call share, checked: the model, engine options, stop policy, plugins,
    streaming, and ``response_format``'s schema (each route's call extends it: ``chat.py``, ``text.py``)."""

    model: str
    options: dict[str, Any]
    stop: dict[str, Any] | None
    plugins: list[Any] | None
    repeat_terminate: dict[str, Any] | None
    """The repeat guard's fields for this call (``engine.repeat_terminate``), laid over the server's guard."""
    stream: bool
    include_usage: bool
    json_schema: Any
    """``response_format``'s schema, for the engine's constrained decoding (None: free text)."""
    n: int
    """Choices per prompt."""
    return_token_ids: bool
    """vLLM's ``return_token_ids``: the ids sampled (and the prompt's) beside the text, never re-tokenized."""
    tokens_as_ids: bool
    """vLLM's ``return_tokens_as_token_ids``: logprobs name each token ``"token_id:<id>"``."""

    def token_id_fields(self, token_ids: Sequence[int] | None = None, *,
                        prompt: Sequence[int] | None = None) -> dict[str, list[int]]:
        """vLLM's ``return_token_ids`` fields, the one place both surfaces build them: ``token_ids`` (the ids
        sampled) and ``prompt_token_ids`` (the prompt's, as the engine ran it), each where given; nothing when the
        client did not ask. Chat puts the prompt's on the body, text completions on each choice.

        >>> call = OpenAICall("m", {}, None, None, None, False, False, None, 1, True, False)
        >>> call.token_id_fields((5, 6), prompt=[1]), call.token_id_fields(prompt=None)
        ({'token_ids': [5, 6], 'prompt_token_ids': [1]}, {})
        >>> dataclasses.replace(call, return_token_ids=False).token_id_fields([5], prompt=[1])
        {}
        """
        if not self.return_token_ids:
            return {}
        given = {"token_ids": token_ids, "prompt_token_ids": prompt}
        return {name: list(ids) for name, ids in given.items() if ids is not None}

    def shared(self) -> dict[str, Any]:
        """These fields by name: what a route's call is built from."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(OpenAICall)}


def parse_openai_call(body: OpenAISampling, own: dict[str, Any]) -> OpenAICall:
    """The shared fields of a validated OpenAI body; ``own``: the engine options its surface read itself (the token
    budget, chat's ``logprobs``). Raises ``RequestError`` naming the first bad field.

    >>> from engine.serve.openai.bodies import ChatCompletionRequest
    >>> body = ChatCompletionRequest.model_validate({"model": "m", "messages": [], "top_k": -1, "temperature": 0})
    >>> parse_openai_call(body, {"max_new_tokens": 4}).options
    {'max_new_tokens': 4, 'temperature': 0, 'top_k': 0}
    """
    neutral_values(body)
    if not body.model:
        raise RequestError("model", body.model, "must name the served model", fix="send the served model's name "
                           "(GET /v1/models lists it)")
    options = {**own, **engine_options(body)}
    stream = bool(body.stream)
    n = 1 if body.n is None else body.n
    if n < 1:
        raise RequestError("n", n, "must be at least 1", fix="send 1 for one choice, or more for a group")
    if n > 1 and stream:
        raise RequestError("n", n, "cannot be streamed: a stream carries one choice",
                           fix="send stream: false for a group, or n: 1 to stream")
    include_usage = False
    if body.stream_options is not None:
        if not stream:
            raise RequestError("stream_options", body.stream_options.model_dump(exclude_unset=True),
                               "is only allowed with stream: true",
                               fix="set stream to true or leave stream_options out")
        include_usage = bool(body.stream_options.include_usage)
        if body.stream_options.continuous_usage_stats:
            raise RequestError("stream_options.continuous_usage_stats", True, "is not supported",
                               fix="use include_usage for one usage chunk at the end")
    stop = stop_strings(body.stop)
    if body.include_stop_str_in_output:
        stop = {**(stop or {}), "include_stop_str": True}
    if body.stop_token_ids not in (None, []):
        stop = {**(stop or {}), "token_ids": body.stop_token_ids}  # checked by the engine, named back by the table
    options, stop, plugins, guard = engine_extension(body.engine, options, stop, options_from="by a top-level field",
                                                     stop_field="stop" if body.stop else "stop_token_ids")
    schema = response_schema(body.response_format)
    structured = structured_schema(body.structured_outputs)
    if schema is not None and structured is not None:
        raise RequestError("structured_outputs", body.structured_outputs.model_dump(by_alias=True, exclude_unset=True),
                           "conflicts with response_format", fix="constrain the answer in one of them")
    return OpenAICall(model=body.model, options=options, stop=stop, plugins=plugins, repeat_terminate=guard,
                    stream=stream,
                    include_usage=include_usage, json_schema=structured if schema is None else schema, n=n,
                    return_token_ids=bool(body.return_token_ids), tokens_as_ids=bool(body.return_tokens_as_token_ids))


UNCONSTRAINED_KINDS = ("regex", "choice", "grammar", "structural_tag")
"""vLLM's ``structured_outputs`` kinds the engine has no decoding for (it constrains to JSON Schemas)."""


def structured_schema(value: Any) -> Any:
    """The JSON Schema a validated ``structured_outputs`` (vLLM's field) asks for, or None: ``json`` (a schema, or
    its JSON text) or ``json_object``; the other kinds are refused by name.

    >>> from engine.serve.openai.bodies import StructuredOutputs
    >>> structured_schema(StructuredOutputs.model_validate({"json": '{"type": "integer"}'}))
    {'type': 'integer'}
    >>> structured_schema(StructuredOutputs.model_validate({"json_object": True}))
    {'type': 'object'}
    >>> structured_schema(StructuredOutputs.model_validate({"regex": "[0-9]+"}))
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: structured_outputs.regex is not supported: this server constrains answers to JSON \
Schemas only, got '[0-9]+'. Fix: send structured_outputs.json with a JSON Schema, or leave structured_outputs out.
    """
    if value is None:
        return None
    fix = "send structured_outputs.json with a JSON Schema, or leave structured_outputs out"
    for name in ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"):
        if getattr(value, name):
            raise RequestError(f"structured_outputs.{name}", getattr(value, name), "is not supported by this server "
                               "(the engine's grammar sets whitespace and properties)", fix="leave it out")
    for kind in UNCONSTRAINED_KINDS:
        if getattr(value, kind) is not None:
            raise RequestError(f"structured_outputs.{kind}", getattr(value, kind), "is not supported: this server "
                               "constrains answers to JSON Schemas only", fix=fix)
    schema, whole = value.json_, bool(value.json_object)
    if schema is not None and whole:
        raise RequestError("structured_outputs.json_object", True, "conflicts with structured_outputs.json",
                           fix="send one of them")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise RequestError("structured_outputs.json", value.json_[:60], "nests arrays or objects too deeply",
                               fix="send a schema nested a few levels deep") from None
        except ValueError as err:
            raise RequestError("structured_outputs.json", value.json_, f"is not JSON ({err})",
                               fix="send the schema as an object, or as valid JSON text") from None
    if schema is None and not whole:
        raise RequestError("structured_outputs", value.model_dump(by_alias=True, exclude_unset=True),
                           "asks for no constraint", fix=fix)
    return {"type": "object"} if whole else schema


def response_schema(value: Any) -> Any:
    """The JSON Schema a validated ``response_format`` asks for, or None for free text.

    >>> from engine.serve.openai.bodies import ResponseFormat
    >>> response_schema(ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "a",
    ...                                                 "schema": {"type": "integer"}}}))
    {'type': 'integer'}
    >>> response_schema(ResponseFormat(type="json_object")), response_schema(ResponseFormat(type="text"))
    ({'type': 'object'}, None)
    >>> response_schema(ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "a"}}))
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: response_format.json_schema.schema is required (the engine constrains answers to \
it), got None. Fix: e.g. {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}.
    """
    example = '{"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}'
    if value is None:
        return None
    kind, spec = value.type, value.json_schema
    if kind in ("text", "json_object"):
        if spec is not None:
            raise RequestError("response_format.json_schema", spec.model_dump(by_alias=True, exclude_unset=True),
                               f"applies to type json_schema only, not {kind}",
                               fix=f"leave it out, or send e.g. {example}")
        return None if kind == "text" else {"type": "object"}
    if spec is None:
        raise RequestError("response_format.json_schema", spec, "is required with type json_schema",
                           fix=f"e.g. {example}")
    if spec.schema_ is None:
        raise RequestError("response_format.json_schema.schema", None, "is required (the engine constrains answers "
                           "to it)", fix=f"e.g. {example}")
    return spec.schema_
