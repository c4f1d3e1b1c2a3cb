"""One logprob contract on every backend: ``model.logprobs_mode: processed_logprobs`` (vLLM's names and steps) reports
the distribution each token was drawn from, equal across HF, vLLM and llama.cpp in float32; a trainer that re-scores
with the same processing (``engine.score(..., processing=...)``) gets importance weights of 1; one that re-scores with
the temperature only (ms-swift's trainer) or reads raw logprobs does not, by the amounts this check measures.

Seeded samples differ across backends (their random streams differ), so a sampled row is compared across backends
at every step whose prefix both rows share (the first step always): the kept support (every finite entry of the
top-20 under ``top_k: 20``), its values and each backend's drawn token. A greedy penalised run (with a min-length ban)
compares every step."""

from __future__ import annotations

import math

import pytest

from conformance.precision import REFERENCE_TOL
from conformance.subjects.plan import engines, servers, uses
from engine.errors import ConfigError
from engine_fixtures import load_prompts

SUBJECTS = uses(
    engines("text"),
    engines("text", model={"logprobs_mode": "processed_logprobs"}, vllm={}),
    servers("text"),
    servers("text", model={"logprobs_mode": "processed_logprobs"}),
    servers("text", model={"logprobs_mode": "processed_logprobs"}, vllm={}),
)

PROMPTS = [p["messages"] for p in load_prompts("chat")[:4]]
PROCESSING = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3}
SAMPLED = {"max_new_tokens": 8, "seed": 11, "logprobs": 20, **PROCESSING}
GREEDY = {"max_new_tokens": 8, "repetition_penalty": 1.3, "min_new_tokens": 3, "logprobs": 5}
PROCESSED = {"logprobs_mode": "processed_logprobs"}
"""The processed engines' model section (the session's dtype: these checks run in the float32 pass only)."""
WEIGHT_TOL = 1e-3
"""|importance weight - 1| of a float32 rollout re-scored as it was drawn: cached decode against one forward pass
(HF on itself measures ~1e-5) plus the cross-backend float32 bound."""


VLLM_PROCESSED = {"multiprocessing": True, "cpu_kv_cache_space_gib": 0.125}
"""vLLM fixes the mode when it starts: its processed engine is a second one, kept out of the suite's process (its
engine core in a child) with a small KV cache (and a 2048-token context), so the full gate's own memory stays where
it was (the CPU CI's 12 GB per process). The quick tier, whose process peaks lower (8.8 GiB), keeps it in-process:
the child's start (two more processes importing vLLM) took 58 s of the 2-core CI run, the in-process one 5-9 s."""


def processed(pool, backend, workload):
    """``backend``'s engine in processed mode: derived from the loaded one on HF and llama.cpp (they read the mode
    per call), a second engine on vLLM (in a child process in the full gate, :data:`VLLM_PROCESSED`; the pool gives
    its small KV cache the context that fits, ``context_that_fits``). Every backend is asked with the same sections
    (each reads its own), so the server the pool starts ahead for another backend is the one its check will ask for."""
    placed = workload.pick(full=VLLM_PROCESSED, quick={**VLLM_PROCESSED, "multiprocessing": False})
    settings = {**pool.config("vllm", pool.options.model)["vllm"], **placed}
    return pool.engine(backend, pool.options.model, model=PROCESSED, vllm=settings)


def kept(step: dict[int, float]) -> dict[int, float]:
    return {t: v for t, v in step.items() if math.isfinite(v)}


@pytest.mark.servable
def test_processed_logprobs_are_one_contract_on_every_backend(pool, backend_names, workload):
    rows = {b: processed(pool, b, workload).generate(PROMPTS, options=SAMPLED) for b in backend_names}
    greedy = {b: processed(pool, b, workload).generate(PROMPTS, options=GREEDY) for b in backend_names}
    for b, results in rows.items():
        for i, r in enumerate(results):
            assert r.meta["logprobs_mode"] == "processed_logprobs", f"{b} row {i}: {r.meta.get('logprobs_mode')}"
            for s, (token, step) in enumerate(zip(r.token_ids, r.logprobs, strict=True)):
                support = kept(step)
                assert token in support, f"{b} row {i} step {s}: drew {token}, outside its kept support {support}"
                assert len(support) <= PROCESSING["top_k"], f"{b} row {i} step {s}: {len(support)} kept tokens"
                mass = sum(math.exp(v) for v in support.values())
                assert abs(mass - 1) < 1e-4, f"{b} row {i} step {s}: the kept support sums to {mass}, not 1"
    first, *others = backend_names
    compared = 0
    for b in others:
        for i, (ref, got) in enumerate(zip(rows[first], rows[b], strict=True)):
            for s in range(min(len(ref.token_ids), len(got.token_ids))):
                want, have = kept(ref.logprobs[s]), kept(got.logprobs[s])
                assert want.keys() == have.keys(), f"{first} vs {b} row {i} step {s}: kept {sorted(want)} vs " \
                                                   f"{sorted(have)}"
                worst = max(abs(want[t] - have[t]) for t in want)
                assert worst <= REFERENCE_TOL, f"{first} vs {b} row {i} step {s}: processed logprobs {worst} apart"
                compared += 1
                if ref.token_ids[s] != got.token_ids[s]:
                    break  # the prefixes part here: later steps condition on different tokens
        for i, (ref, got) in enumerate(zip(greedy[first], greedy[b], strict=True)):
            assert ref.token_ids == got.token_ids, f"{first} vs {b} greedy row {i}: {ref.token_ids} vs {got.token_ids}"
            for s, (want, have) in enumerate(zip(ref.logprobs, got.logprobs, strict=True)):
                worst = max(abs(want[t] - have[t]) for t in want.keys() & have.keys())
                assert worst <= REFERENCE_TOL, f"{first} vs {b} greedy row {i} step {s}: {worst} apart"
    assert compared >= len(PROMPTS) * len(others)


@pytest.mark.servable
def test_min_length_ban_shows_in_processed_logprobs(pool, backend, workload):
    """A token the engine forbids (here EOS under ``min_new_tokens``) has processed logprob -inf while it is banned,
    and its raw logprob is the model's own: every backend reports the ban the same way."""
    engine = processed(pool, backend, workload)
    eos = engine.tokenizer.eos_token_id
    say = [[{"role": "user", "content": "Reply with one word: yes or no. Is water wet?"}]]
    free = engine.generate(say, options={"max_new_tokens": 6})[0]
    ended = len(free.token_ids)
    assert free.token_ids[-1] == eos and ended < 6, f"{backend}: the prompt was meant to end early: {free.token_ids}"
    ban = engine.generate(say, options={"max_new_tokens": 6, "min_new_tokens": ended + 1, "logprobs": 20})[0]
    step = ban.logprobs[ended - 1]  # where the free row drew EOS
    assert step.get(eos, float("-inf")) == float("-inf"), f"{backend}: banned EOS reported {step.get(eos)}"


TRL_VERSION = "1.16"
"""The TRL release whose ``VLLMClient`` drives the served engine (nox installs it beside the stack:
``ENGINE_TRL_PATH``)."""


def trl_environment() -> dict[str, str] | None:
    """The environment in which ``python -m conformance.trl_probe`` imports TRL 1.16: this one where TRL 1.16 is
    installed (the vLLM 0.31 venv of ``nox -s vllm-versions``), else this one with ``ENGINE_TRL_PATH`` (where ``nox -s
    conformance`` installs it, without its dependencies: the stack has them) first on the path; None when neither."""
    import importlib.metadata
    import os
    from pathlib import Path

    import engine

    site = str(Path(engine.__file__).parent / "compat" / "site")  # TRL asks importlib.metadata for "vllm"
    paths = [site, os.environ.get("PYTHONPATH", "")]
    try:
        here = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        here = None
    if here is None or not here.startswith(TRL_VERSION):
        extra = os.environ.get("ENGINE_TRL_PATH")
        if not extra or not Path(extra, "trl").is_dir():
            return None
        paths.insert(0, extra)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}


@pytest.mark.on_servers  # with the served twins: vLLM's processed server starts once for both
@pytest.mark.quick_on("hf", reason=(
    "TRL's client is the same on every server; its processed-logprobs server starts in 6 s on HF, and on vLLM it "
    "would be one more vLLM server (about 25 s on CI)"))
def test_trl_vllm_client_rollouts_rescore_to_the_logprobs_it_returned(pool, backend, workload):
    """TRL 1.16's own ``VLLMClient`` against the served engine in processed mode (what TRL's GRPO trainer requires):
    it reads ``/server_info`` and ``/get_world_size``, sends its completions body (token-id prompts, ``n``,
    ``return_token_ids``, ``return_tokens_as_token_ids``, ``logprobs: 0``), and gets back prompt-major ids; the HF
    trainer re-scores each returned row with the same processing (``engine.score``) to the logprobs TRL returned,
    within the float32 bound of the in-process check (``WEIGHT_TOL``)."""
    import json
    import subprocess
    import sys

    env = trl_environment()
    if env is None:
        pytest.skip(f"TRL {TRL_VERSION} is installed by nox -s conformance (ENGINE_TRL_PATH) or in the vLLM 0.31 venv "
                    "of nox -s vllm-versions; this environment has neither")
    server = processed(pool, backend, workload).server()
    prompts = [list(r.prompt_token_ids) for r in pool.reference("hf", pool.options.model).generate(
        PROMPTS[:2], options={"max_new_tokens": 1})]
    sampling = {key: PROCESSING[key] for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    job = {"url": server.url, "prompts": prompts, "n": 2,
           "sampling": {**sampling, "max_tokens": 8, "logprobs": 0, "generation_kwargs": {"seed": 11}}}
    done = subprocess.run([sys.executable, "-m", "conformance.trl_probe"], input=json.dumps(job), env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"TRL's client failed:\n{done.stderr[-3000:]}"
    answer = json.loads(done.stdout)
    assert answer["trl"].startswith(TRL_VERSION), answer["trl"]
    assert answer["world_size"] == 1
    assert answer["vllm_config"]["model_config"]["logprobs_mode"] == "processed_logprobs"
    got = answer["generate"]
    assert got["prompt_ids"] == prompts, "prompt_ids are not the ids sent"
    completions = got["completion_ids"]
    assert len(completions) == 2 * len(prompts) and all(completions), [len(c) for c in completions]
    assert [[step[0] for step in row] for row in got["logprob_token_ids"]] == completions
    rows = [prompts[k // 2] + completion for k, completion in enumerate(completions)]
    scores = pool.reference("hf", pool.options.model).score(rows, [len(prompts[k // 2]) for k in range(len(rows))],
                                                            processing=PROCESSING)
    worst = max(abs(math.exp(rescored - step[0]) - 1) for row, s in zip(got["logprobs"], scores, strict=True)
                for step, rescored in zip(row, s.logprobs, strict=True))
    assert worst <= WEIGHT_TOL, f"{backend}: TRL's logprobs re-scored by the trainer, weight off 1 by {worst}"


@pytest.mark.servable
def test_importance_weights_are_one_when_the_trainer_rescores_as_the_rollout_drew(pool, backend, summary_note,
                                                                                 workload):
    """Rollouts in processed mode, re-scored by an HF trainer (``engine.score``) with the same processing: every
    token's weight is 1. Re-scored with the temperature only (ms-swift's trainer), or read raw (this server before
    ``logprobs_mode``), the weights are off: each combination is measured and noted."""
    rollout = processed(pool, backend, workload).generate(PROMPTS, options=SAMPLED)
    raw = pool.text_engine(backend).generate(PROMPTS, options=SAMPLED)
    trainer = pool.reference("hf", pool.options.model)

    def weights(results, processing):
        seqs = [list(r.prompt_token_ids) + list(r.token_ids) for r in results]
        scores = trainer.score(seqs, [len(r.prompt_token_ids) for r in results], processing=processing)
        return [math.exp(t - r.logprobs[k][tok]) for r, s in zip(results, scores, strict=True)
                for k, (tok, t) in enumerate(zip(r.token_ids, s.logprobs, strict=True))]

    matched = weights(rollout, PROCESSING)
    worst = max(abs(w - 1) for w in matched)
    assert worst <= WEIGHT_TOL, f"{backend}: processed rollout re-scored as drawn, weight off 1 by {worst}"
    tempered = {"temperature": PROCESSING["temperature"]}  # ms-swift's trainer: temperature only, full vocabulary
    mixed = {"processed rollout, temperature-only trainer": weights(rollout, tempered),
             "raw rollout, temperature-only trainer": weights(raw, tempered),
             "raw rollout, processed trainer": weights(raw, PROCESSING)}
    for name, ws in mixed.items():
        outside = sum(not 0.9 <= w <= 1.1 for w in ws) / len(ws)
        summary_note(f"{backend} {name}: mean weight {sum(ws) / len(ws):.3f}, {outside:.0%} of {len(ws)} tokens "
                     f"outside [0.9, 1.1] (matched: worst {worst:.1e})")
        assert max(abs(w - 1) for w in ws) > 0.05, f"{backend} {name}: no bias measured, the check has no teeth"


def test_kept_mass_is_the_gap_to_temperature_only_rescoring(pool):
    """Without a penalty, processed logprobs exceed temperature-only ones by exactly -log(kept mass) per token (the
    trap of vLLM-processed rollouts against ms-swift's re-scoring), and ``engine.score`` reports that mass."""
    trainer = pool.reference("hf", pool.options.model)
    rows = trainer.generate(PROMPTS, options={**SAMPLED, "repetition_penalty": 1.0})
    seqs = [list(r.prompt_token_ids) + list(r.token_ids) for r in rows]
    starts = [len(r.prompt_token_ids) for r in rows]
    truncated = trainer.score(seqs, starts, processing={**PROCESSING, "repetition_penalty": 1.0})
    tempered = trainer.score(seqs, starts, processing={"temperature": PROCESSING["temperature"]})
    for i, (p, t) in enumerate(zip(truncated, tempered, strict=True)):
        for k, (a, b, mass) in enumerate(zip(p.logprobs, t.logprobs, p.kept_mass, strict=True)):
            assert 0 < mass <= 1 + 1e-6, f"row {i} token {k}: kept mass {mass}"
            assert abs((a - b) + math.log(mass)) < 1e-4, f"row {i} token {k}: gap {a - b}, -log mass {-math.log(mass)}"
    assert any(m < 0.99 for s in truncated for m in s.kept_mass), "top-p/top-k cut nothing: the check has no teeth"


@pytest.mark.servable
def test_a_request_expecting_another_mode_is_refused_before_generation(engine, backend, count_backend_calls, pool):
    """A learner can tell the mode before its first step (``/health``, ``/v1/models``, each result's meta) and can
    make a mismatch a refusal instead of silently wrong weights."""
    import httpx

    calls = count_backend_calls(engine)
    with pytest.raises(ConfigError, match=r"generation\.logprobs_mode") as err:
        engine.generate(PROMPTS[:1], options={"max_new_tokens": 4, "logprobs": 1,
                                              "logprobs_mode": "processed_logprobs"})
    assert "raw_logprobs" in str(err.value) and calls == []
    server = pool.text_server(backend)
    assert httpx.get(f"{server.url}/health", timeout=30).json()["logprobs_mode"] == "raw_logprobs"
    assert httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["logprobs_mode"] == "raw_logprobs"
