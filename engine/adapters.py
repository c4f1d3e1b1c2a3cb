"""LoRA adapters: what ``model.adapters`` names, read and checked once, before any backend loads one.

Every backend loads the same adapters (``model.adapters``: name -> folder) and a request picks one by name
(``ChatRequest.adapter``, or a call's ``adapter=``; none: the base model). This module is the one rule all of them
share: the adapter's ``adapter_config.json`` (PEFT's LoRA: rank, alpha, target modules), the rank limit (vLLM sizes
its LoRA slots by ``max_lora_rank`` at start; the engine holds every backend to the same limit, so an adapter one
backend loads every backend loads), and the shapes of its A and B matrices against the base model's own weights
(an adapter trained for another model is refused by name before generation, not multiplied into garbage or a
crash). Backends translate the checked :class:`Adapter` in one place each: PEFT on HF, ``LoRARequest`` on vLLM,
llama.cpp's adapter API on a GGUF twin of the adapter (its folder holds ``adapter_config.json`` beside one
``.gguf``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config.engine_config import LORA_RANKS as RANKS
from engine.errors import ConfigError, RequestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"



@dataclass(frozen=True)
class Adapter:
    """One checked LoRA adapter of ``model.adapters``.

    >>> a = Adapter(name="math", path="/adapters/math", rank=8, alpha=16.0, targets=("q_proj", "v_proj"), id=1)
    >>> a.scale
    2.0
    """

    name: str
    path: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    id: int
    """A positive id, stable for the engine's life (vLLM's ``lora_int_id``): its place in ``model.adapters``."""

    @property
    def scale(self) -> float:
        """PEFT's scaling of ``B @ A``: alpha over rank (what llama.cpp derives from the GGUF's alpha too)."""
        return self.alpha / self.rank


def read_adapter(name: str, path: str, index: int, field: str | None = None) -> Adapter:
    """``path``'s adapter config as an :class:`Adapter`, or a typed error naming ``field`` (default
    ``model.adapters.<name>``; a served load names its body's ``lora_path``)."""
    field = field or f"model.adapters.{name}"
    folder = Path(path)
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        what = "does not exist" if not folder.exists() else f"holds no {CONFIG_FILE}"
        raise ConfigError(field, path, what, fix="give the folder a trainer saved the adapter to (PEFT's "
                          "save_pretrained: adapter_config.json beside adapter_model.safetensors)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(field, path, f"has an unreadable {CONFIG_FILE} ({err})",
                          fix="save the adapter again") from None
    return adapter_of_config(config, name, str(folder.resolve()), index, field, where=CONFIG_FILE)


UNSHARED = {"use_rslora": "rank-stabilised scaling", "rank_pattern": "per-module ranks",
            "alpha_pattern": "per-module alphas", "modules_to_save": "whole modules trained beside the adapter",
            "bias": "trained biases"}
"""PEFT LoRA options an adapter is refused for, by name: the engine scales every adapter by ``lora_alpha / r`` with
one rank and only ``lora_A``/``lora_B`` weights, the same on HF, vLLM and llama.cpp."""


def adapter_of_config(config: Any, name: str, path: str, index: int, field: str, *, where: str) -> Adapter:
    """A PEFT LoRA config (``adapter_config.json``'s object, or the ``peft_config`` a learner sends with an
    adapter-only weight push) as an :class:`Adapter`, or a typed error naming ``field``; ``where`` names the config
    in the message.

    >>> adapter_of_config({"r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj"]}, "a", "/a", 0,
    ...                   "peft_config", where="peft_config").targets
    ('q_proj', 'v_proj')
    >>> adapter_of_config({"r": 0}, "a", "/a", 0, "peft_config", where="peft_config")
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: peft_config has rank r=0 in peft_config, got '/a'. Fix: save it with a positive rank.
    """
    if not isinstance(config, dict):
        raise ConfigError(field, path, f"has a {where} that is not an object", fix="save the adapter again")
    if str(config.get("peft_type") or "LORA").upper() != "LORA":
        raise ConfigError(field, path, f"is a {config.get('peft_type')} adapter; the engine loads LoRA adapters only",
                          fix="train a LoRA adapter (peft.LoraConfig)")
    if config.get("use_dora"):
        raise ConfigError(field, path, "is a DoRA adapter, which vLLM and llama.cpp do not load",
                          fix="train it without use_dora")
    for key, why in UNSHARED.items():
        if config.get(key) not in (None, False, {}, [], "none"):
            raise ConfigError(field, path, f"sets {key}={config[key]!r} in {where} ({why}), which the engine does "
                              "not load on every backend alike", fix=f"train the adapter without {key}")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ConfigError(field, path, f"has rank r={rank!r} in {where}", fix="save it with a positive rank")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError(field, path, f"has lora_alpha={alpha!r} in {where}",
                          fix="save it with a positive finite lora_alpha")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = (targets,)
    elif not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ConfigError(field, path, f"has target_modules={targets!r} in {where}",
                          fix="save it with a list of module names")
    return Adapter(name=name, path=path, rank=rank, alpha=float(alpha), targets=tuple(sorted(targets)), id=index + 1)


def rank_limit(adapters: tuple[Adapter, ...], configured: int | None) -> int:
    """The engine's LoRA rank limit: ``model.max_lora_rank``, or the smallest of :data:`RANKS` that holds every
    configured adapter; an adapter above a configured limit is refused by name.

    >>> rank_limit((Adapter("a", "/a", 8, 16.0, (), 1), Adapter("b", "/b", 12, 16.0, (), 2)), None)
    16
    >>> rank_limit((Adapter("a", "/a", 32, 16.0, (), 1),), 16)
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: model.adapters.a has rank 32, over model.max_lora_rank 16, got '/a'. \
Fix: raise model.max_lora_rank to 32 or more (one of 1, 8, 16, 32, 64, 128, 256, 320, 512), or train a smaller rank.
    """
    largest = max((a.rank for a in adapters), default=RANKS[1])
    if configured is None:
        return next((r for r in RANKS if r >= largest), largest)
    for adapter in adapters:
        check_rank(adapter, configured)
    return configured


def check_rank(adapter: Adapter, limit: int, field: str | None = None) -> None:
    """Refuse an adapter whose rank is over the engine's limit (see :func:`rank_limit`)."""
    if adapter.rank > limit:
        raise ConfigError(field or f"model.adapters.{adapter.name}", adapter.path, f"has rank {adapter.rank}, over "
                          f"model.max_lora_rank {limit}", fix=f"raise model.max_lora_rank to {adapter.rank} or more "
                          f"(one of {', '.join(map(str, RANKS))}), or train a smaller rank")


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a ``.safetensors`` file's header (no tensor is read), by the one header reader
    (``engine.weights.description.read_header``: a regular file, a bounded header, every entry shaped); a file that
    is none raises ``ValueError``."""
    from engine.weights.description import read_header

    try:
        return {name: shape for name, (shape, _) in read_header(path, field="adapter").items()}
    except RequestError as err:
        raise ValueError(err.problem) from None


def check_weights(adapter: Adapter, field: str) -> dict[str, tuple[int, ...]]:
    """The adapter's weight shapes, every value read and checked finite and floating first: a NaN or inf in an
    adapter would reach every row that uses it as NaN logits (vLLM's sampler fails the engine core on them); a file
    that is no safetensors file is refused by field, never a loader's exception."""
    import numpy as np
    from safetensors.numpy import load_file

    weights = Path(adapter.path) / WEIGHTS_FILE
    try:
        shapes = safetensors_shapes(weights)
        tensors = load_file(str(weights))
    except Exception as err:  # the file is the client's: any failure to read it is this field's 400
        raise ConfigError(field, adapter.path, f"holds an unreadable {WEIGHTS_FILE} ({err})",
                          fix="save the adapter again with PEFT's save_pretrained") from None
    for name, tensor in sorted(tensors.items()):
        if tensor.dtype.kind != "f":
            raise ConfigError(field, adapter.path, f"has {name} of dtype {tensor.dtype}, not floating point",
                              fix="save the adapter's weights as float32, bfloat16 or float16")
        if not np.isfinite(tensor).all():
            raise ConfigError(field, adapter.path, f"has {name} with non-finite values (NaN or inf)",
                              fix="save the adapter from a trainer step whose weights are finite")
    return shapes


def base_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """The base checkpoint's weight shapes (every ``*.safetensors`` of the folder); empty where it has none."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        shapes.update(safetensors_shapes(file))
    return shapes


def check_against_base(adapter: Adapter, base: Mapping[str, tuple[int, ...]], field: str | None = None) -> None:
    """Refuse an adapter whose A or B does not fit the base weight it changes (trained for another model): each
    ``lora_A`` is (rank, in), each ``lora_B`` (out, rank), for a base weight of (out, in). Adapters saved in another
    format (a GGUF twin) are checked by their backend when it loads them; a backend that reads PEFT's files takes
    safetensors weights only.

    >>> a = Adapter("x", "/x", 8, 16.0, ("q_proj",), 1)
    >>> check_fit(a, "model.layers.0.self_attn.q_proj", (8, 64), (576, 8), {"model.layers.0.self_attn.q_proj.weight":
    ...                                                                     (576, 576)})
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: model.adapters.x changes model.layers.0.self_attn.q_proj as (576, 64), but that \
weight is (576, 576) in model.path (an adapter of another base model), got '/x'. Fix: give an adapter trained on \
this model.path.
    """
    weights = Path(adapter.path) / WEIGHTS_FILE
    if not weights.is_file():
        pickled = any((Path(adapter.path) / name).is_file() for name in ("adapter_model.bin", "adapter_model.pt"))
        raise ConfigError(field or f"model.adapters.{adapter.name}", adapter.path, f"holds no {WEIGHTS_FILE}" + (
                          " (its pickled adapter_model.bin is not read: unpickling a file can run code)" if pickled
                          else ""), fix="save the adapter with safetensors (PEFT's default, safe_serialization=True)")
    check_shapes(adapter, check_weights(adapter, field or f"model.adapters.{adapter.name}"), base, field)


def check_shapes(adapter: Adapter, shapes: Mapping[str, tuple[int, ...]], base: Mapping[str, tuple[int, ...]],
                 field: str | None = None) -> None:
    """Each ``lora_A`` of ``shapes`` (tensor name -> shape: a file's, or what a learner announces) with its
    ``lora_B``, against the base weight it changes (:func:`check_fit`); nothing to compare with an empty ``base``."""
    if not base:
        return
    for name, a_shape in sorted(shapes.items()):
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0].removeprefix("base_model.model.")
        b_shape = shapes.get(name.replace(".lora_A.", ".lora_B."))
        if b_shape is None:
            raise ConfigError(field or f"model.adapters.{adapter.name}", adapter.path, f"has {name} without its "
                              "lora_B", fix="save the adapter again")
        check_fit(adapter, module, a_shape, b_shape, base, field)


def check_fit(adapter: Adapter, module: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...],
              base: Mapping[str, tuple[int, ...]], field: str | None = None) -> None:
    """One module's A and B against the base weight ``module + ".weight"`` (see :func:`check_against_base`)."""
    field = field or f"model.adapters.{adapter.name}"
    fix = "give an adapter trained on this model.path"
    weight = base.get(f"{module}.weight")
    if weight is None:
        raise ConfigError(field, adapter.path, f"changes {module}, which model.path does not have (an adapter of "
                          "another base model)", fix=fix)
    if len(a_shape) != 2 or len(b_shape) != 2 or (b_shape[0], a_shape[1]) != tuple(weight):
        got = (b_shape[0], a_shape[1]) if len(a_shape) == 2 and len(b_shape) == 2 else (a_shape, b_shape)
        raise ConfigError(field, adapter.path, f"changes {module} as {got}, but that weight is {tuple(weight)} in "
                          "model.path (an adapter of another base model)", fix=fix)
    if a_shape[0] != adapter.rank or b_shape[1] != adapter.rank:
        raise ConfigError(field, adapter.path, f"has {module} of rank {a_shape[0]}/{b_shape[1]}, but its "
                          f"{CONFIG_FILE} says r={adapter.rank}", fix="save the adapter again")


def load_adapters(adapters: Mapping[str, str], max_rank: int | None,
                  base_dir: str | None = None) -> tuple[tuple[Adapter, ...], int]:
    """Every configured adapter read and checked (against ``base_dir``'s weights where given), and the rank limit.

    >>> load_adapters({}, None)
    ((), 8)
    """
    checked = tuple(read_adapter(name, path, i) for i, (name, path) in enumerate(adapters.items()))
    limit = rank_limit(checked, max_rank)
    if base_dir is not None and checked:
        base = base_shapes(Path(base_dir))
        for adapter in checked:
            check_against_base(adapter, base)
    return checked, limit


def check_loadable(name: str, path: str, *, loaded: tuple[str, ...], limit: int, base_dir: str | None,
                   replace: bool) -> Adapter:
    """An adapter to load while the engine runs (``engine.load_adapter``, ``/v1/load_lora_adapter``), checked as one
    of ``model.adapters`` is, the fields named as vLLM's route names them (``lora_name``, ``lora_path``); its id is the
    backend's to give. A name already loaded needs ``replace`` (vLLM's ``load_inplace``)."""
    from engine.config.engine_config import check_adapter_entry

    check_adapter_entry(name, path, field="lora_name")
    if name in loaded and not replace:
        raise RequestError("lora_name", name, "is already loaded", fix="unload it first, or load it in place "
                           "(load_inplace: true; engine.load_adapter(..., replace=True))")
    adapter = read_adapter(name, path, 0, field="lora_path")
    check_rank(adapter, limit, field="lora_path")
    if base_dir is not None:
        check_against_base(adapter, base_shapes(Path(base_dir)), field="lora_path")
    return adapter


SYNCED = "swift_lora"
"""The name of the adapter a learner pushes over the weight routes (``/update_adapter_flattened_param/``,
``/update_adapter_param/``): listed in ``GET /v1/models`` like any loaded adapter, replaced in place by each push."""


def check_pushed(config: Any, tensors: list[tuple[str, str, list[int]]], *, limit: int,
                 base_dir: str | None) -> Adapter:
    """An adapter a learner announces (its ``peft_config`` and ``(field, name, shape)`` of every tensor), checked as
    a saved one is, before a byte of it is received: a LoRA config within the engine's rank limit, only ``lora_A`` and
    ``lora_B`` weights, each pair fitting the base weight it changes. The values are checked (finite, floating) when
    the received adapter is loaded (:func:`check_loadable`).

    >>> check_pushed({"r": 4, "target_modules": ["q_proj"]}, [("metadatas[0].name", "lm_head.weight", [8, 4])],
    ...              limit=8, base_dir=None)
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: metadatas[0].name is not a LoRA A or B weight, got 'lm_head.weight'. Fix: push \
only the adapter's lora_A and lora_B weights (peft.get_peft_model_state_dict), as swift's trainer does.
    """
    adapter = adapter_of_config(config, SYNCED, "peft_config", 0, "peft_config", where="peft_config")
    check_rank(adapter, limit, field="peft_config.r")
    shapes: dict[str, tuple[int, ...]] = {}
    for field, name, shape in tensors:
        if ".lora_A." not in name and ".lora_B." not in name:
            raise RequestError(field, name, "is not a LoRA A or B weight", fix="push only the adapter's lora_A and "
                               "lora_B weights (peft.get_peft_model_state_dict), as swift's trainer does")
        shapes[name] = tuple(shape)
    if base_dir is not None:
        check_shapes(adapter, shapes, base_shapes(Path(base_dir)), field="metadatas")
    return adapter


def write_adapter(folder: str, config: Mapping[str, Any], tensors: list[tuple[str, Any]]) -> None:
    """A received adapter saved as PEFT saves one (``adapter_config.json`` beside ``adapter_model.safetensors``), so
    every backend loads it through the one loading rule (:meth:`AdapterSet.admit`). The config written holds only
    what :func:`adapter_of_config` read (rank, alpha, target modules): nothing a learner sent besides reaches a
    loader."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors}, str(out / WEIGHTS_FILE))
    (out / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config["r"],
                                               "lora_alpha": config.get("lora_alpha", config["r"]),
                                               "target_modules": config.get("target_modules"), "lora_dropout": 0.0,
                                               "bias": "none"}))


def check_adapter_name(name: Any, known: Mapping[str, Adapter] | tuple[str, ...], at: str) -> None:
    """Refuse a request's adapter that is not a name the engine loaded (None: the base model).

    >>> check_adapter_name("mathh", ("math",), "requests[0].adapter")
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: requests[0].adapter is not an adapter this engine loaded (loaded: math), got \
'mathh'. Fix: use one of the loaded names, or leave it out for the base model.
    """
    if name is None:
        return
    if not isinstance(name, str) or name not in known:
        loaded = ", ".join(sorted(known)) or "none; set model.adapters"
        raise RequestError(at, name, f"is not an adapter this engine loaded (loaded: {loaded})",
                           fix="use one of the loaded names, or leave it out for the base model")


def zero_adapter(adapter: Adapter, out: Path) -> Path:
    """A copy of ``adapter`` with every weight zero, written to ``out``: B @ A adds exactly 0.0, so a row that runs
    with it computes the base model's numbers bit for bit (vLLM's CPU LoRA kernels apply the last loaded adapter to a
    mixed batch's base rows: :mod:`engine.backends.vllm.lora`)."""
    import numpy as np
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    shapes = safetensors_shapes(Path(adapter.path) / WEIGHTS_FILE)
    save_file({name: np.zeros(shape, dtype=np.float32) for name, shape in shapes.items()}, str(out / WEIGHTS_FILE))
    config: dict[str, Any] = json.loads((Path(adapter.path) / CONFIG_FILE).read_text())
    (out / CONFIG_FILE).write_text(json.dumps(config))
    return out


def by_adapter(adapters: list[str | None]) -> list[tuple[str | None, list[int]]]:
    """Row indices grouped by adapter, groups in the order each adapter first appears, rows in order: how a backend
    that runs one adapter per forward (HF with PEFT, llama.cpp) splits a mixed batch.

    >>> by_adapter([None, "a", None, "b", "a"])
    [(None, [0, 2]), ('a', [1, 4]), ('b', [3])]
    """
    groups: dict[str | None, list[int]] = {}
    for i, name in enumerate(adapters):
        groups.setdefault(name, []).append(i)
    return list(groups.items())


class AdapterSet:
    """The adapters a backend holds: those of ``model.adapters`` (checked at start), and those loaded or dropped
    while it runs, with the rank limit and the ids; each backend keeps one and does its own loading beside it.

    Loading at run time needs LoRA on from the start, on every backend alike (vLLM sizes its LoRA slots when it
    starts): ``model.adapters`` names one, or ``model.max_lora_rank`` is set.

    >>> from engine.config import ModelConfig
    >>> AdapterSet(ModelConfig(path="/m"), None).admit("x", "/x", replace=False)
    Traceback (most recent call last):
    ...
    engine.errors.UnsupportedCapabilityError: this engine was started without LoRA adapters; loading one while it \
runs needs them on from the start. Fix: start it with model.max_lora_rank set (or with model.adapters)
    """

    def __init__(self, model: Any, base_dir: str | None) -> None:
        adapters, self.limit = load_adapters(model.adapters, model.max_lora_rank, base_dir)
        self.enabled = bool(adapters) or model.max_lora_rank is not None
        self.loaded: dict[str, Adapter] = {a.name: a for a in adapters}
        self.base_dir = base_dir
        self._next_id = len(adapters) + 1

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.loaded)

    def take_id(self) -> int:
        """A fresh positive id (never one given before: a reloaded adapter is a new one to vLLM's caches)."""
        self._next_id += 1
        return self._next_id - 1

    def admit(self, name: str, path: str, *, replace: bool) -> Adapter:
        """The checked adapter to load as ``name`` (with a fresh id); the backend loads it, then :meth:`keep`."""
        from engine.errors import UnsupportedCapabilityError

        if not self.enabled:
            raise UnsupportedCapabilityError("this engine was started without LoRA adapters; loading one while it "
                                             "runs needs them on from the start. Fix: start it with "
                                             "model.max_lora_rank set (or with model.adapters)")
        adapter = check_loadable(name, path, loaded=self.names, limit=self.limit, base_dir=self.base_dir,
                                 replace=replace)
        return Adapter(name=adapter.name, path=adapter.path, rank=adapter.rank, alpha=adapter.alpha,
                       targets=adapter.targets, id=self.take_id())

    def keep(self, adapter: Adapter) -> None:
        self.loaded[adapter.name] = adapter

    def drop(self, name: str) -> Adapter:
        """The loaded adapter ``name``, forgotten (the backend unloads it); an unknown name is refused by field."""
        if name not in self.loaded:
            loaded = ", ".join(self.names) or "none"
            raise RequestError("lora_name", name, f"is not a loaded adapter (loaded: {loaded})",
                               fix="name one that GET /v1/models lists with a parent")
        return self.loaded.pop(name)
