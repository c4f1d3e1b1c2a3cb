"""Repeat-aware termination on both backends: looping rows end at the rule's index, healthy rows untouched."""

from __future__ import annotations

import pytest

from conformance.compare import assert_same_results, close_at_divergence, first_divergence
from conformance.subjects.plan import engines, servers, uses
from engine.errors import UnsupportedCapabilityError
from engine.rules.repeat import RepeatThresholds, reference_fire_index
from engine_fixtures import fixture_path, load_prompts

SUBJECTS = uses(
    engines("text"),
    engines("tiny-looper"),
    engines("tiny-looper", hf={"max_batch_size": 8}),
    engines("tiny-looper", repeat_terminate={"enabled": True}),
    engines("tiny-looper", vllm={"max_num_seqs": 4}),
    servers("text"),
    servers("tiny-looper"),
    servers("tiny-looper", hf={"max_batch_size": 8}),
    servers("tiny-looper", vllm={"max_num_seqs": 4}),
)

pytestmark = [pytest.mark.dtype_dependent, pytest.mark.runner_dependent]

LOOP_GUARD = {"enabled": True, "max_consecutive_token_repeats": 4, "ngram_size": 3, "ngram_repeats": 3}
REAL_LOOP_GUARD = {"enabled": True, "ngram_size": 5, "ngram_repeats": 4}
"""Catches SmolLM2's real loop on "30 fruits" (".../1280/1280/...": a 5-token n-gram repeated back to back) and must
leave every healthy prompt alone: one guard for both checks, so recall and precision are proved on the same
thresholds (and one guarded server per backend serves both)."""
BUDGET = {"max_new_tokens": 40}
# Rows the looper loops on, and rows it does not: one batch must hold both.
MIXED = [p["messages"] for p in load_prompts("looper") + load_prompts("lists") + load_prompts("chat")[:1]]


def thresholds(guard: dict, min_new_tokens: int = 0) -> RepeatThresholds:
    keys = ("max_consecutive_token_repeats", "ngram_size", "ngram_repeats", "max_object_keys")
    return RepeatThresholds(min_new_tokens=max(guard.get("min_new_tokens", 0), min_new_tokens),
                            **{k: guard.get(k) for k in keys})


@pytest.fixture(scope="session")
def looper():
    return str(fixture_path("tiny-looper"))


def check_against_reference(free, guarded, guard, eos, decode=None, *, dtype):
    """Each guarded row equals the unguarded row cut where the reference fires, plus EOS; others are untouched.

    Outside float32 a guarded row may part from the unguarded one before the cut (its batch-mates end early, and
    the rounding of the rows left changes with them): it must part by vLLM's rule, and then hold on its own tokens
    what the rule guarantees (:func:`check_own_tokens`)."""
    fired = 0
    for i, (f, g) in enumerate(zip(free, guarded, strict=True)):
        index = reference_fire_index(list(f.token_ids), thresholds(guard), decode)
        if index is not None and index >= len(f.token_ids):
            index = None
        want = f.token_ids if index is None else (*f.token_ids[:index], eos)
        if dtype != "float32" and first_divergence(want, g.token_ids) is not None:
            step = close_at_divergence(f, g, what=f"row {i}", name_0="unguarded", name_1="guarded")
            assert step is not None and (index is None or step < index), \
                f"row {i}: same tokens up to {index}, but no EOS there"
            fired += check_own_tokens(g, guard, eos, decode, row=i)
            continue
        if index is None:
            assert g.token_ids == f.token_ids, f"row {i}: a row the rule does not fire on was changed"
            assert g.meta["repeat_terminate_triggered"] == 0 and g.meta["repeat_terminate_index"] is None
            continue
        fired += 1
        assert g.token_ids == want, f"row {i}: expected EOS at {index}, got {g.token_ids}"
        assert (g.meta["repeat_terminate_triggered"], g.meta["repeat_terminate_index"]) == (1, index), f"row {i}"
        assert g.finish_reason == "stop" and g.stop_reason == "repeat_terminate"
    return fired


def check_own_tokens(g, guard, eos, decode, *, row):
    """What the rule guarantees on a guarded row's own tokens: fired, the EOS stands exactly where the reference
    first fires on the tokens before it; not fired, the reference never fires within the row. Returns 1 if fired."""
    if not g.meta["repeat_terminate_triggered"]:
        index = reference_fire_index(list(g.token_ids), thresholds(guard), decode)
        assert index is None or index >= len(g.token_ids), f"row {row}: the rule fires at {index} but did not"
        return 0
    body = list(g.token_ids[:-1])
    assert g.token_ids[-1] == eos and (g.finish_reason, g.stop_reason) == ("stop", "repeat_terminate"), f"row {row}"
    index = reference_fire_index(body, thresholds(guard), decode)
    assert index == len(body) == g.meta["repeat_terminate_index"], f"row {row}: fired at {len(body)}, rule: {index}"
    return 1


def mixes(fired: int, pool) -> bool:
    """Whether a guarded batch of ``MIXED`` proves something: some rows fired and, in float32, some did not. The
    looper is a random model whose healthy rows are near-ties away from looping: in lower precision the kernels of
    some machines (vLLM's AMX attention in bfloat16) send every row into its loop, and each row is still held to the
    rule on its own tokens."""
    return fired > 0 and (fired < len(MIXED) or pool.options.dtype != "float32")


@pytest.mark.servable
def test_looping_rows_end_at_the_same_index_on_every_backend(pool, backend_names, looper):
    guarded = {}
    for b in backend_names:
        free = pool.reference(b, looper).generate(MIXED, options=BUDGET)
        guarded[b] = pool.engine(b, looper, repeat_terminate=LOOP_GUARD).generate(MIXED, options=BUDGET)
        eos = pool.reference(b, looper).tokenizer.eos_token_id
        fired = check_against_reference(free, guarded[b], LOOP_GUARD, eos, dtype=pool.options.dtype)
        assert mixes(fired, pool), f"{b}: the batch must mix looping ({fired}) and healthy rows"
    assert_same_results(guarded, what="repeat guard", dtype=pool.options.dtype)



def test_the_config_path_guard_equals_the_derived_one(pool, backend, looper):
    """The pool derives guarded engines from the loaded one (``GenerationEngine.derive``, no second model); on every
    backend a guard built through the whole config path (its own backend started with ``repeat_terminate``) must
    give exactly the same results."""
    own = pool.engine(backend, looper, shared=False, repeat_terminate=LOOP_GUARD)
    derived = pool.engine(backend, looper, repeat_terminate=LOOP_GUARD)
    assert derived.backend is pool.reference(backend, looper).backend and own.backend is not derived.backend
    want = own.generate(MIXED, options=BUDGET)
    fired = sum(r.meta["repeat_terminate_triggered"] for r in want)
    assert mixes(fired, pool), f"{backend}: the batch must mix looping ({fired}) and healthy rows"
    assert_same_results({"config path": want, "derived": derived.generate(MIXED, options=BUDGET)},
                        what="repeat guard from the config vs derived", dtype=pool.options.dtype)

@pytest.mark.servable
def test_min_new_tokens_respected(pool, backend, looper):
    guard = {**LOOP_GUARD, "min_new_tokens": 12}
    free = pool.reference(backend, looper).generate(MIXED, options=BUDGET)
    got = pool.engine(backend, looper, repeat_terminate=guard).generate(MIXED, options=BUDGET)
    eos = pool.reference(backend, looper).tokenizer.eos_token_id
    assert check_against_reference(free, got, guard, eos, dtype=pool.options.dtype) > 0
    for r in got:
        if r.meta["repeat_terminate_triggered"]:
            assert r.meta["repeat_terminate_index"] >= 12


def test_refuses_to_start_when_the_guard_cannot_be_activated(pool, backend_names, monkeypatch):
    """A vLLM without its runner's logits-processor interface (either runner): the engine refuses before starting."""
    from engine import GenerationEngine
    from engine.backends.vllm import rules as vllm_rules

    # This vLLM "lacks" both runners' interfaces (hiding vLLM's own module would break vLLM's import when it is
    # not imported yet, e.g. when this check runs alone).
    monkeypatch.setitem(vllm_rules.INTERFACES, "v1", "engine_absent.v1")
    monkeypatch.setitem(vllm_rules.INTERFACES, "v2", "engine_absent.v2")
    cfg = pool.config("vllm", pool.options.model, repeat_terminate=LOOP_GUARD)
    with pytest.raises(UnsupportedCapabilityError, match=r"repeat_terminate.enabled.*cannot be activated"):
        GenerationEngine(cfg)


@pytest.mark.servable
def test_generation_min_new_tokens_gates_the_guard_alike(pool, backend_names, looper):
    """``generation.min_new_tokens`` feeds the guard's gate: no trigger before it (the reference fires with
    the larger of the two gates), and every backend ends the same rows at the same index."""
    opts = {**BUDGET, "min_new_tokens": 14}
    got = {}
    for b in backend_names:
        free = pool.reference(b, looper).generate(MIXED, options=opts)
        got[b] = pool.engine(b, looper, repeat_terminate=LOOP_GUARD).generate(MIXED, options=opts)
        eos = pool.reference(b, looper).tokenizer.eos_token_id
        gate = {**LOOP_GUARD, "min_new_tokens": 14}
        assert check_against_reference(free, got[b], gate, eos, dtype=pool.options.dtype) > 0, b
        assert all(r.meta["repeat_terminate_index"] >= 14 for r in got[b] if r.meta["repeat_terminate_triggered"])
    assert_same_results(got, what="repeat guard gated by generation.min_new_tokens", dtype=pool.options.dtype)


@pytest.mark.servable
def test_guarded_batch_larger_than_the_engine_queues_alike(pool, backend_names, looper):
    """More rows than vLLM's ``max_num_seqs`` and HF's ``max_batch_size``: vLLM queues rows and reuses slots (rule
    state must follow each request, not the slot), HF splits the batch; every row still ends where the
    reference fires, and both backends agree on every field."""
    rows = MIXED * 6  # 54 rows > max_num_seqs 4 and max_batch_size 8, looping and healthy rows interleaved
    got = {}
    for b in backend_names:
        small = {"vllm": {**pool.config(b, looper)["vllm"], "max_num_seqs": 4}, "hf": {"max_batch_size": 8}}
        free = pool.reference(b, looper).generate(rows, options=BUDGET)
        got[b] = pool.engine(b, looper, repeat_terminate=LOOP_GUARD, **small).generate(rows, options=BUDGET)
        eos = pool.reference(b, looper).tokenizer.eos_token_id
        fired = check_against_reference(free, got[b], LOOP_GUARD, eos, dtype=pool.options.dtype)
        if pool.options.dtype == "float32":  # each copy of a prompt alike (lower precision: batch-mates matter)
            assert fired == 6 * sum(r.meta["repeat_terminate_triggered"] for r in got[b][: len(MIXED)]), b
        assert fired > 0, b
    assert_same_results(got, what="guarded batch queued over small slots", dtype=pool.options.dtype)


# SmolLM2's checks reach the text server only (text_server): their twins run among that server's users, before the
# check that ends it (plan.served_rank); the looper's checks run with the other modules' servers after it, so vLLM,
# one server at a time, starts the text server and the looper's once each.
@pytest.mark.text_server
@pytest.mark.servable
def test_healthy_smollm2_prompts_never_trigger(pool, backend, engine, workload):
    healthy = [p["messages"] for p in load_prompts("chat") + load_prompts("lists")]
    prompts = workload.pick(full=healthy, quick=healthy[4:])  # quick: two chat answers and both lists
    opts = {"max_new_tokens": 64}
    free = pool.reference(backend, pool.options.model).generate(prompts, options=opts)
    got = pool.engine(backend, pool.options.model, repeat_terminate=REAL_LOOP_GUARD).generate(prompts, options=opts)
    assert [r.meta["repeat_terminate_triggered"] for r in got] == [0] * len(prompts)
    assert [r.token_ids for r in got] == [r.token_ids for r in free]


@pytest.mark.slow
@pytest.mark.text_server
@pytest.mark.servable
@pytest.mark.parametrize(
    ("guard", "reason"),
    [
        (REAL_LOOP_GUARD, "ngram_repeats"),
        # Its nested "fruit1" object reaches 3 keys; the person object stops at exactly 2 (the near miss).
        ({"enabled": True, "max_object_keys": 2}, "object_keys"),
    ],
    ids=["ngram", "object-keys"],
)
def test_real_model_loop_triggers_and_near_miss_does_not(pool, backend, engine, guard, reason, summary_note):
    by_id = {p["id"]: p["messages"] for p in load_prompts("json")}
    prompts = [by_id["json-30-fruits"], by_id["json-person"]]
    opts = {"max_new_tokens": 160}
    free = pool.reference(backend, pool.options.model).generate(prompts, options=opts)
    got = pool.engine(backend, pool.options.model, repeat_terminate=guard).generate(prompts, options=opts)
    decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    eos = engine.tokenizer.eos_token_id
    fired = check_against_reference(free, got, guard, eos, decode, dtype=pool.options.dtype)
    fruits, person = got
    if pool.options.dtype != "float32":  # the loop is the fixture's float32 behaviour (bfloat16 writes Python)
        summary_note(f"real-model {reason} on {backend} ({pool.options.dtype}): {fired} of 2 rows fired")
        return
    assert fired == 1
    assert fruits.meta["repeat_terminate_reason"] == reason
    assert person.meta["repeat_terminate_triggered"] == 0 and person.token_ids == free[1].token_ids
