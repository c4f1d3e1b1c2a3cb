"""The llama.cpp backend's pure parts: its config, which GGUF it loads, the GGUF writer's rotary layout, and the
per-row logits processor (against transformers' own processors on the same logits). No llama.cpp needed."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from engine.backends.llamacpp.backend import SEED_MODULUS, resolve_gguf
from engine.backends.llamacpp.rules import LlamaCppRowStep
from engine.backends.llamacpp.sequences import fit_groups
from engine.config import EngineConfig, LlamaCppConfig, ModelConfig
from engine.errors import ConfigError
from engine.rules.base import RuleSet
from engine.rules.repeat import RepeatRule, RepeatThresholds
from engine.rules.seeding import row_seed
from engine_fixtures.gguf_llama import permute_rotary


@pytest.mark.parametrize(("section", "field"), [
    ({"n_ctx": 8}, "llamacpp.n_ctx"),
    ({"n_ctx": "big"}, "llamacpp.n_ctx"),
    ({"n_threads": 0}, "llamacpp.n_threads"),
    ({"n_batch": 0}, "llamacpp.n_batch"),
    ({"seed": -1}, "llamacpp.seed"),
    ({"n_seq": 0}, "llamacpp.n_seq"),
    ({"n_seq": 257}, "llamacpp.n_seq"),
    ({"n_seq": 2.5}, "llamacpp.n_seq"),
    ({"gguf_file": "model.bin"}, "llamacpp.gguf_file"),
    ({"verbose": "yes"}, "llamacpp.verbose"),
    ({"n_gpu_layers": 1}, "llamacpp.n_gpu_layers"),
])
def test_bad_llamacpp_settings_name_the_key(section, field):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"backend": "llamacpp", "model": "/m", "llamacpp": section})
    assert info.value.field == field


def test_a_gguf_file_is_for_the_llamacpp_backend_only():
    EngineConfig.from_dict({"backend": "llamacpp", "model": "/m/model.gguf"})
    with pytest.raises(ConfigError, match="backend: llamacpp") as info:
        EngineConfig.from_dict({"backend": "hf", "model": "/m/model.gguf"})
    assert info.value.field == "model.path"
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"backend": "llamacpp", "model": {"path": "/m", "attn_implementation": "sdpa"}})
    assert info.value.field == "model.attn_implementation"


def test_the_gguf_is_the_path_itself_or_the_one_in_the_folder(tmp_path):
    model = ModelConfig(path=str(tmp_path))
    with pytest.raises(ConfigError, match=r"holds 0 \.gguf files") as info:
        resolve_gguf(model, LlamaCppConfig())
    assert info.value.field == "model.path" and "fixtures build" in str(info.value)
    (tmp_path / "a.gguf").write_bytes(b"")
    assert resolve_gguf(model, LlamaCppConfig()) == tmp_path / "a.gguf"
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"a\.gguf, b\.gguf"):
        resolve_gguf(model, LlamaCppConfig())
    assert resolve_gguf(model, LlamaCppConfig(gguf_file="b.gguf")) == tmp_path / "b.gguf"
    with pytest.raises(ConfigError) as info:
        resolve_gguf(model, LlamaCppConfig(gguf_file="c.gguf"))
    assert info.value.field == "llamacpp.gguf_file"
    assert resolve_gguf(ModelConfig(path=str(tmp_path / "b.gguf")), LlamaCppConfig()) == tmp_path / "b.gguf"


@pytest.mark.parametrize(("seed", "want"), [(7, 7), (2**32 - 1, 0), (2**63 - 1, (2**63 - 1) % (2**32 - 1))])
def test_seeds_map_to_llama_cpp_s_32_bit_seeds_never_to_its_random_one(seed, want):
    """A row's own seed maps below llama.cpp's "random" value (2**32 - 1)."""
    from engine.backends.base import Prompt
    from engine.backends.llamacpp.backend import LlamaCppBackend

    got = LlamaCppBackend._seed(Prompt(token_ids=(1,), text="x", seed=seed))
    assert got == want and 0 <= got < SEED_MODULUS


def test_the_configured_seed_seeds_calls_without_one_row_by_row():
    """``llamacpp.seed`` reaches the plan as the call's seed (the engine asks the backend's ``default_seed``), so its
    rows get ``row_seed(seed, i)`` like any seeded call's; a call's own seed wins."""
    from types import SimpleNamespace

    from engine.backends.base import CallPlan, Capabilities, prompts_of
    from engine.backends.llamacpp.backend import LlamaCppBackend
    from engine.config import EngineConfig
    from engine.engine import GenerationEngine
    from engine.templates import RenderedPrompt

    engine = object.__new__(GenerationEngine)
    engine.config = EngineConfig.from_dict({"backend": "llamacpp", "model": {"path": "/m"}})
    engine._specials = {}
    backend = SimpleNamespace(name="llamacpp", default_seed=9,
                              capabilities=Capabilities(name="llamacpp", structured_outputs=False, logprobs=True))
    engine.load_info = SimpleNamespace(eos_token_ids=(2,))
    rendered = [RenderedPrompt(text="a", token_ids=(1,), fallback=None)] * 2
    plan: CallPlan = engine._plan({"temperature": 1.0}, None, None, backend)
    assert [p.seed for p in prompts_of(rendered, plan)] == [row_seed(9, 0), row_seed(9, 1)]
    own = engine._plan({"temperature": 1.0, "seed": 3}, None, None, backend)
    assert [p.seed for p in prompts_of(rendered, own)] == [row_seed(3, 0), row_seed(3, 1)]
    assert LlamaCppBackend.default_seed.fget(SimpleNamespace(settings=LlamaCppConfig(seed=9))) == 9


def test_rotary_permutation_is_a_pure_reordering_of_each_head():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((3 * 8, 5)).astype(np.float32)  # 3 heads of dim 8
    permuted = permute_rotary(weight, n_heads=3)
    assert sorted(permuted.ravel().tolist()) == sorted(weight.ravel().tolist())
    assert permuted[:8, 0].tolist() == weight[[0, 4, 1, 5, 2, 6, 3, 7], 0].tolist()  # halves interleaved
    assert permuted[8:16].tolist() == permute_rotary(weight[8:16], n_heads=1).tolist()


def step_for(*, terminal_ids=(0,), rules=None, **options):
    """A row step of a two-token prompt; ``options``: the call's generation options (handed whole)."""
    from engine.config.generation import GenerationOptions

    return LlamaCppRowStep(prompt_len=2, terminal_ids=list(terminal_ids), rules=rules, eos_id=0,
                           options=GenerationOptions(max_new_tokens=8, **options))


def test_repetition_penalty_equals_transformers():
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(1)
    scores = rng.standard_normal(12).astype(np.float32)
    ids = np.array([3, 5, 5, 7], dtype=np.intc)  # prompt 3, 5; generated 5, 7
    step = step_for(repetition_penalty=1.3)
    step.feed(5)
    step.feed(7)
    got = step(ids, scores.copy())
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(ids[None].astype(np.int64)),
                                                 torch.tensor(scores[None]))[0].numpy()
    assert np.allclose(got, want)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_after_the_temperature_keeps_what_the_hf_sampler_keeps(min_p):
    """The llama.cpp step's min-p (after its temperature) keeps exactly the tokens HF's warpers keep in the engine's
    order (temperature, then min-p), and vLLM's rule: p >= min_p * p_max."""
    import torch
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    rng = np.random.default_rng(2)
    scores = (rng.standard_normal(40) * 3).astype(np.float32)
    got = step_for(temperature=1.7, min_p=min_p)(np.array([1]), scores.copy())
    want = torch.tensor(scores[None])
    for warp in (TemperatureLogitsWarper(1.7), MinPLogitsWarper(min_p)):  # HF's own warpers: the oracle
        want = warp(None, want)
    assert (np.isfinite(got) == torch.isfinite(want[0]).numpy()).all()
    probs = torch.softmax(torch.tensor(scores) / 1.7, -1).numpy()
    assert (np.isfinite(got) == (probs >= min_p * probs.max() * (1 - 1e-6))).all()
    assert 1 <= np.isfinite(got).sum() < len(scores) and (min_p < 1.0 or np.isfinite(got).sum() == 1)


def test_min_new_tokens_bans_every_terminal_id_until_reached():
    step = step_for(terminal_ids=[0, 4], min_new_tokens=2)
    assert np.isinf(step(np.array([1, 2]), np.zeros(6, dtype=np.float32))[[0, 4]]).all()
    step.feed(3)
    assert np.isinf(step(np.array([1, 2, 3]), np.zeros(6, dtype=np.float32))[[0, 4]]).all()
    step.feed(3)
    assert np.isfinite(step(np.array([1, 2, 3, 3]), np.zeros(6, dtype=np.float32))).all()


def test_a_rule_that_ends_the_row_leaves_only_eos_and_reports_it():
    rules = RuleSet([RepeatRule(RepeatThresholds(max_consecutive_token_repeats=2))], terminal_ids={0})
    step = step_for(rules=rules)
    for token in (3, 3):
        step.feed(token)
    out = step(np.array([1, 2, 3, 3]), np.ones(5, dtype=np.float32))
    assert out[0] == 0.0 and np.isneginf(out[1:]).all()
    assert rules.events()["repeat_terminate"] == ("consecutive_token_repeats", 2)


def test_temperature_divides_after_the_rules_and_logprobs_are_the_raw_distribution():
    import torch

    scores = np.array([2.0, 1.0, 0.5, -1.0], dtype=np.float32)
    step = step_for(temperature=0.5, logprobs=2)
    out = step(np.array([1, 2]), scores.copy())
    assert np.allclose(out, scores / 0.5)
    entry = step.top_logprobs(token=3, k=2)
    raw = torch.log_softmax(torch.tensor(scores), dim=-1)
    assert list(entry) == [0, 1, 3]  # the top two in order, then the sampled token
    assert all(math.isclose(entry[t], float(raw[t]), abs_tol=1e-6) for t in entry)


@pytest.mark.parametrize(("needs", "n_seq", "n_ctx"), [
    ([5] * 20, 16, 4096), ([100, 3000, 1000, 50, 4096, 1], 8, 4096), ([7, 7, 7], 1, 64), ([60, 5, 60], 4, 64)])
def test_parallel_groups_keep_order_and_fit_the_pool(needs, n_seq, n_ctx):
    groups = fit_groups(needs, n_seq, n_ctx)
    assert [i for g in groups for i in g] == list(range(len(needs)))  # every row once, in order
    assert all(len(g) <= n_seq and sum(needs[i] for i in g) <= n_ctx for g in groups)
    # a group is closed only when the next row would not fit it
    assert all(len(a) == n_seq or sum(needs[i] for i in a) + needs[b[0]] > n_ctx
               for a, b in itertools.pairwise(groups))


def test_a_row_larger_than_the_pool_is_refused():
    with pytest.raises(ValueError, match="row 1 needs 65"):
        fit_groups([10, 65], 4, 64)
