"""vLLM's utility routes, answered as ``vllm serve`` answers them: ``POST /tokenize``, ``POST /detokenize``,
``GET /tokenizer_info``, ``GET /version``.

- ``/tokenize`` takes ``{"prompt": str, "add_special_tokens": true}`` (the text as the tokenizer encodes it) or
  ``{"messages": [...]}`` (the chat rendered exactly as the engine renders it for generation, template and generation
  prompt included: the very ids every backend receives, so a client can count a prompt before sending it). Answer:
  ``{"count", "max_model_len", "tokens", "token_strs"}`` (``return_token_strs: true`` fills the last).
  Choices written down: ``add_generation_prompt`` must be true (the engine always adds it), ``chat_template`` and
  ``continue_final_message`` are not taken.
- ``/detokenize`` takes ``{"tokens": [ids]}`` and answers ``{"prompt": text}``, special tokens kept (as vLLM).
- ``/tokenizer_info``: the tokenizer's class, special tokens, chat template and ``model_max_length`` (the served
  context length). ``vllm serve`` answers it with ``--enable-tokenizer-info-endpoint``; here it is always on (behind
  the API key when one is set): lm-eval's ``local-completions`` model finds it (with ``/tokenize``) and tokenizes
  through the server, so its token ids are the served model's own.
- ``/version``: ``{"version": <this package>, "backend": ..., "backend_version": ...}``.

``model`` is optional on both POST routes; when given it must name the served model (404 otherwise). Bad fields are
400s naming them, in OpenAI's error object.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter

from engine.errors import RequestError, RequestTooLarge
from engine.serve.openai.bodies import DetokenizeRequest, TokenizeRequest
from engine.serve.service import ServedEngine
from engine.serve.shared.bodies import messages_of
from engine.serve.shared.calls import Call, Surface
from engine.serve.shared.readers import chat_messages

BODIES = {"/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


@dataclass(frozen=True)
class TokenizerCall:
    """A checked ``/tokenize`` or ``/detokenize`` body and its answer, computed off the event loop by the call path
    (no generation: nothing for the generation limits to hold)."""

    body: Any
    answer: dict[str, Any]
    options: None = None
    stop: None = None
    prompt_count: int = 0

    @property
    def model(self) -> str | None:
        return self.body.model


def tokenize_call(body: TokenizeRequest, served: Any) -> TokenizerCall:
    engine = served.engine
    limit = engine.backend.capabilities.max_model_len
    ids, strs = tokenize(body, engine)
    strings = engine.tokenizer.convert_ids_to_tokens(ids) if strs else None
    return TokenizerCall(body, {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": strings})


def detokenize_call(body: DetokenizeRequest, served: Any) -> TokenizerCall:
    engine = served.engine
    ids = detokenize(body, len(engine.tokenizer), engine.backend.capabilities.max_model_len)
    return TokenizerCall(body, {"prompt": engine.tokenizer.decode(ids)})


def tokenize(body: TokenizeRequest, engine: Any) -> tuple[list[int], bool]:
    """The ids a validated ``/tokenize`` body asks for and whether to return their strings; ``RequestError`` naming
    a bad field. A chat is checked as generation checks it (roles, content), and text that cannot fit the context
    is refused before it is tokenized.

    >>> from types import SimpleNamespace
    >>> tok = SimpleNamespace(encode=lambda text, add_special_tokens: [1] * add_special_tokens + [ord(c) for c in text])
    >>> engine = SimpleNamespace(tokenizer=tok, check_chars=lambda field, chars, fix="": None,
    ...                          check_conversation=lambda field, messages: None)
    >>> tokenize(TokenizeRequest(prompt="hi"), engine), tokenize(TokenizeRequest(prompt="hi",
    ...                                                          add_special_tokens=False), engine)[0]
    (([1, 104, 105], False), [104, 105])
    >>> tokenize(TokenizeRequest.model_validate({"prompt": "hi", "messages": []}), engine)
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: messages cannot be sent with prompt, got []. Fix: send one of them.
    """
    from engine.templates import render_prompt
    from engine.types import ChatRequest

    tokenizer = engine.tokenizer
    strs = bool(body.return_token_strs)
    if body.messages is not None:
        messages = messages_of(body.messages)
        if body.prompt is not None:
            raise RequestError("messages", messages, "cannot be sent with prompt", fix="send one of them")
        if body.add_generation_prompt is False:
            raise RequestError("add_generation_prompt", False, "is not supported: the engine renders every chat with "
                               "its generation prompt", fix="leave it out or send true")
        if body.add_special_tokens is not None:
            raise RequestError("add_special_tokens", body.add_special_tokens, "applies to prompt only (a chat is "
                               "tokenized as the engine renders it)", fix="leave it out")
        checked = ChatRequest.of(chat_messages(messages), index=0)  # as generation checks it: roles, content
        engine.check_conversation("messages", checked.messages)
        return list(render_prompt(tokenizer, checked.messages).token_ids), strs
    if body.prompt is None:
        raise RequestError("prompt", None, "is required and must be a string (or send messages)",
                           fix='send {"prompt": "..."} or {"messages": [...]}')
    if body.add_generation_prompt is not None:
        raise RequestError("add_generation_prompt", body.add_generation_prompt, "applies to messages only",
                           fix="leave it out")
    engine.check_chars("prompt", len(body.prompt))
    return list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)), strs


def detokenize(body: DetokenizeRequest, vocab: int, max_model_len: int | None = None) -> list[int]:
    """The token ids of a validated ``/detokenize`` body, each checked against the vocabulary, at most the model's
    context length of them (no sequence the model reads or writes is longer).

    >>> detokenize(DetokenizeRequest(tokens=[5, 6]), 10)
    [5, 6]
    >>> detokenize(DetokenizeRequest(tokens=[5, 60]), 10)
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: tokens[1] is not a token id of this model (its tokenizer has 10), got 60. \
Fix: give ids in [0, 10).
    >>> detokenize(DetokenizeRequest(tokens=[5] * 9), 10, max_model_len=8)
    Traceback (most recent call last):
    ...
    engine.errors.RequestTooLarge: tokens holds more ids than the model's context length (8), got 9. Fix: send at \
most 8 ids per call.
    """
    if max_model_len is not None and len(body.tokens) > max_model_len:
        raise RequestTooLarge("tokens", len(body.tokens), f"holds more ids than the model's context length "
                              f"({max_model_len})", fix=f"send at most {max_model_len} ids per call")
    for i, t in enumerate(body.tokens):
        if not 0 <= t < vocab:
            raise RequestError(f"tokens[{i}]", t, f"is not a token id of this model (its tokenizer has {vocab})",
                               fix=f"give ids in [0, {vocab})")
    return body.tokens


def tokenizer_facts(tokenizer: Any, max_model_len: int | None) -> dict[str, Any]:
    """What ``/tokenizer_info`` tells a client: the class, the special tokens (text), the chat template.

    >>> from types import SimpleNamespace
    >>> tok = SimpleNamespace(eos_token="</s>", bos_token=None, pad_token="</s>", unk_token=None, chat_template="{{x}}")
    >>> tokenizer_facts(tok, 2048)["eos_token"], tokenizer_facts(tok, 2048)["model_max_length"]
    ('</s>', 2048)
    """
    facts: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, name, None)
        facts[name] = None if value is None else str(value)
    facts["chat_template"] = getattr(tokenizer, "chat_template", None)
    facts["model_max_length"] = max_model_len
    return facts


def package_version() -> str:
    try:
        return importlib.metadata.version("xbackend-engine")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def backend_version(name: str) -> str | None:
    """The version of the library that runs backend ``name`` (its first module in the registry: ``transformers``
    for HF, ``vllm``, ``llama_cpp``), as that module reports it."""
    import sys

    from engine.backends.registry import spec

    modules = spec(name).modules
    library = "transformers" if "transformers" in modules else modules[0]
    return getattr(sys.modules.get(library), "__version__", None)


def router(served: ServedEngine) -> APIRouter:
    api = APIRouter()
    engine = served.engine
    tokenizes = Surface(served, "tokenize", TokenizeRequest, tokenize_call)
    detokenizes = Surface(served, "detokenize", DetokenizeRequest, detokenize_call)

    @tokenizes.route(api, "/tokenize")
    async def tokenize_route(call: Call) -> Any:
        return call.answered(call.parsed.answer)

    @detokenizes.route(api, "/detokenize")
    async def detokenize_route(call: Call) -> Any:
        return call.answered(call.parsed.answer)

    @api.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return tokenizer_facts(engine.tokenizer, engine.backend.capabilities.max_model_len)

    @api.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": package_version(), "backend": engine.backend.name,
                "backend_version": backend_version(engine.backend.name)}

    return api
