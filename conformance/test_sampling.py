"""Sampling options observed, not just passed through: seeds, top-k, top-p, min-p, temperature, repetition penalty,
and the top-k log-probability sets, on every backend.

Seeded samples are reproducible per backend, not across backends (their random streams differ), so seed checks
compare a backend with itself; the limits of sampling (``top_k: 1``, a nucleus of one token) must equal greedy
decoding, which is compared across backends too. Expected values are greedy outputs, never the sampler's own.
"""

from __future__ import annotations

import math

import pytest

from conformance.compare import assert_same_results, divergence_steps, exact_pair
from conformance.precision import REFERENCE_TOL, assert_top_k_close, own_error, rescored, value_bound
from conformance.subjects.plan import engines, uses
from engine.errors import ConfigError
from engine_fixtures import load_prompts

SUBJECTS = uses(engines("text"), engines("text", model={"dtype": "float32"}))

pytestmark = pytest.mark.dtype_dependent

PROMPTS = [p["messages"] for p in load_prompts("chat")[:4]]
SAMPLE = {"max_new_tokens": 12, "temperature": 1.0}


def greedy(engine, n: int = 12):
    return engine.generate(PROMPTS, options={"max_new_tokens": n})


def fields(results):
    return [(r.token_ids, r.text, r.finish_reason, r.stop_reason) for r in results]


def test_a_seed_reproduces_and_another_seed_changes_the_sample(engine, backend):
    first = engine.generate(PROMPTS, options={**SAMPLE, "seed": 7})
    again = engine.generate(PROMPTS, options={**SAMPLE, "seed": 7})
    other = engine.generate(PROMPTS, options={**SAMPLE, "seed": 8})
    assert fields(first) == fields(again), f"{backend}: the same seed gave different samples"
    assert fields(first) != fields(other), f"{backend}: seeds 7 and 8 gave identical samples on every row"
    assert fields(first) != fields(greedy(engine)), f"{backend}: temperature 1.0 sampled exactly the greedy rows"


@pytest.mark.parametrize("limit", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}],
                         ids=["top_k-1", "top_p-tiny", "min_p-1"])
def test_a_one_token_candidate_set_is_greedy(engines, limit, pool):
    """``top_k: 1`` keeps one candidate; so does a nucleus smaller than any token's probability, and ``min_p: 1``
    (only tokens as likely as the likeliest). Each must
    reproduce greedy decoding whatever the temperature and the seed, and agree across backends. (In lower
    precision two tokens can tie exactly, and the sampler's top-k may keep the other one than argmax: vLLM's rule.)"""
    got = {}
    for b, e in engines.items():
        rows = e.generate(PROMPTS, options={**SAMPLE, "temperature": 1.5, "seed": 3, **limit})
        assert_same_results({"greedy": greedy(e), f"{limit}": rows}, what=f"{b}: {limit} with temperature 1.5",
                            dtype=pool.options.dtype)
        got[b] = rows
    assert_same_results(got, what=f"sampling limited by {limit}", dtype=pool.options.dtype)


def test_greedy_with_a_nucleus_is_refused_before_generation(engine, count_backend_calls):
    """``top_p``, ``top_k`` or ``min_p`` with temperature 0 would be ignored by greedy decoding: the engine refuses
    it (a typed error naming the field) rather than let one backend apply it and the other drop it."""
    calls = count_backend_calls(engine)
    for key, value in (("top_p", 0.5), ("top_k", 5), ("min_p", 0.1)):
        with pytest.raises(ConfigError) as info:
            engine.generate(PROMPTS, options={"max_new_tokens": 4, key: value})
        assert info.value.field == f"generation.{key}" and info.value.value == value
    assert calls == [], "a refused request generated tokens"


def test_min_p_never_draws_below_its_floor(engine, backend, pool):
    """``min_p``: a token is drawn only if its probability after the temperature is at least ``min_p`` times the
    likeliest one's, i.e. its raw log-probability (what ``logprobs`` returns) is at most ``T * ln(1 / min_p)`` below
    the best. The same seeds without ``min_p`` draw below that floor at temperature 2 (the most any backend takes):
    the check has teeth. The floor holds within float32 rounding in every dtype: the sampler's decision and the
    reported log-probabilities are computed from the same logits (cast to float32 by every backend before sampling),
    so no low-precision kernel error separates them."""
    temperature, min_p = 2.0, 0.3
    floor = temperature * math.log(min_p)

    def lowest(rows) -> float:
        return min(r.logprobs[step][t] - max(r.logprobs[step].values())
                   for r in rows for step, t in enumerate(r.token_ids))

    options = {"max_new_tokens": 16, "temperature": temperature, "seed": 11, "logprobs": 1}
    free = engine.generate(PROMPTS, options=options)
    kept = engine.generate(PROMPTS, options={**options, "min_p": min_p})
    assert lowest(free) < floor, f"{backend}: without min_p no draw fell below {floor:.2f}; the check proves nothing"
    assert lowest(kept) >= floor - REFERENCE_TOL, f"{backend}: min_p {min_p} drew {lowest(kept):.3f} below the best"


def test_repetition_penalty_greedy_parity(engines, pool, summary_note):
    """CTRL-style penalty on prompt and output tokens: not the unpenalised rows (the penalty is applied, not
    dropped), and in float32 the same greedy rows on every backend.

    Outside float32 the backends are compared up to their first divergence only, and how many rows agree is
    reported: vLLM's rule cannot judge a divergence here, since log-probabilities are the raw distribution's and
    the penalty picks tokens outside its top-k."""
    opts = {"max_new_tokens": 24, "repetition_penalty": 1.3}
    got = {}
    for b, e in engines.items():
        rows = e.generate(PROMPTS, options=opts)
        plain = e.generate(PROMPTS, options={"max_new_tokens": 24})
        assert [r.token_ids for r in rows] != [r.token_ids for r in plain], f"{b}: the penalty changed nothing"
        got[b] = rows
    if pool.options.dtype == "float32":
        assert_same_results(got, what="repetition_penalty 1.3", dtype="float32")
        return
    (first, rows_0), *others = got.items()
    for other, rows_1 in others:
        steps = divergence_steps(rows_0, rows_1)
        summary_note(f"repetition_penalty 1.3 {first} vs {other} ({pool.options.dtype}): "
                     f"{steps.count(None)}/{len(steps)} rows token-identical; first divergences {steps}")


def test_top_k_logprob_sets_and_values_agree(engines, pool, summary_note):
    """Greedy with ``logprobs: 5``: per step, each backend returns the 5 most likely tokens (plus the chosen
    one) of the raw distribution; the sets agree up to ties at the edge, and the values agree within 1e-3 in
    fp32. Each backend's set is checked against its own ranking: every value returned is at least every value
    it left out (it cannot know those, so: the set is the top 5, and the chosen token is the best).

    Below float32 the value bound is calibrated in this run (``conformance.precision``): each backend's own error
    against its float32 re-score of the same tokens, plus what float32 allows between backends."""
    k = 5
    rows = {b: e.generate(PROMPTS[:2], options={"max_new_tokens": 8, "logprobs": k}) for b, e in engines.items()}
    names = list(rows)
    own = {}
    if pool.options.dtype != "float32":
        for b in names:
            own[b] = own_error(b, [r.logprobs for r in rows[b]], rescored(pool.float32_reference(b), rows[b], 20))
            summary_note(f"top-{k} logprobs ({pool.options.dtype}): {own[b].line()}")
    compared, worst = 0, 0.0
    for other, i in ((o, i) for o in names[1:] for i in range(len(PROMPTS[:2]))):
        a, b = rows[names[0]][i], rows[other][i]
        bound = value_bound(own[names[0]], own[other]) if own else REFERENCE_TOL
        if exact_pair(names[0], other, pool.options.dtype):
            assert a.token_ids == b.token_ids, f"request {i}: greedy rows of {other} differ in float32"
        n = min(len(a.token_ids), len(b.token_ids))
        shared = next((j for j in range(n) if a.token_ids[j] != b.token_ids[j]), n)
        for step, chosen in enumerate(a.token_ids[:shared]):  # up to the first divergence (other dtypes)
            la, lb = a.logprobs[step], b.logprobs[step]
            for name, lp in ((names[0], la), (other, lb)):
                assert len(lp) == k, f"{name} request {i} step {step}: {len(lp)} entries, want {k} (chosen is top-1)"
                assert max(lp, key=lp.get) == chosen, f"{name} request {i} step {step}: greedy token is not the max"
                assert all(v <= 0.0 and math.isfinite(v) for v in lp.values()), f"{name}: not log-probabilities"
            assert sum(math.exp(v) for v in la.values()) <= 1.0 + 1e-4, f"request {i} step {step}: mass above 1"
            worst = max(worst, assert_top_k_close(la, lb, bound=bound, what=f"request {i} step {step}",
                                                  name_a=names[0], name_b=other))
            compared += 1
    assert compared >= 2 * (len(names) - 1), f"only {compared} steps shared by the backends; the check proves little"
    bounds = " + ".join(f"{o.worst:.3g}" for o in own.values())
    summary_note(f"top-{k} logprobs {' vs '.join(names)} ({pool.options.dtype}): {compared} shared steps, largest "
                 f"difference {worst:.2g} (bound {bounds + ' + ' if bounds else ''}{REFERENCE_TOL:g})")
