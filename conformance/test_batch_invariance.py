"""A request's greedy result does not depend on its batch-mates (sizes 1, 3, 8; mixed prompt lengths): every field
equal in float32; in lower precision, vLLM's rule (a divergence only where each side's token is in the other's
top-k: rounding differs per batch shape, so near-ties may break either way)."""

from __future__ import annotations

import pytest

from conformance.compare import assert_same_results
from conformance.subjects.plan import engines, uses
from engine_fixtures import load_prompts

SUBJECTS = uses(engines("text"))

pytestmark = pytest.mark.dtype_dependent

MIXED = [p["messages"] for p in load_prompts("chat") + load_prompts("lists")]  # 8 prompts, mixed lengths


def test_batch_invariance(engine, backend, pool, summary_note, workload):
    prompts = workload.pick(full=MIXED, quick=MIXED[:3] + MIXED[4:6])  # quick: 5 prompts of 5 lengths (25 to 43)
    opts = {"max_new_tokens": 32}
    alone = [engine.generate([m], options=opts)[0] for m in prompts]
    in_three = [r for i in range(0, len(prompts), 3) for r in engine.generate(prompts[i : i + 3], options=opts)]
    in_all = engine.generate(prompts, options=opts)
    lengths = {len(ids) for ids in (engine.prepare([m])[0][0].token_ids for m in prompts)}
    assert len(lengths) > 3, "the batch must mix prompt lengths"
    everything = f"batch of {len(prompts)}"
    diverged = assert_same_results({"batch of 1": alone, "batch of 3": in_three, everything: in_all},
                                   what="batch invariance", dtype=pool.options.dtype)
    summary_note(f"batch invariance {backend} ({pool.options.dtype}, {len(prompts)} prompts in batches of 1, 3 and "
                 f"{len(prompts)}): {diverged} of {2 * len(prompts)} comparisons diverged at a near-tie")
