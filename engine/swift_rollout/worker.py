"""The vLLM worker extension of a guarded ``swift rollout``: swift's own (weight sync) plus the engine's rule events.

vLLM takes one ``worker_extension_cls`` by dotted name and imports it in every worker process. Swift sets its
``WeightSyncWorkerExtension``; :mod:`.attach` replaces that name with ``engine.swift_rollout.WORKER_EXTENSION`` and
names swift's in the environment variable ``WORKER_BASE_VARIABLE`` (inherited by the engine-core and tensor-parallel
processes vLLM starts), so :class:`GuardedWorker` here is the engine's
:class:`~engine.backends.vllm.events.EngineWorkerExtension` mixed with whatever swift configured, and every one of
swift's collective calls keeps working.
"""

from __future__ import annotations

import importlib
import os

from engine.backends.vllm.events import EngineWorkerExtension
from engine.swift_rollout import WORKER_BASE_VARIABLE


def _resolve(dotted: str) -> type:
    module, _, name = dotted.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), name)


def _bases() -> tuple[type, ...]:
    base = os.environ.get(WORKER_BASE_VARIABLE)
    return (EngineWorkerExtension,) if not base else (EngineWorkerExtension, _resolve(base))


GuardedWorker = type("GuardedWorker", _bases(), {"__module__": __name__, "__doc__": (
    "The engine's rule events mixed with the worker extension swift configured (named by the environment)."),
    "__qualname__": "GuardedWorker"})
