"""The learner side of the rollout server: check the guard's activation, post batches, read the envelope.

``RolloutClient`` (threads) and ``AsyncRolloutClient`` (asyncio) wait for ``/health``, refuse a server whose
repeat guard does not match the learner's ``repeat_terminate`` subtree, post ``/infer/`` batches concurrently,
and return ``GenerationResult``s whose ``meta["repeat_terminate_triggered"]`` is the envelope's per-sequence flag.
``audit`` builds the step's payload with :func:`engine.trainer.metrics.rollout_metrics` from those flags, never from
finish reasons. ``launch_server`` starts ``python -m engine.serve`` with the learner's subtree in its environment.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config.repeat import RepeatTerminateConfig
from engine.config.validation import build
from engine.errors import EngineError
from engine.serve.activation import ENV_JSON
from engine.serve.rollout.infer import result_from_item
from engine.serve.shared.auth import ENV_API_KEY
from engine.types import GenerationResult

HEALTH_POLL_S = 0.5
"""Seconds between two polls of ``/health`` while a server starts."""


class RolloutServerError(EngineError):
    """The rollout server answered with an error, could not be reached, or does not match the learner."""


def check_activation(learner: Mapping[str, Any] | RepeatTerminateConfig | None, health: Mapping[str, Any]) -> None:
    """Refuse a server whose guard differs from the learner's subtree (None: the learner does not care).

    >>> cfg = RepeatTerminateConfig(enabled=True, max_consecutive_token_repeats=8)
    >>> check_activation(cfg, {"repeat_terminate_active": 1, "repeat_terminate_hash": cfg.fingerprint()})
    >>> check_activation(cfg, {"repeat_terminate_active": 0, "repeat_terminate_hash": "ab12"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.serve.rollout.client.RolloutServerError: the learner's repeat_terminate is enabled (hash ...) but \
the server's guard is inactive (hash ab12)...
    """
    if learner is None:
        return
    mine = learner if isinstance(learner, RepeatTerminateConfig) else build(RepeatTerminateConfig, learner,
                                                                            "repeat_terminate")
    theirs, active = health.get("repeat_terminate_hash"), int(health.get("repeat_terminate_active", 0))
    fix = ("start the server with the learner's subtree (launch_server(..., repeat_terminate=...), "
           f"{ENV_JSON}, or --repeat-terminate-from train.yaml:<dotted.path>)")
    if mine.enabled and not active:
        raise RolloutServerError(f"the learner's repeat_terminate is enabled (hash {mine.fingerprint()[:12]}) but "
                                 f"the server's guard is inactive (hash {str(theirs)[:12]}). Fix: {fix}")
    if mine.fingerprint() != theirs:
        raise RolloutServerError(f"the learner's repeat_terminate (hash {mine.fingerprint()[:12]}: "
                                 f"{json.dumps(mine.as_dict())}) differs from the server's (hash {str(theirs)[:12]}: "
                                 f"{json.dumps(health.get('repeat_terminate'))}). Fix: {fix}")


def _body(requests: Sequence[Any], request_config: Mapping[str, Any] | None,
          engine: Mapping[str, Any] | None, adapter: str | None = None) -> dict[str, Any]:
    items = [{"messages": list(r)} if not isinstance(r, Mapping) else dict(r) for r in requests]
    config = {**(request_config or {}), "return_details": True}
    body: dict[str, Any] = {"infer_requests": items, "request_config": config}
    if engine:
        body["engine"] = dict(engine)
    if adapter is not None:  # swift's AdapterRequest; the server reads its name (a loaded adapter)
        body["adapter_request"] = {"name": adapter, "path": ""}
    return body


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class _Base:
    def __init__(self, base_url: str, *, repeat_terminate: Mapping[str, Any] | RepeatTerminateConfig | None = None,
                 namespace: str = "coordexp", batch_size: int = 16, max_concurrency: int = 8,
                 timeout: float = 600.0, health_timeout: float = 240.0, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
        """Sent with every request: the server's API key (``engine.serve.shared.auth``), when it has one."""
        self.repeat_terminate = repeat_terminate
        self.namespace = namespace
        self.batch_size = batch_size
        self.max_concurrency = max_concurrency
        self.timeout = timeout
        self.health_timeout = health_timeout
        self.health: dict[str, Any] | None = None

    def _accept(self, health: dict[str, Any]) -> dict[str, Any]:
        check_activation(self.repeat_terminate, health)
        if health.get("namespace") != self.namespace:
            raise RolloutServerError(f"the server's envelope namespace is {health.get('namespace')!r}, the learner "
                                     f"reads {self.namespace!r}. Fix: set serve.namespace or the client's namespace")
        self.health = health
        return health

    def _polled(self, answer: Any, deadline: float) -> dict[str, Any] | None:
        """One poll of ``/health`` (``answer``: its response, None when unreachable): the accepted health once it
        answers 200 (the guard's activation checked), None to poll again, past ``deadline`` the error."""
        if answer is not None and answer.status_code == 200:
            return self._accept(answer.json())
        if time.monotonic() > deadline:
            raise RolloutServerError(f"{self.base_url}/health did not answer within {self.health_timeout}s")
        return None

    def _parse(self, response: Any) -> list[GenerationResult]:
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except Exception:
                message = response.text[:500]
            raise RolloutServerError(f"/infer/ answered {response.status_code}: {message}")
        return [result_from_item(item, self.namespace) for item in response.json()]

    def audit(self, results: Sequence[GenerationResult], *, seconds: float = 0.0,
              dropped_invalid: int = 0) -> dict[str, float]:
        """The step's audit payload from the envelope flags (call ``aggregate`` on it across ranks)."""
        from engine.trainer.metrics import rollout_metrics

        active = bool(self.health and self.health.get("repeat_terminate_active"))
        return rollout_metrics(results, guard_active=active, dropped_invalid=dropped_invalid, seconds=seconds)


class RolloutClient(_Base):
    """Blocking client; batches are posted concurrently from a thread pool.

    Example (a server running; see ``launch_server``)::

        with RolloutClient(url, repeat_terminate=train_cfg["custom"]["repeat_terminate"]) as client:
            client.wait_ready()                      # refuses a server whose guard differs
            results = client.infer([[{"role": "user", "content": "Hi"}]] * 64, {"max_tokens": 64})
            payload = client.audit(results)
    """

    def __init__(self, base_url: str, **kwargs: Any) -> None:
        import httpx

        super().__init__(base_url, **kwargs)
        self._http = httpx.Client(timeout=httpx.Timeout(self.timeout, connect=5.0), headers=self.headers)

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def wait_ready(self) -> dict[str, Any]:
        """Poll ``/health`` until it answers (or ``health_timeout``), then check the guard's activation."""
        import httpx

        deadline = time.monotonic() + self.health_timeout
        while True:
            try:
                answer = self._http.get(f"{self.base_url}/health", timeout=5.0)
            except httpx.TransportError:
                answer = None
            if (health := self._polled(answer, deadline)) is not None:
                return health
            time.sleep(HEALTH_POLL_S)

    def _post(self, body: dict[str, Any]) -> list[GenerationResult]:
        import httpx

        try:
            return self._parse(self._http.post(f"{self.base_url}/infer/", json=body))
        except httpx.TransportError as err:
            raise RolloutServerError(f"{self.base_url}/infer/ failed: {type(err).__name__}: {err}") from err

    def infer(self, requests: Sequence[Any], request_config: Mapping[str, Any] | None = None, *,
              engine: Mapping[str, Any] | None = None, adapter: str | None = None) -> list[GenerationResult]:
        """One result per request (message lists, or swift ``infer_requests`` items), in order; ``adapter``: a
        LoRA adapter the server loaded (swift's ``adapter_request``)."""
        if self.health is None:
            self.wait_ready()
        bodies = [_body(c, request_config, engine, adapter) for c in _chunks(requests, self.batch_size)]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, max(len(bodies), 1))) as pool:
            return [r for part in pool.map(self._post, bodies) for r in part]


class AsyncRolloutClient(_Base):
    """asyncio client; batches are posted concurrently (at most ``max_concurrency`` at once).

    Example::

        async with AsyncRolloutClient(url, repeat_terminate=subtree) as client:
            await client.wait_ready()
            results = await client.infer(prompts, {"max_tokens": 64})
    """

    def __init__(self, base_url: str, **kwargs: Any) -> None:
        import httpx

        super().__init__(base_url, **kwargs)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=5.0), headers=self.headers)

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def wait_ready(self) -> dict[str, Any]:
        """Poll ``/health`` until it answers (or ``health_timeout``), then check the guard's activation."""
        import httpx

        deadline = time.monotonic() + self.health_timeout
        while True:
            try:
                answer = await self._http.get(f"{self.base_url}/health", timeout=5.0)
            except httpx.TransportError:
                answer = None
            if (health := self._polled(answer, deadline)) is not None:
                return health
            await asyncio.sleep(HEALTH_POLL_S)

    async def infer(self, requests: Sequence[Any], request_config: Mapping[str, Any] | None = None, *,
                    engine: Mapping[str, Any] | None = None, adapter: str | None = None) -> list[GenerationResult]:
        import httpx

        if self.health is None:
            await self.wait_ready()
        gate = asyncio.Semaphore(self.max_concurrency)

        async def post(chunk: Sequence[Any]) -> list[GenerationResult]:
            async with gate:
                try:
                    r = await self._http.post(f"{self.base_url}/infer/",
                                              json=_body(chunk, request_config, engine, adapter))
                except httpx.TransportError as err:
                    raise RolloutServerError(f"{self.base_url}/infer/ failed: {type(err).__name__}: {err}") from err
                return self._parse(r)

        parts = await asyncio.gather(*(post(c) for c in _chunks(requests, self.batch_size)))
        return [r for part in parts for r in part]


@dataclass
class ServerProcess:
    """A ``python -m engine.serve`` child process; ``stop()`` (or leaving the ``with``) shuts it down gracefully and
    removes ``work``, the folder of its files (config, ready file, log, vLLM's IPC sockets), keeping the log's text for
    ``log()``: a learner that starts a server per run leaves nothing in the temp folder (the conformance gate left
    one folder per server start, and vLLM's sockets beside them, before)."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    work: Path | None = None
    """Removed once the process has stopped (None: nothing to remove)."""
    _log_text: str | None = field(default=None, init=False, repr=False)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.work is not None:
            self._log_text = self.log()
            shutil.rmtree(self.work, ignore_errors=True)
            self.work = None
        return int(self.process.returncode)

    def log(self) -> str:
        """The server's output so far (after ``stop()``, all of it)."""
        if self._log_text is not None:
            return self._log_text
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


IPC_PATH_ROOM = 107 - len("/") - 36
"""Longest folder vLLM's IPC sockets may go in: a Unix socket's path holds 107 bytes, and vLLM names each
``<VLLM_RPC_BASE_PATH>/<uuid4>`` (36 characters)."""


def vllm_sockets_in(work: Path) -> dict[str, str]:
    """The variable that puts a server's vLLM IPC sockets into ``work`` (removed at ``stop()``), where their paths
    fit; else nothing, and vLLM keeps its default (the temp folder).

    >>> vllm_sockets_in(Path("/tmp/engine-serve-abc")), vllm_sockets_in(Path("/" + "x" * 80))
    ({'VLLM_RPC_BASE_PATH': '/tmp/engine-serve-abc'}, {})
    """
    return {"VLLM_RPC_BASE_PATH": str(work)} if len(str(work).encode()) <= IPC_PATH_ROOM else {}


def launch_server(config: str | Path | Mapping[str, Any], *,
                  repeat_terminate: Mapping[str, Any] | RepeatTerminateConfig | None = None,
                  args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                  timeout: float = 600.0, api_key: str | None = None,
                  on_start: Callable[[ServerProcess], None] | None = None) -> ServerProcess:
    """Start the server on 127.0.0.1 (a free port unless the config sets one) with the learner's subtree in its
    environment (``ENGINE_REPEAT_TERMINATE_JSON``) and ``api_key`` too (``ENGINE_API_KEY``: not on its command
    line, which other users can list), wait until ``/health`` answers, and return it.

    Raises ``RolloutServerError`` with the server's own message if it exits first (e.g. a guard that cannot run).
    ``on_start`` hears the process as soon as it exists, before it serves (its pid; e.g. to change its scheduling).
    """
    import httpx
    import yaml

    work = Path(tempfile.mkdtemp(prefix="engine-serve-"))
    if not isinstance(config, (str, Path)):
        (work / "served.yaml").write_text(yaml.safe_dump(dict(config)))
        config = work / "served.yaml"
    child_env = {**vllm_sockets_in(work), **os.environ, **(env or {})}  # vLLM's sockets go with the folder
    if repeat_terminate is not None:
        subtree = repeat_terminate.as_dict() if isinstance(repeat_terminate, RepeatTerminateConfig) else \
            dict(repeat_terminate)
        child_env[ENV_JSON] = json.dumps(subtree)
    if api_key is not None:
        child_env[ENV_API_KEY] = api_key
    ready, log_path = work / "ready.json", work / "server.log"
    cmd = [sys.executable, "-m", "engine.serve", "--config", str(config), "--ready-file", str(ready), *args]
    if "--port" not in args:
        cmd += ["--port", "0"] if "port" not in (yaml.safe_load(Path(config).read_text()).get("serve") or {}) else []
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env)
    handle = ServerProcess(process, "", log_path, work)
    if on_start is not None:
        on_start(handle)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if process.poll() is not None:
            handle.stop()  # its folder goes; its log stays in the message
            raise RolloutServerError(f"the server exited with code {process.returncode} before serving:\n"
                                     f"{handle.log()[-3000:]}")
        if time.monotonic() > deadline:
            handle.stop()
            raise RolloutServerError(f"the server did not bind within {timeout}s:\n{handle.log()[-3000:]}")
        time.sleep(0.2)
    handle.url = json.loads(ready.read_text())["url"]
    while True:
        try:
            if httpx.get(f"{handle.url}/health", timeout=5.0).status_code == 200:
                return handle
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            handle.stop()
            raise RolloutServerError(f"the server bound {handle.url} but /health never answered:\n{handle.log()}")
        time.sleep(0.2)
