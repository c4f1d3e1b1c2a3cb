"""Backends, by name. One module per backend; heavy imports (torch, vllm) happen only inside it.

``REGISTRY`` is the single source of truth for backend names: the config validates against it.
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.backends.base import Backend, BackendOutput, Capabilities, Prompt, SamplingPlan, TokenScores
from engine.backends.registry import REGISTRY


def backend_class(name: str) -> Any:
    """The backend class registered under ``name`` (imported on first use)."""
    from engine.config._build import did_you_mean
    from engine.errors import ConfigError

    if name not in REGISTRY:
        raise ConfigError("backend", name, "is not a registered backend", fix=did_you_mean(name, REGISTRY))
    module, _, attr = REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), attr)


__all__ = ["REGISTRY", "Backend", "BackendOutput", "Capabilities", "Prompt", "SamplingPlan", "TokenScores",
           "backend_class"]
