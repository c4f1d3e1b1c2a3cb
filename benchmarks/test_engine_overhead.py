"""Engine vs raw HF ``generate`` on identical prompt ids and settings (greedy, EOS suppressed by min tokens)."""

from __future__ import annotations

import pytest

from fixtures import load_prompts

NEW_TOKENS = 16


@pytest.mark.parametrize("batch", [1, 8])
def test_engine_vs_raw_hf(benchmark, hf_engine, batch):
    import time

    import torch

    msgs = [p["messages"] for p in (load_prompts("chat") + load_prompts("lists"))][:batch]
    opts = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}
    rendered, plan = hf_engine.prepare(msgs, options=opts)
    backend = hf_engine.backend
    ids, mask = backend._left_pad([r.token_ids for r in rendered])
    cfg = backend.generation_config(plan)

    def raw():
        with torch.inference_mode():
            return backend.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)

    raw()  # warm-up
    raw_times = []
    for _ in range(3):
        t = time.perf_counter()
        raw()
        raw_times.append(time.perf_counter() - t)
    results = benchmark.pedantic(lambda: hf_engine.generate(msgs, options=opts), rounds=3, warmup_rounds=1)
    assert all(len(r.token_ids) == NEW_TOKENS for r in results)
    raw_median = sorted(raw_times)[1]
    ratio = raw_median / benchmark.stats.stats.median
    benchmark.extra_info.update({"backend": "hf", "batch": batch, "new_tokens": NEW_TOKENS,
                                 "raw_median_s": raw_median, "engine_over_raw_throughput": ratio})
    print(f"hf batch {batch}: engine/raw throughput ratio {ratio:.3f}")
