"""The OpenAI chat-completions wire format (``POST /v1/chat/completions``), both ways: :func:`parse_chat` reads the
validated body (``openai/bodies.py``) into engine arguments, :func:`completion_body` and :func:`chunk` build the
non-streamed response and the streamed ``chat.completion.chunk`` objects. No web framework is imported here.

Choices written down, beyond those the completions routes share (:mod:`engine.serve.openai.sampling`):

* ``max_tokens`` and ``max_completion_tokens`` are synonyms; giving both with different values is a 400.
* ``top_logprobs`` needs ``logprobs: true``.
* Streamed logprobs: the chunk with the ``finish_reason`` carries every token's logprobs (the text deltas are
  cut where stop truncation is safe, not at token boundaries), so all chunks' logprobs together equal the
  non-streamed ``choices[0].logprobs``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import RequestError
from engine.serve.openai.bodies import ChatCompletionRequest
from engine.serve.openai.sampling import OpenAICall, parse_openai_call
from engine.serve.shared.bodies import messages_of
from engine.serve.shared.readers import chat_messages
from engine.serve.shared.writers import logprobs_content, usage
from engine.types import GenerationResult


@dataclass(frozen=True)
class CompletionCall(OpenAICall):
    """One checked ``/v1/chat/completions`` body: what the engine is asked for and how to answer."""

    messages: list[dict[str, Any]]
    logprobs: bool = False
    top_logprobs: int | None = None
    thinking: bool = False
    """``chat_template_kwargs.enable_thinking``."""

    @property
    def request(self) -> Any:
        """The conversation as the engine takes it (a ``ChatRequest``, thinking on or off)."""
        from engine.types import ChatRequest

        return ChatRequest(tuple(self.messages), thinking=self.thinking)

    @property
    def prompt_count(self) -> int:
        """The rows this call generates: its prompt ``n`` times."""
        return self.n

    @property
    def kwargs(self) -> dict[str, Any]:
        """The engine call's keyword arguments."""
        return {"options": self.options or None, "stop": self.stop, "plugins": self.plugins,
                "json_schema": self.json_schema, "repeat_terminate": self.repeat_terminate}


def prepare(call: CompletionCall, served: Any) -> Any:
    """The engine's own checks of a chat call and its rendered prompts (run by the call path off the event loop: the
    chat template and the tokenizer), which the route then runs without preparing them again."""
    return served.engine.prepare([call.request] * call.n, **call.kwargs, adapter=served.adapter_of(call.model))


def parse_chat(body: ChatCompletionRequest, served: Any = None) -> CompletionCall:
    """Read a validated chat-completions body; raise ``RequestError`` naming the first bad field. Nothing is generated.

    >>> def chat(**fields):
    ...     return parse_chat(ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user",
    ...                                                             "content": "Hi"}], **fields}))
    >>> call = chat(max_tokens=8, temperature=0, stop="\\n")
    >>> call.options, call.stop
    ({'max_new_tokens': 8, 'temperature': 0}, {'strings': ['\\n']})
    >>> chat(n=3).prompt_count
    3
    >>> chat(n=2, stream=True)
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: n cannot be streamed: a stream carries one choice, got 2. Fix: send stream: false \
for a group, or n: 1 to stream.
    """
    logprobs, top = bool(body.logprobs), body.top_logprobs
    if top is not None and not logprobs:
        raise RequestError("top_logprobs", top, "needs logprobs: true", fix="set logprobs to true")
    own: dict[str, Any] = {}
    tokens = _max_tokens(body)
    if tokens is not None:
        own["max_new_tokens"] = tokens
    if logprobs:
        own["logprobs"] = 0 if top is None else top
    common = parse_openai_call(body, own)
    return CompletionCall(**common.shared(), messages=chat_messages(messages_of(body.messages)), logprobs=logprobs,
                          top_logprobs=top, thinking=template_thinking(body.chat_template_kwargs))


TEMPLATE_KWARGS = ("enable_thinking",)
"""The ``chat_template_kwargs`` this server takes (vLLM passes any to the template)."""


def template_thinking(kwargs: dict[str, Any] | None) -> bool:
    """``chat_template_kwargs.enable_thinking`` (false when absent: thinking is off by default); any other key is
    refused by name.

    >>> template_thinking(None), template_thinking({"enable_thinking": True})
    (False, True)
    >>> template_thinking({"add_vision_id": True})
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: chat_template_kwargs.add_vision_id is not taken by this server, got True. Fix: send \
only enable_thinking (true or false).
    """
    for key, value in (kwargs or {}).items():
        if key not in TEMPLATE_KWARGS:
            raise RequestError(f"chat_template_kwargs.{key}", value, "is not taken by this server",
                               fix="send only enable_thinking (true or false)")
        if not isinstance(value, bool):
            raise RequestError(f"chat_template_kwargs.{key}", value, "must be true or false", fix="send true or false")
    return bool((kwargs or {}).get("enable_thinking", False))


def _max_tokens(body: ChatCompletionRequest) -> Any:
    a, b = body.max_tokens, body.max_completion_tokens
    if a is not None and b is not None and a != b:
        raise RequestError("max_completion_tokens", b, f"differs from max_tokens ({a!r})", fix="send one of them")
    return a if a is not None else b


# -- responses ------------------------------------------------------------------------------------------


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _logprobs(result: GenerationResult, call: CompletionCall, tokenizer: Any) -> dict[str, Any] | None:
    if not call.logprobs:
        return None
    return logprobs_content(result, tokenizer, 0 if call.top_logprobs is None else call.top_logprobs,
                            as_ids=call.tokens_as_ids)


def completion_body(results: Sequence[GenerationResult], call: CompletionCall, *, model: str,
                    tokenizer: Any) -> dict[str, Any]:
    """The ``chat.completion`` object: one choice per result (``n`` of them); ``usage`` counts the prompt once, as
    OpenAI's and vLLM's servers do, and every choice's tokens."""
    prompt = len(results[0].prompt_token_ids)
    completion = sum(len(r.token_ids) for r in results)
    choices = [{"index": i, "message": {"role": "assistant", "content": r.text},
                "logprobs": _logprobs(r, call, tokenizer), "finish_reason": r.finish_reason,
                **call.token_id_fields(r.token_ids)} for i, r in enumerate(results)]
    body = {
        "id": completion_id(), "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        "system_fingerprint": None,
    }
    body.update(call.token_id_fields(prompt=results[0].prompt_token_ids))  # the rendered conversation, as run
    return body


def chunk(cid: str, created: int, model: str, call: CompletionCall, *, delta: dict[str, Any] | None = None,
          result: GenerationResult | None = None, tokenizer: Any = None, usage_only: bool = False,
          prompt_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk``: a delta; with ``result`` the closing one (finish reason, logprobs); with
    ``usage_only`` the trailing usage chunk (``stream_options.include_usage``), whose ``choices`` are empty. With
    ``return_token_ids`` each choice carries ``token_ids`` (all of them in the closing chunk, as its logprobs) and
    ``prompt_ids`` go into the first chunk's ``prompt_token_ids``."""
    body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "system_fingerprint": None}
    if usage_only:
        assert result is not None
        return {**body, "choices": [], "usage": usage(result)}
    choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": None}
    if result is not None:
        choice["finish_reason"] = result.finish_reason
        choice["logprobs"] = _logprobs(result, call, tokenizer)
    choice.update(call.token_id_fields(result.token_ids if result is not None else ()))
    body.update(call.token_id_fields(prompt=prompt_ids))
    body["choices"] = [choice]
    if call.include_usage:
        body["usage"] = None
    return body


async def answer(call: Any, served: Any) -> Any:
    """The parsed call's answer through the one call path (:class:`engine.serve.shared.calls.Call`): one
    ``agenerate`` of ``n`` rows, whole, or one ``astream`` as ``chat.completion.chunk`` events. An adapter's calls
    answer with the adapter's name, as vLLM's do."""
    c, engine = call.parsed, served.engine
    answering = served.adapter_of(c.model) or served.model_name
    if not c.stream:
        return await call.whole(lambda: engine.agenerate([c.request] * c.n, **c.kwargs, prepared=call.prepared),
                                body=lambda results:
                                completion_body(results, c, model=answering, tokenizer=engine.tokenizer))
    cid, created = completion_id(), int(time.time())

    async def open_stream() -> tuple[Any, list[Any]]:  # validation raises here, before any generation
        role = chunk(cid, created, answering, c, delta={"role": "assistant", "content": ""},
                     prompt_ids=call.prepared[0][0].token_ids)
        return engine.astream(c.request, **c.kwargs, prepared=call.prepared), [role]

    def events(part: Any) -> list[Any]:
        out = [chunk(cid, created, answering, c, delta={"content": part.delta})] if part.delta else []
        if part.result is not None:
            out.append(chunk(cid, created, answering, c, result=part.result, tokenizer=engine.tokenizer))
            if c.include_usage:
                out.append(chunk(cid, created, answering, c, result=part.result, usage_only=True))
        return out

    return await call.stream(open_stream, events)
