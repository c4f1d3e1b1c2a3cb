"""A request's greedy result does not depend on its batch-mates (sizes 1, 3, 8; mixed prompt lengths)."""

from __future__ import annotations

from fixtures import load_prompts

MIXED = [p["messages"] for p in load_prompts("chat") + load_prompts("lists")]  # 8 prompts, mixed lengths


def test_batch_invariance(engine):
    opts = {"max_new_tokens": 32}
    alone = [engine.generate([m], options=opts)[0].token_ids for m in MIXED]
    in_three = [r.token_ids for i in range(0, len(MIXED), 3) for r in engine.generate(MIXED[i : i + 3], options=opts)]
    in_eight = [r.token_ids for r in engine.generate(MIXED, options=opts)]
    lengths = {len(ids) for ids in (engine.prepare([m])[0][0].token_ids for m in MIXED)}
    assert len(lengths) > 3, "the batch must mix prompt lengths"
    for i, ids in enumerate(alone):
        assert in_three[i] == ids, f"request {i}: batch of 3 differs from batch of 1"
        assert in_eight[i] == ids, f"request {i}: batch of 8 differs from batch of 1"
