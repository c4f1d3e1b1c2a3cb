"""Weight sync routes, as ms-swift's ``VLLMClient`` calls them in GRPO server mode: ``/init_communicator/``,
``/update_named_param/``, ``/update_flattened_params/``, ``/process_weights_after_loading/``,
``/reset_prefix_cache/`` (and ``_encoder_``, ``_mm_``), ``/get_model_state_keys/``, ``/close_communicator/``.
What moves and how: :mod:`engine.weights.sync`. Their bodies: ``rollout/bodies.py``.

Pushes form a session that ends (the loaded weights take effect, ``WeightLoading.finish_weights``) at the next
``/process_weights_after_loading/``, ``/reset_prefix_cache/``, key listing or closing; generations wait for that
(one training step's weights, whole: never a half-pushed model), or end it themselves when the learner has been
silent for ``serve.weight_sync_session_timeout_s``. On vLLM a session must carry every tensor of each fused layer it
touches (q, k and v together; gate and up together), as a training step's full push does: vLLM rebuilds such a layer
from what the session brought.

An opening or a push answers at once (the learner joins or broadcasts only after the answer, as swift's server
does) and runs in the background; the next *weight* call waits for it and reports its failure (a generation never
hears a learner's failure: the session is ended and the rows run). What a push announces is checked first (dtypes,
shapes, bucket byte ranges; on HF the names and shapes against the model): a 400 for the push itself. A push waits
for the generations in flight to end (new ones wait at the gate), so each row runs on one set of weights and no load
runs under a generating batch (vLLM's layerwise reload leaves layers on the meta device until the session ends).
The join runs on a thread of its own with ``serve.weight_sync_join_timeout_s``: generation goes on while the learner
joins. The group's store listens only on loopback or this server's ``serve.host`` (swift's wildcard means the
latter) unless ``serve.weight_sync_hosts`` lists more. The backend does the loading off the event loop: vLLM in its
engine core (which serializes it with generation steps), HF on the batcher's thread (never during a ``generate``).
A backend without weight loading (llama.cpp) is refused by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from fastapi import APIRouter

from engine.backends.base import AsyncGenerating, WeightLoading
from engine.errors import RequestError, UnsupportedCapabilityError
from engine.serve.rollout.bodies import InitCommunicatorRequest, UpdateFlattenedParamsRequest, UpdateNamedParamRequest
from engine.serve.service import ServedEngine
from engine.serve.shared.bodies import Body
from engine.serve.shared.calls import control_route
from engine.serve.shared.errors import WeightSyncConflict, WeightSyncFailed
from engine.weights.channel import new_secret
from engine.weights.sync import check_metadatas, check_shape, check_transport, store_host, torch_dtype

log = logging.getLogger(__name__)
BODIES = {"/init_communicator/": InitCommunicatorRequest, "/update_named_param/": UpdateNamedParamRequest,
          "/update_flattened_params/": UpdateFlattenedParamsRequest}
WEIGHTS = "weights"
"""The ``/metrics`` endpoint label of every weight route (swift's and vLLM's): counted by status like the rest."""
CACHES = ("prefix", "encoder", "mm")
"""The caches swift's trainer resets (``/reset_<kind>_cache/``): after each weight update, and at its start."""


class WeightCalls:
    """The served engine's weight-sync state: the background call under way, run one at a time, and a failure kept
    for the next weight call (never for a generation: a learner's mistake is the learner's to hear)."""

    def __init__(self, served: ServedEngine) -> None:
        self.served = served
        self.pending: asyncio.Future[Any] | None = None
        self.failed: BaseException | None = None
        """A background call's failure that no weight call has heard yet."""
        self.pushed = False
        """A push arrived since the session last finished."""
        self.ended = asyncio.Event()
        """Set while no push session is open: generations wait for it (one training step's weights, whole)."""
        self.ended.set()
        self.last_push = 0.0
        self.holding = False
        """A cache reset is waiting for the rows in flight: new generations wait for it too."""
        self.opened = False
        """A communicator was opened (``/init_communicator/``) and not closed since: pushes may come."""
        self.opened_at = 0.0
        """When the open push session began (its first push, or ``/start_weight_update``), or, for sessions that
        never received a tensor, the first of them: starts with no push cannot restart the bound."""
        self.unfed_since: float | None = None
        """When the first of a run of sessions that received no tensor began (None: the last session got one)."""
        self.stale: set[str] = set()
        """The caches (``CACHES``) computed with weights older than the loaded ones: each is reset once after a
        load; a reset of a cache not stale drops nothing, and drains nothing."""
        self.version: str | None = None
        """The weight version the last finished update named (vLLM's ``weight_version``)."""

    def open_session(self, *, pushing: bool = True) -> None:
        """A push session is open from now (``pushing``: a tensor is on its way; else ``/start_weight_update``): new
        generations wait at the gate until it ends. A session that never received a tensor is aged from the first
        such start, so a learner that starts sessions and never pushes holds the rollouts no longer than
        ``serve.weight_sync_session_max_s`` in all (each start used to age the next from zero)."""
        now = time.monotonic()
        if not self.pushed:
            self.opened_at = now if pushing or self.unfed_since is None else self.unfed_since
        if pushing:
            self.unfed_since = None
        elif self.unfed_since is None:
            self.unfed_since = self.opened_at
        self.pushed, self.last_push, self.stale = True, now, set(CACHES)
        self.ended.clear()

    def session_over(self) -> str | None:
        """Why the open session must end before the next generation, or None: the learner was silent for
        ``serve.weight_sync_session_timeout_s``, or the session has lasted ``serve.weight_sync_session_max_s``."""
        serve, now = self.served.serve, time.monotonic()
        if now - self.last_push >= serve.weight_sync_session_timeout_s:
            return f"open for {serve.weight_sync_session_timeout_s:.0f} s with no push"
        if now - self.opened_at >= serve.weight_sync_session_max_s:
            return f"open for {serve.weight_sync_session_max_s:.0f} s in all"
        return None

    @property
    def backend(self) -> WeightLoading:
        backend = self.served.engine.backend
        if not isinstance(backend, WeightLoading):
            raise UnsupportedCapabilityError(f"backend {backend.name!r} cannot load a learner's weights while "
                                             "serving. Fix: serve the model with hf or vllm")
        return backend

    def run(self, fn: Callable[[], Any], *, exclusive: bool = True) -> asyncio.Future[Any]:
        """``fn()`` off the event loop: on the batcher's thread for a backend that batches through it (HF) when it
        touches the model (``exclusive``), else a worker thread (vLLM's engine core serializes the call itself)."""
        if not exclusive or isinstance(self.served.engine.backend, AsyncGenerating):
            return asyncio.ensure_future(asyncio.to_thread(fn))
        return asyncio.ensure_future(self.served.engine.batcher().run_exclusive(fn))

    async def _wait(self) -> None:
        """Wait for the background call; its failure is kept for the next weight call."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            await pending
        except Exception as err:
            self.failed = err

    async def settle(self) -> None:
        """Wait for the background call; an unheard failure is this weight call's (then forgotten)."""
        await self._wait()
        failed, self.failed = self.failed, None
        if failed is not None:
            raise failed

    async def before_generation(self) -> None:
        """The generation gate: while a push session is open, wait for the learner to end it (its cache reset,
        ``/process_weights_after_loading/`` or closing), so every row runs on one training step's weights, never on a
        half-pushed model; a learner silent for ``serve.weight_sync_session_timeout_s`` has its session ended here.
        A failed push is not the generation's: it stays for the learner's next weight call.

        Every wait is followed by the whole check again, and the gate opens only where nothing is open or running
        with no wait since the check: the caller then counts its generation in flight before any weight call can
        start, so the next push drains it. (A gate that ended a session after waiting for a background call could
        end a session the learner had opened meanwhile, and generate under its next load.)"""
        while True:
            if self.holding:  # a cache reset under way: rows after it must not reuse the old weights' blocks
                await self.ended.wait()
                continue
            if self.pushed:
                reason = self.session_over()
                if reason is None:
                    serve = self.served.serve
                    left = min(self.last_push + serve.weight_sync_session_timeout_s,
                               self.opened_at + serve.weight_sync_session_max_s) - time.monotonic()
                    with contextlib.suppress(TimeoutError):  # then the session's age is checked again
                        await asyncio.wait_for(self.ended.wait(), timeout=max(left, 0.01))
                    continue
                log.warning("engine.serve: a weight session %s: ending it before generating", reason)
                await self._end_session()
                continue
            if self.pending is not None:  # a weight call still running in the background (its failure is kept)
                await self._wait()
                continue
            return

    async def _end_session(self) -> None:
        """Wait for the background call, then make the session's weights take effect (failures kept)."""
        await self._wait()
        if self.pushed:
            self.pushed = False
            try:
                await self.run(self.backend.finish_weights)
            except Exception as err:
                log.error("engine.serve: ending a weight session failed: %s", err)
                self.failed = self.failed or err
            finally:
                self.ended.set()

    async def close(self) -> None:
        """Leave the learner's group (swift's ``/close_communicator/``, vLLM's ``/shutdown_weight_transfer_engine``):
        the open session ends first."""
        backend = self.backend
        await self.finish()
        await self.run(backend.close_weights)
        self.opened = False

    async def finish(self) -> None:
        """Wait for the background call and end the push session (a weight call: resets, key listing, closing);
        a failure is this call's."""
        await self._end_session()
        await self.settle()

    async def start(self, fn: Callable[[], Any], *, drain: bool = False, exclusive: bool = True) -> None:
        """Wait for the previous call, then start ``fn`` in the background; with ``drain``, only once no generation
        is in flight (new ones wait at the gate for it): a load never runs under a generating batch."""
        await self.settle()

        async def call() -> Any:
            if drain:
                await self.served.idle()
            return await self.run(fn, exclusive=exclusive)

        self.pending = asyncio.ensure_future(call())
        self.pending.add_done_callback(_log_failure)


def _log_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("engine.serve: a weight-sync call failed: %s", future.exception())


def _in_range(key: str, value: int, low: int, high: int | None = None) -> int:
    """``value`` (an integer: the body model checked its type) within [low, high], or a 400 naming ``key``."""
    if value < low or (high is not None and value > high):
        span = f"[{low}, {high}]" if high is not None else f"[{low}, inf)"
        raise RequestError(key, value, f"must be an integer in {span}", fix=f"send an integer in {span}")
    return value


def group_answer(message: str, transport: str, secret: str) -> dict[str, Any]:
    """The answer of a call that opens a group: on ``tcp``, the group's secret (``group_secret``), which the learner
    needs to read or write anything in the group's store. Only this keyed call hands it out."""
    return {"message": message, **({"group_secret": secret} if transport == "tcp" else {})}


def weight_calls(served: ServedEngine) -> WeightCalls:
    """The served engine's one weight-sync state, shared by swift's routes and vLLM's (``transfer.py``); its gate
    is added to the generation gates once."""
    calls = getattr(served, "weight_calls", None)
    if calls is None:
        calls = served.weight_calls = WeightCalls(served)
        served.gates.append(calls.before_generation)
    return calls


async def reset_cache(calls: WeightCalls, kind: str) -> str:
    """Drop the backend's ``kind`` cache once the rows in flight ended (new rows wait meanwhile), when weights were
    loaded since its last reset; with none loaded there is nothing stale to drop, so nothing is drained (resets
    posted back to back cost the rollouts nothing)."""
    backend = calls.backend
    await calls.finish()
    if kind not in calls.stale:
        return f"{kind} cache kept: no weights were loaded since its last reset"
    calls.holding = True  # vLLM resets no block a running row holds: drain first, hold new rows meanwhile
    calls.ended.clear()
    try:
        await calls.served.idle()
        await calls.run(lambda: backend.reset_cache(kind))
    finally:
        calls.holding = False
        calls.ended.set()
    calls.stale.discard(kind)
    return f"{kind} cache reset"


Route = tuple[str | tuple[str, ...], type[Body] | None, str, Callable[..., Any]]
"""A weight route: its path (or paths), its body model (None: no body), its method, and its handler, a module-level
function of the session state (:class:`WeightCalls`) and, when it takes one, the validated body."""


def weight_router(served: ServedEngine, routes: Sequence[Route]) -> APIRouter:
    """The routes of one weight surface (swift's here, vLLM's in ``transfer.py``, the adapter-only sync in
    ``adapter_sync.py``), each bound to the one session state they share, through the control call path."""
    api = APIRouter()
    calls = weight_calls(served)
    for paths, body, method, handler in routes:
        control_route(api, served, WEIGHTS, paths, body, method, failed=WeightSyncFailed)(partial(handler, calls))
    return api


async def push(calls: WeightCalls, announced: dict[str, Any], what: str) -> Any:
    backend = calls.backend
    if not calls.opened:  # the load would fail in the background and be answered to an unrelated caller
        raise WeightSyncConflict("no communicator is open, so no tensor can arrive: call /init_communicator/ "
                                 "first (swift's VLLMClient.init_communicator)")
    backend.check_announced(announced)  # names and shapes the model cannot take: this call's 400
    within = calls.served.serve.weight_sync_session_timeout_s
    await calls.start(lambda: backend.load_weights(announced, within), drain=True)
    calls.open_session()
    return {"message": f"receiving {what}"}


async def init_communicator(calls: WeightCalls, body: InitCommunicatorRequest) -> Any:
    served, backend = calls.served, calls.backend
    host = store_host(body.host, served.serve.host, served.serve.weight_sync_hosts, keyed=served.api_key is not None)
    port = _in_range("port", body.port, 1, 65535)
    expected = served.world_size() + 1
    world_size = _in_range("world_size", body.world_size, 2)
    if world_size != expected:
        raise RequestError("world_size", world_size, f"must be {expected}: this server's {expected - 1} "
                           "workers and the learner", fix="take it from GET /get_world_size/, plus one")
    transport = check_transport(body.transport)
    timeout = served.serve.weight_sync_join_timeout_s
    secret = new_secret()
    await calls.start(lambda: backend.open_weights(host, port, world_size, transport, timeout, secret=secret),
                      exclusive=False)
    calls.opened = True
    return group_answer(f"joining the learner's group on {host}:{port} ({transport})", transport, secret)


async def update_named_param(calls: WeightCalls, body: UpdateNamedParamRequest) -> Any:
    if not body.name:
        raise RequestError("name", body.name, "must be a parameter name", fix="e.g. lm_head.weight")
    torch_dtype(body.dtype)
    shape = check_shape(body.shape)
    return await push(calls, {"name": body.name, "dtype": body.dtype, "shape": shape}, body.name)


async def update_flattened_params(calls: WeightCalls, body: UpdateFlattenedParamsRequest) -> Any:
    metadatas = check_metadatas(body.metadatas)
    return await push(calls, {"metadatas": metadatas}, f"{len(metadatas)} tensors")


async def process_weights_after_loading(calls: WeightCalls) -> Any:
    calls.backend  # noqa: B018 (refuses a backend without weight loading)
    await calls.finish()
    return {"message": "weights in effect"}


async def reset(calls: WeightCalls, *, kind: str) -> Any:
    return {"message": await reset_cache(calls, kind)}


async def get_model_state_keys(calls: WeightCalls) -> Any:
    backend = calls.backend
    await calls.finish()
    return {"keys": await calls.run(backend.state_keys)}


async def close_communicator(calls: WeightCalls) -> Any:
    await calls.close()
    return {"message": "closed"}


ROUTES: tuple[Route, ...] = (
    ("/init_communicator/", InitCommunicatorRequest, "POST", init_communicator),
    ("/update_named_param/", UpdateNamedParamRequest, "POST", update_named_param),
    ("/update_flattened_params/", UpdateFlattenedParamsRequest, "POST", update_flattened_params),
    ("/process_weights_after_loading/", None, "POST", process_weights_after_loading),
    *(((f"/reset_{kind}_cache/", f"/reset_{kind}_cache"), None, "POST", partial(reset, kind=kind))  # swift's name,
      for kind in CACHES),  # and vLLM's (TRL's client)
    ("/get_model_state_keys/", None, "GET", get_model_state_keys),
    ("/close_communicator/", None, "POST", close_communicator),
)
"""swift's weight-sync routes (``VLLMClient`` in GRPO server mode), and the cache resets by vLLM's names too."""


def router(served: ServedEngine) -> APIRouter:
    return weight_router(served, ROUTES)
