"""How every surface answers: one path for ``/infer/``, ``/v1/chat/completions`` and Pattern C ``/chat``. A call is
counted in ``/metrics``, answered whole or as server-sent events, cancelled when the client goes away, and refused
as OpenAI's error object naming the field as the client sent it (the surface's :class:`~engine.serve.wire.FieldTable`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.errors import EngineError, RequestTooLarge
from engine.serve.limits import read_json
from engine.serve.service import ServedEngine
from engine.serve.wire import FieldTable, error_body
from engine.types import GenerationResult

log = logging.getLogger(__name__)
T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any) -> str:
    """One server-sent event carrying ``data`` (JSON, or the literal ``[DONE]``)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def refusal_status(err: EngineError) -> int:
    """413 for a body over ``serve.max_body_bytes``, else 400."""
    return 413 if isinstance(err, RequestTooLarge) and err.field == "body" else 400


def refuse(err: EngineError, fields: FieldTable) -> JSONResponse:
    """The refusal of ``err`` (see :func:`refusal_status`), naming the field as the client sent it."""
    status = refusal_status(err)
    err = fields.rename(err)
    return JSONResponse(error_body(str(err), param=getattr(err, "field", None), code=status), status)


def unknown_model(name: str, served: ServedEngine) -> JSONResponse:
    message = f"The model {name!r} does not exist: this server serves {served.model_name!r} (GET /v1/models)."
    return JSONResponse(error_body(message, kind="NotFoundError", param="model", code=404), 404)


def gone() -> JSONResponse:
    return JSONResponse(error_body("client disconnected", code=499), 499)


async def until_disconnected(request: Request, task: asyncio.Task[Any]) -> bool:
    """Wait for ``task``; cancel it (aborting its generation) if the client goes away first. True if cancelled."""
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            return True
    return False


class Answering:
    """One endpoint's calls against ``served``: count them, answer whole or stream, cancel on disconnect.

    Example (inside a route)::

        calls = Answering(served, "chat", pattern_c_wire.TABLE)
        return await calls.whole(request, start, [messages], kwargs, body=lambda results: ...)
    """

    def __init__(self, served: ServedEngine, endpoint: str, fields: FieldTable) -> None:
        self.served = served
        self.endpoint = endpoint
        self.fields = fields

    def observe(self, status: int, start: float, results: Sequence[GenerationResult] = (),
                cancelled: bool = False) -> None:
        self.served.metrics.observe(
            endpoint=self.endpoint, status=status, seconds=time.perf_counter() - start, cancelled=cancelled,
            sequences=len(results), prompt_tokens=sum(len(r.prompt_token_ids) for r in results),
            generated_tokens=sum(len(r.token_ids) for r in results),
            triggered=sum(int(r.meta.get("repeat_terminate_triggered", 0)) for r in results))

    async def read(self, request: Request, start: float) -> tuple[Any, Answering | None]:
        """The request's JSON body (within ``serve.max_body_bytes``) and the answering of this call, whose errors name
        the fields this body sent (where two client fields name one engine field); or (the counted refusal, None)."""
        try:
            body = await read_json(request, self.served.serve.max_body_bytes)
        except EngineError as err:
            return self.refused(err, start), None
        return body, Answering(self.served, self.endpoint, self.fields.sent(body))

    def refused(self, err: EngineError, start: float) -> JSONResponse:
        """Count a refusal and answer it (see :func:`refuse`)."""
        self.observe(refusal_status(err), start)
        return refuse(err, self.fields)

    async def whole(self, request: Request, start: float, requests: list[Any], kwargs: dict[str, Any], *,
                    body: Callable[[list[GenerationResult]], Any]) -> Any:
        """The non-streamed answer to ``requests`` (one ``agenerate`` call): ``body(results)`` as JSON, a 400 for
        what validation refuses, or the 499 of a client that went away (its generation cancelled); counted."""
        return await self.whole_of(request, start, lambda: self.served.engine.agenerate(requests, **kwargs),
                                   body=body, counted=lambda results: results)

    async def whole_of(self, request: Request, start: float, run: Callable[[], Awaitable[T]], *,
                       body: Callable[[T], Any], counted: Callable[[T], Sequence[GenerationResult]]) -> Any:
        """``whole`` for any engine work: ``run()`` (validation raises in it before anything is generated), answered
        as ``body(output)``; ``counted(output)`` are the results ``/metrics`` counts."""
        await self.served.ready()
        self.served.in_flight += 1
        task = asyncio.ensure_future(run())
        try:
            if await until_disconnected(request, task):
                self.observe(499, start, cancelled=True)
                return gone()
            output = task.result()
        except EngineError as err:
            return self.refused(err, start)
        finally:
            self.served.in_flight -= 1
        self.observe(200, start, counted(output))
        return JSONResponse(body(output))

    def stream(self, stream: Any, start: float, events: Callable[[Any], list[Any]],
               first: Sequence[Any] = ()) -> StreamingResponse:
        """The SSE response: ``first`` events, ``events(chunk)`` for every engine chunk, an error event if
        generation fails after the headers went out, then ``[DONE]``."""
        return StreamingResponse(self._events(stream, start, events, list(first)), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    async def _events(self, stream: Any, start: float, events: Callable[[Any], list[Any]],
                      first: list[Any]) -> AsyncIterator[str]:
        await self.served.ready()
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
            yield sse(error_body(f"generation failed: {err}", kind="server_error", code=500))
        else:
            self.observe(200, start, [result] if result is not None else [])
        finally:
            self.served.in_flight -= 1
            await parts.aclose()  # stops the generation now if the client left between two chunks
        yield sse("[DONE]")
