"""Divergences users reported upstream between the stacks, one check per class on every backend (the README's table
"divergences reported upstream" maps each report to its check here or elsewhere in the suite).

- A checkpoint's EOS list (vllm#4180 class): never applied by itself (``test_loading.py`` on a checkpoint that ships
  one); with ``model.checkpoint_eos`` every backend ends rows at every id in it, holds them all back under
  ``min_new_tokens``, and adds ``stop.token_ids`` to them.
- Seeded sampling (vllm#3333 class): row ``i`` of a call seeded ``s`` samples with its own generator
  (``engine.rules.seeding``), so identical prompts give distinct samples, reproducibly, and a row's sample never
  depends on its batch-mates.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.compare import assert_same_results
from conformance.variants import answered_token, model_copy
from fixtures import fixture_path, load_prompts

LOOPER_PROMPTS = [p["messages"] for p in load_prompts("looper") + load_prompts("lists") + load_prompts("chat")[:1]]
BUDGET = {"max_new_tokens": 24}
CHAT = [p["messages"] for p in load_prompts("chat")]
SAMPLED = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "seed": 1234}


@pytest.fixture(scope="session")
def looper() -> str:
    return str(fixture_path("tiny-looper"))


@pytest.fixture(scope="session")
def eos_list_model(pool, looper, tmp_path_factory) -> tuple[str, int]:
    """The looper with a ``generation_config.json`` whose ``eos_token_id`` list holds a token its greedy answers
    produce (and its GGUF twin likewise), and that token."""
    reference = pool.reference(pool.options.backends[0], looper)
    listed = answered_token(reference.generate(LOOPER_PROMPTS, options=BUDGET))
    config = {"eos_token_id": [reference.tokenizer.eos_token_id, listed]}
    root = tmp_path_factory.mktemp("eos-list")
    out = model_copy(Path(looper), root / "looper", generation_config=config)
    twin = dict(pool.twins).get(looper)
    if twin is not None:
        pool.twins[str(out)] = str(model_copy(Path(twin), root / "looper-gguf", generation_config=config))
    return str(out), listed


def cut_at(ids, ends):
    """``ids`` up to and including the first id in ``ends`` (all of them when none occurs)."""
    for i, token in enumerate(ids):
        if token in ends:
            return tuple(ids[: i + 1])
    return tuple(ids)


def test_checkpoint_eos_list_when_asked_ends_rows_at_every_id_in_it(pool, backend, looper, eos_list_model):
    """``model.checkpoint_eos``: each row is the free greedy row cut at its first listed id (finish "stop" with
    that id), on every backend; ``stop.token_ids`` add to the list."""
    variant, listed = eos_list_model
    free = pool.reference(backend, looper).generate(LOOPER_PROMPTS, options=BUDGET)
    honoured = pool.engine(backend, variant, model={"checkpoint_eos": True})
    assert honoured.load_info.eos_token_ids[1:] == (listed,)
    got = honoured.generate(LOOPER_PROMPTS, options=BUDGET)
    assert any(listed in f.token_ids[:-1] for f in free), "the listed id must occur inside a free answer"
    for i, (f, g) in enumerate(zip(free, got, strict=True)):
        assert g.token_ids == cut_at(f.token_ids, {listed, *honoured.load_info.eos_token_ids}), f"row {i}"
        if g.token_ids[-1:] == (listed,):
            assert (g.finish_reason, g.stop_reason) == ("stop", listed), f"row {i}"
    other = answered_token(free, start=1)
    with_stop = honoured.generate(LOOPER_PROMPTS, options=BUDGET, stop={"token_ids": [other]})
    for i, (f, g) in enumerate(zip(free, with_stop, strict=True)):
        assert g.token_ids == cut_at(f.token_ids, {listed, other, *honoured.load_info.eos_token_ids}), f"row {i}"


def test_checkpoint_eos_list_is_held_back_by_min_new_tokens(pool, backend_names, looper, eos_list_model):
    """Under ``min_new_tokens`` no row ends early at any listed id (every backend bans them all), and the backends
    agree on every row."""
    variant, listed = eos_list_model
    opts = {**BUDGET, "min_new_tokens": 12}
    got = {}
    for b in backend_names:
        free = pool.reference(b, looper).generate(LOOPER_PROMPTS, options=BUDGET)
        assert any(listed in f.token_ids[:11] for f in free), "the listed id must occur early in a free answer"
        honoured = pool.engine(b, variant, model={"checkpoint_eos": True})
        got[b] = honoured.generate(LOOPER_PROMPTS, options=opts)
        for i, r in enumerate(got[b]):
            assert not set(r.token_ids[:12]) & set(honoured.load_info.eos_token_ids), f"{b} row {i}: ended early"
            assert len(r.token_ids) >= 12, f"{b} row {i}"
    assert_same_results(got, what="checkpoint EOS list under min_new_tokens")


@pytest.mark.servable
def test_seeded_group_of_identical_prompts_gives_distinct_reproducible_samples(pool, backend):
    """A GRPO group: four copies of one prompt in one seeded call come back as four different samples, and the
    same call gives the same four again."""
    engine = pool.text_engine(backend)
    group = [CHAT[0]] * 4
    first = engine.generate(group, options=SAMPLED)
    assert len({r.token_ids for r in first}) == 4, f"{backend}: {[r.token_ids for r in first]}"
    again = engine.generate(group, options=SAMPLED)
    assert [r.token_ids for r in again] == [r.token_ids for r in first]


@pytest.mark.servable
def test_seeded_row_does_not_depend_on_its_batch_mates(pool, backend):
    """A seeded row's sample depends on its prompt, the call's seed and its index only: other rows' content (and so
    the batch's padding) changes nothing."""
    engine = pool.text_engine(backend)
    a = engine.generate([CHAT[0], CHAT[1], CHAT[2]], options=SAMPLED)
    b = engine.generate([CHAT[0], CHAT[3], [{"role": "user", "content": "Hi"}]], options=SAMPLED)
    assert a[0].token_ids == b[0].token_ids
    c = engine.generate([CHAT[3], CHAT[1]], options=SAMPLED)
    assert c[1].token_ids == a[1].token_ids
