"""Divergences users reported upstream between the stacks, one check per class on every backend (the table in
``docs/divergences.md`` maps each report to its check here or elsewhere in the suite).

- A checkpoint's EOS list (vllm#4180 class): never applied by itself (``test_loading.py`` on a checkpoint that ships
  one); with ``model.checkpoint_eos`` every backend ends rows at every id in it, holds them all back under
  ``min_new_tokens``, and adds ``stop.token_ids`` to them.
- Seeded sampling (vllm#3333 class): row ``i`` of a call seeded ``s`` samples with its own generator
  (``engine.rules.seeding``), so identical prompts give distinct samples, reproducibly, and a row's sample never
  depends on its batch-mates, nor on the calls the engine answered before it (llama.cpp's kept prompt prefixes
  moved a seeded draw, issue 76).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.compare import assert_same_results, check_rollout_band
from conformance.subjects.plan import BUILT, engines, servers, uses
from conformance.subjects.variants import answered_token, model_copy
from engine_fixtures import fixture_path, load_prompts

SUBJECTS = uses(
    engines("text"),
    engines("tiny-looper"),
    engines(BUILT),
    engines(BUILT, model={"checkpoint_eos": True}),
    servers("text"),
)

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
    assert_same_results(got, what="checkpoint EOS list under min_new_tokens", dtype=pool.options.dtype)


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


def test_a_seeded_call_does_not_depend_on_the_calls_before_it(pool, backend):
    """The seeded GRPO group answers the same after other calls (other prompts, sharing the chat template's prefix,
    of other lengths, greedy and sampled) as before them: an engine keeps nothing from one call that moves the next
    (llama.cpp kept prompt prefixes in its unified KV pool, and the same group drew another token after them)."""
    engine = pool.text_engine(backend)
    group = [CHAT[0]] * 4
    first = [r.token_ids for r in engine.generate(group, options=SAMPLED)]
    for shift in range(2):  # on llama.cpp with kept prefixes, the second round's group differed
        engine.generate(CHAT[1 + shift:6 + shift], options={"max_new_tokens": 12})
        engine.generate([CHAT[2 + shift], CHAT[0], CHAT[3 + shift]], options={**SAMPLED, "max_new_tokens": 16})
        again = [r.token_ids for r in engine.generate(group, options=SAMPLED)]
        assert again == first, f"{backend}: after {shift + 1} rounds of other calls"


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


def nucleus(logprobs: dict[int, float], temperature: float, top_k: int, top_p: float, *,
            temperature_first: bool = True) -> set[int]:
    """The tokens a sampler may draw from raw ``logprobs`` (the top ones at least): HF's order is temperature, then
    top-k, then top-p (``temperature_first=False``: top-p on the unscaled distribution, the order that differs).
    Top-p keeps the smallest head whose mass reaches ``top_p`` (a token within 1e-4 of the boundary counts as in)."""
    import math

    head = sorted(logprobs.items(), key=lambda kv: -kv[1])[:top_k]
    scale = temperature if temperature_first else 1.0
    weights = [math.exp(lp / scale) for _, lp in head]
    total, kept, mass = sum(weights), set(), 0.0
    for (token, _), w in zip(head, weights, strict=True):
        if mass >= top_p + 1e-4:
            break
        kept.add(token)
        mass += w / total
    return kept


def test_temperature_top_k_top_p_compose_in_hf_order(pool, backend_names):
    """Two hundred rows of one prompt, one seeded draw each (the seeding contract makes them independent): on every
    backend the observed first tokens lie in the nucleus HF's order allows (temperature, then top-k, then top-p),
    a set smaller than the order that applies top-p before the temperature allows."""
    text = "Once upon a time, in a small village, there lived a"
    probe = pool.reference(backend_names[0], pool.options.model).complete([text], options={
        "max_new_tokens": 1, "logprobs": 20})[0].logprobs[0]
    top_k = 12  # a nucleus of three tokens at least, which the other order would widen
    temperature, top_p = next((t, p) for t in (0.5, 0.7, 0.8, 0.9) for p in (0.6, 0.7, 0.8, 0.9, 0.95)
                              if len(nucleus(probe, t, top_k, p)) >= 3
                              and nucleus(probe, t, top_k, p) != nucleus(probe, t, top_k, p, temperature_first=False))
    allowed = nucleus(probe, temperature, top_k, top_p)
    opts = {"max_new_tokens": 1, "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": 11}
    for b in backend_names:
        drawn = [r.token_ids[0] for r in pool.text_engine(b).complete([text] * 200, options=opts)]
        assert set(drawn) <= allowed, f"{b} drew {set(drawn) - allowed} outside HF's nucleus {allowed}"
        assert len(set(drawn)) >= 2, f"{b}: 200 draws gave one token, the check says nothing"


def test_rollout_logprobs_equal_the_trainers_rescoring(pool, backend, summary_note):
    """The training-inference mismatch, measured: each backend's sampled rollout (temperature, top-p and a repetition
    penalty, which change the draw but not the reported logprobs: they are the model's raw ones) re-scored
    teacher-forced by HF (``engine.score``, the trainer's view). In float32 it is a bound: every token within 2e-3,
    every sequence's importance ratio within 1 %."""
    from engine.trainer.mismatch import rescore_mismatch

    rollout = pool.text_engine(backend).generate(CHAT[:4], options={
        "max_new_tokens": 24, "temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.3, "seed": 5, "logprobs": 0})
    got = rescore_mismatch(rollout, pool.reference("hf", pool.options.model))
    check_rollout_band(got, what=f"rollout {backend} vs trainer hf (repetition penalty 1.3, temperature 0.7)",
                       dtype=pool.options.dtype, note=summary_note)


def test_prompt_logprobs_same_with_the_prefix_cache_cold_warm_and_reordered(pool, backend_names):
    """Scoring (lm-eval's loglikelihood, a trainer's reference logprobs) must not depend on vLLM's prefix cache:
    sequences sharing a prefix scored cold, again warm, and in reverse order give the same logprobs, on every
    backend that scores."""
    scoring = [b for b in backend_names if pool.text_engine(b).backend.capabilities.scoring]
    assert "vllm" in scoring or "vllm" not in backend_names, "the in-process vLLM engine must score"
    base = pool.text_engine(scoring[0]).tokenizer.encode("The committee met on a rainy Tuesday to decide")
    seqs = [base + pool.text_engine(scoring[0]).tokenizer.encode(tail) for tail in
            (" the budget for the new library.", " whether to close the old bridge.", " who would lead the parade.")]
    starts = [len(base) - 3] * len(seqs)
    for b in scoring:
        eng = pool.text_engine(b)
        cold = eng.score(seqs, starts)
        warm = eng.score(seqs, starts)
        reordered = eng.score(seqs[::-1], starts[::-1])[::-1]
        for name, got in (("warm", warm), ("reordered", reordered)):
            for i, (c, g) in enumerate(zip(cold, got, strict=True)):
                assert max(abs(x - y) for x, y in zip(c.logprobs, g.logprobs, strict=True)) < 1e-4, \
                    f"{b} sequence {i}: {name} prefix cache changed its logprobs"


BOS_TEMPLATES = {  # role-prefixed turns, so the BOS token occurs nowhere else in the prompt
    "writes bos_token": "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}",
    "writes none": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}assistant:{% endif %}",
}


def adding_bos(folder: Path) -> Path:
    """``folder``'s tokenizer made to add its BOS token (``add_special_tokens=True`` prepends it), as Llama's do."""
    import json

    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    bos = json.loads((folder / "tokenizer_config.json").read_text())["bos_token"]
    bos_id = next(t["id"] for t in data["added_tokens"] if t["content"] == bos)
    first = {"SpecialToken": {"id": bos, "type_id": 0}}
    a, b = ({"Sequence": {"id": name, "type_id": i}} for i, name in enumerate("AB"))
    data["post_processor"] = {"type": "TemplateProcessing", "single": [first, a], "pair": [first, a, b],
                              "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}
    path.write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="session")
def bos_adding_model(pool, looper, tmp_path_factory) -> str:
    """The looper whose tokenizer adds BOS (and its GGUF twin's likewise)."""
    root = tmp_path_factory.mktemp("bos-adding")
    out = adding_bos(model_copy(Path(looper), root / "looper"))
    twin = dict(pool.twins).get(looper)
    if twin is not None:
        pool.twins[str(out)] = str(adding_bos(model_copy(Path(twin), root / "looper-gguf")))
    return str(out)


@pytest.mark.parametrize("template", list(BOS_TEMPLATES))
def test_a_tokenizer_that_adds_bos_gets_exactly_one_whatever_the_template(pool, backend_names, bos_adding_model,
                                                                          template):
    """Double BOS (a template writing ``bos_token``, then a tokenizer adding one; or none at all): every backend's
    prompt starts with exactly one BOS, and the backends agree on the prompt and the answer."""
    got = {}
    for b in backend_names:
        engine = pool.engine(b, bos_adding_model)
        tokenizer = engine.tokenizer
        assert tokenizer("x", add_special_tokens=True)["input_ids"][0] == tokenizer.bos_token_id, "variant adds no BOS"
        saved, tokenizer.chat_template = tokenizer.chat_template, BOS_TEMPLATES[template]
        try:
            got[b] = engine.generate([CHAT[0]], options={"max_new_tokens": 8})
        finally:
            tokenizer.chat_template = saved
        ids = list(got[b][0].prompt_token_ids)
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1, f"{b}: {ids[:4]}..."
    assert_same_results(got, what=f"a BOS-adding tokenizer, template that {template}", dtype=pool.options.dtype)


def test_a_stop_string_holding_a_special_token_is_refused_on_every_backend(pool, backend, count_backend_calls):
    """A special token's text as a stop string ("<|im_end|>", a common port from other stacks) can never match:
    outputs are decoded with special tokens skipped on every backend, so it would be silently ignored. It is
    refused before generation, naming the field and the token id to use instead (``stop.token_ids``)."""
    from engine.errors import ConfigError

    engine = pool.text_engine(backend)
    calls = count_backend_calls(engine.local)
    eos = engine.tokenizer.eos_token
    with pytest.raises(ConfigError, match=r"stop\.token_ids: \[") as info:
        engine.generate([CHAT[0]], options={"max_new_tokens": 4}, stop={"strings": ["\n\n", f"{eos}\n"]})
    assert info.value.field == "stop.strings[1]" and str(engine.tokenizer.eos_token_id) in str(info.value)
    assert calls == [], "a refused request must generate nothing"
