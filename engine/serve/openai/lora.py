"""vLLM's LoRA routes: ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``, with vLLM's bodies and
answers, for an engine started with LoRA on (``model.adapters`` or ``model.max_lora_rank``) and
``serve.adapter_loading`` true (``--allow-adapter-loading``; vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): without
it the routes do not exist (404), as on ``vllm serve``. Behind the API key like every route but ``/health``.

* load ``{"lora_name", "lora_path", "load_inplace"?}``: the adapter is checked as ``model.adapters`` are (PEFT LoRA
  with safetensors weights, the rank limit, its shapes against the served model) and loaded; answered ``200`` with
  vLLM's text ``Success: LoRA adapter '<name>' added successfully.``. A name already loaded is refused (400) unless
  ``load_inplace``; then rows in flight finish first and the prefix cache is reset, so no row computed after the
  reload reads a block of the old weights (``vllm serve`` keeps those blocks when the path is the same:
  docs/divergences.md).
* unload ``{"lora_name"}``: rows in flight finish, the adapter is dropped (404 for a name not loaded, as vLLM).

A request picks a loaded adapter by its OpenAI ``model`` field (``GET /v1/models`` lists each with the served model as
its ``parent``); ``/infer/`` by swift's ``adapter_request``.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from engine.backends.base import AsyncGenerating
from engine.errors import RequestError
from engine.serve.service import ServedEngine
from engine.serve.shared.bodies import Body
from engine.serve.shared.calls import control_route
from engine.serve.shared.errors import UnknownAdapter
from engine.serve.shared.fields import Neutral, Wire

ADAPTERS = "lora_adapters"
"""The ``/metrics`` endpoint label of both routes."""


class LoadLoRAAdapterRequest(Body):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: Annotated[str, Wire("the name requests pick it by (their model field)")]
    lora_path: Annotated[str, Wire("the adapter's folder, as this server sees it")]
    load_inplace: Annotated[bool | None, Wire("replace a loaded adapter of that name")] = None
    is_3d_lora_weight: Annotated[bool | None, Neutral((False, None))] = None


class UnloadLoRAAdapterRequest(Body):
    """``POST /v1/unload_lora_adapter`` (vLLM's body)."""

    lora_name: Annotated[str, Wire("a loaded adapter's name")]
    lora_int_id: Annotated[int | None, Wire("accepted and ignored (the name says which)")] = None


BODIES = {"/v1/load_lora_adapter": LoadLoRAAdapterRequest, "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest}


async def off_the_loop(served: ServedEngine, fn: Any) -> Any:
    """``fn()`` where it cannot meet a generation of the backend: on the batcher's thread between two batches (HF,
    llama.cpp), else a worker thread (vLLM's engine core serializes it itself)."""
    if isinstance(served.engine.backend, AsyncGenerating):
        return await asyncio.to_thread(fn)
    return await served.engine.batcher().run_exclusive(fn)


def router(served: ServedEngine) -> APIRouter:
    api = APIRouter()
    if not served.serve.adapter_loading:
        return api
    engine = served.engine
    lock = asyncio.Lock()  # one load or unload at a time

    @control_route(api, served, ADAPTERS, "/v1/load_lora_adapter", LoadLoRAAdapterRequest)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Any:
        name = body.lora_name
        if served.serves(name) and name not in served.adapters:
            raise RequestError("lora_name", name, "conflicts with the served base model's name",
                               fix="name the adapter otherwise")
        async with lock:
            if body.load_inplace and name in served.adapters:
                await served.idle()  # the rows computing with the old weights end first
            await off_the_loop(served, lambda: engine.load_adapter(name, body.lora_path,
                                                                   replace=bool(body.load_inplace)))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @control_route(api, served, ADAPTERS, "/v1/unload_lora_adapter", UnloadLoRAAdapterRequest)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Any:
        name = body.lora_name
        if name not in served.adapters:
            raise UnknownAdapter(name, served.adapters)
        async with lock:
            await served.idle()
            await off_the_loop(served, lambda: engine.unload_adapter(name))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return api
