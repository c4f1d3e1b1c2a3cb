"""Backends, by name: one subpackage per backend (``hf/``, ``vllm/``, ``llamacpp/``); heavy imports (torch, vllm,
llama_cpp) happen only inside them, when a backend is built.

``registry.SPECS`` holds every backend's static facts (:class:`~engine.backends.registry.BackendSpec`); ``base`` the
contract they implement (:class:`~engine.backends.base.Backend`, and the optional ``AsyncGenerating``,
``TokenStreaming``, ``Scoring``, ``AsyncScoring``, ``WeightLoading``): import them from those modules. This package
imports neither at import time, so that reading the registry (``engine.config`` does) never loads the contract, which
imports the config back.
"""

from __future__ import annotations

import importlib
from typing import Any


def load_target(target: str) -> Any:
    """The object a ``module:attr`` target names (imported on first use)."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def backend_class(name: str, settings: object = None) -> Any:
    """The backend class registered under ``name``, for ``settings`` (its config section; e.g. vLLM's
    ``async_engine`` picks ``AsyncLLM``'s class)."""
    from engine.backends.registry import spec

    return load_target(spec(name).target_for(settings))


__all__ = ["backend_class", "load_target"]
