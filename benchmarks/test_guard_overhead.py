"""Repeat guard on vs off on vLLM, batch 64, identical work (fixed length: EOS held back by min tokens)."""

from __future__ import annotations

import statistics
import time

import pytest

from fixtures import load_prompts

BATCH = 64
NEW_TOKENS = 32
GUARD = {"enabled": True, "max_consecutive_token_repeats": 8, "ngram_size": 4, "ngram_repeats": 4}


@pytest.fixture(scope="session")
def vllm_pair():
    from engine import GenerationEngine
    from fixtures import ensure

    path = str(ensure("smollm2-135m-instruct"))
    base = {"backend": "vllm", "model": {"path": path, "dtype": "float32"}, "vllm": {"max_num_seqs": BATCH}}
    return GenerationEngine(base), GenerationEngine({**base, "repeat_terminate": GUARD})


def test_repeat_guard_overhead_vllm_batch64(benchmark, vllm_pair):
    plain, guarded = vllm_pair
    prompts = [p["messages"] for p in load_prompts("chat") + load_prompts("lists")]
    batch = (prompts * (BATCH // len(prompts) + 1))[:BATCH]
    opts = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}
    for eng in (plain, guarded):
        eng.generate(batch, options=opts)  # warm-up
    times = {"off": [], "on": []}
    for _ in range(3):  # interleaved rounds: noise hits both sides alike
        for name, eng in (("off", plain), ("on", guarded)):
            t = time.perf_counter()
            out = eng.generate(batch, options=opts)
            times[name].append(time.perf_counter() - t)
            assert all(len(r.token_ids) == NEW_TOKENS for r in out)
            assert sum(r.meta["repeat_terminate_triggered"] for r in out) == 0
    result = benchmark.pedantic(lambda: guarded.generate(batch, options=opts), rounds=1, iterations=1)
    assert len(result) == BATCH
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    ratio = off / on  # guarded throughput relative to unguarded
    benchmark.extra_info.update({"backend": "vllm", "batch": BATCH, "new_tokens": NEW_TOKENS,
                                 "median_off_s": off, "median_on_s": on, "guard_on_over_off_throughput": ratio})
    print(f"vllm batch {BATCH}: guard off {off:.3f}s, on {on:.3f}s, throughput ratio on/off {ratio:.3f}")
