"""The FastAPI app factory of the served engine: each surface folder gives a router and its request bodies
(``/openapi.json``); errors are OpenAI's error object, their status from :mod:`engine.serve.shared.errors`."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import EngineError, RequestError
from engine.serve.openai import lora as lora_routes
from engine.serve.openai import routes as openai_routes
from engine.serve.openai import tokenize as tokenize_routes
from engine.serve.pattern_c import routes as pattern_c_routes
from engine.serve.rollout import adapter_sync as adapter_sync_routes
from engine.serve.rollout import routes as rollout_routes
from engine.serve.rollout import transfer as transfer_routes
from engine.serve.rollout import weights as weights_routes
from engine.serve.service import ServedEngine
from engine.serve.shared import bodies
from engine.serve.shared.access import AccessLog
from engine.serve.shared.auth import ApiKeyGate
from engine.serve.shared.errors import error_body, error_response, status_of

SURFACES = (rollout_routes, openai_routes, pattern_c_routes, weights_routes, transfer_routes, adapter_sync_routes,
            tokenize_routes, lora_routes)
"""Each gives ``router(served)`` and ``BODIES`` (path -> the body model its POST route reads)."""

log = logging.getLogger(__name__)


async def engine_error(request: Request, err: EngineError) -> JSONResponse:
    """An engine error no route's call path caught: its field as raised (no surface to rename it by)."""
    return error_response(err)


async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    """An unknown route (404) or method (405) in the same error object as every other refusal."""
    message = f"{request.method} {request.url.path}: {err.detail}"
    return JSONResponse(error_body(message, kind="NotFoundError" if err.status_code == 404 else
                                            "invalid_request_error", code=err.status_code), err.status_code,
                        headers=getattr(err, "headers", None))


async def internal_error(request: Request, err: Exception) -> JSONResponse:
    """Whatever escaped every typed refusal: still a JSON error in the wire format, naming the request (the client's
    ``x-request-id``, else a new one) so that the log line with the traceback can be found."""
    request_id = getattr(request.state, "request_id", None) or uuid.uuid4().hex[:16]  # AccessLog's
    log.error("engine.serve: request %s (%s %s) failed: %s", request_id, request.method, request.url.path,
              type(err).__name__, exc_info=err)
    status = status_of(err)
    body = error_body(f"internal error while answering request {request_id} ({request.method} "
                      f"{request.url.path}): {type(err).__name__}; the server log has the traceback",
                      kind="internal_error", code=status)
    # Sent by Starlette's outermost error middleware, outside AccessLog: the header is set here.
    return JSONResponse(body, status, headers={"x-request-id": request_id})


async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    """FastAPI's own parameter check (no route declares one: bodies are read by the call path), refused by name like
    any other request error."""
    first: dict[str, Any] = err.errors()[0] if err.errors() else {}
    field = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return error_response(RequestError(field or "body", first.get("input"), first.get("msg", "is invalid"),
                                       fix="see GET /openapi.json"))


HANDLERS = ((EngineError, engine_error), (StarletteHTTPException, http_error), (Exception, internal_error),
            (RequestValidationError, validation_error))
"""Every refusal that reaches the app, in OpenAI's error object (``shared/errors.py``)."""


def openapi_of(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document with the request bodies the routes read themselves (``shared/bodies.py``)."""
    if app.openapi_schema is None:
        routes = {path: model for surface in SURFACES for path, model in surface.BODIES.items()}
        app.openapi_schema = bodies.openapi(get_openapi(title=app.title, version=app.version, routes=app.routes),
                                            routes)
    return app.openapi_schema


def create_app(served: ServedEngine, *, close_engine: bool = True) -> FastAPI:
    """The app serving ``served``: its middleware, each surface's router, the error handlers; with ``close_engine``
    the engine is released when the app shuts down.

    Example (an engine already loaded; tests drive it with ``httpx.ASGITransport``)::

        app = create_app(ServedEngine(engine, activation))
        uvicorn.run(app, host="127.0.0.1", port=8000)
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if close_engine:  # uvicorn has drained in-flight requests by now (timeout_graceful_shutdown)
            log.info("engine.serve: closing the engine")
            served.engine.close()

    app = FastAPI(title="engine.serve", lifespan=lifespan)
    if served.api_key is not None:
        app.add_middleware(ApiKeyGate, key=served.api_key)
    app.add_middleware(AccessLog)  # outermost: every request gets its id and its line, refusals included
    for surface in SURFACES:
        app.include_router(surface.router(served))
    app.openapi = partial(openapi_of, app)  # type: ignore[method-assign]
    for kind, handler in HANDLERS:
        app.add_exception_handler(kind, handler)  # type: ignore[arg-type]
    return app
