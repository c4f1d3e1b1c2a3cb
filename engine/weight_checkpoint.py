"""Weights reloaded from a saved checkpoint (``POST /update_weights_from_disk``, the name SGLang and AReaL use): the
trainer saves its model with ``save_pretrained`` (safetensors) and names the folder; every backend that loads
weights reads the tensors itself. The one transport that works everywhere a file system is shared, CPU hosts
included, with nothing to join.

What is read is checked before anything is loaded: a folder holding ``*.safetensors`` files (a ``.index.json`` is
not needed: every file is read), tensors in floating dtypes. Names and shapes are checked by the backend against its
model (HF) or by vLLM's own loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import RequestError
from engine.weight_sync import WEIGHT_DTYPES

LOAD_FORMATS = (None, "auto", "safetensors")


def check_model_path(model_path: Any, load_format: Any = None) -> Path:
    """The checkpoint folder a reload names, refused by name when it holds no safetensors weights.

    >>> check_model_path("/nonexistent/checkpoint")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: model_path is not a folder on this server, got '/nonexistent/checkpoint'. Fix: ...
    """
    if load_format not in LOAD_FORMATS:
        raise RequestError("load_format", load_format, "is not a format this server reads",
                           fix="leave it out, or send auto or safetensors (save with save_pretrained)")
    if not isinstance(model_path, str) or not model_path:
        raise RequestError("model_path", model_path, "must be the path of a saved checkpoint folder",
                           fix="send the folder model.save_pretrained(...) wrote")
    path = Path(model_path)
    if not path.is_dir():
        raise RequestError("model_path", model_path, "is not a folder on this server",
                           fix="send the folder model.save_pretrained(...) wrote, as this server sees it")
    if not any(path.glob("*.safetensors")):
        raise RequestError("model_path", model_path, "holds no *.safetensors file",
                           fix="save the checkpoint with safetensors (save_pretrained's default)")
    return path


def checkpoint_tensors(path: Path) -> list[tuple[str, Any]]:
    """Every tensor of the folder's safetensors files, by checkpoint name (floating dtypes only)."""
    from safetensors.torch import load_file

    out: list[tuple[str, Any]] = []
    for file in sorted(path.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            if str(tensor.dtype).removeprefix("torch.") not in WEIGHT_DTYPES:
                raise RequestError("model_path", str(file), f"holds {name} in {tensor.dtype}, not a floating dtype "
                                   "weights are loaded in", fix="save the model's floating weights only")
            out.append((name, tensor))
    return out
