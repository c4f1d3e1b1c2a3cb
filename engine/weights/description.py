"""What a push or a reload may bring: the served model's weights by checkpoint name (shape and dtype), read from the
headers of its safetensors files, and the one check every way weights arrive makes against it before anything is
written (swift's pushes, vLLM's transfer routes, ``/update_weights_from_disk``).

A push is refused, naming the field and the parameter, when it names a tensor the model does not have (a trainer's
value head), gives one in another shape, names one twice, names more tensors than the model has, or (a reload,
which is a whole session) brings part of a layer vLLM fuses (``q_proj`` without ``k_proj`` and ``v_proj``; ``gate_proj``
without ``up_proj``), which vLLM would rebuild from what came and what it no longer has. Any floating dtype is taken
(the backend casts to its own). Values are checked apart (:func:`check_finite`).

>>> weights = ModelWeights({"a.q_proj.weight": ((4, 2), "F32"), "a.k_proj.weight": ((2, 2), "F32"),
...                         "a.v_proj.weight": ((2, 2), "F32"), "norm.weight": ((2,), "F32")})
>>> weights.check([("name", "norm.weight", [2])])
>>> weights.check([("names[0]", "v_head.weight", [1, 2])])  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
engine.errors.RequestError: names[0] is not a parameter of the served model, got 'v_head.weight'. Fix: ...
>>> weights.check([("model_path", "a.q_proj.weight", [4, 2])], whole=True)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
engine.errors.RequestError: model_path brings part of a fused layer (a.q_proj.weight without a.k_proj.weight, \
a.v_proj.weight): ...
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import RequestError

FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""The checkpoint projections vLLM loads into one fused parameter (``qkv_proj``, ``gate_up_proj``)."""
MAX_HEADER_BYTES = 100 * 2**20
"""Largest safetensors header read (the format's own reader refuses beyond 100 MB)."""
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


def regular_file(path: Path, field: str) -> Path:
    """``path`` if it is a regular file (not a FIFO, a device or a socket, whose reads can block a server)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise RequestError(field, str(path)[:200], f"cannot be read ({err.strerror})",
                           fix="send a checkpoint folder this server can read") from None
    if not stat.S_ISREG(mode):
        raise RequestError(field, str(path)[:200], "is not a regular file", fix="send a folder of saved "
                           "*.safetensors files (model.save_pretrained), not a pipe or a device")
    return path


def read_header(file: Path, field: str = "model_path") -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) of every tensor of a safetensors file, from its header alone."""
    regular_file(file, field)
    with open(file, "rb") as handle:
        head = handle.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < size <= MAX_HEADER_BYTES:
            raise RequestError(field, str(file)[:200], "is not a safetensors file (its header size is "
                               f"{size} bytes)", fix="save the checkpoint with safetensors (save_pretrained)")
        try:
            header = json.loads(handle.read(size))
        except (ValueError, RecursionError):
            header = None
    if not isinstance(header, dict):
        raise RequestError(field, str(file)[:200], "has a corrupt safetensors header",
                           fix="save the checkpoint again with safetensors (save_pretrained)")
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise RequestError(field, str(file)[:200], f"has a corrupt safetensors header (tensor {name[:80]!r})",
                               fix="save the checkpoint again with safetensors (save_pretrained)")
        out[name] = (tuple(shape), str(entry.get("dtype")))
    return out


def checkpoint_headers(folder: Path, field: str = "model_path") -> dict[str, tuple[tuple[int, ...], str]]:
    """The headers of every ``*.safetensors`` file of ``folder``, by tensor name (a name in two files is refused)."""
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        for name, entry in read_header(file, field).items():
            if name in found:
                raise RequestError(field, str(file)[:200], f"holds {name[:80]} a second time",
                                   fix="save the checkpoint again (one file per tensor)")
            found[name] = entry
    return found


@dataclass(frozen=True)
class ModelWeights:
    """The served model's tensors by checkpoint name: ``name -> (shape, safetensors dtype)``.

    >>> ModelWeights({"w": ((2, 3), "F32")}).check([("name", "w", [3, 2])])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: name has shape [3, 2] but the model's w is [2, 3], got 'w'. Fix: ...
    """

    tensors: Mapping[str, tuple[tuple[int, ...], str]]

    @classmethod
    def of_checkpoint(cls, folder: str | Path, *, tied_embeddings: bool | None = None) -> ModelWeights:
        """The model as its checkpoint folder describes it; with tied embeddings (``config.json``'s
        ``tie_word_embeddings``), ``lm_head.weight`` is the embedding's, which a trainer may push by that name."""
        folder = Path(folder)
        tensors = checkpoint_headers(folder, "model.path")
        if tied_embeddings is None:
            config = folder / "config.json"
            tied_embeddings = bool(json.loads(config.read_text()).get("tie_word_embeddings")) \
                if config.is_file() else False
        embed = "model.embed_tokens.weight"
        if tied_embeddings and embed in tensors and "lm_head.weight" not in tensors:
            tensors["lm_head.weight"] = tensors[embed]
        return cls(tensors)

    def check(self, tensors: Sequence[tuple[str, str, Sequence[int]]], *, whole: bool = False) -> None:
        """Refuse, by field and name, ``(field, name, shape)`` tensors the model cannot take; ``whole``: they are a
        whole session (a reload), so a fused layer must come whole."""
        if len(tensors) > len(self.tensors):
            field = tensors[len(self.tensors)][0]
            raise RequestError(field, len(tensors), f"names more tensors than the served model has "
                               f"({len(self.tensors)})", fix="push the model's own parameters, each once")
        seen: set[str] = set()
        for field, name, shape in tensors:
            if name not in self.tensors:
                raise RequestError(field, name, "is not a parameter of the served model",
                                   fix="send the names GET /get_model_state_keys/ lists (a trainer's value head "
                                       "stays with the trainer)")
            if name in seen:
                raise RequestError(field, name, "is named twice in one push", fix="push each parameter once")
            seen.add(name)
            want = self.tensors[name][0]
            if tuple(shape) != want:
                raise RequestError(field, name, f"has shape {list(shape)} but the model's {name} is {list(want)}",
                                   fix="push the parameter with its own shape")
        if whole:
            self._check_fused_whole(tensors[0][0] if tensors else "model_path", seen)

    def _check_fused_whole(self, field: str, names: Iterable[str]) -> None:
        names = set(names)
        for name in sorted(names):
            for group in FUSED_GROUPS:
                part = next((p for p in group if f".{p}." in name), None)
                if part is None:
                    continue
                siblings = [name.replace(f".{part}.", f".{other}.") for other in group if other != part]
                missing = [s for s in siblings if s in self.tensors and s not in names]
                if missing:
                    raise RequestError(field, name, f"brings part of a fused layer ({name} without "
                                       f"{', '.join(missing)}): vLLM loads them as one parameter",
                                       fix="save or push the whole layer (every projection it fuses)")


def check_finite(received: Iterable[tuple[str, Any]], field: str = "name") -> None:
    """Refuse tensors holding NaN or infinity before any is written: a learner whose weights diverged would make
    every sampled answer garbage or an error (HF's sampler fails on NaN probabilities)."""
    import torch

    for name, tensor in received:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise RequestError(field, name, "holds NaN or infinite values", fix="push finite weights (the "
                               "learner's update diverged); the served weights are unchanged")


def check_dtypes(headers: Mapping[str, tuple[tuple[int, ...], str]], field: str = "model_path") -> None:
    """Every tensor of a reload in a floating dtype."""
    for name, (_, dtype) in headers.items():
        if dtype not in FLOAT_DTYPES:
            raise RequestError(field, name, f"is stored in {dtype}, not a floating dtype weights are loaded in",
                               fix="save the model's floating weights only")
