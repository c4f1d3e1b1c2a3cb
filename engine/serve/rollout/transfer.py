"""Weight updates through vLLM's own routes, as TRL 1.16's ``VLLMClient``, SkyRL and verl's remote servers send them
(:mod:`engine.weights.transfer`), and the checkpoint reload SGLang and AReaL name ``/update_weights_from_disk``
(:mod:`engine.weights.checkpoint`). They share swift's routes' state (``weights.py``: one push session at a time,
the generation gate, the drain before a load, the session bounds), so the two families cannot interleave.

* ``/init_weight_transfer_engine`` ``{"init_info": {master_address, master_port, rank_offset: 1, world_size,
  transport?}}``: the workers start joining the trainer's group (it is rank 0 and hosts the store, on an address this
  server may reach: loopback, ``serve.host`` or ``serve.weight_sync_hosts``); answered at once, the join goes on
  beside generation (a client that posts it in a thread, as TRL's does, and one that posts it first both work).
* ``/start_weight_update``: a push session opens (new generations wait for its end; the bounds of
  ``serve.weight_sync_session_timeout_s`` and ``serve.weight_sync_session_max_s`` hold).
* ``/update_weights`` ``{"update_info": {names, dtype_names, shapes}}``: answered once the tensors were received and
  loaded (vLLM's behaviour: the trainer broadcasts while the call is open), its failure this call's 500.
* ``/finish_weight_update`` ``{"weight_version"?}``: the session's weights take effect; ``GET /weight_info`` reports
  the version. ``/shutdown_weight_transfer_engine`` leaves the group.
* ``/update_weights_from_disk`` ``{"model_path", "load_format"?, "weight_version"?, "flush_cache"?}``: rows in flight
  end, new ones wait, every tensor of the folder is checked then loaded, the prefix cache is reset (unless
  ``flush_cache`` is false); answered ``{"success": true, "message", "num_paused_requests": 0}`` as SGLang does.
  ``abort_all_requests: true`` is refused by name: this server finishes the rows in flight instead.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from engine.errors import RequestError
from engine.serve.rollout.bodies import (
    FinishWeightUpdateRequest,
    InitWeightTransferRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsRequest,
)
from engine.serve.rollout.weights import CACHES, Route, WeightCalls, group_answer, reset_cache, weight_router
from engine.serve.service import ServedEngine
from engine.serve.shared.errors import WeightSyncConflict
from engine.weights.channel import new_secret
from engine.weights.sync import store_host

BODIES = {"/init_weight_transfer_engine": InitWeightTransferRequest, "/update_weights": UpdateWeightsRequest,
          "/finish_weight_update": FinishWeightUpdateRequest,
          "/update_weights_from_disk": UpdateWeightsFromDiskRequest}


MAX_VERSION_CHARS = 256


def check_version(version: str | None) -> str | None:
    """A ``weight_version`` as ``GET /weight_info`` will report it: printable text of at most 256 characters.

    >>> check_version("step-12"), check_version(None)
    ('step-12', None)
    >>> check_version("a\\nforged: line")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: weight_version must be printable text of at most 256 characters, got ...
    """
    if version is not None and (len(version) > MAX_VERSION_CHARS or not version.isprintable()):
        raise RequestError("weight_version", version[:80], f"must be printable text of at most {MAX_VERSION_CHARS} "
                           "characters", fix="send a short label such as the training step, e.g. 'step-12'")
    return version


def require_group(calls: WeightCalls, route: str) -> None:
    if not calls.opened:
        raise WeightSyncConflict(f"{route} needs the trainer's group: call /init_weight_transfer_engine first "
                                 "(TRL's VLLMClient.init_communicator)")


async def init_weight_transfer_engine(calls: WeightCalls, body: InitWeightTransferRequest) -> Any:
    from engine.weights.transfer import check_init_info

    served, backend, info = calls.served, calls.backend, body.init_info
    address = store_host(info.get("master_address"), served.serve.host, served.serve.weight_sync_hosts,
                         field="init_info.master_address", keyed=served.api_key is not None)
    checked = check_init_info(info, served.world_size())
    port, world = info["master_port"], info["world_size"]
    packed = {"buffer_bytes": checked["buffer_bytes"], "buffers": checked["buffers"]} if checked["packed"] else None
    timeout = served.serve.weight_sync_join_timeout_s
    secret = new_secret()
    await calls.start(lambda: backend.open_weights(address, port, world, checked["transport"], timeout,
                                                   learner_rank=0, packed=packed, secret=secret), exclusive=False)
    calls.opened = True
    return group_answer("Weight transfer initialized", checked["transport"], secret)


async def start_weight_update(calls: WeightCalls) -> Any:
    calls.backend  # noqa: B018 (refuses a backend without weight loading)
    require_group(calls, "/start_weight_update")
    await calls.finish()
    calls.open_session(pushing=False)
    return {"message": "Weight update started"}


async def update_weights(calls: WeightCalls, body: UpdateWeightsRequest) -> Any:
    from engine.weights.transfer import check_update_info

    backend = calls.backend
    require_group(calls, "/update_weights")
    announced = check_update_info(body.update_info)
    backend.check_announced(announced)
    within = calls.served.serve.weight_sync_session_timeout_s
    await calls.start(lambda: backend.load_weights(announced, within), drain=True)
    calls.open_session()
    await calls.settle()  # answered once loaded, as vLLM does: a failure is this call's
    return {"message": "Weights updated"}


async def finish_weight_update(calls: WeightCalls, body: FinishWeightUpdateRequest) -> Any:
    calls.backend  # noqa: B018
    require_group(calls, "/finish_weight_update")  # the version trainers read is the group's to set
    version = check_version(body.weight_version)
    await calls.finish()
    if version is not None:
        calls.version = version
    return {"message": "Weight update finished"}


async def shutdown_weight_transfer_engine(calls: WeightCalls) -> Any:
    await calls.close()
    return {"message": "Weight transfer shut down"}


async def weight_info(calls: WeightCalls) -> Any:
    return {"weight_version": calls.version}


async def update_weights_from_disk(calls: WeightCalls, body: UpdateWeightsFromDiskRequest) -> Any:
    from engine.weights.checkpoint import check_model_path

    backend = calls.backend
    if body.abort_all_requests:
        raise RequestError("abort_all_requests", True, "is not supported: this server lets the rows in flight "
                           "end, holds new ones, then loads", fix="leave it out (or false)")
    path = str(check_model_path(body.model_path, body.load_format))
    version = check_version(body.weight_version)
    await calls.finish()
    calls.holding = True  # new rows wait for the load; the rows in flight end first
    calls.ended.clear()
    try:
        await calls.served.idle()
        loaded = await calls.run(lambda: backend.load_checkpoint(path))
    finally:
        calls.holding = False
        calls.ended.set()
    calls.stale = set(CACHES)
    if body.flush_cache is not False:
        await reset_cache(calls, "prefix")
    if version is not None:
        calls.version = version
    return {"success": True, "message": f"loaded {loaded} tensors from {path}", "num_paused_requests": 0}


ROUTES: tuple[Route, ...] = (
    ("/init_weight_transfer_engine", InitWeightTransferRequest, "POST", init_weight_transfer_engine),
    ("/start_weight_update", None, "POST", start_weight_update),
    ("/update_weights", UpdateWeightsRequest, "POST", update_weights),
    ("/finish_weight_update", FinishWeightUpdateRequest, "POST", finish_weight_update),
    ("/shutdown_weight_transfer_engine", None, "POST", shutdown_weight_transfer_engine),
    ("/weight_info", None, "GET", weight_info),
    ("/update_weights_from_disk", UpdateWeightsFromDiskRequest, "POST", update_weights_from_disk),
)


def router(served: ServedEngine) -> APIRouter:
    return weight_router(served, ROUTES)
