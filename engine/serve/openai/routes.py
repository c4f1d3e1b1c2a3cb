"""OpenAI's surface: ``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming as
server-sent events).

Wire formats: :mod:`engine.serve.openai.chat` and :mod:`engine.serve.openai.text`; every route takes the one call
path (:mod:`engine.serve.shared.calls`). Every answer is one ``GenerationEngine`` call (``agenerate``/``astream`` for
chat, ``acomplete``/``astream_complete`` for text, and ``ascore`` for an echoed prompt's logprobs), so the streamed
text equals the non-streamed text equals the in-process ``generate``/``complete`` text.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from engine.serve.openai import chat, text
from engine.serve.openai.bodies import ChatCompletionRequest, CompletionRequest
from engine.serve.openai.server_info import server_info
from engine.serve.service import ServedEngine
from engine.serve.shared.calls import Call, Surface
from engine.serve.shared.fields import FieldTable
from engine.serve.shared.writers import usage

BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


def router(served: ServedEngine) -> APIRouter:
    api = APIRouter()
    engine = served.engine
    model = served.model_name
    chats = Surface(served, "chat_completions", ChatCompletionRequest, chat.parse_chat, prepare=chat.prepare)
    texts = Surface(served, "completions", CompletionRequest,
                    lambda body, served: text.parse_text_completion(body, served.engine,
                                                                    served.serve.max_prompts_per_call),
                    fields=FieldTable.of(CompletionRequest, requests="prompt"), prepare=text.prepare)

    @api.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        """Every name the model answers to (``--served-model-name``), as ``vllm serve`` lists them; ``root`` is the
        model's path for a caller that sent the API key, its name otherwise (a keyless server shows no path)."""
        keyed = served.sent_the_key(request.scope["headers"])
        root = engine.config.model.path if keyed else model
        card = {"object": "model", "created": int(served.started), "owned_by": "engine",
                "max_model_len": engine.backend.capabilities.max_model_len,
                "logprobs_mode": engine.config.model.logprobs_mode}
        adapters = [{"id": name, **card, "root": served.adapter_path(name) if keyed else name, "parent": model}
                    for name in served.adapters]  # vLLM's LoRA cards: each names the served model as its parent
        return {"object": "list", "data": [{"id": name, **card, "root": root}
                                           for name in (model, *served.serve.model_aliases)] + adapters}

    @api.get("/server_info")
    async def show_server_info(request: Request, config_format: str = "text") -> Any:
        """vLLM's ``/server_info`` (what TRL's client reads before training): :mod:`engine.serve.openai.server_info`."""
        return server_info(served, config_format=config_format, with_path=served.sent_the_key(request.scope["headers"]))

    @chats.route(api, "/v1/chat/completions")
    async def chat_completions(call: Call) -> Any:
        c = call.parsed
        answering = served.adapter_of(c.model) or model  # an adapter's calls answer with its name, as vLLM's
        if not c.stream:
            return await call.whole(lambda: engine.agenerate([c.request] * c.n, **c.kwargs, prepared=call.prepared),
                                    body=lambda results:
                                    chat.completion_body(results, c, model=answering, tokenizer=engine.tokenizer))
        cid, created = chat.completion_id(), int(time.time())

        async def open_stream() -> tuple[Any, list[Any]]:  # validation raises here, before any generation
            prompt_ids = list(call.prepared[0][0].token_ids) if c.return_token_ids else None
            role = chat.chunk(cid, created, answering, c, delta={"role": "assistant", "content": ""},
                              prompt_ids=prompt_ids)
            return engine.astream(c.request, **c.kwargs, prepared=call.prepared), [role]

        def events(part: Any) -> list[Any]:
            out = [chat.chunk(cid, created, answering, c, delta={"content": part.delta})] if part.delta else []
            if part.result is not None:
                out.append(chat.chunk(cid, created, answering, c, result=part.result, tokenizer=engine.tokenizer))
                if c.include_usage:
                    out.append(chat.chunk(cid, created, answering, c, result=part.result, usage_only=True))
            return out

        return await call.stream(open_stream, events)

    @texts.route(api, "/v1/completions")
    async def completions(call: Call) -> Any:
        c = call.parsed
        answering = served.adapter_of(c.model) or model  # an adapter's calls answer with its name, as vLLM's

        async def prompt_scores() -> list[Any]:
            sequences = [c.prompts[i] for i in c.scored]
            found = await engine.ascore(sequences, [1] * len(sequences), c.logprobs) if sequences else []
            by_prompt: list[Any] = [None] * len(c.prompts)
            for i, score in zip(c.scored, found, strict=True):
                by_prompt[i] = score
            return by_prompt

        if not c.stream:
            async def run() -> tuple[list[Any], list[Any]]:
                scores = await prompt_scores()
                if not c.generates:
                    return [None] * c.prompt_count, scores
                return await engine.acomplete(c.rows, **c.kwargs, prepared=call.prepared), scores

            return await call.whole(run, counted=lambda out: [r for r in out[0] if r is not None], body=lambda out:
                                    text.completion_body(c, out[0], out[1], model=answering,
                                                         tokenizer=engine.tokenizer))
        cid, created = text.completion_id(), int(time.time())

        unsent = [c.prompts[0]] if c.return_token_ids else []  # the prompt's ids, until a chunk carries them

        def ids(token_ids: list[int]) -> dict[str, list[int]] | None:
            """``return_token_ids``: the chunk's token ids (all of them in the closing chunk), and the prompt's in
            the first chunk."""
            if not c.return_token_ids:
                return None
            return {"token_ids": token_ids, **({"prompt_token_ids": unsent.pop()} if unsent else {})}

        async def open_stream() -> tuple[Any, list[Any]]:
            stream = engine.astream_complete(c.prompts[0], **c.kwargs, prepared=call.prepared)
            if not c.echo:
                return stream, []
            echoed = text.choice_logprobs(c, 0, None, (await prompt_scores())[0], engine.tokenizer, answer=False)
            return stream, [text.chunk(cid, created, answering, text=text.shown_prompt(c, 0), logprobs=echoed,
                                       ids=ids([]))]

        def events(part: Any) -> list[Any]:
            out = [text.chunk(cid, created, answering, text=part.delta, ids=ids([]))] if part.delta else []
            if part.result is not None:
                logprobs = text.choice_logprobs(c, 0, part.result, None, engine.tokenizer, prompt=False)
                out.append(text.chunk(cid, created, answering, logprobs=logprobs,
                                      finish_reason=part.result.finish_reason, ids=ids(list(part.result.token_ids))))
                if c.include_usage:
                    out.append(text.chunk(cid, created, answering, usage=usage(part.result)))
            return out

        return await call.stream(open_stream, events)

    return api
