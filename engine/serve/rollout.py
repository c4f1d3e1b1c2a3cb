"""The rollout surface swift's clients expect: ``/health``, ``/infer/``, ``/get_world_size/``,
``/get_engine_type/``, and ``/metrics``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from engine.errors import EngineError, RequestTooLarge
from engine.serve import protocol
from engine.serve.limits import check_call, read_json
from engine.serve.service import ServedEngine


def bad_request(err: EngineError) -> JSONResponse:
    """The refusal of ``err``: 413 for a body over ``serve.max_body_bytes``, else 400, the field as sent."""
    status = refusal_status(err)
    err = protocol.wire_error(err)
    return JSONResponse(protocol.error_body(str(err), param=getattr(err, "field", None), code=status), status)


def refusal_status(err: EngineError) -> int:
    return 413 if isinstance(err, RequestTooLarge) and err.field == "body" else 400


async def until_disconnected(request: Request, task: asyncio.Task[Any]) -> bool:
    """Wait for ``task``; cancel it (aborting its generation) if the client goes away first. True if cancelled."""
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            return True
    return False


def router(served: ServedEngine) -> APIRouter:
    api = APIRouter()
    engine = served.engine

    @api.get("/health")
    @api.get("/health/")
    async def health() -> dict[str, Any]:
        return served.health()

    @api.get("/get_world_size/")
    async def world_size() -> dict[str, int]:
        return {"world_size": served.world_size()}

    @api.post("/get_engine_type/")
    async def engine_type() -> dict[str, Any]:
        # Both backends take concurrent /infer/ calls and batch them (AsyncLLM, or the HF batcher).
        return {"engine_type": "AsyncLLMEngine", "backend": engine.backend.name, "enable_multi_turn": False,
                "use_gym_env": False, "enable_lora": False}

    @api.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(served.metrics.render(active=served.guard_active, in_flight=served.in_flight),
                                 media_type="text/plain; version=0.0.4")

    @api.post("/infer/")
    async def infer(request: Request) -> Any:
        start = time.perf_counter()
        try:
            call = protocol.parse_infer(await read_json(request, served.serve.max_body_bytes))
            check_call(served.serve, prompts=len(call.requests), options=call.options, stop=call.stop,
                       max_model_len=engine.backend.capabilities.max_model_len)
        except EngineError as err:
            served.metrics.observe(endpoint="infer", status=refusal_status(err), seconds=time.perf_counter() - start)
            return bad_request(err)
        served.in_flight += 1
        # The engine validates messages, options, plugins and context length first and raises before generating.
        task = asyncio.ensure_future(engine.agenerate(call.requests, options=call.options or None, stop=call.stop,
                                                      plugins=call.plugins))
        try:
            cancelled = await until_disconnected(request, task)
            if cancelled:
                served.metrics.observe(endpoint="infer", status=499, seconds=time.perf_counter() - start,
                                       cancelled=True)
                return JSONResponse(protocol.error_body("client disconnected", code=499), 499)
            results = task.result()
        except EngineError as err:
            served.metrics.observe(endpoint="infer", status=400, seconds=time.perf_counter() - start)
            return bad_request(err)
        finally:
            served.in_flight -= 1
        items = [protocol.rollout_item(r, call, model=served.model_name, tokenizer=engine.tokenizer,
                                       namespace=served.serve.namespace) for r in results]
        served.metrics.observe(endpoint="infer", status=200, seconds=time.perf_counter() - start,
                               sequences=len(results), prompt_tokens=sum(len(r.prompt_token_ids) for r in results),
                               generated_tokens=sum(len(r.token_ids) for r in results),
                               triggered=sum(int(r.meta.get("repeat_terminate_triggered", 0)) for r in results))
        return JSONResponse(items)

    return api
