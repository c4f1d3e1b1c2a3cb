"""``ServedEngine``: one loaded ``GenerationEngine`` plus what the server reports about it.

The HTTP layer only translates; every generation goes through ``GenerationEngine.agenerate``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from engine.serve.activation import Activation
from engine.serve.metrics import ServeMetrics


class ServedEngine:
    """A loaded engine, the guard's startup activation, and the server's counters.

    Example (needs a built model)::

        served = ServedEngine(GenerationEngine(cfg), Activation(None, "default (disabled)"))
        app = create_app(served)          # engine.serve.app
    """

    def __init__(self, engine: Any, activation: Activation, serve: Any = None) -> None:
        self.engine = engine
        self.activation = activation
        self.serve = serve or engine.config.serve
        """The ``ServeConfig`` in effect (the engine's own unless given)."""
        self.metrics = ServeMetrics()
        self.in_flight = 0
        self.started = time.time()

    @property
    def spec(self) -> Any:
        """The served backend's :class:`~engine.backends.registry.BackendSpec`."""
        from engine.backends.registry import spec

        return spec(self.engine.backend.name)

    @property
    def settings(self) -> Any:
        """The served backend's config section (``vllm:``, ``hf:``, ...)."""
        return getattr(self.engine.config, self.engine.backend.name)

    @property
    def model_name(self) -> str:
        return self.serve.model_name or Path(self.engine.config.model.path).name

    @property
    def guard_active(self) -> int:
        """1 when the repeat guard runs on every request: enabled, and the backend offers its hook (an engine
        whose guard cannot run refuses to start, so this equals ``enabled``)."""
        return int(self.engine.config.repeat_terminate.enabled)

    def health(self) -> dict[str, Any]:
        cfg = self.engine.config
        backend = self.engine.backend
        return {
            "status": "ok",
            "backend": backend.name,
            "model": self.model_name,
            "model_path": cfg.model.path,
            "dtype": cfg.model.dtype,
            "runner": backend.runner,
            "engine_core": "child process" if self.spec.engine_core_in_child(self.settings) else "in-process",
            "repeat_terminate_active": self.guard_active,
            "repeat_terminate": cfg.repeat_terminate.as_dict(),
            "repeat_terminate_hash": cfg.repeat_terminate.fingerprint(),
            "repeat_terminate_source": self.activation.source,
            "namespace": self.serve.namespace,
            "max_model_len": backend.capabilities.max_model_len,
            "uptime_s": round(time.time() - self.started, 3),
        }

    def world_size(self) -> int:
        size = 1
        for name in self.spec.parallel_settings:
            size *= getattr(self.settings, name)
        return size
