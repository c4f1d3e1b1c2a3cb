"""The training-inference mismatch per backend and dtype: what switching rollouts from HF to vLLM (or llama.cpp, or
to bfloat16) does to a trainer's importance ratios.

One case per (rollout backend, dtype): float32 on every backend (HF, vLLM, llama.cpp on its F32 GGUF twin), and
bfloat16 on HF and vLLM (llama.cpp's ``model.dtype`` sets only its KV cache; the twin's weights stay F32). Each
case samples ``rollout_tokens`` per row for the healthy chat prompts (temperature 0.7, top-p 0.9, repetition
penalty 1.3, one seed: every round draws the same tokens, asserted), with the chosen tokens' raw logprobs; the
trainer, HF in the same dtype, re-scores those tokens teacher-forced (``engine.score``). Two variants, timed:
``rollout`` (subject: the figures are about its logprobs) and ``rescore`` (reference); no speed ratio.

Recorded (``engine.mismatch``): ``dlogprob_mean``, ``dlogprob_p99``, ``dlogprob_max`` (per-token absolute
difference) and ``importance_ratio_min`` / ``importance_ratio_max`` (per sequence, exp(sum trainer - sum
rollout)). The conformance suite holds the float32 figures to a bound
(``test_rollout_logprobs_equal_the_trainers_rescoring``); here they are reported, bfloat16 included.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from benchmarks.conftest import SESSION_KEY
from benchmarks.harness import Variant
from benchmarks.workload import batch_messages
from engine.backends.registry import SPECS

SAMPLING = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.3, "seed": 5, "logprobs": 0}
BATCH = 8


def cases(backends: tuple[str, ...]) -> list[tuple[str, str]]:
    """(rollout backend, dtype) pairs: float32 everywhere, bfloat16 where the weights really are bfloat16.

    >>> cases(("hf", "vllm", "llamacpp"))
    [('hf', 'float32'), ('vllm', 'float32'), ('llamacpp', 'float32'), ('hf', 'bfloat16'), ('vllm', 'bfloat16')]
    """
    # A GGUF twin holds F32 weights whatever model.dtype says, so bfloat16 would only rename the float32 case.
    return [(b, "float32") for b in backends] + [(b, "bfloat16") for b in backends if SPECS[b].model_format != "gguf"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "rollout_case" not in metafunc.fixturenames:
        return
    bench = metafunc.config.stash.get(SESSION_KEY, None)
    if bench is None:  # not opted in: one placeholder, skipped
        metafunc.parametrize("rollout_case", [("hf", "float32")], ids=["hf-float32"])
        return
    installed = [name for name, spec in SPECS.items() if name not in bench.backends and spec.model_format == "gguf"
                 and all(importlib.util.find_spec(m) for m in spec.modules)]
    backends = (*bench.backends, *installed)
    metafunc.parametrize("rollout_case", cases(backends), ids=[f"{b}-{d}" for b, d in cases(backends)])


def test_rollout_vs_trainer(bench, benchmark, rollout_case: tuple[str, str]) -> None:
    from engine.mismatch import rescore_mismatch

    backend, dtype = rollout_case
    rollout_engine, trainer = bench.engine_in(backend, dtype), bench.engine_in("hf", dtype)
    messages = batch_messages(BATCH, "short")
    options = {**SAMPLING, "max_new_tokens": bench.size.rollout_tokens}
    seen: dict[str, Any] = {}

    def rollout() -> int:
        seen.setdefault("rollouts", []).append(rollout_engine.generate(messages, options=options))
        return sum(len(r.token_ids) for r in seen["rollouts"][-1])

    def rescore() -> int:
        last = seen["rollouts"][-1]
        seen["mismatch"] = rescore_mismatch(last, trainer)
        return seen["mismatch"].tokens

    label = f"rollout_vs_trainer[{backend}-{dtype}-b{BATCH}]"
    # The first round (a warm-up where there is one) runs the variants in the listed order, so a rescore always has a
    # rollout to score, also in the later rounds that run them the other way round. Two calls at least, warm-up
    # included, so that the reproducibility assertion below compares two draws.
    rounds = bench.measure(benchmark, label, [Variant("rollout", "subject", rollout),
                                              Variant("rescore", "reference", rescore)], gated=False,
                           rounds_compared=True)
    drawn = [[r.token_ids for r in results] for results in seen["rollouts"]]
    assert all(d == drawn[0] for d in drawn), f"{label}: one seed must draw the same tokens every round"
    got = seen["mismatch"]
    figures = {"dlogprob_mean": got.mean, "dlogprob_p99": got.p99, "dlogprob_max": got.max,
               "importance_ratio_min": got.ratio_min, "importance_ratio_max": got.ratio_max}
    bench.record({"benchmark": label, "group": "rollout_vs_trainer", "backend": backend, "dtype": dtype,
                  "batch": BATCH, "prompt_len": "short",
                  "prompt_tokens": sum(len(r.prompt_token_ids) for r in seen["rollouts"][0]),
                  "new_tokens": bench.size.rollout_tokens, "fixed_length": False, "guard_set": "none"},
                 rounds, figures, benchmark)
    bench.progress(f"{label} vs trainer hf-{dtype}: {got.line()}")
