"""Served twins: a ``servable`` check run again with every engine it compares reached through ``python -m
engine.serve`` (the ``served`` variant of its ``reach`` parameter; ``-m served`` selects them, ``-m "not served"``
leaves them out).

A :class:`ServedTwin` stands in for the in-process engine: ``generate`` runs the call in-process *and* through the
server (``/infer/`` with the engine extension for options, stop policy, plugins and guard), asserts the two agree field
by field (trigger flags from the envelope against the in-process meta included), and hands the check the served
results. Everything else (tokenizer, config, backend) is the in-process engine's. A call the engine refuses must
be refused by the server too (HTTP 400). Plugins given as Python objects, and rows that carry their own seed
(``ChatRequest.seed``: ``/infer/`` has no field for it), cannot travel over HTTP: such calls run in-process only
(a row's LoRA adapter travels, as swift's ``adapter_request``); a served twin none of whose calls reached a server
fails (see the ``reach`` fixture), so only checks that travel are marked ``servable``.

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
import time
from collections.abc import Callable
from typing import Any

from conformance.compare import assert_served_equal
from conformance.kit.outputs import OutputRecord
from engine.errors import EngineError
from engine.types import ChatRequest

IN_PROCESS, SERVED = "in-process", "served"
"""The two ways a check reaches a pooled engine (the ``reach`` parameter of ``servable`` checks)."""


REPLAY_CONCURRENCY = 8
"""Calls a served twin's replay keeps in flight at once (its servers batch them as they would any clients').
The replay is off unless ``ENGINE_TWIN_REPLAY=1``: measured on test_stop.py (all three backends, one run each, the
machine to itself), its 17 twins took 177 s with it against 134 s without (every call asked when made)."""



def replay_on() -> bool:
    """Whether served twins replay their in-process calls (``ENGINE_TWIN_REPLAY=1``; off by default)."""
    import os

    return os.environ.get("ENGINE_TWIN_REPLAY", "0") == "1"

@dataclasses.dataclass
class Reach:
    """How the running check reaches the pool's engines (``how``, set per check by the ``reach`` fixture), and the
    calls served twins answered through a server (``served_calls``: the fixture checks that a served twin really
    reached one). The engine pool hands this one object to every twin it makes.

    It also keeps each servable check's script: the calls its in-process variant made on twins that have a server
    (``check`` names the running check without its reach). With ``ENGINE_TWIN_REPLAY=1``, when the check's served
    variant starts, :meth:`replay` sends all of them to their servers at once, in the background; each twin's
    ``generate`` then takes the answer to its call from there (and asserts it equal to the in-process one, call by
    call, as before). A call the served variant makes that its in-process one did not is sent when it is made.

    >>> reach = Reach()
    >>> reach.how, reach.served
    ('in-process', False)
    """

    how: str = IN_PROCESS
    served_calls: int = 0
    record: OutputRecord = dataclasses.field(default_factory=OutputRecord)
    """What every twin's calls got, for the run's outputs record (``conformance/kit/outputs.py``)."""
    check: str = ""
    scripts: dict[str, list[tuple[Any, Any, dict[str, Any], str]]] = dataclasses.field(default_factory=dict)
    """check -> (twin, requests, extension, call key) of each call its in-process variant made, in order."""
    replayed: dict[tuple[int, str], Any] = dataclasses.field(default_factory=dict)
    """(id of the twin, call key) -> the future of the served answer, for the running served variant."""
    _executor: Any = None

    @property
    def served(self) -> bool:
        return self.how == SERVED

    def note(self, twin: Any, requests: Any, extension: dict[str, Any], call: str) -> None:
        """An in-process variant's call on a twin that has a server: the served variant's script (kept for servable
        checks only, those the ``reach`` fixture names in ``check``, and only while the replay is on)."""
        if self.check and replay_on():
            self.scripts.setdefault(self.check, []).append((twin, requests, extension, call))

    def replay(self) -> int:
        """Send the running check's script to its servers, all calls at once (each twin's server started here, in
        this thread, first). Returns how many calls were sent."""
        from concurrent.futures import ThreadPoolExecutor

        self.replayed.clear()
        script = self.scripts.pop(self.check, [])
        if not script or not replay_on():
            return 0
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=REPLAY_CONCURRENCY, thread_name_prefix="twin-replay")
        servers = {id(twin): twin.server() for twin, *_ in script}  # started here, one after another
        for twin, requests, extension, call in script:
            server = servers[id(twin)]
            if (id(twin), call) in self.replayed or server.process.poll() is not None:
                continue  # asked twice, or its server was stopped by a later one of its backend: asked when made
            self.replayed[(id(twin), call)] = self._executor.submit(twin.ask_server, server.url, requests, extension)
        return len(self.replayed)

    def settle(self) -> None:
        """The end of a served variant: answers nobody took are waited for (so no request outlives its check)."""
        for future in self.replayed.values():
            future.exception()
        self.replayed.clear()

    def close(self) -> None:
        self.settle()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except TypeError:
        return False
    return True


def _adapter(adapter: str | None) -> dict[str, Any]:
    """The ``adapter`` keyword where a call names one (an engine without adapters, or a stand-in, never sees it)."""
    return {} if adapter is None else {"adapter": adapter}


def _travels(request: Any) -> bool:
    """Whether a row travels over ``/infer/``: messages, or a ``ChatRequest`` of messages and an adapter (its own seed
    has no ``/infer/`` field, so such a call runs in process only, under either reach).

    >>> _travels([{"role": "user", "content": "Hi"}]), _travels(ChatRequest(({"role": "user", "content": "Hi"},),
    ...                                                                      seed=3))
    (True, False)
    """
    return not isinstance(request, ChatRequest) or dataclasses.replace(request, adapter=None) == ChatRequest(
        request.messages)


def _row(request: Any, adapter: str | None) -> tuple[str | None, Any]:
    """(the row's adapter, what ``/infer/`` sends of it): a ``ChatRequest`` travels as its messages and its adapter
    (``adapter_request``); its other fields have no ``/infer/`` field and fail here by name."""
    if not isinstance(request, ChatRequest):
        return adapter, request
    assert _travels(request), f"only a ChatRequest's messages and adapter travel over /infer/, got {request}"
    return request.adapter or adapter, list(request.messages)


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


class ServedTwin:
    """The in-process engine plus its served twin, reached as ``reach`` says (module doc).

    Example (the engine pool makes them)::

        twin = ServedTwin(engine, lambda: servers.server(key, config), pool.reach)
        twin.generate(requests)  # in-process; under the served reach through the server too, compared
    """

    def __init__(self, local: Any, server: Callable[[], Any] | None, reach: Reach, *,
                 guard: dict[str, Any] | None = None, subject: str = "") -> None:
        self.local = local
        self.subject = subject or local.backend.name
        """The engine as the outputs record names it (``OutputRecord``): backend, model, sections."""
        self._rendered: dict[str, tuple[list[str], list[str]]] = {}
        """Rendered prompts and how their rows draw, by call, for the record (once per call, whichever reach asked
        it)."""
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

    def generate(self, requests: Any, *, options: Any = None, stop: Any = None, plugins: Any = None,
                 adapter: str | None = None) -> Any:
        """The check's call: in-process, or through the server as well (module doc); recorded either way.
        ``adapter``: the call's LoRA adapter (rows may name their own: ``ChatRequest.adapter``)."""
        extension = {k: _plain(v) for k, v in (("options", options), ("stop", stop), ("plugins", plugins),
                                               ("adapter", adapter)) if v is not None}
        plain = [_plain(r) if isinstance(r, ChatRequest) else r for r in requests]  # a row's own adapter or seed
        call = json.dumps([plain, extension], sort_keys=True) if _jsonable([plain, extension]) else None
        record = self._reach.record
        subject = self.subject + (" served" if self._reach.served and self._server is not None and call else "")
        try:
            results = self._generate(requests, extension, call, options=options, stop=stop, plugins=plugins,
                                     adapter=adapter, travels=all(map(_travels, requests)))
        except EngineError as err:
            if call is not None:
                record.saw(subject, plain, extension, error=err)
            raise
        if record.enabled and call is not None:
            began = time.perf_counter()
            rendered, sampling = self.prepared(call, requests, options=options, stop=stop, plugins=plugins,
                                               **_adapter(adapter))
            record.saw(subject, plain, extension, results=results, rendered=rendered, sampling=sampling)
            record.seconds += time.perf_counter() - began
        return results

    def generate_vlm(self, requests: Any, **kwargs: Any) -> Any:
        """Image requests, in-process only (the served engine takes text); recorded as ``generate``'s calls are,
        each image as the digest of its pixels (``outputs.stable``)."""
        record = self._reach.record
        call = {k: _plain(v) for k, v in kwargs.items() if v is not None}
        try:
            results = self.local.generate_vlm(requests, **kwargs)
        except EngineError as err:
            record.saw(self.subject, requests, call, error=err)
            raise
        if record.enabled:
            began = time.perf_counter()
            record.saw(self.subject, requests, call, results=results, rendered=self.rendered_vlm(requests),
                       sampling=self.draws(kwargs.get("options"), [None] * len(requests)))
            record.seconds += time.perf_counter() - began
        return results

    def rendered_vlm(self, requests: Any) -> list[str]:
        """Image requests' rendered prompts, as the engine renders them (its processor's chat template)."""
        from engine.templates import render_prompt
        from engine.vision import VisionRequest

        local = self.local
        return [render_prompt(local.processor, VisionRequest.of(r, index=i).messages, tokenizer=local.tokenizer).text
                for i, r in enumerate(requests)]

    def prepared(self, call: str, requests: Any, **kwargs: Any) -> tuple[list[str] | None, list[str] | None]:
        """The call's rendered prompts (the engine's own ``prepare``) and how each row draws (``greedy``, ``seeded``:
        the call, its request or the backend gives a seed; ``unseeded``: another answer every run, which the
        comparison does not hold to the last one), once per call."""
        if call not in self._rendered:
            try:
                rendered, _ = self.local.prepare(requests, **kwargs)
            except EngineError:
                return None, None
            self._rendered[call] = ([r.text for r in rendered],
                                    self.draws(kwargs.get("options"), [r.seed for r in rendered]))
        return self._rendered[call]

    def draws(self, options: Any, row_seeds: list[int | None]) -> list[str]:
        """How each row of a call with ``options`` draws: ``greedy``, ``seeded`` (the call, the row's request or the
        backend gives a seed) or ``unseeded``; read from the options asked, before a portable seed is drawn."""
        asked = self.local.config.generation.merged(options)
        seeded = asked.seed is not None or getattr(self.local.backend, "default_seed", None) is not None
        return ["greedy" if asked.is_greedy else "seeded" if seeded or own is not None else "unseeded"
                for own in row_seeds]

    def _generate(self, requests: Any, extension: dict[str, Any], call: str | None, *, options: Any, stop: Any,
                  plugins: Any, adapter: str | None = None, travels: bool = True) -> Any:
        """The call in process, or (a served twin's call whose rows travel over ``/infer/``) through the server too,
        compared; ``travels`` False (a row with its own seed) keeps the call in process under either reach."""
        from engine.client import RolloutServerError

        if self._server is None and call in self._answers:  # a reference answers each call once per session
            return copy.deepcopy(self._answers[call])
        if not self._reach.served or call is None or not travels:
            if call is not None and self._server is not None:
                self._reach.note(self, requests, extension, call)
            results = self.local.generate(requests, options=options, stop=stop, plugins=plugins,
                                          **_adapter(adapter))
            if call is not None:
                self._answers[call] = copy.deepcopy(results)
            return results
        if self._server is None:  # a reference's first sight of this call, under the served reach
            results = self.local.generate(requests, options=options, stop=stop, plugins=plugins,
                                          **_adapter(adapter))
            self._answers[call] = copy.deepcopy(results)
            return results
        answer = self._served_answer(requests, extension, call)
        try:
            local = self._answers.get(call) or self.local.generate(requests, options=options, stop=stop,
                                                                     plugins=plugins, **_adapter(adapter))
        except EngineError as err:
            try:
                answer.result()
            except RolloutServerError as served_err:
                assert "answered 400" in str(served_err), f"served refusal is not a 400: {served_err}"
                self._reach.served_calls += 1
                raise err from None
            raise AssertionError(f"in-process refused ({err}) but the server generated") from err
        served = answer.result()
        self._reach.served_calls += 1
        assert_served_equal(served, local, what=f"served vs in-process ({self.local.backend.name})")
        return served

    def _served_answer(self, requests: Any, extension: dict[str, Any], call: str) -> Any:
        """The server's answer to ``call`` as a finished future: the replay's (``Reach.replay``), or asked now when
        no replay sent it or its request did not get an answer (its server stopped meanwhile: asked again once)."""
        from engine.client import RolloutServerError

        replayed = self._reach.replayed.pop((id(self), call), None)
        if replayed is not None:
            err = replayed.exception()
            if err is None or (isinstance(err, RolloutServerError) and "answered 4" in str(err)):
                return replayed
        return self._ask_now(requests, extension)

    def _ask_now(self, requests: Any, extension: dict[str, Any]) -> Any:
        """The served answer to a call no replay sent, as a finished future (its error raised by ``result()``)."""
        from concurrent.futures import Future

        answer: Future[Any] = Future()
        try:
            answer.set_result(self.ask_server(self._server().url, requests, extension))
        except Exception as err:  # handed to the caller through result(), as a replayed one is
            answer.set_exception(err)
        return answer

    def ask_server(self, url: str, requests: Any, extension: dict[str, Any]) -> Any:
        """One call through ``/infer/`` (with the engine's guard where the server was started without it); safe to
        run from a replay thread (a client of its own). ``/infer/`` takes one adapter per call (swift's
        ``adapter_request``): a call whose rows name different adapters is sent as one ``/infer/`` per adapter, all
        at once (the server batches them as it would concurrent clients), and the rows put back in order."""
        from concurrent.futures import ThreadPoolExecutor

        from engine.adapters import by_adapter
        from engine.client import RolloutClient

        learner = None if self._guard is not None else self.local.config.repeat_terminate
        if self._guard is not None:
            extension = {**extension, "repeat_terminate": self._guard}
        called = extension.get("adapter")
        extension = {k: v for k, v in extension.items() if k != "adapter"}
        rows = [_row(r, called) for r in requests]
        groups = by_adapter([adapter for adapter, _ in rows])
        with RolloutClient(url, repeat_terminate=learner, batch_size=10_000, health_timeout=30) as client:
            if len(groups) == 1:
                return client.infer([messages for _, messages in rows], engine=extension, adapter=groups[0][0])
            with ThreadPoolExecutor(len(groups)) as threads:
                parts = list(threads.map(lambda g: client.infer([rows[i][1] for i in g[1]], engine=extension,
                                                                adapter=g[0]), groups))
        out: list[Any] = [None] * len(rows)
        for (_, indices), part in zip(groups, parts, strict=True):
            for i, result in zip(indices, part, strict=True):
                out[i] = result
        return out


def scrape(url: str, name: str, **labels: str) -> float:
    """The sum of the ``name`` samples of a server's ``/metrics`` whose labels include ``labels``, read with
    ``prometheus_client``'s own parser (a malformed exposition fails here)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())
