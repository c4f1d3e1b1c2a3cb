"""What the chat surfaces share: one generation per request, answered whole or as server-sent events, counted in
``/metrics``, cancelled when the client goes away; errors as OpenAI error objects. Used by
:mod:`engine.serve.openai` and :mod:`engine.serve.chat`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.errors import EngineError
from engine.serve import protocol
from engine.serve.rollout import refusal_status, until_disconnected
from engine.serve.service import ServedEngine
from engine.types import GenerationResult

log = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any) -> str:
    """One server-sent event carrying ``data`` (JSON, or the literal ``[DONE]``)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def refuse(err: EngineError, rename: Callable[[EngineError], EngineError]) -> JSONResponse:
    """A 400 (413 for a body over ``serve.max_body_bytes``) naming the field as the client sent it (``rename``
    maps engine field names to wire names)."""
    status = refusal_status(err)
    err = rename(err)
    return JSONResponse(protocol.error_body(str(err), param=getattr(err, "field", None), code=status), status)


def unknown_model(name: str, served: ServedEngine) -> JSONResponse:
    message = f"The model {name!r} does not exist: this server serves {served.model_name!r} (GET /v1/models)."
    return JSONResponse(protocol.error_body(message, kind="NotFoundError", param="model", code=404), 404)


def gone() -> JSONResponse:
    return JSONResponse(protocol.error_body("client disconnected", code=499), 499)


class Answering:
    """One endpoint's requests against ``served``: count them, answer whole or stream, cancel on disconnect.

    Example (inside a route)::

        calls = Answering(served, "chat")
        result = await calls.answer(request, start, messages, options=..., plugins=...)
    """

    def __init__(self, served: ServedEngine, endpoint: str) -> None:
        self.served = served
        self.endpoint = endpoint

    def observe(self, status: int, start: float, result: GenerationResult | None = None,
                cancelled: bool = False) -> None:
        counts = {} if result is None else {"sequences": 1, "prompt_tokens": len(result.prompt_token_ids),
                                            "generated_tokens": len(result.token_ids)}
        self.served.metrics.observe(endpoint=self.endpoint, status=status, seconds=time.perf_counter() - start,
                                    cancelled=cancelled, **counts)

    def refused(self, err: EngineError, start: float, rename: Callable[[EngineError], EngineError]) -> JSONResponse:
        """Count a refusal and answer it (see :func:`refuse`)."""
        self.observe(refusal_status(err), start)
        return refuse(err, rename)

    async def whole(self, request: Request, start: float, messages: Any, kwargs: dict[str, Any],
                    rename: Callable[[EngineError], EngineError], *, body: Callable[[GenerationResult], Any]) -> Any:
        """The non-streamed answer: ``body(result)`` as JSON, a 400 for what validation refuses, or the 499 of a
        client that went away; counted."""
        try:
            result = await self.answer(request, start, messages, **kwargs)
        except EngineError as err:
            return self.refused(err, start, rename)
        if result is None:
            return gone()
        self.observe(200, start, result)
        return JSONResponse(body(result))

    async def answer(self, request: Request, start: float, messages: Any, **kwargs: Any) -> GenerationResult | None:
        """One non-streamed generation; None when the client went away (the generation is cancelled)."""
        self.served.in_flight += 1
        task = asyncio.ensure_future(self.served.engine.agenerate([messages], **kwargs))
        try:
            if await until_disconnected(request, task):
                self.observe(499, start, cancelled=True)
                return None
            return task.result()[0]
        finally:
            self.served.in_flight -= 1

    def stream(self, stream: Any, start: float, events: Callable[[Any], list[Any]],
               first: Sequence[Any] = ()) -> StreamingResponse:
        """The SSE response: ``first`` events, ``events(chunk)`` for every engine chunk, an error event if
        generation fails after the headers went out, then ``[DONE]``."""
        return StreamingResponse(self._events(stream, start, events, list(first)), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    async def _events(self, stream: Any, start: float, events: Callable[[Any], list[Any]],
                      first: list[Any]) -> AsyncIterator[str]:
        for event in first:
            yield sse(event)
        self.served.in_flight += 1
        result = None
        parts = stream.__aiter__()
        try:
            async for part in parts:
                result = part.result or result
                for event in events(part):
                    yield sse(event)
        except asyncio.CancelledError:  # the client went away: the stream's generation is stopped
            self.observe(499, start, cancelled=True)
            raise
        except Exception as err:  # headers are sent: report in-band, as OpenAI's and vLLM's servers do
            log.exception("%s: streamed generation failed", self.endpoint)
            self.observe(500, start)
            yield sse(protocol.error_body(f"generation failed: {err}", kind="server_error", code=500))
        else:
            self.observe(200, start, result)
        finally:
            self.served.in_flight -= 1
            await parts.aclose()  # stops the generation now if the client left between two chunks
        yield sse("[DONE]")
