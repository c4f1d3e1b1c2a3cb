"""The looper's servers that ``test_served.py`` and ``test_weight_sync.py`` share: one ``python -m engine.serve`` per
backend on the tiny looper, its guard activated from the environment (``ENGINE_REPEAT_TERMINATE_JSON``), the serve
settings both need. The served-engine checks read the start-up guard, the envelope and the counters; the weight checks
ask with the guard off per request (``engine.repeat_terminate.enabled: false``, a field of the same request API) and
change the weights, which the next user gets back from disk. Before issue 76 each module started its own three.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

NAME = "looper servers"
"""Their name in a module's ``SUBJECTS`` (``kept(NAME, why=...)``) and in the run's bill."""
LOOPER_SERVE = {"port": 0, "namespace": "coordexp", "weight_sync_join_timeout_s": 10}
"""Their ``serve`` section. The join timeout bounds the group a weight check opens and never joins
(``test_pushes_under_load_round_trip_exactly``); the namespace is the client's default."""


class LooperServers:
    """One server per backend on the looper, started on first need and kept for the modules that share it.

    ``checkout(backend)`` gives the running one; one that died (a check kills vLLM's engine core) is started again,
    and one whose weights a check changed (``changes_weights=True``) reloads the looper's checkpoint first.
    ``release(backend)`` stops one after its last user (the session plan's call, through the engine pool); ``close()``
    stops them all at the session's end.

    >>> from conformance.subjects.bill import Bill
    >>> servers = LooperServers(configure=lambda backend: {"backend": backend}, guard={"enabled": False},
    ...                         checkpoint="/looper", bill=Bill())
    >>> servers.running, servers.config("hf")["serve"]["weight_sync_join_timeout_s"], servers.release("hf")
    ({}, 10, [])
    """

    def __init__(self, *, configure: Callable[[str], dict[str, Any]], guard: Mapping[str, Any], checkpoint: str,
                 bill: Any) -> None:
        self.configure, self.guard, self.checkpoint, self.bill = configure, dict(guard), checkpoint, bill
        self.running: dict[str, Any] = {}
        self.changed: set[str] = set()
        """Backends whose server holds weights a check pushed: reloaded from the checkpoint at the next checkout."""

    def config(self, backend: str) -> dict[str, Any]:
        return {**self.configure(backend), "serve": dict(LOOPER_SERVE)}

    def checkout(self, backend: str, *, changes_weights: bool = False) -> Any:
        import httpx

        from engine.client import launch_server

        self.bill.used("kept", (NAME, backend), model=NAME, sections={})
        server = self.running.get(backend)
        if server is not None and not healthy(server):
            self.running.pop(backend).stop()
            self.changed.discard(backend)
            server = None
        if server is None:
            with self.bill.timed("kept", (NAME, backend)):
                server = self.running[backend] = launch_server(self.config(backend), repeat_terminate=self.guard)
        elif backend in self.changed:
            reply = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": self.checkpoint},
                               timeout=120)
            assert reply.status_code == 200, f"the shared server did not reload the looper: {reply.text[:400]}"
            self.changed.discard(backend)
        if changes_weights:
            self.changed.add(backend)
        return server

    def release(self, backend: str) -> list[str]:
        """Stop ``backend``'s server: the session plan says the last check that uses it is done (the pool calls this,
        ``EnginePool.releasers``). A later checkout starts it again. Returns what stopped."""
        server = self.running.pop(backend, None)
        self.changed.discard(backend)
        if server is None:
            return []
        server.stop()
        return [f"kept {NAME} {backend}"]

    def close(self) -> None:
        for server in self.running.values():
            server.stop()
        self.running.clear()
        self.changed.clear()


def healthy(server: Any) -> bool:
    """Whether ``server`` runs and its ``/health`` answers 200."""
    import httpx

    if server.process.poll() is not None:
        return False
    try:
        return httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False
