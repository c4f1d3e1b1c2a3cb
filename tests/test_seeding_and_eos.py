"""The seeded-sampling contract's pure parts (row seeds, HF's per-row sampler on tiny tensors) and where the EOS
set comes from (``model.checkpoint_eos``). The backends run them for real in conformance/test_divergences.py."""

from __future__ import annotations

import json

import pytest

from engine.backends.base import CallPlan, prompts_of
from engine.config import GenerationOptions, ModelConfig, StopPolicy
from engine.errors import ConfigError
from engine.loading import checkpoint_eos_ids
from engine.rules.seeding import row_seed, row_seeds
from engine.templates import RenderedPrompt


def test_row_seeds_differ_per_row_and_per_call_seed_and_stay_in_range():
    seeds = {row_seed(s, i) for s in range(50) for i in range(50)}
    assert len(seeds) == 2500  # no two (call seed, row) pairs share a generator seed here
    assert all(0 <= s < 2**63 for s in seeds)
    assert row_seeds(3, 4) == [row_seed(3, i) for i in range(4)] and row_seeds(None, 3) == [None] * 3


def test_prompts_carry_their_row_seed_only_when_the_call_samples_with_a_seed():
    rendered = [RenderedPrompt(text="a", token_ids=(1,), fallback=None)] * 3
    plan = lambda **o: CallPlan(GenerationOptions(**o), StopPolicy(), (2,))  # noqa: E731
    assert [p.seed for p in prompts_of(rendered, plan(temperature=1.0, seed=9))] == row_seeds(9, 3)
    assert [p.seed for p in prompts_of(rendered, plan(temperature=1.0))] == [None] * 3
    assert [p.seed for p in prompts_of(rendered, plan(seed=9))] == [None] * 3  # greedy: no draw to seed


def test_hf_row_sampler_draws_each_row_from_its_own_generator():
    torch = pytest.importorskip("torch", reason="the HF sampler needs torch (installed by `nox -s tests`)")
    from engine.backends.hf.sampling import RowSampler

    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    ids = torch.zeros(3, 1, dtype=torch.long)

    def drawn(seeds, scores, **warp):
        out = []
        sampler = RowSampler(seeds, GenerationOptions(max_new_tokens=4, **{"temperature": 1.0, **warp}))
        for _ in range(12):  # twelve steps: the generators advance per row
            s = sampler(ids, scores.clone())
            assert (torch.isfinite(s).sum(dim=-1) == 1).all()  # exactly one token left to pick greedily
            out.append(s.argmax(dim=-1).tolist())
        return [tuple(step[row] for step in out) for row in range(scores.shape[0])]

    same = drawn([5, 5, 6], logits[[0, 0, 0]])
    assert same[0] == same[1] and same[0] != same[2]  # identical rows: same seed same draws, another seed others
    mates = drawn([5, 7, 8], torch.stack([logits[0], logits[1], logits[2]]))
    assert mates[0] == same[0]  # row 0's draws do not depend on its batch-mates
    top1 = drawn([1, 2, 3], logits, top_k=1)  # top-k after temperature: the argmax only
    assert all(set(row) == {int(logits[i].argmax())} for i, row in enumerate(top1))


def model_dir(tmp_path, generation_config=None):
    (tmp_path / "config.json").write_text("{}")
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return ModelConfig(path=str(tmp_path), checkpoint_eos=True)


@pytest.mark.parametrize(("found", "want"), [(7, (7,)), ([2, 7, 9], (2, 7, 9))])
def test_checkpoint_eos_ids_read_an_id_or_a_list(tmp_path, found, want):
    assert checkpoint_eos_ids(model_dir(tmp_path, {"eos_token_id": found})) == want


@pytest.mark.parametrize(("generation_config", "words"), [
    (None, "does not exist"), ({"bos_token_id": 1}, "has no eos_token_id"), ({"eos_token_id": ["x"]}, "not token ids"),
])
def test_checkpoint_eos_asked_for_and_missing_is_a_config_error(tmp_path, generation_config, words):
    with pytest.raises(ConfigError, match=words) as info:
        checkpoint_eos_ids(model_dir(tmp_path, generation_config))
    assert info.value.field == "model.checkpoint_eos" and "Fix:" in str(info.value)
