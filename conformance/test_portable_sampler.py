"""The portable sampler (``generation.sampler: portable``): sampled rows compared token for token across backends.

With the backend's own sampler a seeded row reproduces on its backend only (``test_sampling.py`` compares sets and
supports). The portable draw (``engine.rules.portable_sampler``: the argmax of the processed logits plus Gumbel noise
hashed from (row seed, position, token), vLLM Model Runner V2's arithmetic) depends on nothing else, so HF, vLLM and
llama.cpp, computing the same processed distribution in float32, draw the same tokens. Their logits differ in the
last bits, so a row may part where two noisy scores nearly tie: a divergence is accepted only where the reference's
(HF's) two noisy scores, re-scored under the same processing, are within :data:`NEAR_TIE`, and every such place is
printed in the summary. Anything else fails, naming the row, the step and the margin.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from conformance.compare import first_divergence
from conformance.precision import REFERENCE_TOL
from conformance.subjects.plan import engines, servers, uses
from engine.rules.portable_sampler import gumbel_noise
from engine.rules.seeding import row_seed
from engine_fixtures import load_prompts

SUBJECTS = uses(
    engines("text"),
    engines("text", model={"logprobs_mode": "processed_logprobs"}, vllm={}),  # test_logprobs_mode.processed
    servers("text"),
)

pytestmark = [pytest.mark.dtype_dependent, pytest.mark.runner_dependent]

PROMPTS = [p["messages"] for p in load_prompts("chat")[:4]]
TOKENS = 32
CONFIGS: dict[str, dict[str, Any]] = {
    "t0.7": {"temperature": 0.7},
    "t1.0": {"temperature": 1.0},
    "t1.3": {"temperature": 1.3},
    "top_k": {"temperature": 1.0, "top_k": 20},
    "top_p": {"temperature": 1.0, "top_p": 0.9},
    "min_p": {"temperature": 1.0, "min_p": 0.05},
    "penalty": {"temperature": 1.0, "repetition_penalty": 1.3},
    "combined": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.02, "repetition_penalty": 1.2},
}
"""8 settings x 4 prompts: 32 rows of 32 tokens, each setting one seeded call."""
GROUP = 8
"""A GRPO group: one prompt eight times in one seeded call (row seeds differ by index, so rows differ)."""
NEAR_TIE = 2 * REFERENCE_TOL
"""How close the reference's two noisy scores (the tokens each backend drew) must be for a divergence to be
accepted: each backend's float32 log-probabilities stay within REFERENCE_TOL of the reference's, so each noisy score
moves at most that much, and the order of two scores closer than twice that may flip."""


def options(config: Mapping[str, Any], seed: int, sampler: str = "portable") -> dict[str, Any]:
    return {"max_new_tokens": TOKENS, "seed": seed, "sampler": sampler, **config}


def seed_of(name: str) -> int:
    return 1000 + list(CONFIGS).index(name) if name in CONFIGS else 7


def near_tie(reference: Any, prompt_ids: Sequence[int], ours: Sequence[int], theirs: Sequence[int], step: int,
             config: Mapping[str, Any], seed: int, *, fp64: bool = False) -> float:
    """The reference's margin between the two drawn tokens at ``step`` (positive: the reference's token ahead), from
    its processed log-probabilities of both (``engine.score`` with the call's processing) and their noise (float64's
    for ``portable_fp64`` rows)."""
    mine = ours[step] if step < len(ours) else None
    other = theirs[step] if step < len(theirs) else None
    if mine is None or other is None:  # one row ended (EOS counts as a token): not a tie the draw made
        return float("inf")
    prefix = list(prompt_ids) + list(ours[:step])
    processing = dict(config)
    mine_lp, other_lp = (reference.score([[*prefix, t]], [len(prefix)], processing=processing)[0].logprobs[0]
                         for t in (mine, other))
    noise = gumbel_noise(seed, len(prefix) - 1, [mine, other], fp64=fp64)
    return float((mine_lp + noise[0]) - (other_lp + noise[1]))


def compare_rows(reference: Any, rows: dict[str, Sequence[Any]], config: Mapping[str, Any], seed: int,
                 label: str) -> tuple[int, list[str], list[str]]:
    """(identical rows, accepted near-ties, failures) of every backend's rows against the first backend's."""
    names = list(rows)
    identical, ties, failures = 0, [], []
    for other in names[1:]:
        for i, (a, b) in enumerate(zip(rows[names[0]], rows[other], strict=True)):
            step = first_divergence(a.token_ids, b.token_ids)
            if step is None:
                identical += 1
                continue
            margin = near_tie(reference, a.prompt_token_ids, a.token_ids, b.token_ids, step, config,
                              row_seed(seed, i))
            where = (f"{label} row {i}: {names[0]} vs {other} part at step {step} "
                     f"({a.token_ids[step:step + 1]} vs {b.token_ids[step:step + 1]}), margin {margin:.2e}")
            (ties if abs(margin) <= NEAR_TIE else failures).append(where)
    return identical, ties, failures


@pytest.mark.servable  # the quick tier runs it in-process; test_openai_groups_draw_the_engines_rows is its served part
def test_portable_rows_are_identical_across_backends(engines, pool, summary_note, workload):
    """In float32 every row is identical or parts at a near-tie; in a lower dtype the agreement is reported only
    (kernels round differently per backend there, so rows part wherever two tokens are within that rounding)."""
    reference = pool.reference(next(iter(engines)), pool.options.model)
    total, identical, ties, failures = 0, 0, [], []
    chosen = workload.pick(full=list(CONFIGS), quick=["combined"])  # the quick tier: every processing step at once
    calls = [(name, PROMPTS, CONFIGS[name]) for name in chosen]
    calls.append(("grpo", [PROMPTS[0]] * GROUP, {"temperature": 1.0}))
    for name, prompts, config in calls:
        rows = {b: e.generate(prompts, options=options(config, seed_of(name))) for b, e in engines.items()}
        for b, got in rows.items():
            assert all(r.meta.get("sampler") == "portable" and r.meta.get("seed") == seed_of(name) for r in got), \
                f"{b}: the rows do not report the portable sampler and the call's seed: {[r.meta for r in got]}"
        if name == "grpo":
            distinct = {r.token_ids for r in rows[next(iter(engines))]}
            assert len(distinct) > GROUP // 2, f"a GRPO group of {GROUP} drew only {len(distinct)} distinct rows"
        same, tied, failed = compare_rows(reference, rows, config, seed_of(name), name)
        total += len(prompts) * (len(engines) - 1)
        identical, ties, failures = identical + same, ties + tied, failures + failed
    dtype = pool.options.dtype
    summary_note(f"portable sampler, {dtype}, {total} row pairs of {TOKENS} tokens against {next(iter(engines))}: "
                 f"{identical} identical, {len(ties)} parted at a near-tie (margin <= {NEAR_TIE:g}), "
                 f"{len(failures)} elsewhere" + "".join(f"; {t}" for t in ties))
    if dtype == "float32":
        assert not failures, "rows parted where no near-tie explains it:\n" + "\n".join(failures)


@pytest.mark.servable
def test_a_portable_row_does_not_change_with_its_batch_mates_the_batch_size_or_the_order(engine, backend):
    """Row 0 of a seeded call draws with the same row seed whatever follows it: alone, beside three other prompts,
    beside seven copies of another one, its tokens are the same. Requests that carry their own seed
    (``ChatRequest.seed``) draw alike in any order."""
    from engine.types import ChatRequest

    config = CONFIGS["combined"]
    alone = engine.generate(PROMPTS[:1], options=options(config, 5))[0]
    mates = engine.generate(PROMPTS, options=options(config, 5))[0]
    crowd = engine.generate([PROMPTS[0], *[PROMPTS[3]] * 7], options=options(config, 5))[0]
    if engine.config.model.dtype != "float32":
        pytest.skip("batch-size invariance is float32's promise: in bfloat16 a batch's shape changes the kernels' "
                    "rounding (test_batch_invariance.py holds that case to the low-precision rule)")
    assert alone.token_ids == mates.token_ids == crowd.token_ids, (
        f"{backend}: row 0 changed with its batch: {alone.token_ids} / {mates.token_ids} / {crowd.token_ids}")
    own = [ChatRequest(tuple(p), seed=300 + i) for i, p in enumerate(PROMPTS)]
    forward = engine.generate(own, options=options(config, 5))
    backward = engine.generate(own[::-1], options=options(config, 5))[::-1]
    single = [engine.generate([r], options=options(config, 6))[0] for r in own[1:3]]
    assert [r.token_ids for r in forward] == [r.token_ids for r in backward], f"{backend}: the order changed rows"
    assert [r.token_ids for r in single] == [r.token_ids for r in forward[1:3]], f"{backend}: a seeded request " \
        "drew otherwise alone"


def test_an_unseeded_portable_call_reports_a_seed_that_replays_it(engine, backend):
    opts = {k: v for k, v in options(CONFIGS["t1.0"], 0).items() if k != "seed"}
    first = engine.generate(PROMPTS[:2], options=opts)
    seed = first[0].meta["seed"]
    assert isinstance(seed, int) and all(r.meta["seed"] == seed for r in first), [r.meta for r in first]
    again = engine.generate(PROMPTS[:2], options={**opts, "seed": seed})
    assert [r.token_ids for r in again] == [r.token_ids for r in first], f"{backend}: seed {seed} did not replay"


def test_the_comparison_fails_when_one_backend_draws_natively(engines, pool):
    """The check's teeth: the reference drawing portably against another backend drawing with its own sampler parts
    at places no near-tie explains (so a backend that ignored ``sampler`` would fail the check above)."""
    names = list(engines)
    reference = pool.reference(names[0], pool.options.model)
    config = CONFIGS["t1.0"]
    rows = {names[0]: engines[names[0]].generate(PROMPTS, options=options(config, 3)),
            names[1]: engines[names[1]].generate(PROMPTS, options=options(config, 3, sampler="native"))}
    _, _, failures = compare_rows(reference, rows, config, 3, "native")
    assert failures, f"{names[1]}'s own sampler drew the portable rows: the comparison cannot tell them apart"


def test_greedy_with_the_portable_sampler_is_refused_before_generation(engine, count_backend_calls):
    from engine.errors import ConfigError

    calls = count_backend_calls(engine)
    with pytest.raises(ConfigError) as info:
        engine.generate(PROMPTS[:1], options={"max_new_tokens": 4, "sampler": "portable"})
    assert info.value.field == "generation.sampler"
    with pytest.raises(ConfigError) as info:
        engine.generate(PROMPTS[:1], options={"max_new_tokens": 4, "temperature": 1.0, "sampler": "gumbel"})
    assert info.value.field == "generation.sampler" and "portable" in str(info.value)
    assert calls == [], "a refused request generated tokens"


def test_processed_logprobs_describe_the_distribution_the_draw_used(pool, backend_names, workload):
    """In processed mode a portable row's logprobs are those of the distribution it was drawn from, on every backend
    (on vLLM the processor forces the drawn token, and the engine reports the distribution the draw used instead of
    that one-token row): an HF trainer re-scoring with the same processing weighs every token 1, and each step's
    kept support holds the drawn token and sums to 1."""
    import math

    from conformance.test_logprobs_mode import PROCESSING, SAMPLED, WEIGHT_TOL, kept, processed

    if pool.options.dtype != "float32":
        pytest.skip("weights within 1e-3 of 1 are float32's bound (test_logprobs_mode.py's WEIGHT_TOL)")
    trainer = pool.reference("hf", pool.options.model)
    for b in backend_names:
        rows = processed(pool, b, workload).generate(PROMPTS, options={**SAMPLED, "sampler": "portable"})
        seqs = [list(r.prompt_token_ids) + list(r.token_ids) for r in rows]
        scores = trainer.score(seqs, [len(r.prompt_token_ids) for r in rows], processing=PROCESSING)
        for i, (r, score) in enumerate(zip(rows, scores, strict=True)):
            for k, (token, want) in enumerate(zip(r.token_ids, score.logprobs, strict=True)):
                support = kept(r.logprobs[k])
                assert token in support, f"{b} row {i} step {k}: drew {token} outside its kept support"
                mass = sum(math.exp(v) for v in support.values())
                assert len(support) > 1 or mass == pytest.approx(1), f"{b} row {i} step {k}: {support}"
                assert abs(math.exp(want - r.logprobs[k][token]) - 1) <= WEIGHT_TOL, (
                    f"{b} row {i} step {k}: reported {r.logprobs[k][token]:.5f}, drawn from {want:.5f}")
        assert any(len(kept(step)) > 1 for r in rows for step in r.logprobs), f"{b}: every step kept one token"


def test_openai_groups_draw_the_engines_rows(pool, backend_names, summary_note):
    """``/v1/completions`` with ``n``, ``seed`` and the portable sampler (the ``engine`` extension): each backend's
    server answers the group an in-process call of the same prompt ``n`` times draws, token for token (near-ties
    aside, as above)."""
    import httpx

    reference = pool.reference(backend_names[0], pool.options.model)
    prompt = list(reference.prepare([PROMPTS[1]])[0][0].token_ids)
    config, n, seed = CONFIGS["combined"], 4, 21
    local = reference.generate([PROMPTS[1]] * n, options=options(config, seed))
    body = {"prompt": prompt, "n": n, "seed": seed, "max_tokens": TOKENS, "return_token_ids": True,
            "engine": {"options": {"sampler": "portable"}}, **config}
    ties, failures = [], []
    for b in backend_names:
        server = pool.text_server(b)
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        reply = httpx.post(f"{server.url}/v1/completions", json={"model": model, **body}, timeout=300)
        assert reply.status_code == 200, f"{b}: {reply.status_code} {reply.text[:500]}"
        choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
        assert len(choices) == n, f"{b}: {len(choices)} choices"
        for i, (want, choice) in enumerate(zip(local, choices, strict=True)):
            got = tuple(choice["token_ids"])
            step = first_divergence(want.token_ids, got)
            if step is None:
                continue
            margin = near_tie(reference, prompt, want.token_ids, got, step, config, row_seed(seed, i))
            (ties if abs(margin) <= NEAR_TIE else failures).append(f"{b} choice {i} at step {step}: {margin:.2e}")
    summary_note(f"portable sampler over /v1/completions (n={n}, {len(backend_names)} servers): {len(ties)} "
                 "near-ties" + "".join(f"; {t}" for t in ties))
    if pool.options.dtype == "float32":
        assert not failures, "server choices parted from the engine's rows:\n" + "\n".join(failures)


def test_vllm_model_runner_v2s_own_sampler_draws_the_portable_rows(engines, pool, summary_note):
    """Where vLLM runs Model Runner V2 (CUDA hosts: its Gumbel sampler is the arithmetic the portable one follows),
    vLLM's own sampler, seeded with the rows' seeds, draws what HF's portable sampler draws, near-ties aside. The GPU
    runbook runs it (``nox -s gpu``); vLLM's CPU build runs the V1 runner, whose sampler is another stream."""
    if "vllm" not in engines or engines["vllm"].backend.load_decisions.get("runner") != "v2":
        pytest.skip("needs vLLM on Model Runner V2 (CUDA hosts); vLLM's CPU build runs the V1 runner")
    names = [next(iter(engines)), "vllm"]
    reference = pool.reference(names[0], pool.options.model)
    total, ties, failures = 0, [], []
    for name, config in CONFIGS.items():
        rows = {names[0]: engines[names[0]].generate(PROMPTS, options=options(config, seed_of(name))),
                "vllm": engines["vllm"].generate(PROMPTS, options=options(config, seed_of(name), sampler="native"))}
        _, tied, failed = compare_rows(reference, rows, config, seed_of(name), f"{name} (vLLM's own sampler)")
        total, ties, failures = total + len(PROMPTS), ties + tied, failures + failed
    summary_note(f"vLLM Model Runner V2's own sampler against the portable one on {names[0]}: {total} rows, "
                 f"{len(ties)} near-ties, {len(failures)} elsewhere" + "".join(f"; {t}" for t in ties + failures))
    if pool.options.dtype == "float32":
        assert not failures, "vLLM's own Gumbel draw parted from the portable one:\n" + "\n".join(failures)
