"""The served engine's access log and request ids, and the ``engine`` loggers' configuration.

Every HTTP request gets an id: the client's ``x-request-id`` (64 characters at most) or a new one. It is sent back in
the ``x-request-id`` response header, named by the error body of a failure (``engine.serve.app``), and written in one
access-log line per request on the ``engine.serve.access`` logger when the answer ends (for a stream: its last
event)::

    engine.serve.access: 3f2a9c1e0b7d4a55 127.0.0.1 "POST /v1/chat/completions" 200 412.3ms

A plain ASGI middleware, so streamed answers and disconnects pass through untouched (a client that left is logged
with the status the app had sent, or 499 when nothing was sent).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

ACCESS = logging.getLogger("engine.serve.access")
HEADER = b"x-request-id"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``x-request-id`` (trimmed to 64 characters), or a new 16-hex-digit id.

    >>> request_id([(b"x-request-id", b"abc")]), len(request_id([]))
    ('abc', 16)
    """
    for name, value in headers:
        if name.lower() == HEADER and value.strip():
            return value.decode("latin-1").strip()[:64]
    return uuid.uuid4().hex[:16]


def loggable(text: str) -> str:
    """``text`` with every character that is not printable escaped, so a client cannot write a line of its own into
    the log (hostile round 4: ``%0A`` in a URL's path, which the server decodes to a newline).

    >>> loggable("/v1/models" + chr(10) + "forged: 200")
    '/v1/models\\\\x0aforged: 200'
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}"
                   for c in text)


class AccessLog:
    """ASGI middleware: the request id (``scope["state"]["request_id"]``, the response header) and the access line.

    Example: ``app.add_middleware(AccessLog)``.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope.get("headers", []))
        scope.setdefault("state", {})["request_id"] = rid
        start, status = time.perf_counter(), 499

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (HEADER, rid.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            status = 500  # answered by Starlette's error middleware, outside this one (engine.serve.app)
            raise
        finally:
            client = scope.get("client") or ("-", 0)
            ACCESS.info('%s %s "%s %s" %d %.1fms', loggable(rid), client[0], scope["method"],
                        loggable(scope["path"]), status, (time.perf_counter() - start) * 1000)


def configure_logging(level: str) -> None:
    """Give the ``engine`` loggers (access log included) a stderr handler at ``level`` (uvicorn's ``--log-level``),
    once; a handler the embedding program already set on ``engine`` wins."""
    root = logging.getLogger("engine")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
        root.propagate = False
    root.setLevel("DEBUG" if level.lower() == "trace" else level.upper())
