"""The rollout surface swift's clients expect: ``/health``, ``/infer/``, ``/get_world_size/``,
``/get_engine_type/``, and ``/metrics``. Wire format: :mod:`engine.serve.rollout_wire`."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from engine.errors import EngineError
from engine.serve import rollout_wire as wire
from engine.serve.answering import Answering
from engine.serve.limits import check_call, read_json
from engine.serve.metrics import CONTENT_TYPE
from engine.serve.service import ServedEngine


def router(served: ServedEngine) -> APIRouter:
    api = APIRouter()
    engine = served.engine
    calls = Answering(served, "infer", wire.FIELDS)

    @api.get("/health")
    @api.get("/health/")
    async def health(request: Request) -> dict[str, Any]:
        return served.health(detailed=served.sent_the_key(request.scope["headers"]))

    @api.get("/get_world_size/")
    async def world_size() -> dict[str, int]:
        return {"world_size": served.world_size()}

    @api.post("/get_engine_type/")
    async def engine_type() -> dict[str, Any]:
        # Every backend takes concurrent /infer/ calls and batches them (AsyncLLM, or the engine's batcher).
        return {"engine_type": "AsyncLLMEngine", "backend": engine.backend.name, "enable_multi_turn": False,
                "use_gym_env": False, "enable_lora": False}

    @api.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(served.metrics.render(active=served.guard_active, in_flight=served.in_flight),
                                 media_type=CONTENT_TYPE)

    @api.post("/infer/")
    async def infer(request: Request) -> Any:
        start = time.perf_counter()
        try:
            call = wire.parse_infer(await read_json(request, served.serve.max_body_bytes))
            check_call(served.serve, prompts=len(call.requests), options=call.options, stop=call.stop,
                       max_model_len=engine.backend.capabilities.max_model_len)
        except EngineError as err:
            return calls.refused(err, start)
        kwargs = {"options": call.options or None, "stop": call.stop, "plugins": call.plugins}
        return await calls.whole(request, start, call.requests, kwargs, body=lambda results: [
            wire.rollout_item(r, call, model=served.model_name, tokenizer=engine.tokenizer,
                              namespace=served.serve.namespace) for r in results])

    return api
