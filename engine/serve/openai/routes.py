"""OpenAI's surface: ``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming as
server-sent events).

Wire formats: :mod:`engine.serve.openai.chat` and :mod:`engine.serve.openai.text`; every route takes the one call
path (:mod:`engine.serve.shared.calls`). Every answer is one ``GenerationEngine`` call (``agenerate``/``astream`` for
chat, ``acomplete``/``astream_complete`` for text, and ``ascore`` for an echoed prompt's logprobs), so the streamed
text equals the non-streamed text equals the in-process ``generate``/``complete`` text. Each route hands its parsed
call to its wire format's ``answer`` (``chat.answer``, ``text.answer``): the route only routes.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from engine.serve.openai import chat, text
from engine.serve.openai.bodies import ChatCompletionRequest, CompletionRequest
from engine.serve.openai.server_info import server_info
from engine.serve.service import ServedEngine
from engine.serve.shared.calls import Call, Surface
from engine.serve.shared.fields import FieldTable

BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


def model_list(served: ServedEngine, *, keyed: bool) -> dict[str, Any]:
    """``GET /v1/models``: every name the model answers to (``--served-model-name``), as ``vllm serve`` lists them,
    then each adapter's card naming the served model as its ``parent`` (vLLM's LoRA cards); ``root`` is the model's
    path for a caller that sent the API key (``keyed``), its name otherwise (a keyless server shows no path)."""
    engine, model = served.engine, served.model_name
    card = {"object": "model", "created": int(served.started), "owned_by": "engine",
            "max_model_len": engine.backend.capabilities.max_model_len,
            "logprobs_mode": engine.config.model.logprobs_mode}
    names = [{"id": name, **card, "root": engine.config.model.path if keyed else model}
             for name in (model, *served.serve.model_aliases)]
    adapters = [{"id": name, **card, "root": served.adapter_path(name) if keyed else name, "parent": model}
                for name in served.adapters]
    return {"object": "list", "data": names + adapters}


def router(served: ServedEngine) -> APIRouter:
    """The surface's routes; each hands its parsed call on (``chat.answer``, ``text.answer``, :func:`model_list`)."""
    api = APIRouter()
    chats = Surface(served, "chat_completions", ChatCompletionRequest, chat.parse_chat, prepare=chat.prepare)
    texts = Surface(served, "completions", CompletionRequest,
                    lambda body, served: text.parse_text_completion(body, served.engine,
                                                                    served.serve.max_prompts_per_call),
                    fields=FieldTable.of(CompletionRequest, requests="prompt"), prepare=text.prepare)

    @api.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        return model_list(served, keyed=served.sent_the_key(request.scope["headers"]))

    @api.get("/server_info")
    async def show_server_info(request: Request, config_format: str = "text") -> Any:
        """vLLM's ``/server_info`` (what TRL's client reads before training): :mod:`engine.serve.openai.server_info`."""
        return server_info(served, config_format=config_format, with_path=served.sent_the_key(request.scope["headers"]))

    @chats.route(api, "/v1/chat/completions")
    async def chat_completions(call: Call) -> Any:
        return await chat.answer(call, served)

    @texts.route(api, "/v1/completions")
    async def completions(call: Call) -> Any:
        return await text.answer(call, served)

    return api
