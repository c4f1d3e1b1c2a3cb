"""Our repeat guard (through the engine) vs vLLM's native ``repetition_detection`` (on a bare ``LLM``).

Two workloads, natural length (EOS allowed: vLLM skips its native check while min tokens hold EOS back,
so a fixed-length run would measure nothing on its side):

* ``healthy``: prompts that never loop. Neither guard fires, all variants generate the same tokens (asserted):
  the ratio is the cost of watching.
* ``looping``: SmolLM2's "30 fruits" loop in a batch of 8. Both guards must end the looping row early
  (asserted); the ratio is how fast each serves the batch.

Variants: ``raw`` (bare LLM, no guard; context), ``raw+native_repetition`` (reference),
``engine+repeat`` (subject) -> ``ours_over_native`` = native median wall / ours.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.conftest import SESSION_KEY
from benchmarks.harness import Variant
from benchmarks.workload import NATIVE_REPETITION, healthy_messages, looping_messages

WORKLOADS = {"healthy": lambda: healthy_messages()[:8], "looping": looping_messages}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "workload" in metafunc.fixturenames:
        bench = metafunc.config.stash.get(SESSION_KEY, None)
        skip = bench is not None and "vllm" not in bench.backends
        reason = "vllm is not in --benchmark-backends (this benchmark is vLLM-only)"
        marks = [pytest.mark.skip(reason=reason)] if skip else []
        metafunc.parametrize("workload", [pytest.param(name, marks=marks) for name in WORKLOADS])


def test_repeat_guard_vs_native(bench, benchmark, workload: str) -> None:
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RepetitionDetectionParams

    budget = bench.size.native_budget
    messages = WORKLOADS[workload]()
    options = {"max_new_tokens": budget}
    guarded = bench.engine("vllm", guarded=True)
    llm = bench.raw_vllm()
    rendered, plan = guarded.prepare(messages, options=options)
    prompts = [TokensPrompt(prompt_token_ids=list(r.token_ids)) for r in rendered]
    plain_params = guarded.backend.sampling_params(plan)  # the same settings the engine sends
    native_params = plain_params.clone()
    native_params.repetition_detection = RepetitionDetectionParams(**NATIVE_REPETITION)
    last: dict[str, Any] = {}

    def raw(params: Any, name: str) -> int:
        last[name] = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in last[name])

    def ours() -> int:
        last["ours"] = guarded.generate(messages, options=options)
        return sum(len(r.token_ids) for r in last["ours"])

    variants = [Variant("raw", "context", lambda: raw(plain_params, "raw")),
                Variant("raw+native_repetition", "reference", lambda: raw(native_params, "native")),
                Variant("engine+repeat", "subject", ours)]
    rounds = bench.measure(benchmark, f"repeat_vs_native[{workload}]", variants, gated=False)

    native_fired = [o.outputs[0].finish_reason == "repetition" or o.outputs[0].stop_reason == "repetition_detected"
                    for o in last["native"]]
    ours_fired = [bool(r.meta["repeat_terminate_triggered"]) for r in last["ours"]]
    tokens = {v.name: rounds.tokens(v.name) for v in variants}
    if workload == "healthy":
        assert not any(native_fired) and not any(ours_fired), (native_fired, ours_fired)
        assert len(set().union(*tokens.values())) == 1, tokens  # same work on every side
    else:
        assert native_fired[0] and ours_fired[0], (native_fired, ours_fired)
        assert max(tokens["engine+repeat"]) < min(tokens["raw"]), tokens
        assert max(tokens["raw+native_repetition"]) < min(tokens["raw"]), tokens
    bench.record({"benchmark": f"repeat_vs_native[{workload}]", "group": "repeat_vs_native", "backend": "vllm",
                  "batch": len(messages), "prompt_len": workload,
                  "prompt_tokens": sum(len(r.token_ids) for r in rendered), "new_tokens": budget,
                  "fixed_length": False, "guard_set": "repeat"},
                 rounds, {"ours_over_native": rounds.speed_ratio("engine+repeat", "raw+native_repetition")},
                 benchmark)
