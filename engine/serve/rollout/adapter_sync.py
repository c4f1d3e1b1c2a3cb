"""Adapter-only weight sync: a learner that trains a LoRA adapter pushes the adapter alone, as ms-swift's GRPO trainer
does with ``vllm_enable_lora`` (``VLLMClient.update_adapter_flattened_param`` and ``update_adapter_param``):

* ``/update_adapter_flattened_param/`` ``{"peft_config", "metadatas"}``: one swift bucket follows over the
  communicator (``/init_communicator/`` first);
* ``/update_adapter_param/`` ``{"peft_config", "lora_tensors_metadata"}``: one broadcast per tensor, then one barrier.

Why swift's form: it is the one served form that carries the adapter's tensors (vLLM's own server has no tensor route
for adapters: its RL clients write the adapter to disk and call ``/v1/load_lora_adapter``, which this server has too,
``openai/lora.py``), and it rides the communicator swift's trainer already opened for full pushes.

What the push announces is checked first (a LoRA config within the rank limit, only ``lora_A``/``lora_B`` tensors,
each pair fitting the base weight it changes: ``engine.adapters.check_pushed``), a 400 for the push itself. The
tensors are received where the group is (the HF process, vLLM's engine-core workers), saved as PEFT saves an adapter
into a folder of this server's, and loaded as adapter ``swift_lora`` (``engine.adapters.SYNCED``) through the same
admission and loading as ``/v1/load_lora_adapter`` with ``load_inplace`` (values checked finite; no cached block of
the previous push reused). Like a full push it answers at once, runs once the rows in flight ended, holds new rows
until the learner's cache reset ends the session, and a failure is the next weight call's; the previous push keeps
serving when one fails.

From the first push on, ``/infer/`` without ``adapter_request`` computes with ``swift_lora``, as swift's
``GRPOVllmEngine.infer`` uses its loaded adapter (its ``async_infer`` does not, and sampled the base model: ms-swift
#9855); the OpenAI routes pick it by ``model`` like any adapter. The server must start with LoRA on
(``--max-lora-rank`` or ``--lora-modules``); llama.cpp loads no learner's weights and is refused by name.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from fastapi import APIRouter

from engine.adapters import SYNCED, check_pushed
from engine.backends.base import AdapterLoading
from engine.errors import UnsupportedCapabilityError
from engine.serve.rollout.bodies import UpdateAdapterFlattenedParamRequest, UpdateAdapterParamRequest
from engine.serve.rollout.weights import WEIGHTS, WeightCalls, weight_calls
from engine.serve.service import ServedEngine
from engine.serve.shared.calls import control_route
from engine.serve.shared.errors import WeightSyncConflict, WeightSyncFailed
from engine.weights.sync import announced_tensors, check_listed, check_metadatas

BODIES = {"/update_adapter_flattened_param/": UpdateAdapterFlattenedParamRequest,
          "/update_adapter_param/": UpdateAdapterParamRequest}


class SyncedFolders:
    """Where pushed adapters are saved (a temporary folder of the server's, removed with it): one folder per push,
    the previous one removed once the next is loaded."""

    def __init__(self) -> None:
        self._root: tempfile.TemporaryDirectory[str] | None = None
        self.count = 0
        self.serving: Path | None = None

    def next(self) -> Path:
        if self._root is None:
            self._root = tempfile.TemporaryDirectory(prefix="engine-synced-lora-")
        self.count += 1
        return Path(self._root.name) / f"{SYNCED}-{self.count}"

    def loaded(self, folder: Path) -> None:
        old, self.serving = self.serving, folder
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


async def push_adapter(served: ServedEngine, calls: WeightCalls, folders: SyncedFolders, config: dict[str, Any],
                       announced: dict[str, Any], what: str) -> dict[str, str]:
    """Check what is announced, then receive, save and load it in the background (module doc)."""
    backend, engine = calls.backend, served.engine
    if not isinstance(engine.backend, AdapterLoading) or not served.lora_enabled:
        raise UnsupportedCapabilityError("this server was started without LoRA adapters, so a pushed adapter has no "
                                         "slot. Fix: start it with --max-lora-rank (or --lora-modules)")
    if not calls.opened:
        raise WeightSyncConflict("no communicator is open, so no tensor can arrive: call /init_communicator/ "
                                 "first (swift's VLLMClient.init_communicator)")
    held = served.adapter_set
    check_pushed(config, announced_tensors(announced), limit=held.limit, base_dir=held.base_dir)
    folder = folders.next()
    within = served.serve.weight_sync_session_timeout_s

    def receive_and_load() -> None:
        try:
            backend.receive_adapter(announced, str(folder), config, within)
            engine.load_adapter(SYNCED, str(folder), replace=SYNCED in served.adapters)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)  # the previous push keeps serving
            raise
        folders.loaded(folder)
        served.synced_adapter = True

    await calls.start(receive_and_load, drain=True)
    calls.open_session()
    return {"message": f"receiving adapter {SYNCED} ({what})"}


def router(served: ServedEngine) -> APIRouter:
    api = APIRouter()
    calls = weight_calls(served)
    folders = SyncedFolders()

    @control_route(api, served, WEIGHTS, "/update_adapter_flattened_param/", UpdateAdapterFlattenedParamRequest,
                   failed=WeightSyncFailed)
    async def update_adapter_flattened_param(body: UpdateAdapterFlattenedParamRequest) -> Any:
        metadatas = check_metadatas(body.metadatas)
        return await push_adapter(served, calls, folders, body.peft_config, {"metadatas": metadatas},
                                  f"{len(metadatas)} tensors in one bucket")

    @control_route(api, served, WEIGHTS, "/update_adapter_param/", UpdateAdapterParamRequest, failed=WeightSyncFailed)
    async def update_adapter_param(body: UpdateAdapterParamRequest) -> Any:
        announced = check_listed(body.lora_tensors_metadata)
        return await push_adapter(served, calls, folders, body.peft_config, announced,
                                  f"{len(announced['tensors'])} tensors")

    return api
