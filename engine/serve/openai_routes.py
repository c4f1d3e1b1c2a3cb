"""OpenAI's chat surface: ``GET /v1/models`` and ``POST /v1/chat/completions`` (streaming as server-sent events).

Wire format: :mod:`engine.serve.openai_wire`. Every answer is one ``GenerationEngine.agenerate`` or
``astream`` call, so the streamed text equals the non-streamed text equals the in-process ``generate`` text.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from engine.errors import EngineError
from engine.serve import openai_wire as wire
from engine.serve.answering import Answering, unknown_model
from engine.serve.limits import check_call, read_json
from engine.serve.service import ServedEngine


def router(served: ServedEngine) -> APIRouter:
    api = APIRouter()
    engine = served.engine
    calls = Answering(served, "chat_completions", wire.TABLE)

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.model_name, "object": "model", "created": int(served.started),
                                            "owned_by": "engine", "root": engine.config.model.path,
                                            "max_model_len": engine.backend.capabilities.max_model_len}]}

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        start = time.perf_counter()
        try:
            body = await read_json(request, served.serve.max_body_bytes)
        except EngineError as err:
            return calls.refused(err, start)
        # Errors name the field the client sent where two name one engine field (min_tokens / engine.options).
        answer = Answering(served, "chat_completions", wire.TABLE.sent(body))
        try:
            call = wire.parse_completion(body)
            check_call(served.serve, prompts=1, options=call.options, stop=call.stop,
                       max_model_len=engine.backend.capabilities.max_model_len)
        except EngineError as err:
            return answer.refused(err, start)
        if call.model != served.model_name:
            answer.observe(404, start)
            return unknown_model(call.model, served)
        kwargs = {"options": call.options or None, "stop": call.stop, "plugins": call.plugins,
                  "json_schema": call.json_schema}
        model = served.model_name
        if call.stream:
            try:  # validation (messages, options, plugins, context length) raises here, before any generation
                stream = engine.astream(call.messages, **kwargs)
            except EngineError as err:
                return answer.refused(err, start)
            cid, created = wire.completion_id(), int(time.time())

            def events(part: Any) -> list[Any]:
                out = []
                if part.delta:
                    out.append(wire.chunk(cid, created, model, call, delta={"content": part.delta}))
                if part.result is not None:
                    out.append(wire.chunk(cid, created, model, call, result=part.result, tokenizer=engine.tokenizer))
                    if call.include_usage:
                        out.append(wire.chunk(cid, created, model, call, result=part.result, usage_only=True))
                return out

            role = wire.chunk(cid, created, model, call, delta={"role": "assistant", "content": ""})
            return answer.stream(stream, start, events, first=[role])
        return await answer.whole(request, start, [call.messages], kwargs, body=lambda results:
                                 wire.completion_body(results[0], call, model=model, tokenizer=engine.tokenizer))

    return api
