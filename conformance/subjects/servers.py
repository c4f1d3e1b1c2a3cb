"""The conformance session's servers (``python -m engine.serve``), beside the engine pool
(``conformance/subjects/pool.py``): one server per served config key, started on first need, ``servers_per_backend`` of
each backend alive at once (the least recently used one stops first) beside the HF and llama.cpp text servers, which
stay up (``KEPT_TEXT_SERVERS``), the same server of every other backend started ahead in the background.

The engine pool asks it for the server of an engine (``served_config`` names it); the served twins reach it through
the callable the engine pool hands them (``conformance/subjects/served.py``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.subjects.bill import Bill
from engine.backends.registry import SPECS

SERVED_CHAT = {"temperature": 0, "top_p": 1.0}
"""Pattern C ``/chat`` defaults of every server the pool starts: greedy (its other defaults kept), so HF, vLLM and
llama.cpp must agree to the character. The chat checks use the text engine's server the served twins use too."""

KEPT_TEXT_SERVERS = ("hf", "llamacpp")
"""Backends whose text server (``--engine-model`` with the pool's defaults: the chat, target and hostile checks' and
most twins') stays up beside their ``servers_per_backend`` others: about 1 GB each here. In the full gate at f320f65
every other served config of a backend stopped it: HF servers on SmolLM2 with no other section were started 10 times
and llama.cpp's 6 (processed-logprobs ones among them: the bill did not print model settings then). vLLM's (about 4
GB in two processes) still takes its turn."""

TINY_SERVERS_PER_BACKEND = {"hf": 2, "llamacpp": 2}
"""Backends whose servers of a tiny fixture (``tiny-looper``) take turns among themselves, that many at once, beside
the backend's full-size ones: about 0.6-0.7 GB each, and the looper's twins use two configs of it (the queued-batch
check sizes its own), which took turns with every other config of the backend (the HF looper server started twice in a
module run at 08abad4). vLLM's tiny servers keep taking turns with its full-size ones: one holds about 2 GB in two
processes here (a SmolLM2 one about 4 GB), and on a CUDA host each is a share of the card the engine pool reserved
for one server (``PoolOptions.gpu_vllm_engines``)."""

SERVED_TIMEOUTS = {"idle_connection_timeout_s": 3, "body_timeout_s": 5, "drain_timeout_s": 1}
"""Shorter than the defaults (10 s, 30 s, 30 s), so the hostile checks of silent connections and stalled bodies
(``conformance/test_hostile.py``) see them fire in seconds, and its SIGTERM check's long stream outlasts the drain of
the text server it is handed last (:meth:`ServerPool.hand_over`)."""


IDLE_STARTS = True
"""Servers started ahead (:meth:`ServerPool.prefetch`, the other backends' servers a check will need next) start at
Linux's ``SCHED_IDLE``: the pool's thread that starts one runs in the idle class and the server's processes inherit
it, so its imports and loading take a core only while the checks leave one idle. Started at the normal class beside
the first module's in-process generation, three text servers made ``test_batch_invariance.py`` take 132 s instead of
38 s in CI's quick tier (117871d): each side's OpenMP threads spun while the other held a core."""


def idle_thread() -> None:
    """Put the calling thread (and what it starts from now on) in the idle class, where Linux has one."""
    if IDLE_STARTS and hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def normal_priority(pid: int) -> int:
    """Every thread of ``pid`` and of the processes below it back in the normal class (``SCHED_OTHER``); returns how
    many threads moved. A thread that ended meanwhile, or a class this user may not raise, is left as it is.

    >>> normal_priority(os.getpid()) >= 0
    True
    """
    if not hasattr(os, "SCHED_IDLE"):
        return 0
    below: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            below.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    moved, todo = 0, [pid]
    while todo:
        process = todo.pop()
        todo.extend(below.get(process, ()))
        for task in Path(f"/proc/{process}/task").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                if os.sched_getscheduler(int(task.name)) == os.SCHED_IDLE:
                    os.sched_setscheduler(int(task.name), os.SCHED_OTHER, os.sched_param(0))
                    moved += 1
    return moved


def raise_priority(server: Any) -> None:
    """:func:`normal_priority` for a server handle (``ServerProcess``; one without a pid is left alone)."""
    pid = getattr(server.process, "pid", None)
    if isinstance(pid, int):
        normal_priority(pid)


@dataclass
class ServerPool:
    """Session-wide servers keyed by (backend, served config).

    Example (the engine pool builds it)::

        servers = ServerPool(options, configure=engine_pool.config, bill=engine_pool.bill)
        server = servers.server(*servers.served_config("hf", model))
    """

    options: Any
    """The session's ``PoolOptions`` (its ``model``, ``servers_per_backend``)."""
    configure: Callable[..., dict[str, Any]]
    """``configure(backend, model, **sections)``: the engine config the in-process engine gets."""
    bill: Bill
    ahead_backends: frozenset[str] = frozenset()
    """Backends whose servers may be started ahead (see :meth:`server`): those the collected checks reach (the
    conftest sets it); empty, every server starts when a check first needs it."""
    ahead_for: frozenset[str] | None = None
    """The backends the running check's other variants run on after it (the reach fixture sets it per check): only
    their servers start ahead; None (a cross-backend check, or no check running) leaves ``ahead_backends`` whole."""
    _servers: dict[tuple[str, str], Any] = field(default_factory=dict)
    _ahead: dict[tuple[str, str], Any] = field(default_factory=dict)
    """Servers starting ahead in the background, by key: (future of the running server, its config)."""
    _starting: dict[tuple[str, str], Any] = field(default_factory=dict)
    """Servers starting ahead whose process exists, by key (``launch_server``'s ``on_start``): whose priority
    :meth:`_settle` raises."""
    _unused: set[tuple[str, str]] = field(default_factory=set)
    """Servers started ahead that no check has asked for yet."""
    wrong_guesses: set[tuple[str, str]] = field(default_factory=set)
    """Servers started ahead and stopped before any check asked for them: never started ahead again (a check that
    sizes each backend its own way, as the processed-logprobs checks do for vLLM, made every guess from another
    backend's config wrong: in a module run at 124a183 its servers started 30 times, 889 s of its twins)."""
    _executor: Any = None
    """The threads that start them (made on first need, shut down by :meth:`close`)."""
    _recipes: dict[tuple[str, str], tuple[str, dict[str, Any]]] = field(default_factory=dict)
    """Server key -> (model, sections) of the engine it serves: what the same server is on another backend."""

    def served_config(self, backend: str, model: str, /, **sections: Any) -> tuple[tuple[str, str], dict[str, Any]]:
        """(server key, config) of the server that serves the engine ``engine(backend, model, **sections)``."""
        config = self.configure(backend, model, **sections)
        # A served vLLM engine always runs AsyncLLM, its engine core in a child process, whatever
        # vllm.multiprocessing says: engines that differ only there share one server. The suite's servers keep the
        # uniproc executor (false), not the served default: a multiprocess worker spins while idle, and the suite
        # keeps several servers alive on a few cores.
        config["vllm"] = {**config["vllm"], "multiprocessing": False}
        config["serve"] = {**SERVED_TIMEOUTS, "chat": dict(SERVED_CHAT), **config.get("serve", {}), "port": 0}
        key = (backend, json.dumps(config, sort_keys=True))
        self._recipes.setdefault(key, (model, copy.deepcopy(sections)))
        return key, config

    def server(self, key: tuple[str, str], config: dict[str, Any]) -> Any:
        """The running server for ``key`` ((backend, the served config)): started on first need; beyond
        ``servers_per_backend`` of its backend, the least recently used one stops first, to bound memory.

        Starting one also starts the same server of every other backend in ``ahead_backends`` in the background
        (a cross-backend check needs them now, and served twins run backend after backend on one config, see the
        conftest's order; for a per-backend check, only of the backends its later variants run on, ``ahead_for``): a
        vLLM server spends about 20 s importing in two processes, which then overlaps the other backends' work instead
        of adding to it."""
        from engine.client import launch_server

        self._unused.discard(key)
        model = self._recipes.get(key, ("",))[0]
        self.bill.used("server", (key[0], self._chosen(config)), model=model,
                       sections=self.beyond_defaults(config, model) if model else {})
        if key in self._servers:
            self._servers[key] = self._servers.pop(key)  # most recently used last
            return self._servers[key]
        if key in self._ahead:
            return self._settle(key)
        for other in [k for k in self._ahead if k[0] == key[0]]:  # this backend's guess was wrong: free its place
            self._settle(other)
            self.wrong_guesses.add(other)
        self._make_server_room(key)
        self._start_ahead(key)
        with self.bill.timed("server", (key[0], self._chosen(config))):
            self._servers[key] = launch_server(config)
        return self._servers[key]

    def prefetch(self, backend: str, model: str, /, **sections: Any) -> bool:
        """Start, in the background, the server a later check will ask for (the session plan's: the text server of
        every backend its checks reach, from the first check on), unless it is running or starting already, another
        of its backend is starting, or it would stop a running server to take its place (vLLM's take turns). The
        check that first asks for it settles it (:meth:`server`); returns whether it started one.

        A server's start is mostly single-threaded imports (vLLM's in two processes, about 40 s on CI) while the checks
        leave part of the two cores idle, so it overlaps them instead of adding to the check that first needs it."""
        import pytest

        try:
            key, config = self.served_config(backend, model, **sections)
        except pytest.skip.Exception:  # no model for it there (e.g. no GGUF twin): nothing to start
            return False
        if key in self._servers or key in self._ahead or key in self.wrong_guesses:
            return False
        if any(k[0] == backend for k in self._ahead) or self._would_stop(key):
            return False
        self._ahead[key] = (self._background().submit(self._launch_timed, key, config), config)
        self._unused.add(key)
        return True

    def hand_over(self, key: tuple[str, str], config: dict[str, Any]) -> Any:
        """The running server for ``key`` (started if need be, as :meth:`server`), no longer the pool's: a check that
        stops it (a signal, a kill) owns it and stops it; a later ask starts another. The session plan runs such a
        check (``ends_servers``) after every other user of the server, so none is started again for it.

        Example (``conformance/test_hostile.py``'s SIGTERM check; ``tests/test_served_twins.py`` holds it)::

            server = pool.servers.hand_over(*pool.servers.served_config(backend, pool.options.model))
        """
        server = self.server(key, config)
        self._servers.pop(key, None)
        self.bill.starts.append(("handed over", f"{key[0]} {self._chosen(config)}", 0.0))
        return server

    def release(self, backend: str, subject: Any, spare: Sequence[Any] = ()) -> list[str]:
        """Stop ``backend``'s servers that ``subject`` (a module's declared ``servers(...)``) names, running or starting
        ahead, but those a ``spare`` subject names (a later check's): the session plan says its last user is done
        (``conformance/subjects/plan.py::last_users``). A later ask starts one again. Returns each stopped server as
        the bill names it."""
        stopped = []
        for key in [k for k in (*self._servers, *self._ahead) if k[0] == backend]:
            model = self._recipes.get(key, ("",))[0]
            config = json.loads(key[1])
            role = self.bill.roles.of(model) if self.bill.roles is not None and model else model
            sections = self.beyond_defaults(config, model) if model else {}
            if not model or not subject.matches("server", role, sections):
                continue
            if any(other.matches("server", role, sections) for other in spare):
                continue
            if key in self._ahead:
                self._abandon(key)
            else:
                self._servers.pop(key).stop()
            self._unused.discard(key)
            stopped.append(f"server {backend} {self._chosen(config)}".rstrip())
        return stopped

    def beyond_defaults(self, config: dict[str, Any], model: str) -> dict[str, Any]:
        """The sections of a served ``config`` that differ from the pool's default server of ``model`` on its backend
        (the model section: its settings but the path): what a module declares a server by.

        >>> def configure(backend, path, /, model=None, vllm=None):
        ...     return {"backend": backend, "model": {"path": path, **(model or {})},
        ...             "vllm": vllm or {"max_num_seqs": 16}}
        >>> servers = ServerPool(None, configure=configure, bill=Bill())
        >>> _, config = servers.served_config("vllm", "/m", vllm={"max_num_seqs": 4}, model={"logprobs_mode": "x"})
        >>> servers.beyond_defaults(config, "/m")
        {'model': {'logprobs_mode': 'x'}, 'vllm': {'max_num_seqs': 4, 'multiprocessing': False}}
        """
        _, default = self.served_config(config["backend"], model)
        out = {k: v for k, v in config.items() if k not in ("backend", "model") and v != default.get(k)}
        settings = {k: v for k, v in config["model"].items() if k != "path" and v != default["model"].get(k)}
        if settings:
            out["model"] = settings
        return dict(sorted(out.items()))

    def _would_stop(self, new: tuple[str, str]) -> bool:
        """Whether starting ``new`` now would stop a running server (:meth:`_make_server_room`)."""
        turns, budget = self._turns_with(new)
        return sum(turns(k) for k in self._servers) >= budget

    def _turns_with(self, new: tuple[str, str]) -> tuple[Callable[[tuple[str, str]], bool], int]:
        """Which servers take turns with ``new``, and how many of them may run at once."""
        place = self._place(new)
        budget = TINY_SERVERS_PER_BACKEND[new[0]] if place == "tiny" else self.options.servers_per_backend

        def turns(key: tuple[str, str]) -> bool:
            return self._takes_turns(key, new[0]) and self._place(key) == place

        return turns, budget

    def _make_server_room(self, new: tuple[str, str]) -> None:
        """Stop the least recently used servers that take turns with ``new`` until it has its place: those of its
        backend and, on the backends of ``TINY_SERVERS_PER_BACKEND``, of its size (a tiny fixture's server takes
        turns with the tiny ones there; every other with ``servers_per_backend`` others)."""
        turns, budget = self._turns_with(new)
        while sum(turns(k) for k in self._servers) >= budget:
            # Stopped before the next one starts: two vLLM servers of SmolLM2 at once would hold ~8 GB.
            doomed = next(k for k in self._servers if turns(k))
            if doomed in self._unused:  # started ahead for nobody
                self.wrong_guesses.add(doomed)
                self._unused.discard(doomed)
            self._servers.pop(doomed).stop()

    def _place(self, key: tuple[str, str]) -> str:
        """The places ``key`` takes turns for: ``tiny`` (a tiny fixture's server, on a backend of
        ``TINY_SERVERS_PER_BACKEND``: the engine pool gives its vLLM engines the tiny KV cache), else ``full``."""
        from conformance.subjects.pool import TINY_KV_GIB, kv_cache_gib

        model = self._recipes.get(key, ("",))[0]
        tiny = key[0] in TINY_SERVERS_PER_BACKEND and bool(model) and kv_cache_gib(model) == TINY_KV_GIB
        return "tiny" if tiny else "full"

    def _takes_turns(self, key: tuple[str, str], backend: str) -> bool:
        """Whether ``key`` is a server of ``backend`` that a new one of that backend may stop (all but a kept text
        server, ``KEPT_TEXT_SERVERS``)."""
        import pytest

        if key[0] != backend:
            return False
        if backend not in KEPT_TEXT_SERVERS:
            return True
        try:
            return key != self.served_config(backend, self.options.model)[0]
        except pytest.skip.Exception:  # no model of it on this backend: there is no text server to keep
            return True

    def _start_ahead(self, key: tuple[str, str]) -> None:
        """Start, in the background, the server of every other backend in ``ahead_backends`` that serves the same
        (model, sections) as ``key``, unless one of that backend is already starting."""
        import pytest

        if key not in self._recipes:
            return
        model, sections = self._recipes[key]
        wanted = self.ahead_backends if self.ahead_for is None else self.ahead_backends & self.ahead_for
        for backend in sorted(wanted - {key[0]}):
            if any(k[0] == backend for k in self._ahead):
                continue
            try:
                other, config = self.served_config(backend, model, **copy.deepcopy(sections))
            except pytest.skip.Exception:  # no model for it there (e.g. no GGUF twin): nothing to start
                continue
            if other in self._servers or other in self.wrong_guesses:
                continue
            self._make_server_room(other)
            self._ahead[other] = (self._background().submit(self._launch_timed, other, config), config)
            self._unused.add(other)

    def _launch_timed(self, key: tuple[str, str], config: dict[str, Any]) -> Any:
        """Start ``key``'s server from a background thread at ``SCHED_IDLE`` (:data:`IDLE_STARTS`)."""
        from engine.client import launch_server

        idle_thread()
        with self.bill.timed("server ahead", (key[0], self._chosen(config))):
            return launch_server(config, on_start=lambda handle: self._starting.__setitem__(key, handle))

    def _settle(self, key: tuple[str, str]) -> Any:
        """Wait for a server started ahead and keep it as a running one, at normal priority from now on: a check
        needs it (its start, if still going, then takes the cores the waiting check leaves)."""
        future, config = self._ahead.pop(key)
        began = time.monotonic()
        if key in self._starting:
            raise_priority(self._starting[key])
        server = future.result()  # its own start error, raised where the check needs it
        self._starting.pop(key, None)
        raise_priority(server)  # the threads and processes it made since
        self.bill.starts.append(("waited for", f"{key[0]} {self._chosen(config)}", time.monotonic() - began))
        self._make_server_room(key)
        self._servers[key] = server
        return server

    def _abandon(self, key: tuple[str, str]) -> dict[str, Any]:
        """Stop a server started ahead that no check needs any more: one still starting is terminated, not waited
        for only to be stopped (its start error fails nothing: no check needs it). Returns its config."""
        future, config = self._ahead.pop(key)
        starting = self._starting.pop(key, None)
        if starting is not None and starting.process.poll() is None:
            starting.process.terminate()
        with contextlib.suppress(Exception):
            future.result().stop()
        return config

    def _background(self) -> Any:
        from concurrent.futures import ThreadPoolExecutor

        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=len(SPECS), thread_name_prefix="server-ahead")
        return self._executor

    def _chosen(self, config: dict[str, Any]) -> str:
        """A served config in a report line: the model folder's name and every section that differs from the pool's
        defaults for it."""
        _, default = self.served_config(config["backend"], self.options.model)
        chosen = {k: v for k, v in config.items() if k not in ("backend", "model") and v != default.get(k)}
        model = {k: v for k, v in config["model"].items() if k != "path" and v != default["model"].get(k)}
        if model:  # e.g. a processed-logprobs server's mode
            chosen["model"] = model
        return f"{config['model']['path'].rsplit('/', 1)[-1]} {json.dumps(chosen, sort_keys=True) if chosen else ''}"

    def close(self) -> None:
        for key in list(self._ahead):  # started ahead and never needed: stopped with the rest, and billed as such
            config = self._abandon(key)
            self.bill.starts.append(("ahead, unused", f"{key[0]} {self._chosen(config)}", 0.0))
        if self._executor is not None:
            self._executor.shutdown()
        servers = list(self._servers.values())
        for server in servers:  # all drain at once
            if server.process.poll() is None:
                server.process.terminate()
        for server in servers:
            server.stop()
        self._servers.clear()
