"""What a slow or idle client may hold: uvicorn starts no timer on a new connection before its first byte (its
keep-alive timeout covers only the silence between requests) and none on a request head that trickles in, so a
client that opens sockets and never writes, or writes one byte every few seconds, would hold them forever, and enough
of them exhaust the server's connections. :func:`guarded_protocol` is uvicorn's own HTTP protocol with three rules
added:

* a request's head (request line and headers) must arrive whole within ``serve.idle_connection_timeout_s`` of the
  connection's opening, or of the first byte of a later request on it; else the connection is closed (a silent
  socket and a trickled head alike; hostile round 3: a head sent one byte every 5-9 s stayed open for 100 s);
* beyond ``serve.max_connections`` open connections, the oldest connection with no request running (silent, part
  of a head or of a body, or idle between requests) is closed to make room; only when every connection runs a
  request is the new one closed at once (hostile round 3: 1,100 stalled sockets had every other client refused,
  ``/health`` included; round 4: 1,024 sockets that sent a head and trickled the body still did);
* a request running (its head and body arrived whole) is never closed by these rules.

A request body that stalls or trickles is the call path's (``serve.body_timeout_s``, a total deadline: a 408,
:func:`engine.serve.shared.limits.read_bytes`).

>>> from engine.config import ServeConfig
>>> guarded_protocol(ServeConfig(max_connections=8)).max_connections
8
"""

from __future__ import annotations

from typing import Any


def guarded_protocol(serve: Any) -> type:
    """uvicorn's HTTP protocol class (httptools where installed, else h11) with the head deadline and the connection
    cap of ``serve`` (a :class:`~engine.config.ServeConfig`); pass it as ``uvicorn.Config(http=...)``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[valid-type,misc]
        max_connections = serve.max_connections
        head_s = serve.idle_connection_timeout_s

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.opened = self.loop.time()
            self.head_timer: Any = None
            if len(self.connections) > self.max_connections and not self._make_room():
                transport.abort()  # frees the descriptor now; connection_lost forgets the connection
                return
            self.head_timer = self.loop.call_later(self.head_s, self._head_late)

        def idle(self) -> bool:
            """No request runs on this connection (none yet, part of a head, or between requests)."""
            return self.cycle is None or self.cycle.response_complete

        def runs_a_request(self) -> bool:
            """A request whose head and body arrived whole runs here (being answered, or streaming its answer); one
            whose body is still arriving does not yet (hostile round 4: 1,024 connections that sent a head and
            trickled the body counted as running, and no new client got in)."""
            return not self.idle() and not getattr(self.cycle, "more_body", False)

        def _make_room(self) -> bool:
            """Close the oldest connection but this one that runs no request (silent, part of a head or a body,
            idle between requests); False when every other one runs a request."""
            idle = [c for c in self.connections
                    if c is not self and isinstance(c, GuardedHTTPProtocol) and not c.runs_a_request()]
            if not idle:
                return False
            oldest = min(idle, key=lambda c: c.opened)
            oldest.transport.abort()
            return True

        def data_received(self, data: bytes) -> None:
            if self.head_timer is None and self.idle():  # the first byte of a later request's head
                self.head_timer = self.loop.call_later(self.head_s, self._head_late)
            super().data_received(data)
            if self.head_timer is not None and not self.idle():  # the head arrived whole: its request runs
                self.head_timer.cancel()
                self.head_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            if getattr(self, "head_timer", None) is not None:
                self.head_timer.cancel()
                self.head_timer = None
            super().connection_lost(exc)

        def _head_late(self) -> None:
            self.head_timer = None
            if self.idle():
                self.transport.close()

    return GuardedHTTPProtocol
