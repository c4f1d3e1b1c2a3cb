"""The ``sitecustomize`` way in: attach the guard the moment swift imports its GRPO vLLM engine.

``engine/swift_rollout/site/sitecustomize.py`` arms it at interpreter start. Armed, it waits on ``sys.meta_path`` for
:data:`TARGET` and runs :func:`engine.swift_rollout.attach.install` right after that module is executed: in swift's
main process (while its rollout pipeline is imported, before any argument is parsed, so a bad subtree stops it) and in
each rollout worker it spawns (they start with the same ``PYTHONPATH``). Processes that never import swift's GRPO
engine pay one finder lookup per import and nothing else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Any

TARGET = "swift.infer_engine.grpo_vllm_engine"
"""The module that defines ``GRPOVllmEngine``, the engine ``swift rollout`` builds in its workers."""


def _target() -> str:
    return TARGET  # read at each use, so a test can point the hook at a module of its own


class _AttachAfterImport(importlib.abc.MetaPathFinder):
    """Finds :data:`TARGET` with the other finders, then wraps its loader so ``install`` runs after it executes."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _target():
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from finding this finder again
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            from engine.swift_rollout.attach import install

            install()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def arm() -> bool:
    """Wait for swift's GRPO engine; True when armed. Already imported (a plugin file got there first): ``install``
    runs now instead (it runs once per process either way)."""
    if _target() in sys.modules:
        from engine.swift_rollout.attach import install

        install()
        return False
    if not any(isinstance(f, _AttachAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AttachAfterImport())
    return True


def disarm() -> None:
    """Remove the hook (tests)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AttachAfterImport)]
