"""The OpenAI surface's request bodies, each field with what it is to the engine (:mod:`engine.serve.shared.fields`):
``POST /v1/chat/completions``, ``POST /v1/completions``, and vLLM's ``POST /tokenize`` and ``POST /detokenize``.

A new sampling option is one line in ``shared/bodies.py::SamplingOptions`` (every surface's) or in
:class:`OpenAISampling` (both completions routes), e.g.
``min_p: Annotated[Number | None, Engine("generation.min_p")] = None``.

>>> from engine.serve.shared.fields import FieldTable
>>> FieldTable.of(ChatCompletionRequest).client_field("generation.max_new_tokens")
'max_tokens'
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from engine.serve.shared.bodies import Body, EngineExtension, Message, Number, SamplingOptions
from engine.serve.shared.fields import Engine, Neutral, Wire


class StreamOptions(Body):
    include_usage: Annotated[bool | None, Wire("a usage chunk at the stream's end")] = None
    continuous_usage_stats: Annotated[bool | None, Wire("refused when true: include_usage instead")] = None


class JsonSchemaFormat(Body):
    name: Annotated[str | None, Wire("accepted, not used")] = None
    description: Annotated[str | None, Wire("accepted, not used")] = None
    schema_: Annotated[dict[str, Any] | bool | None, Engine("json_schema", read=False),
                       Field(alias="schema")] = None  # pydantic reserves ``schema``
    strict: Annotated[bool | None, Wire("accepted: decoding is always constrained")] = None


class ResponseFormat(Body):
    type: Annotated[Literal["text", "json_object", "json_schema"], Wire("which answers the engine builds")]
    json_schema: Annotated[JsonSchemaFormat | None, Wire("the schema's object")] = None


class StructuredOutputs(Body):
    """vLLM's ``structured_outputs``: ``json`` (a schema) and ``json_object`` map onto the engine's constrained
    decoding; the other kinds are refused by name (the engine constrains to JSON Schemas only)."""

    json_: Annotated[dict[str, Any] | str | None, Wire("the JSON Schema answers are built to"),
                     Field(alias="json")] = None
    json_object: Annotated[bool | None, Wire("any JSON object")] = None
    regex: Annotated[str | None, Wire("refused: the engine constrains to JSON Schemas")] = None
    choice: Annotated[list[str] | None, Wire("refused: the engine constrains to JSON Schemas")] = None
    grammar: Annotated[str | None, Wire("refused: the engine constrains to JSON Schemas")] = None
    structural_tag: Annotated[str | None, Wire("refused: the engine constrains to JSON Schemas")] = None
    disable_any_whitespace: Annotated[bool | None, Wire("false only")] = None
    disable_additional_properties: Annotated[bool | None, Wire("false only")] = None
    whitespace_pattern: Annotated[str | None, Wire("refused: the engine's grammar sets whitespace")] = None


class OpenAISampling(SamplingOptions):
    """What the chat and text completions bodies share (``openai/sampling.py`` reads it), beyond the options every
    surface names alike."""

    model: Annotated[str, Wire("must name the served model")]
    max_tokens: Annotated[int | None, Engine("generation.max_new_tokens", read=False)] = None
    stream: Annotated[bool | None, Wire("answered as server-sent events")] = None
    stream_options: Annotated[StreamOptions | None, Wire("the stream's usage chunk")] = None
    n: Annotated[int | None, Wire("choices per prompt: a GRPO group, the prompt's rows seeded as one call's")] = None
    user: Annotated[str | None, Wire("accepted and ignored")] = None
    engine: Annotated[EngineExtension | None, Wire("the engine extension")] = None
    min_tokens: Annotated[int | None, Engine("generation.min_new_tokens")] = None
    stop_token_ids: Annotated[list[int] | None, Engine("stop.token_ids", read=False)] = None
    response_format: Annotated[ResponseFormat | None, Wire("constrained decoding (json_schema)")] = None
    structured_outputs: Annotated[StructuredOutputs | None, Wire("vLLM's constrained decoding (json only)")] = None
    return_token_ids: Annotated[bool | None, Wire("each choice's token_ids and the prompt's ids (vLLM's field)")] = None
    return_tokens_as_token_ids: Annotated[bool | None, Wire('logprobs name tokens "token_id:<id>"')] = None
    ignore_eos: Annotated[bool | None, Engine("generation.ignore_eos")] = None
    include_stop_str_in_output: Annotated[bool | None, Engine("stop.include_stop_str", read=False)] = None
    skip_special_tokens: Annotated[bool | None, Neutral((True,))] = None
    spaces_between_special_tokens: Annotated[bool | None, Neutral((True,))] = None
    vllm_xargs: Annotated[dict[str, Any] | None, Neutral(({},))] = None
    frequency_penalty: Annotated[Number | None, Neutral((0, 0.0))] = None
    presence_penalty: Annotated[Number | None, Neutral((0, 0.0))] = None
    logit_bias: Annotated[dict[str, Number] | None, Neutral(({},))] = None


class ChatCompletionRequest(OpenAISampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Wire("the conversation")]
    max_completion_tokens: Annotated[int | None, Engine("generation.max_new_tokens", read=False)] = None
    logprobs: Annotated[bool | None, Wire("per-token logprobs in the answer")] = None
    top_logprobs: Annotated[int | None, Engine("generation.logprobs", read=False)] = None
    tools: Annotated[list[dict[str, Any]] | None, Neutral(([],))] = None
    tool_choice: Annotated[str | dict[str, Any] | None, Neutral(("none",))] = None
    parallel_tool_calls: Annotated[bool | None, Neutral((False, True))] = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, Wire("enable_thinking only (off by default)")] = None


class CompletionRequest(OpenAISampling):
    """``POST /v1/completions``: ``prompt`` is a string, strings, token ids, or lists of token ids."""

    prompt: Annotated[str | list[str] | list[int] | list[list[int]], Engine("prompts", read=False)]
    logprobs: Annotated[int | None, Engine("generation.logprobs")] = None
    echo: Annotated[bool | None, Wire("the prompt before the answer")] = None
    add_special_tokens: Annotated[bool | None, Wire("how text prompts are tokenized")] = None
    best_of: Annotated[int | None, Neutral((1,))] = None
    suffix: Annotated[str | None, Neutral(("",))] = None


class TokenizeRequest(Body):
    """``POST /tokenize``: ``prompt`` (text) or ``messages`` (a chat, rendered as the engine renders it)."""

    model: Annotated[str | None, Wire("names the served model, when given")] = None
    prompt: Annotated[str | None, Wire("the text to tokenize")] = None
    messages: Annotated[list[Message] | None, Wire("the chat to render and tokenize")] = None
    add_special_tokens: Annotated[bool | None, Wire("how the text is tokenized")] = None
    add_generation_prompt: Annotated[bool | None, Wire("must stay true")] = None
    return_token_strs: Annotated[bool | None, Wire("the tokens' strings in the answer")] = None


class DetokenizeRequest(Body):
    """``POST /detokenize``."""

    model: Annotated[str | None, Wire("names the served model, when given")] = None
    tokens: Annotated[list[int], Wire("the ids to decode")]
