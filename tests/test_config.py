"""Config validation: unknown keys, ranges, conflicts and YAML loading fail with field, value and fix."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, GenerationOptions, StopPolicy
from engine.errors import ConfigError

BASE = {"backend": "hf", "model": {"path": "/m"}}


def cfg(**over):
    return EngineConfig.from_dict({**BASE, **over})


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        ({**BASE, "backnd": "hf"}, "backnd", "did you mean 'backend'"),
        ({**BASE, "backend": "vlm"}, "backend", "did you mean 'vllm'"),
        ({**BASE, "generation": {"max_new_token": 3}}, "generation.max_new_token", "did you mean 'max_new_tokens'"),
        ({**BASE, "generation": {"top_k": -1}}, "generation.top_k", "[0, inf)"),
        ({**BASE, "generation": {"temperature": 0.5, "top_p": 0}}, "generation.top_p", "(0, 1]"),
        ({**BASE, "generation": {"max_new_tokens": True}}, "generation.max_new_tokens", "an integer"),
        ({**BASE, "generation": {"seed": -1}}, "generation.seed", "[0,"),
        ({**BASE, "model": {"path": "/m", "dtype": "fp16"}}, "model.dtype", "float16"),
        ({**BASE, "model": {"path": "/m", "device": "tpu"}}, "model.device", "cuda:N"),
        ({**BASE, "vllm": {"gpu_memory_utilization": 1.5}}, "vllm.gpu_memory_utilization", "(0, 1]"),
        ({**BASE, "vllm": {"data_parallel_size": 2}}, "vllm.data_parallel_size", "first data-parallel engine"),
        ({**BASE, "vllm": {"cpu_kv_cache_space_gib": 0}}, "vllm.cpu_kv_cache_space_gib", "(0, inf)"),
        ({**BASE, "vllm": {"cpu_kv_cache_space_gib": "1G"}}, "vllm.cpu_kv_cache_space_gib", "a number"),
        ({**BASE, "hf": {"max_batch_size": 0}}, "hf.max_batch_size", "[1, inf)"),
        ({**BASE, "stop": {"strings": "abc"}}, "stop.strings", "must be a list"),
        ({"backend": "hf"}, "model", "is required"),
        ({**BASE, "backend": "vllm", "model": {"path": "/m", "attn_implementation": "sdpa"}},
         "model.attn_implementation", "does not apply"),
    ],
)
def test_bad_config_names_field_value_and_fix(data, field, words):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(data)
    assert info.value.field == field
    assert words in str(info.value)
    assert "Fix:" in str(info.value) or "required" in str(info.value) or "must be" in str(info.value)


def test_greedy_conflicts_are_errors():
    with pytest.raises(ConfigError, match="temperature 0"):
        GenerationOptions(top_k=5)
    GenerationOptions(temperature=0.7, top_k=5, top_p=0.9)  # fine when sampling


def test_temperature_above_vllms_bound_is_refused_on_every_backend():
    """vLLM's ``SamplingParams`` refuses a temperature above 2 mid-request; the engine refuses it at the option, so
    no backend samples a request another backend cannot run."""
    assert GenerationOptions(temperature=2).temperature == 2
    for backend in ("hf", "vllm", "llamacpp"):
        with pytest.raises(ConfigError, match=r"must be in \[0, 2\], got 2.5") as info:
            EngineConfig.from_dict({"backend": backend, "model": "/m", "generation": {"temperature": 2.5}})
        assert info.value.field == "generation.temperature"
    for bad in (2.5, 0.001):  # Pattern C's default is held to the same bounds at load, not at every /chat request
        with pytest.raises(ConfigError) as info:
            EngineConfig.from_dict({"backend": "hf", "model": "/m", "serve": {"chat": {"temperature": bad}}})
        assert info.value.field == "serve.chat.temperature"


def test_model_shorthand_and_defaults():
    c = EngineConfig.from_dict({"backend": "vllm", "model": "/m"})
    assert c.model.path == "/m" and c.generation.max_new_tokens == 256 and c.stop == StopPolicy()


def test_cpu_kv_cache_is_given_per_engine_in_bytes():
    pytest.importorskip("torch", reason="llm_kwargs asks torch whether CUDA is present")
    import torch

    from engine.backends.vllm.backend import llm_kwargs

    c = EngineConfig.from_dict({"backend": "vllm", "model": "/m", "vllm": {"cpu_kv_cache_space_gib": 0.5}})
    kwargs = llm_kwargs(c.model, c.vllm)
    if torch.cuda.is_available():
        assert "kv_cache_memory_bytes" not in kwargs  # gpu_memory_utilization sizes it there
    else:
        assert kwargs["kv_cache_memory_bytes"] == 2**29


def test_configs_are_frozen():
    c = cfg()
    with pytest.raises(AttributeError):
        c.backend = "vllm"  # type: ignore[misc]


def test_merged_overrides_validate_against_the_merged_whole():
    base = GenerationOptions(max_new_tokens=512)
    merged = base.merged({"min_new_tokens": 300})
    assert merged.max_new_tokens == 512 and merged.min_new_tokens == 300
    with pytest.raises(ConfigError) as info:
        base.merged({"min_new_tokens": 600})
    assert info.value.field == "generation.min_new_tokens"
    assert StopPolicy(strings=("a",)).merged({"include_stop_str": True}) == StopPolicy(strings=("a",),
                                                                                       include_stop_str=True)


def test_yaml_file(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("backend: hf\nmodel:\n  path: /m\n  dtype: float32\ngeneration:\n  max_new_tokens: 7\n"
                    "stop:\n  strings: [\"\\n\\n\"]\n")
    c = EngineConfig.from_yaml(path)
    assert c.model.dtype == "float32" and c.generation.max_new_tokens == 7 and c.stop.strings == ("\n\n",)
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level"):
        EngineConfig.from_yaml(tmp_path / "bad.yaml")


def test_min_p_is_a_fraction_of_the_likeliest_and_needs_sampling():
    from engine.config import GenerationOptions
    from engine.errors import ConfigError

    assert GenerationOptions(temperature=1.0, min_p=0.05).min_p == 0.05
    for bad, says in [(1.5, "must be in"), (-0.1, "must be in"), ("0.1", "must be a number")]:
        with pytest.raises(ConfigError, match=says) as err:
            GenerationOptions(temperature=1.0, min_p=bad)
        assert err.value.field == "generation.min_p"
    with pytest.raises(ConfigError, match="no effect with temperature 0"):
        GenerationOptions(min_p=0.1)


@pytest.mark.parametrize(("serve", "field"), [
    ({"batch_wait_max_ms": 1001}, "serve.batch_wait_max_ms"),
    ({"batch_wait_ms": 20, "batch_wait_max_ms": 10}, "serve.batch_wait_max_ms"),
    ({"batch_wait_max_ms": "long"}, "serve.batch_wait_max_ms"),
])
def test_the_batchers_longest_wait_is_checked_against_its_quiet_wait(serve, field):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"backend": "hf", "model": "/m", "serve": serve})
    assert info.value.field == field
