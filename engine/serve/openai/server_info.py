"""``GET /server_info``, as RL clients of vLLM's API read it before training: TRL's ``VLLMClient`` reads
``vllm_config.model_config.logprobs_mode`` (a GRPO run refuses a server whose logprobs are not processed) and
``vllm_config.weight_transfer_config`` (the transport of ``/init_weight_transfer_engine`` on this host; None where
the backend loads no weights, and TRL's ``init_communicator`` says so before it opens anything). No web framework
is imported here.

Choices written down:

* The answer has vLLM's three keys; ``vllm_config`` holds the parts of vLLM's config a client reads, in vLLM's names,
  plus ``engine`` (the backend, the engine's own settings' fingerprint); ``vllm_env`` and ``system_env`` are empty
  (this server reads no ``VLLM_*`` variables of its own, and a host's details are not a client's business).
* ``config_format``: ``json`` (a tree) or ``text`` (vLLM's default: the config as one string); anything else is a 400.
* Stock vLLM shows the route only with ``VLLM_SERVER_DEV_MODE=1``; here it is always on, and the model's path is
  shown only to a caller that sent the API key (its name otherwise), as ``/v1/models`` shows ``root``.
"""

from __future__ import annotations

from typing import Any

from engine.errors import RequestError

FORMATS = ("text", "json")


def server_info(served: Any, *, config_format: str = "text", with_path: bool = False) -> dict[str, Any]:
    """vLLM's ``/server_info`` answer for ``served`` (a ``ServedEngine``).

    >>> from types import SimpleNamespace as NS
    >>> model = NS(path="/models/m", dtype="float32", logprobs_mode="processed_logprobs")
    >>> engine = NS(config=NS(model=model), backend=NS(name="hf", capabilities=NS(max_model_len=2048)))
    >>> served = NS(engine=engine, model_name="m", world_size=lambda: 1)
    >>> info = server_info(served, config_format="json")
    >>> info["vllm_config"]["model_config"]["logprobs_mode"], info["vllm_config"]["weight_transfer_config"]
    ('processed_logprobs', None)
    >>> info["vllm_config"]["model_config"]["model"]
    'm'
    >>> server_info(served, config_format="yaml")
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: config_format must be text or json, got 'yaml'. Fix: send ?config_format=json for \
a tree, or leave it out for text.
    """
    if config_format not in FORMATS:
        raise RequestError("config_format", config_format, "must be text or json",
                           fix="send ?config_format=json for a tree, or leave it out for text")
    engine = served.engine
    model = engine.config.model
    world = served.world_size()
    config = {
        "model_config": {"model": model.path if with_path else served.model_name,
                         "served_model_name": served.model_name, "dtype": model.dtype,
                         "max_model_len": engine.backend.capabilities.max_model_len,
                         "logprobs_mode": model.logprobs_mode},
        "parallel_config": {"tensor_parallel_size": world, "pipeline_parallel_size": 1, "data_parallel_size": 1,
                            "world_size": world},
        "weight_transfer_config": transfer_config(engine.backend),
        "lora_config": lora_config(served),
        "engine": {"backend": engine.backend.name},
    }
    return {"vllm_config": config if config_format == "json" else str(config), "vllm_env": {}, "system_env": {}}


def lora_config(served: Any) -> dict[str, Any] | None:
    """vLLM's ``lora_config`` (what TRL's async GRPO reads to push adapters instead of merged weights): None unless
    the engine started with LoRA on (``model.adapters`` or ``model.max_lora_rank``). ``max_loras`` is vLLM's slot
    count on vLLM; HF and llama.cpp hold every loaded adapter at once and report the count the engine's vLLM backend
    would get for the same config (``vllm.max_loras``, or one per adapter at start plus one, at least two), so a client
    sizes itself alike against every backend's server."""
    backend = served.engine.backend
    held = getattr(backend, "adapter_set", None) or getattr(getattr(backend, "lora", None), "set", None)
    if held is None or not held.enabled:
        return None
    lora = getattr(backend, "lora", None)
    slots = lora.start_arguments()["max_loras"] if lora is not None else (
        served.engine.config.vllm.max_loras or max(2, len(served.engine.config.model.adapters) + 1))
    return {"max_lora_rank": held.limit, "max_loras": slots, "max_cpu_loras": slots, "lora_dtype": "auto",
            "fully_sharded_loras": False}


def transfer_config(backend: Any) -> dict[str, str] | None:
    """vLLM's ``weight_transfer_config`` for a backend that loads a trainer's weights (its transport on this host:
    ``nccl`` with CUDA, ``tcp`` without; ``/init_weight_transfer_engine`` takes either), None for one that cannot."""
    from engine.backends.base import WeightLoading

    if not isinstance(backend, WeightLoading):
        return None
    from engine.weights.sync import check_transport

    return {"backend": check_transport(None)}
