"""Served twins: a ``servable`` check run again with every engine it compares reached through ``python -m
engine.serve`` (the ``served`` variant of its ``reach`` parameter; ``-m served`` selects them, ``-m "not served"``
leaves them out).

A :class:`ServedTwin` stands in for the in-process engine: ``generate`` runs the call in-process *and* through the
server (``/infer/`` with the engine extension for options, stop policy, plugins and guard), asserts the two agree field
by field (trigger flags from the envelope against the in-process meta included), and hands the check the served
results. Everything else (tokenizer, config, backend) is the in-process engine's. A call the engine refuses must
be refused by the server too (HTTP 400). Plugins given as Python objects cannot travel over HTTP: such calls run
in-process only; a served twin none of whose calls reached a server fails (see the ``reach`` fixture), so only
checks that travel are marked ``servable``.

The in-process answer a served call is compared with is the one the check's in-process variant got for the same
call (remembered per engine, keyed by the call's JSON); a call not seen in-process is generated in-process then.
References (``pool.reference``: engines a check derives expectations from, never served) answer each distinct call
once per session, whatever the reach, and repeat that answer afterwards: an expectation is derived once (the real-loop
check's two guards, for example, read the same unguarded rows), never re-generated per check or per variant.
The servable checks make deterministic calls only (greedy, or sampled with a seed, which ``test_sampling.py``
shows reproduces), so this compares the same two answers as generating both at once, at half the cost.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from typing import Any

from conformance.compare import assert_served_equal
from engine.errors import EngineError

IN_PROCESS, SERVED = "in-process", "served"
"""The two ways a check reaches a pooled engine (the ``reach`` parameter of ``servable`` checks)."""


@dataclasses.dataclass
class Reach:
    """How the running check reaches the pool's engines (``how``, set per check by the ``reach`` fixture), and the
    calls served twins answered through a server (``served_calls``: the fixture checks that a served twin really
    reached one). The engine pool hands this one object to every twin it makes.

    >>> reach = Reach()
    >>> reach.how, reach.served
    ('in-process', False)
    """

    how: str = IN_PROCESS
    served_calls: int = 0

    @property
    def served(self) -> bool:
        return self.how == SERVED


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except TypeError:
        return False
    return True


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


class ServedTwin:
    """The in-process engine plus its served twin, reached as ``reach`` says (module doc).

    Example (the engine pool makes them)::

        twin = ServedTwin(engine, lambda: servers.server(key, config), pool.reach)
        twin.generate(requests)  # in-process; under the served reach through the server too, compared
    """

    def __init__(self, local: Any, server: Callable[[], Any] | None, reach: Reach, *,
                 guard: dict[str, Any] | None = None) -> None:
        self.local = local
        self._server = server
        """The running server (started on first need); None for a reference, which is never served."""
        self._guard = guard
        """The in-process engine's repeat guard, sent with every served call (``engine.repeat_terminate``) to a
        server started without one; None: the server's own guard is the engine's."""
        self._reach = reach
        """Says the current reach and counts calls that reached a server."""
        self._answers: dict[str, Any] = {}
        """In-process results by call (its JSON), for the served twin of the same check."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    def server(self) -> Any:
        """The twin's running server (started on first need), for a check that drives it with a client of its own."""
        assert self._server is not None, "a reference has no server"
        return self._server()

    def generate(self, requests: Any, *, options: Any = None, stop: Any = None, plugins: Any = None) -> Any:
        from engine.client import RolloutClient, RolloutServerError

        extension = {k: _plain(v) for k, v in (("options", options), ("stop", stop), ("plugins", plugins))
                     if v is not None}
        call = json.dumps([requests, extension], sort_keys=True) if _jsonable([requests, extension]) else None
        if self._server is None and call in self._answers:  # a reference answers each call once per session
            return copy.deepcopy(self._answers[call])
        if not self._reach.served or call is None:
            results = self.local.generate(requests, options=options, stop=stop, plugins=plugins)
            if call is not None:
                self._answers[call] = copy.deepcopy(results)
            return results
        if self._server is None:  # a reference's first sight of this call, under the served reach
            results = self.local.generate(requests, options=options, stop=stop, plugins=plugins)
            self._answers[call] = copy.deepcopy(results)
            return results
        learner = None if self._guard is not None else self.local.config.repeat_terminate
        client = RolloutClient(self._server().url, repeat_terminate=learner, batch_size=10_000, health_timeout=30)
        if self._guard is not None:
            extension = {**extension, "repeat_terminate": self._guard}
        with client:
            try:
                local = self._answers.get(call) or self.local.generate(requests, options=options, stop=stop,
                                                                         plugins=plugins)
            except EngineError as err:
                try:
                    client.infer(requests, engine=extension)
                except RolloutServerError as served_err:
                    assert "answered 400" in str(served_err), f"served refusal is not a 400: {served_err}"
                    self._reach.served_calls += 1
                    raise err from None
                raise AssertionError(f"in-process refused ({err}) but the server generated") from err
            served = client.infer(requests, engine=extension)
        self._reach.served_calls += 1
        assert_served_equal(served, local, what=f"served vs in-process ({self.local.backend.name})")
        return served


def scrape(url: str, name: str, **labels: str) -> float:
    """The sum of the ``name`` samples of a server's ``/metrics`` whose labels include ``labels``, read with
    ``prometheus_client``'s own parser (a malformed exposition fails here)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())
