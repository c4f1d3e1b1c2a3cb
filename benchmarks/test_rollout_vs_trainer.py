"""The training-inference mismatch per backend and dtype: what switching rollouts from HF to vLLM (or llama.cpp, or
to bfloat16) does to a trainer's importance ratios.

One case per (rollout backend, dtype, logprobs mode): float32 on every backend (HF, vLLM, llama.cpp on its F32 GGUF
twin), bfloat16 on HF and vLLM (llama.cpp's ``model.dtype`` sets only its KV cache; the twin's weights stay F32), each
with ``raw_logprobs`` and ``processed_logprobs`` rollouts (``model.logprobs_mode``). Each case samples
``rollout_tokens`` per row for the healthy chat prompts (temperature 0.7, top-p 0.9, repetition penalty 1.3, one
seed: every round draws the same tokens, asserted); the trainer, HF in the same dtype, re-scores those tokens
teacher-forced as the rollout reports them (``engine.score``, with the sampling processing for processed rollouts).
Two variants, timed: ``rollout`` (subject) and ``rescore`` (reference); no speed ratio. The mode is in the case's
benchmark name.

Recorded (``engine.trainer.mismatch``, ``engine.trainer.correction``): ``dlogprob_*`` (per-token absolute difference),
``importance_ratio_min`` / ``_max`` (per sequence), ms-swift's ``k3_kl``, ``chi2_token``, ``is_weight_mean`` and
``ess`` of the matched pairing, and what ms-swift's trainer (temperature only, full vocabulary) would weight the same
tokens by (``temp_only_weight_mean``, ``temp_only_outside_frac``). The float32 cases carry ``trainer_agreement``, the
worst token weight folded below 1, which the release gate holds at 0.99 or more (``engine.report.gate``): the full
tier's run (``gated_full``); CI's conformance quick tier asserts the same band in its rollout checks.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from benchmarks.conftest import SESSION_KEY
from benchmarks.harness import Variant
from benchmarks.workload import batch_messages
from engine.backends.registry import SPECS

PROCESSING = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.3}
SAMPLING = {**PROCESSING, "seed": 5, "logprobs": 0}
TEMPERATURE_ONLY = {"temperature": PROCESSING["temperature"]}
"""How ms-swift's trainer re-scores: the temperature, over the full vocabulary."""
MODES = ("raw_logprobs", "processed_logprobs")
BATCH = 8


def cases(backends: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(rollout backend, dtype, logprobs mode): float32 everywhere, bfloat16 where the weights really are bfloat16,
    each in both modes.

    >>> [c for c in cases(("hf", "llamacpp")) if c[2] == "raw_logprobs"]
    [('hf', 'float32', 'raw_logprobs'), ('llamacpp', 'float32', 'raw_logprobs'), ('hf', 'bfloat16', 'raw_logprobs')]
    """
    # A GGUF twin holds F32 weights whatever model.dtype says, so bfloat16 would only rename the float32 case.
    pairs = [(b, "float32") for b in backends] + [(b, "bfloat16") for b in backends
                                                  if SPECS[b].model_format != "gguf"]
    return [(b, d, m) for m in MODES for b, d in pairs]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "rollout_case" not in metafunc.fixturenames:
        return
    bench = metafunc.config.stash.get(SESSION_KEY, None)
    if bench is None:  # not opted in: one placeholder, skipped
        metafunc.parametrize("rollout_case", [("hf", "float32", "raw_logprobs")], ids=["hf-float32-raw_logprobs"])
        return
    installed = [name for name, spec in SPECS.items() if name not in bench.backends and spec.model_format == "gguf"
                 and all(importlib.util.find_spec(m) for m in spec.modules)]
    backends = (*bench.backends, *installed)
    # The release band reads the float32 processed cases (the mode to serve a trainer): the full tier's gate.
    params = [pytest.param(c, id="-".join(c), marks=[pytest.mark.gated_full] if c[1:] == ("float32", MODES[1]) else [])
              for c in cases(backends)]
    metafunc.parametrize("rollout_case", params)


def test_rollout_vs_trainer(bench, benchmark, rollout_case: tuple[str, str, str]) -> None:
    from engine.trainer.correction import correction_metrics, offpolicy_metrics
    from engine.trainer.mismatch import agreement, chosen_logprobs, logprob_mismatch, rescored, token_weights

    backend, dtype, mode = rollout_case
    rollout_engine, trainer = bench.engine_in(backend, dtype, mode), bench.engine_in("hf", dtype)
    matched = PROCESSING if mode == "processed_logprobs" else None  # the trainer re-scores as the rollout reports
    messages = batch_messages(BATCH, "short")
    options = {**SAMPLING, "max_new_tokens": bench.size.rollout_tokens}
    seen: dict[str, Any] = {}

    def rollout() -> int:
        seen.setdefault("rollouts", []).append(rollout_engine.generate(messages, options=options))
        return sum(len(r.token_ids) for r in seen["rollouts"][-1])

    def rescore() -> int:
        seen["trainer"] = rescored(seen["rollouts"][-1], trainer, matched)
        return sum(map(len, seen["trainer"]))

    label = f"rollout_vs_trainer[{backend}-{dtype}-{mode}-b{BATCH}]"
    # The first round (a warm-up where there is one) runs the variants in the listed order, so a rescore always has a
    # rollout to score, also in the later rounds that run them the other way round. Two calls at least, warm-up
    # included, so that the reproducibility assertion below compares two draws.
    rounds = bench.measure(benchmark, label, [Variant("rollout", "subject", rollout),
                                              Variant("rescore", "reference", rescore)], gated=False,
                           rounds_compared=True)
    drawn = [[r.token_ids for r in results] for results in seen["rollouts"]]
    assert all(d == drawn[0] for d in drawn), f"{label}: one seed must draw the same tokens every round"
    last = seen["rollouts"][-1]
    reported, trained = [chosen_logprobs(r) for r in last], seen["trainer"]
    got = logprob_mismatch(reported, trained)
    weights = token_weights(reported, trained)
    swift = token_weights(reported, rescored(last, trainer, TEMPERATURE_ONLY))
    figures = {"dlogprob_mean": got.mean, "dlogprob_p99": got.p99, "dlogprob_max": got.max,
               "importance_ratio_min": got.ratio_min, "importance_ratio_max": got.ratio_max,
               "k3_kl": offpolicy_metrics(trained, reported)["k3_kl"],
               "chi2_token": offpolicy_metrics(trained, reported)["chi2_token"],
               **{k: v for k, v in correction_metrics(trained, reported, mode="token_truncate").items()
                  if k in ("is_weight_mean", "ess")},
               "temp_only_weight_mean": sum(swift) / len(swift),
               "temp_only_outside_frac": sum(not 0.9 <= w <= 1.1 for w in swift) / len(swift)}
    if dtype == "float32":
        figures["trainer_agreement"] = agreement(weights)
    bench.record({"benchmark": label, "group": "rollout_vs_trainer", "backend": backend, "dtype": dtype,
                  "batch": BATCH, "prompt_len": "short",
                  "prompt_tokens": sum(len(r.prompt_token_ids) for r in seen["rollouts"][0]),
                  "new_tokens": bench.size.rollout_tokens, "fixed_length": False, "guard_set": "none"},
                 rounds, figures, benchmark)
    bench.progress(f"{label} vs trainer hf-{dtype}: {got.line()}; temperature-only trainer: mean weight "
                   f"{figures['temp_only_weight_mean']:.3f}, {figures['temp_only_outside_frac']:.0%} outside "
                   "[0.9, 1.1]")
