"""What an idle client may hold: uvicorn starts no timer on a new connection before its first byte (its keep-alive
timeout covers only the silence between requests), so a client that opens sockets and never writes would hold them
forever, and enough of them exhaust the server's file descriptors. :func:`guarded_protocol` is uvicorn's own HTTP
protocol with two rules added:

* a new connection that sends nothing for ``serve.idle_connection_timeout_s`` is closed (the keep-alive timer,
  started at once instead of after a first response; the first byte cancels it, as it cancels a keep-alive wait);
* beyond ``serve.max_connections`` open connections, a new one is closed at once.

A request body that stalls part-way is the call path's (``serve.body_timeout_s``: a 408,
:func:`engine.serve.shared.limits.read_bytes`).

>>> from engine.config import ServeConfig
>>> guarded_protocol(ServeConfig(max_connections=8)).max_connections
8
"""

from __future__ import annotations

from typing import Any


def guarded_protocol(serve: Any) -> type:
    """uvicorn's HTTP protocol class (httptools where installed, else h11) with the first-byte timeout and the
    connection cap of ``serve`` (a :class:`~engine.config.ServeConfig`); pass it as ``uvicorn.Config(http=...)``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[valid-type,misc]
        max_connections = serve.max_connections
        first_byte_s = serve.idle_connection_timeout_s

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > self.max_connections:
                transport.abort()  # frees the descriptor now; connection_lost forgets the connection
                return
            self.timeout_keep_alive_task = self.loop.call_later(self.first_byte_s, self.timeout_keep_alive_handler)

    return GuardedHTTPProtocol
