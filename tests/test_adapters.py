"""LoRA adapters' shared rule (``engine.adapters``): reading, rank limit, fit to the base model, request names, the
zero adapter, grouping, and the config's own checks. Synthetic files only: the backends load the fixture adapters in
``conformance/test_adapters.py``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from engine.adapters import (
    by_adapter,
    check_adapter_name,
    check_pushed,
    load_adapters,
    rank_limit,
    read_adapter,
    zero_adapter,
)
from engine.config import EngineConfig
from engine.errors import ConfigError, RequestError
from engine.types import ChatRequest

BASE = {"model.layers.0.self_attn.q_proj.weight": (16, 12), "model.layers.0.self_attn.v_proj.weight": (4, 12)}


def write_base(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: np.ones(shape, dtype=np.float32) for name, shape in BASE.items()},
              str(folder / "model.safetensors"))
    return folder


def write_adapter(folder: Path, *, rank: int = 2, out: int = 16, inp: int = 12, module: str = "q_proj",
                  **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    prefix = f"base_model.model.model.layers.0.self_attn.{module}"
    rng = np.random.default_rng(0)
    save_file({f"{prefix}.lora_A.weight": rng.normal(size=(rank, inp)).astype(np.float32),
               f"{prefix}.lora_B.weight": rng.normal(size=(out, rank)).astype(np.float32)},
              str(folder / "adapter_model.safetensors"))
    fields = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [module], **config}
    (folder / "adapter_config.json").write_text(json.dumps(fields))
    return folder


def test_an_adapter_of_this_model_loads_with_its_rank_alpha_targets_and_a_stable_id(tmp_path):
    base = write_base(tmp_path / "base")
    adapters, limit = load_adapters({"a": str(write_adapter(tmp_path / "a")),
                                     "b": str(write_adapter(tmp_path / "b", rank=12))}, None, str(base))
    assert [(a.name, a.rank, a.alpha, a.targets, a.id) for a in adapters] == [
        ("a", 2, 4.0, ("q_proj",), 1), ("b", 12, 24.0, ("q_proj",), 2)]
    assert limit == 16  # the smallest of vLLM's ranks that holds 12
    assert adapters[0].scale == 2.0


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"out": 8}, "changes model.layers.0.self_attn.q_proj as (8, 12), but that weight is (16, 12)"),
    ({"inp": 10}, "as (16, 10)"),
    ({"module": "k_proj"}, "changes model.layers.0.self_attn.k_proj, which model.path does not have"),
])
def test_an_adapter_of_another_base_model_is_refused_by_its_name_before_any_backend_loads(tmp_path, kwargs, says):
    base = write_base(tmp_path / "base")
    with pytest.raises(ConfigError) as info:
        load_adapters({"math": str(write_adapter(tmp_path / "a", **kwargs))}, None, str(base))
    assert info.value.field == "model.adapters.math" and says in str(info.value), str(info.value)


def test_a_rank_over_the_limit_a_missing_folder_and_other_kinds_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_adapters({"big": str(write_adapter(tmp_path / "big", rank=32))}, 16)
    assert info.value.field == "model.adapters.big" and "rank 32, over model.max_lora_rank 16" in str(info.value)
    with pytest.raises(ConfigError) as info:
        read_adapter("gone", str(tmp_path / "nowhere"), 0)
    assert info.value.field == "model.adapters.gone" and "does not exist" in str(info.value)
    with pytest.raises(ConfigError, match=r"holds no adapter_config\.json"):
        read_adapter("empty", str(tmp_path), 0)
    with pytest.raises(ConfigError, match="DoRA"):
        read_adapter("dora", str(write_adapter(tmp_path / "dora", use_dora=True)), 0)
    with pytest.raises(ConfigError, match=r"IA3 adapter"):
        read_adapter("ia3", str(write_adapter(tmp_path / "ia3", peft_type="IA3")), 0)
    assert rank_limit((), None) == 8


def test_a_request_names_a_loaded_adapter_or_none(tmp_path):
    check_adapter_name(None, ("a",), "adapter")
    check_adapter_name("a", ("a",), "adapter")
    with pytest.raises(RequestError) as info:
        check_adapter_name("b", ("a",), "requests[3].adapter")
    assert info.value.field == "requests[3].adapter" and "loaded: a" in str(info.value)
    with pytest.raises(RequestError, match=r"loaded: none; set model\.adapters"):
        check_adapter_name("a", (), "adapter")
    with pytest.raises(RequestError) as info:
        ChatRequest.of(ChatRequest(({"role": "user", "content": "x"},), adapter=7), index=1)
    assert info.value.field == "requests[1].adapter"


def test_the_zero_adapter_has_the_adapters_shapes_and_only_zeros(tmp_path):
    base = write_base(tmp_path / "base")
    (adapter,), _ = load_adapters({"a": str(write_adapter(tmp_path / "a"))}, None, str(base))
    zero = zero_adapter(adapter, tmp_path / "zero")
    original, zeros = load_file(str(tmp_path / "a" / "adapter_model.safetensors")), load_file(
        str(zero / "adapter_model.safetensors"))
    assert {k: v.shape for k, v in zeros.items()} == {k: v.shape for k, v in original.items()}
    assert all(not v.any() for v in zeros.values()) and any(v.any() for v in original.values())
    assert json.loads((zero / "adapter_config.json").read_text())["r"] == 2


def test_rows_group_by_adapter_in_order_of_first_appearance():
    assert by_adapter(["a", None, "a", "b", None]) == [("a", [0, 2]), (None, [1, 4]), ("b", [3])]
    assert by_adapter([]) == []


@pytest.mark.parametrize(("model", "field"), [
    ({"adapters": ["a"]}, "model.adapters"),
    ({"adapters": {"a/b": "/x"}}, "model.adapters"),
    ({"adapters": {"a": 3}}, "model.adapters.a"),
    ({"adapters": {"a": ""}}, "model.adapters.a"),
    ({"max_lora_rank": 12}, "model.max_lora_rank"),
    ({"max_lora_rank": True}, "model.max_lora_rank"),
])
def test_the_config_refuses_malformed_adapter_settings_by_field(model, field):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"backend": "hf", "model": {"path": "/m", **model}})
    assert info.value.field == field, str(info.value)


def test_vllm_max_loras_is_a_positive_integer():
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"backend": "vllm", "model": "/m", "vllm": {"max_loras": 0}})
    assert info.value.field == "vllm.max_loras"


def test_an_adapter_with_pickled_weights_only_is_refused_by_name(tmp_path):
    """PEFT falls back to ``adapter_model.bin`` (a pickle) where no safetensors file exists: the engine never reads
    one, at start or on a served load, so a folder a client names cannot run code in the server."""
    base = write_base(tmp_path / "base")
    folder = write_adapter(tmp_path / "a")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(ConfigError) as info:
        load_adapters({"a": str(folder)}, None, str(base))
    assert info.value.field == "model.adapters.a" and "unpickling" in str(info.value)


def test_an_adapter_set_admits_checked_adapters_with_fresh_ids_and_drops_by_name(tmp_path):
    from engine.adapters import AdapterSet
    from engine.config import ModelConfig
    from engine.errors import UnsupportedCapabilityError

    base = write_base(tmp_path / "base")
    first = write_adapter(tmp_path / "a")
    held = AdapterSet(ModelConfig(path=str(base), adapters={"a": str(first)}), str(base))
    assert held.enabled and held.names == ("a",) and held.limit == 8
    again = held.admit("a", str(first), replace=True)
    assert again.id != held.loaded["a"].id  # a reload is a new adapter to vLLM's caches
    with pytest.raises(RequestError) as info:
        held.admit("a", str(first), replace=False)
    assert info.value.field == "lora_name"
    with pytest.raises(ConfigError) as info:
        held.admit("big", str(write_adapter(tmp_path / "big", rank=16)), replace=False)
    assert info.value.field == "lora_path" and "over model.max_lora_rank 8" in str(info.value)
    with pytest.raises(ConfigError) as info:
        held.admit("other", str(write_adapter(tmp_path / "other", out=8)), replace=False)
    assert info.value.field == "lora_path" and "another base model" in str(info.value)
    held.keep(again)
    assert held.drop("a") == again and held.names == ()
    with pytest.raises(RequestError, match="is not a loaded adapter"):
        held.drop("a")
    off = AdapterSet(ModelConfig(path=str(base)), str(base))
    with pytest.raises(UnsupportedCapabilityError):
        off.admit("a", str(first), replace=False)
    on = AdapterSet(ModelConfig(path=str(base), max_lora_rank=16), str(base))
    assert on.enabled and on.admit("a", str(first), replace=False).rank == 2


def _rewrite_weights(folder: Path, fill) -> None:
    path = folder / "adapter_model.safetensors"
    save_file({name: fill(t) for name, t in load_file(str(path)).items()}, str(path))


@pytest.mark.parametrize(("damage", "says"), [
    ("alpha nan", "lora_alpha=nan"),
    ("alpha text", "lora_alpha='16'"),
    ("targets dict", "target_modules="),
    ("config list", "not an object"),
    ("nan weight", "non-finite values"),
    ("inf weight", "non-finite values"),
    ("int weight", "not floating point"),
    ("truncated", "unreadable adapter_model.safetensors"),
    ("huge header", "unreadable adapter_model.safetensors"),
])
def test_a_damaged_adapter_is_refused_by_field_before_any_backend_reads_it(tmp_path, damage, says):
    """What a client may point ``/v1/load_lora_adapter`` at: every damage is a ``ConfigError`` naming the field,
    never an exception inside PEFT, vLLM's engine core or a sampler (a NaN weight gives NaN logits)."""
    import struct

    base = write_base(tmp_path / "base")
    folder = write_adapter(tmp_path / "a")
    config = folder / "adapter_config.json"
    weights = folder / "adapter_model.safetensors"
    if damage == "alpha nan":
        config.write_text(config.read_text().replace('"lora_alpha": 4', '"lora_alpha": NaN'))
    elif damage == "alpha text":
        config.write_text(config.read_text().replace('"lora_alpha": 4', '"lora_alpha": "16"'))
    elif damage == "targets dict":
        config.write_text(config.read_text().replace('["q_proj"]', '{"q_proj": 1}'))
    elif damage == "config list":
        config.write_text("[1, 2]")
    elif damage == "nan weight":
        _rewrite_weights(folder, lambda t: np.full_like(t, np.nan))
    elif damage == "inf weight":
        _rewrite_weights(folder, lambda t: np.full_like(t, np.inf))
    elif damage == "int weight":
        _rewrite_weights(folder, lambda t: t.astype(np.int32))
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:5])
    else:
        weights.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(ConfigError) as info:
        load_adapters({"a": str(folder)}, None, str(base))
    assert info.value.field == "model.adapters.a" and says in str(info.value), str(info.value)


def test_a_served_load_names_lora_path_and_refuses_a_nul_in_it(tmp_path):
    from engine.adapters import check_loadable

    base = write_base(tmp_path / "base")
    folder = write_adapter(tmp_path / "a")
    _rewrite_weights(folder, lambda t: np.full_like(t, np.nan))
    with pytest.raises(ConfigError) as info:
        check_loadable("a", str(folder), loaded=(), limit=8, base_dir=str(base), replace=False)
    assert info.value.field == "lora_path"
    with pytest.raises(ConfigError) as info:
        check_loadable("a", "/x\x00y", loaded=(), limit=8, base_dir=str(base), replace=False)
    assert info.value.field == "lora_path" and "no NUL" in str(info.value)
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"backend": "vllm", "model": "/m", "vllm": {"max_loras": 10**9}})
    assert info.value.field == "vllm.max_loras"


PUSHED = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(("config", "tensors", "field", "says"), [
    ({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "use_dora": True}, [], "peft_config", "DoRA"),
    ({"r": 2, "use_rslora": True}, [], "peft_config", "use_rslora=True"),
    ({"r": 2, "modules_to_save": ["lm_head"]}, [], "peft_config", "modules_to_save"),
    ({"r": 2, "bias": "lora_only"}, [], "peft_config", "bias='lora_only'"),
    ({"r": 32}, [], "peft_config.r", "over model.max_lora_rank 16"),
    ({"r": 2}, [("metadatas[0].name", "model.norm.weight", [16])], "metadatas[0].name", "not a LoRA A or B"),
    ({"r": 2}, [("m[0]", f"{PUSHED}.lora_A.weight", [2, 10]), ("m[1]", f"{PUSHED}.lora_B.weight", [16, 2])],
     "metadatas", "as (16, 10), but that weight is (16, 12)"),
    ({"r": 4}, [("m[0]", f"{PUSHED}.lora_A.weight", [2, 12]), ("m[1]", f"{PUSHED}.lora_B.weight", [16, 2])],
     "metadatas", "says r=4"),
])
def test_a_pushed_adapter_is_refused_by_field_before_any_tensor_is_received(tmp_path, config, tensors, field, says):
    base = write_base(tmp_path / "base")
    with pytest.raises((ConfigError, RequestError)) as info:
        check_pushed(config, tensors, limit=16, base_dir=str(base))
    assert info.value.field == field and says in str(info.value), str(info.value)


def test_a_pushed_adapter_that_fits_is_admitted_and_saved_with_only_what_was_read(tmp_path):
    import torch

    from engine.adapters import write_adapter as save_pushed

    base = write_base(tmp_path / "base")
    config = {"r": 2, "lora_alpha": 8, "target_modules": ["q_proj"], "layers_pattern": None, "init_lora_weights": True}
    tensors = [("m[0]", f"{PUSHED}.lora_A.weight", [2, 12]), ("m[1]", f"{PUSHED}.lora_B.weight", [16, 2])]
    adapter = check_pushed(config, tensors, limit=16, base_dir=str(base))
    assert (adapter.name, adapter.rank, adapter.scale) == ("swift_lora", 2, 4.0)
    save_pushed(str(tmp_path / "pushed"), config, [(name, torch.ones(shape)) for _, name, shape in tensors])
    saved = read_adapter("swift_lora", str(tmp_path / "pushed"), 0)
    assert (saved.rank, saved.alpha, saved.targets) == (2, 8.0, ("q_proj",))
    assert "init_lora_weights" not in json.loads((tmp_path / "pushed" / "adapter_config.json").read_text())
    assert set(load_file(str(tmp_path / "pushed" / "adapter_model.safetensors"))) == {n for _, n, _ in tensors}
