"""``ServedEngine``: one loaded ``GenerationEngine`` plus what the server reports about it.

The HTTP layer only translates; every generation goes through ``GenerationEngine.agenerate``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from engine.serve.activation import Activation
from engine.serve.shared.metrics import ServeMetrics


class ServedEngine:
    """A loaded engine, the guard's startup activation, and the server's counters.

    Example (needs a built model)::

        served = ServedEngine(GenerationEngine(cfg), Activation(None, "default (disabled)"))
        app = create_app(served)          # engine.serve.app
    """

    def __init__(self, engine: Any, activation: Activation, serve: Any = None, api_key: str | None = None) -> None:
        self.engine = engine
        self.activation = activation
        self.api_key = api_key
        """The bearer key every route but ``/health`` requires (``engine.serve.shared.auth``); None: no key."""
        self.serve = serve or engine.config.serve
        """The ``ServeConfig`` in effect (the engine's own unless given)."""
        self.metrics = ServeMetrics(self.model_name, include_vllm=engine.backend.name == "vllm")
        self.gates: list[Callable[[], Awaitable[None]]] = []
        """What must finish before the next generation starts (a learner's weight push: ``weights_routes``)."""
        self.in_flight = 0
        self.started = time.time()
        self.synced_adapter = False
        """A learner pushed an adapter over the weight routes (``rollout/adapter_sync.py``)."""

    async def idle(self) -> None:
        """Wait until no generation is in flight (a weight push waits for it; new generations wait at the gates)."""
        while self.in_flight:
            await asyncio.sleep(0.005)

    @property
    def dead_reason(self) -> str | None:
        """Why the engine can no longer generate (its backend says so), or None while it can."""
        return getattr(self.engine.backend, "dead_reason", None)

    def arriving(self) -> contextlib.AbstractContextManager[None]:
        """Around the checking and preparing of a generation request: the engine's batcher (HF, llama.cpp) holds a
        batch about to start for it (a burst of clients lands in one batch); a backend that schedules requests
        itself (vLLM's ``AsyncLLM``) needs nothing."""
        from engine.backends.base import AsyncGenerating

        batcher = getattr(self.engine, "batcher", None)
        if batcher is None or isinstance(self.engine.backend, AsyncGenerating):
            return contextlib.nullcontext()
        return batcher().arriving()  # type: ignore[no-any-return]

    async def ready(self) -> None:
        """Wait for every gate (see ``gates``); a gate's failure is the waiting request's."""
        for gate in self.gates:
            await gate()

    @property
    def spec(self) -> Any:
        """The served backend's :class:`~engine.backends.registry.BackendSpec`."""
        from engine.backends.registry import spec

        return spec(self.engine.backend.name)

    @property
    def settings(self) -> Any:
        """The served backend's config section (``vllm:``, ``hf:``, ...)."""
        from engine.backends.registry import settings_section

        return getattr(self.engine.config, settings_section(self.engine.backend.name))

    @property
    def model_name(self) -> str:
        return self.serve.model_name or Path(self.engine.config.model.path).name

    def serves(self, name: str) -> bool:
        """Whether a request's ``model`` names this model: its name, an alias (``serve.model_aliases``), its path
        as configured (what a client of ``vllm serve <path>`` sends), or a loaded LoRA adapter (:meth:`adapter_of`)."""
        return (name == self.model_name or name in self.serve.model_aliases or name == self.engine.config.model.path
                or self.adapter_of(name) is not None)

    def adapter_of(self, name: str | None) -> str | None:
        """The loaded LoRA adapter a request's ``model`` names (as ``vllm serve`` picks one), or None: the model."""
        return name if name in self.adapters else None

    def adapter_path(self, name: str) -> str:
        """The folder adapter ``name`` was loaded from (``/v1/models``' ``root`` for a caller with the key)."""
        held = self.adapter_set
        return held.loaded[name].path if held is not None and name in held.loaded else name

    @property
    def adapter_set(self) -> Any:
        """The backend's :class:`engine.adapters.AdapterSet` (None for a backend without adapters)."""
        backend = self.engine.backend
        return getattr(backend, "adapter_set", None) or getattr(getattr(backend, "lora", None), "set", None)

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine started with LoRA on (``model.adapters`` or ``model.max_lora_rank``)."""
        held = self.adapter_set
        return bool(held is not None and held.enabled)

    @property
    def default_adapter(self) -> str | None:
        """The adapter ``/infer/`` computes with when a request names none: the one a learner last pushed over the
        weight routes (``engine.adapters.SYNCED``) while it is loaded, as swift's ``GRPOVllmEngine.infer`` picks
        its loaded LoRA; otherwise None (the model)."""
        from engine.adapters import SYNCED

        return SYNCED if self.synced_adapter and SYNCED in self.adapters else None

    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters the backend has loaded (``capabilities.adapters``; none for a backend without them)."""
        return tuple(getattr(self.engine.backend.capabilities, "adapters", ()))

    @property
    def guard_active(self) -> int:
        """1 when the repeat guard runs on every request: enabled, and the backend offers its hook (an engine
        whose guard cannot run refuses to start, so this equals ``enabled``)."""
        return int(self.engine.config.repeat_terminate.enabled)

    def health(self, *, detailed: bool = False) -> dict[str, Any]:
        """What ``/health`` reports; ``detailed`` (a caller that sent the API key) adds filesystem paths: the model
        folder and the subtree's file."""
        cfg = self.engine.config
        backend = self.engine.backend
        dead = self.dead_reason
        report = {
            "status": "ok" if dead is None else "dead",
            "backend": backend.name,
            "model": self.model_name,
            "dtype": cfg.model.dtype,
            "logprobs_mode": cfg.model.logprobs_mode,
            **backend.load_decisions,
            "engine_core": "child process" if self.spec.engine_core_in_child(self.settings) else "in-process",
            "repeat_terminate_active": self.guard_active,
            "repeat_terminate": cfg.repeat_terminate.as_dict(),
            "repeat_terminate_hash": cfg.repeat_terminate.fingerprint(),
            "repeat_terminate_source": self.activation.source if detailed else self.activation.public_source,
            "namespace": self.serve.namespace,
            "max_model_len": backend.capabilities.max_model_len,
            "uptime_s": round(time.time() - self.started, 3),
        }
        if dead is not None:
            report["error"] = dead
        if detailed:
            report["model_path"] = cfg.model.path
        return report

    def sent_the_key(self, headers: Any) -> bool:
        """Whether a request's raw ASGI ``headers`` carry this server's API key (never, when it has none)."""
        from engine.serve.shared.auth import bearer_matches

        return self.api_key is not None and bearer_matches(headers, self.api_key)

    def world_size(self) -> int:
        size = 1
        for name in self.spec.parallel_settings:
            size *= getattr(self.settings, name)
        return size
