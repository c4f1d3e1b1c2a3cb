"""The rollout surface swift's clients expect: ``/health``, ``/infer/``, ``/get_world_size/``,
``/get_engine_type/``, and ``/metrics``. Wire format: :mod:`engine.serve.rollout.infer`; weight sync:
:mod:`engine.serve.rollout.weights`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from engine.serve.rollout import infer as wire
from engine.serve.rollout.bodies import InferRequest
from engine.serve.service import ServedEngine
from engine.serve.shared.calls import Call, Surface
from engine.serve.shared.errors import EngineDead, status_of
from engine.serve.shared.fields import FieldTable
from engine.serve.shared.metrics import CONTENT_TYPE

BODIES = {"/infer/": InferRequest}


def router(served: ServedEngine) -> APIRouter:
    api = APIRouter()
    infers = Surface(served, "infer", InferRequest, wire.parse_infer,
                     fields=FieldTable.of(InferRequest, requests="infer_requests"),
                     prepare=lambda c, served: served.engine.prepare(c.requests, **c.kwargs))  # off the event loop

    @api.get("/health")
    @api.get("/health/")
    async def health(request: Request) -> Any:
        report = served.health(detailed=served.sent_the_key(request.scope["headers"]))
        if report["status"] == "ok":
            return report
        return JSONResponse(report, status_code=status_of(EngineDead(report["error"])))  # the one status table

    @api.get("/get_world_size/")
    @api.get("/get_world_size")  # vLLM's name (TRL's client); ``include_dp`` is moot: no data parallelism here
    async def world_size(include_dp: bool = True) -> dict[str, int]:
        return {"world_size": served.world_size()}

    @api.post("/get_engine_type/")
    async def engine_type() -> dict[str, Any]:
        # Every backend takes concurrent /infer/ calls and batches them (AsyncLLM, or the engine's batcher).
        return {"engine_type": "AsyncLLMEngine", "backend": served.engine.backend.name, "enable_multi_turn": False,
                "use_gym_env": False, "enable_lora": served.lora_enabled}  # swift's trainer then pushes adapters

    @api.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(served.metrics.render(active=served.guard_active, in_flight=served.in_flight),
                                 media_type=CONTENT_TYPE)

    @infers.route(api, "/infer/")
    async def infer(call: Call) -> Any:
        return await wire.answer(call, served)

    return api
