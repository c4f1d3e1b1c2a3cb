"""Backends, by name: one subpackage per backend (``hf/``, ``vllm/``, ``llamacpp/``); heavy imports (torch, vllm,
llama_cpp) happen only inside them, when a backend is built.

``registry.SPECS`` holds every backend's static facts (:class:`BackendSpec`); ``base`` the contract they implement
(:class:`Backend`, and the optional :class:`AsyncGenerating`, :class:`TokenStreaming`, :class:`Scoring`,
:class:`AsyncScoring`, :class:`WeightLoading`).
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.backends.base import (
    AsyncGenerating,
    AsyncScoring,
    Backend,
    BackendOutput,
    Capabilities,
    Prompt,
    SamplingPlan,
    Scoring,
    TokenScores,
    TokenStreaming,
    WeightLoading,
)
from engine.backends.registry import REGISTRY, SPECS, BackendSpec, spec


def load_target(target: str) -> Any:
    """The object a ``module:attr`` target names (imported on first use)."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def backend_class(name: str, settings: object = None) -> Any:
    """The backend class registered under ``name``, for ``settings`` (its config section; e.g. vLLM's
    ``async_engine`` picks ``AsyncLLM``'s class)."""
    return load_target(spec(name).target_for(settings))


__all__ = ["REGISTRY", "SPECS", "AsyncGenerating", "AsyncScoring", "Backend", "BackendOutput", "BackendSpec",
           "Capabilities", "Prompt", "SamplingPlan", "Scoring", "TokenScores", "TokenStreaming", "WeightLoading",
           "backend_class", "load_target", "spec"]
