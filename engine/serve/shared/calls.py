"""The one call path every POST route takes: read the body within ``serve.max_body_bytes``, check it against the
route's body model, parse the validated model into a call, hold the call to the server's limits, check the model
name once, and either refuse (OpenAI's error object naming the field as the client sent it, its status from
:mod:`engine.serve.shared.errors`) or hand the route a :class:`Call` to run and answer: whole, or as server-sent
events, cancelled when the client goes away, counted in ``/metrics`` either way.

A route is then "run and answer" an accepted call (:meth:`Surface.route` registers it behind the call path; an
engine error it raises is refused like any other)::

    chats = Surface(served, "chat_completions", ChatCompletionRequest, parse_chat)

    @chats.route(api, "/v1/chat/completions")
    async def chat_completions(call: Call) -> Any:
        return await call.whole(lambda: engine.agenerate([call.parsed.messages]), body=...)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.errors import EngineError
from engine.serve.service import ServedEngine
from engine.serve.shared.bodies import Body, check
from engine.serve.shared.errors import ClientGone, UnknownModel, error_body, error_response, status_of
from engine.serve.shared.fields import FieldTable, sent_paths
from engine.serve.shared.limits import check_call, check_counts, parse_json, read_bytes
from engine.types import GenerationResult

log = logging.getLogger(__name__)
T = TypeVar("T")
P = TypeVar("P", bound="Parsed")
B = TypeVar("B", bound=Body)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Parsed(Protocol):
    """What every parsed call tells the call path: the model it names (None: any), and what the limits check."""

    model: str | None
    options: Any
    stop: Any

    @property
    def prompt_count(self) -> int: ...


def sse(data: Any) -> str:
    """One server-sent event carrying ``data`` (JSON, or the literal ``[DONE]``)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def until_disconnected(request: Request, task: asyncio.Task[Any]) -> bool:
    """Wait for ``task``; cancel it (aborting its generation) if the client goes away first. True if cancelled."""
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            return True
    return False


async def read_body(request: Request, model: type[B], served: ServedEngine) -> B:
    """The request's body within ``serve.max_body_bytes``, checked against ``model``: the first step of every POST
    route (generation calls through :meth:`Surface.accept`, swift's weight-sync calls directly)."""
    raw = await read_bytes(request, served.serve.max_body_bytes, served.serve.body_timeout_s)
    return await asyncio.to_thread(lambda: check(model, parse_json(raw)))



def control_route(api: Any, served: ServedEngine, endpoint: str, paths: str | tuple[str, ...],
                  body: type[Body] | None = None, method: str = "POST", *,
                  failed: Callable[[BaseException], EngineError] | None = None) -> Callable[[Any], Any]:
    """Register ``handler`` at ``paths`` as a route that controls the server rather than generating (the weight
    routes): its body read within ``serve.max_body_bytes`` and checked against ``body`` (the handler gets the
    validated model), its engine errors refused by name through the one status table, every answer counted in
    ``/metrics`` under ``endpoint`` by status. An unexpected error is ``failed(err)`` (the weight routes: a background
    call that failed after its 200, reported to the next call), else a 500.
    """
    def register(handler: Callable[..., Any]) -> Callable[..., Any]:
        async def endpoint_(request: Request) -> Any:
            start = time.perf_counter()
            try:
                answer = await (handler() if body is None else handler(await read_body(request, body, served)))
            except EngineError as err:
                answer = error_response(err)
            except Exception as err:
                log.exception("engine.serve: %s failed", request.url.path)
                answer = error_response(failed(err) if failed is not None else err)
            status = getattr(answer, "status_code", 200)
            served.metrics.observe(endpoint=endpoint, status=status, seconds=time.perf_counter() - start,
                                   generation=False)
            return answer

        for path in (paths,) if isinstance(paths, str) else paths:
            name = getattr(handler, "__name__", None) or handler.func.__name__  # a partial: its function's name
            api.add_api_route(path, endpoint_, methods=[method], name=f"{name}:{path}")
        return handler
    return register

class Surface(Generic[P]):
    """One POST route's way in: its ``/metrics`` endpoint label, its body model, its parser and its field table.

    ``parse(body, served)`` turns the validated body model into the call (raising ``EngineError`` naming engine or
    client fields); ``prepare(call, served)``, when given, runs the engine's own checks after the limits and returns
    what they prepared (``Call.prepared``: the text route's tokenized prompts and plan, run without preparing them
    again). The table is built from the body model unless given.

    Example::

        surface = Surface(served, "chat", PatternCRequest, parse_pattern_c)
        call = await surface.accept(request)  # a Call, or the refusal to return
    """

    def __init__(self, served: ServedEngine, endpoint: str, body: type[Body], parse: Callable[[Any, ServedEngine], P],
                 *, fields: FieldTable | None = None, prepare: Callable[[P, ServedEngine], Any] | None = None) -> None:
        self.served = served
        self.endpoint = endpoint
        self.body = body
        self.parse = parse
        self.prepare = prepare
        self.fields = fields if fields is not None else FieldTable.of(body)

    def observe(self, status: int, start: float, results: Sequence[GenerationResult] = (),
                cancelled: bool = False) -> None:
        self.served.metrics.observe(
            endpoint=self.endpoint, status=status, seconds=time.perf_counter() - start, cancelled=cancelled,
            sequences=len(results), prompt_tokens=sum(len(r.prompt_token_ids) for r in results),
            generated_tokens=sum(len(r.token_ids) for r in results),
            triggered=sum(int(r.meta.get("repeat_terminate_triggered", 0)) for r in results))

    def refused(self, err: EngineError, start: float, fields: FieldTable | None = None) -> JSONResponse:
        """Count a refusal and answer it."""
        self.observe(status_of(err), start)
        return error_response(err, fields or self.fields)

    def route(self, api: Any, path: str) -> Callable[[Callable[[Call[P]], Awaitable[Any]]], Any]:
        """Register ``handler(call)`` as ``POST path`` on ``api`` behind :meth:`accept`: a refusal is answered
        before the handler runs, and an ``EngineError`` the handler raises is refused with this call's field names."""
        def register(handler: Callable[[Call[P]], Awaitable[Any]]) -> Any:
            async def endpoint(request: Request) -> Any:
                call = await self.accept(request)
                if not isinstance(call, Call):
                    return call
                try:
                    return await handler(call)
                except EngineError as err:
                    return call.refused(err)

            api.add_api_route(path, endpoint, methods=["POST"], name=handler.__name__)
            return handler
        return register

    async def accept(self, request: Request) -> Call[P] | JSONResponse:
        """The call ``request`` asks for, or its refusal (counted)."""
        start = time.perf_counter()
        try:
            raw = await read_bytes(request, self.served.serve.max_body_bytes, self.served.serve.body_timeout_s)
        except EngineError as err:
            return self.refused(err, start)
        # JSON, the body model, the parser (tokenizing), the limits and the engine's checks: CPU work on a body of up
        # to serve.max_body_bytes, run off the event loop so that /health and every stream go on meanwhile.
        with self.served.arriving():  # the batcher waits for this request before it starts a batch
            checked = await asyncio.to_thread(self._check, raw)
        if isinstance(checked[0], EngineError):
            return self.refused(checked[0], start, checked[1])
        call, fields, prepared = checked
        return Call(self, call, start, fields, request, prepared)

    def _check(self, raw: bytes) -> tuple[Any, FieldTable, Any]:
        """(the parsed call, its field table, what ``prepare`` gave), or (the refusal, the table to name it by)."""
        fields = self.fields
        serve, limit = self.served.serve, self.served.engine.backend.capabilities.max_model_len
        try:
            data = parse_json(raw)
            check_counts(data, max_items=max(serve.max_prompts_per_call, serve.max_stop_token_ids, limit or 0),
                         requests=self.fields.requests or None, max_prompts=serve.max_prompts_per_call)
            body = check(self.body, data)
            fields = self.fields.sent(set(sent_paths(body)))  # where two client fields name one engine field
            named = getattr(body, "model", None)
            if isinstance(named, str) and named and not self.served.serves(named):  # before any work on the body
                raise UnknownModel(named, self.served.model_name)
            call = self.parse(body, self.served)
            engine = self.served.engine
            check_call(self.served.serve, prompts=call.prompt_count, options=call.options, stop=call.stop,
                       max_model_len=engine.backend.capabilities.max_model_len,
                       default_max_new=engine.config.generation.max_new_tokens)
            prepared = self.prepare(call, self.served) if self.prepare is not None else None
        except EngineError as err:
            return err, fields, None
        return call, fields, prepared


class Call(Generic[P]):
    """One accepted call: ``parsed`` (the surface's call object), run and answered whole or streamed.

    Example (inside a route registered with :meth:`Surface.route`)::

        return await call.whole(lambda: engine.agenerate(call.parsed.requests, **call.parsed.kwargs),
                                body=lambda results: [item(r) for r in results])
    """

    def __init__(self, surface: Surface[P], parsed: P, start: float, fields: FieldTable, request: Request,
                 prepared: Any = None) -> None:
        self.surface = surface
        self.prepared = prepared
        """What the surface's ``prepare`` gave (None without one)."""
        self.request = request
        """The HTTP request, watched for a disconnect while the engine works."""
        self.served = surface.served
        self.parsed = parsed
        self.start = start
        self.fields = fields

    def refused(self, err: EngineError) -> JSONResponse:
        return self.surface.refused(err, self.start, self.fields)

    def answered(self, payload: Any) -> Any:
        """A 200 answered at once (no engine work to wait for), counted."""
        self.surface.observe(200, self.start)
        return payload

    async def whole(self, run: Callable[[], Awaitable[T]], *, body: Callable[[T], Any],
                    counted: Callable[[T], Sequence[GenerationResult]] | None = None) -> Any:
        """The non-streamed answer: ``run()`` (validation raises in it before anything is generated) answered as
        ``body(output)``, a refusal for what validation refuses, or the 499 of a client that went away (its
        generation cancelled); ``counted(output)`` (default: the output itself) are the results ``/metrics`` counts."""
        try:
            await self.served.ready()
        except EngineError as err:
            return self.refused(err)
        self.served.in_flight += 1
        task = asyncio.ensure_future(run())
        try:
            if await until_disconnected(self.request, task):
                self.surface.observe(499, self.start, cancelled=True)
                return error_response(ClientGone())
            output = task.result()
        except EngineError as err:
            return self.refused(err)
        finally:
            self.served.in_flight -= 1
        self.surface.observe(200, self.start, counted(output) if counted else output)  # type: ignore[arg-type]
        return JSONResponse(body(output))

    async def stream(self, open_stream: Callable[[], Awaitable[tuple[Any, Sequence[Any]]]],
                     events: Callable[[Any], list[Any]]) -> Any:
        """The SSE answer: ``open_stream()`` gives the engine's stream and the first events (validation raises in it,
        before anything is generated: a refusal), then ``events(chunk)`` for every engine chunk, an error event if
        generation fails after the headers went out, and ``[DONE]``."""
        try:
            stream, first = await open_stream()
        except EngineError as err:
            return self.refused(err)
        return StreamingResponse(self._events(stream, events, list(first)), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    async def _events(self, stream: Any, events: Callable[[Any], list[Any]], first: list[Any]) -> AsyncIterator[str]:
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
            self.surface.observe(499, self.start, cancelled=True)
            raise
        except Exception as err:  # headers are sent: report in-band, as OpenAI's and vLLM's servers do
            log.exception("%s: streamed generation failed", self.surface.endpoint)
            self.surface.observe(500, self.start)
            yield sse(error_body(f"generation failed: {err}", kind="server_error", code=500))
        else:
            self.surface.observe(200, self.start, [result] if result is not None else [])
        finally:
            self.served.in_flight -= 1
            await parts.aclose()  # stops the generation now if the client left between two chunks
        yield sse("[DONE]")
