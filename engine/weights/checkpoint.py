"""Weights reloaded from a saved checkpoint (``POST /update_weights_from_disk``, the name SGLang and AReaL use): the
trainer saves its model with ``save_pretrained`` (safetensors) and names the folder; every backend that loads
weights reads the tensors itself. The one transport that works everywhere a file system is shared, CPU hosts
included, with nothing to join.

What is read is checked before anything is loaded: a folder holding ``*.safetensors`` files (regular files; a
``.index.json`` is not needed: every file is read), their headers first (tensors in floating dtypes; names, shapes
and, for vLLM, whole fused layers checked by the backend against its model), then every value finite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import RequestError

LOAD_FORMATS = (None, "auto", "safetensors")
MAX_PATH_CHARS = 4096
"""Longest ``model_path`` (Linux's ``PATH_MAX``)."""


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
    if not isinstance(model_path, str) or not model_path or len(model_path) > MAX_PATH_CHARS:
        raise RequestError("model_path", model_path if isinstance(model_path, str) and len(model_path) < 200 else
                           f"({type(model_path).__name__} of {len(model_path) if isinstance(model_path, str) else '?'} "
                           "characters)", f"must be the path of a saved checkpoint folder (at most {MAX_PATH_CHARS} "
                           "characters)", fix="send the folder model.save_pretrained(...) wrote")
    path = Path(model_path)
    try:
        is_dir = path.is_dir()
    except OSError:  # a name too long for the file system, a component that is no folder...
        is_dir = False
    if not is_dir:
        raise RequestError("model_path", model_path, "is not a folder on this server",
                           fix="send the folder model.save_pretrained(...) wrote, as this server sees it")
    if not any(path.glob("*.safetensors")):
        raise RequestError("model_path", model_path, "holds no *.safetensors file",
                           fix="save the checkpoint with safetensors (save_pretrained's default)")
    return path


def checkpoint_description(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of every tensor of the folder, from the safetensors headers alone (regular files only:
    a pipe named ``model.safetensors`` would hold the reader), floating dtypes only."""
    from engine.weights.description import check_dtypes, checkpoint_headers

    headers = checkpoint_headers(path)
    check_dtypes(headers)
    return headers


def check_checkpoint_values(path: Path) -> None:
    """Every value of the folder finite, read one tensor at a time (memory: the largest tensor), for a backend that
    loads the folder elsewhere (vLLM's engine core) and must not start a reload it cannot finish."""
    from safetensors import safe_open

    from engine.weights.description import check_finite

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open is no mapping)
                check_finite([(name, tensors.get_tensor(name))], "model_path")


def checkpoint_tensors(path: Path) -> list[tuple[str, Any]]:
    """Every tensor of the folder's safetensors files, by checkpoint name; the caller checked the headers
    (:func:`checkpoint_description`) before reading them."""
    from safetensors.torch import load_file

    out: list[tuple[str, Any]] = []
    for file in sorted(path.glob("*.safetensors")):
        out.extend(load_file(str(file)).items())
    return out
