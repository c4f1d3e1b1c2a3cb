"""The chat surfaces: OpenAI's ``GET /v1/models`` and ``POST /v1/chat/completions`` (streaming as server-sent
events), and Pattern C's ``POST /chat``. Wire formats: :mod:`engine.serve.chat_protocol`,
:mod:`engine.serve.pattern_c`. Every answer is one ``GenerationEngine.agenerate`` or ``astream`` call, so the
streamed text equals the non-streamed text equals the in-process ``generate`` text for the same request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.errors import EngineError
from engine.serve import chat_protocol, pattern_c, protocol
from engine.serve.rollout import read_json, until_disconnected
from engine.serve.service import ServedEngine
from engine.types import GenerationResult

log = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any) -> str:
    """One server-sent event carrying ``data`` (JSON, or the literal ``[DONE]``)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def _refuse(err: EngineError, rename: Callable[[EngineError], EngineError]) -> JSONResponse:
    err = rename(err)
    return JSONResponse(protocol.error_body(str(err), param=getattr(err, "field", None)), 400)


def _unknown_model(name: str, served: ServedEngine) -> JSONResponse:
    message = f"The model {name!r} does not exist: this server serves {served.model_name!r} (GET /v1/models)."
    return JSONResponse(protocol.error_body(message, kind="NotFoundError", param="model", code=404), 404)


def router(served: ServedEngine) -> APIRouter:
    api = APIRouter()
    engine = served.engine

    def observe(endpoint: str, status: int, start: float, result: GenerationResult | None = None,
                cancelled: bool = False) -> None:
        counts = {} if result is None else {"sequences": 1, "prompt_tokens": len(result.prompt_token_ids),
                                            "generated_tokens": len(result.token_ids)}
        served.metrics.observe(endpoint=endpoint, status=status, seconds=time.perf_counter() - start,
                               cancelled=cancelled, **counts)

    async def answer(endpoint: str, request: Request, start: float, messages: Any, **kwargs: Any) -> Any:
        """One non-streamed generation; None when the client went away (the generation is cancelled)."""
        served.in_flight += 1
        task = asyncio.ensure_future(engine.agenerate([messages], **kwargs))
        try:
            if await until_disconnected(request, task):
                observe(endpoint, 499, start, cancelled=True)
                return None
            return task.result()[0]
        finally:
            served.in_flight -= 1

    async def stream_events(endpoint: str, stream: Any, start: float,
                            events: Callable[[Any], list[Any]]) -> AsyncIterator[str]:
        """The SSE body: ``events(chunk)`` for every engine chunk, an error event if generation fails, [DONE]."""
        served.in_flight += 1
        result = None
        parts = stream.__aiter__()
        try:
            async for part in parts:
                result = part.result or result
                for event in events(part):
                    yield sse(event)
        except asyncio.CancelledError:  # the client went away: the stream's generation is stopped
            observe(endpoint, 499, start, cancelled=True)
            raise
        except Exception as err:  # headers are sent: report in-band, as OpenAI's and vLLM's servers do
            log.exception("%s: streamed generation failed", endpoint)
            observe(endpoint, 500, start)
            yield sse(protocol.error_body(f"generation failed: {err}", kind="server_error", code=500))
        else:
            observe(endpoint, 200, start, result)
        finally:
            served.in_flight -= 1
            await parts.aclose()  # stops the generation now if the client left between two chunks
        yield sse("[DONE]")

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.model_name, "object": "model", "created": int(served.started),
                                            "owned_by": "engine", "root": engine.config.model.path,
                                            "max_model_len": engine.backend.capabilities.max_model_len}]}

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        start = time.perf_counter()
        try:
            call = chat_protocol.parse_completion(await read_json(request))
        except EngineError as err:
            observe("chat_completions", 400, start)
            return _refuse(err, chat_protocol.wire_error)
        if call.model != served.model_name:
            observe("chat_completions", 404, start)
            return _unknown_model(call.model, served)
        kwargs = {"options": call.options or None, "stop": call.stop, "plugins": call.plugins}
        model = served.model_name
        if call.stream:
            try:  # validation (messages, options, plugins, context length) raises here, before any generation
                stream = engine.astream(call.messages, **kwargs)
            except EngineError as err:
                observe("chat_completions", 400, start)
                return _refuse(err, chat_protocol.wire_error)
            cid, created = chat_protocol.completion_id(), int(time.time())

            def events(part: Any) -> list[Any]:
                out = []
                if part.delta:
                    out.append(chat_protocol.chunk(cid, created, model, call, delta={"content": part.delta}))
                if part.result is not None:
                    out.append(chat_protocol.chunk(cid, created, model, call, result=part.result,
                                                   tokenizer=engine.tokenizer))
                    if call.include_usage:
                        out.append(chat_protocol.chunk(cid, created, model, call, result=part.result, usage_only=True))
                return out

            first = sse(chat_protocol.chunk(cid, created, model, call, delta={"role": "assistant", "content": ""}))
            body = _prefixed(first, stream_events("chat_completions", stream, start, events))
            return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            result = await answer("chat_completions", request, start, call.messages, **kwargs)
        except EngineError as err:
            observe("chat_completions", 400, start)
            return _refuse(err, chat_protocol.wire_error)
        if result is None:
            return JSONResponse(protocol.error_body("client disconnected", code=499), 499)
        observe("chat_completions", 200, start, result)
        return JSONResponse(chat_protocol.completion_body(result, call, model=model, tokenizer=engine.tokenizer))

    @api.post("/chat")
    async def chat(request: Request) -> Any:
        start = time.perf_counter()
        try:
            call = pattern_c.parse_pattern_c(await read_json(request), served.serve.chat)
        except EngineError as err:
            observe("chat", 400, start)
            return _refuse(err, pattern_c.wire_error)
        if call.model is not None and call.model != served.model_name:
            observe("chat", 404, start)
            return _unknown_model(call.model, served)
        kwargs = {"options": call.options, "plugins": call.plugins}
        model = served.model_name
        if call.stream:
            try:
                stream = engine.astream(call.messages, **kwargs)
            except EngineError as err:
                observe("chat", 400, start)
                return _refuse(err, pattern_c.wire_error)

            def events(part: Any) -> list[Any]:
                out: list[Any] = [{"delta": part.delta}] if part.delta else []
                if part.result is not None:
                    out.append(pattern_c.pattern_c_body(part.result, call, model=model))
                return out

            return StreamingResponse(stream_events("chat", stream, start, events), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        try:
            result = await answer("chat", request, start, call.messages, **kwargs)
        except EngineError as err:
            observe("chat", 400, start)
            return _refuse(err, pattern_c.wire_error)
        if result is None:
            return JSONResponse(protocol.error_body("client disconnected", code=499), 499)
        observe("chat", 200, start, result)
        return JSONResponse(pattern_c.pattern_c_body(result, call, model=model))

    return api


async def _prefixed(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for item in rest:
        yield item
