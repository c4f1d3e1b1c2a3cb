"""Greedy token-id parity of every backend with the first (HF): exact for HF and vLLM in fp32; vLLM's rule (equal up
to the first divergence, where each side's token is in the other's top-k) for llama.cpp and other dtypes, with the
exact-match count and the divergence steps written into the conformance summary."""

from __future__ import annotations

import pytest

from conformance.compare import check_logprobs_close, describe, divergence_steps, exact_pair
from conformance.subjects.plan import engines, servers, uses
from engine_fixtures import load_prompts

SUBJECTS = uses(engines("text"), servers("text"))

pytestmark = [pytest.mark.servable, pytest.mark.dtype_dependent, pytest.mark.runner_dependent]


@pytest.mark.quick  # with its served twin: every backend's server through /infer/ (conformance.kit.tiers)
def test_greedy_parity_on_chat_prompts(engines, pool, summary_note):
    prompts = load_prompts("chat") + load_prompts("lists")
    names = list(engines)
    opts = {"max_new_tokens": 48, "logprobs": 5}
    outs = {b: engines[b].generate([p["messages"] for p in prompts], options=opts) for b in names}
    reference = names[0]
    for other in names[1:]:
        o0, o1 = outs[reference], outs[other]
        steps = divergence_steps(o0, o1)
        same = steps.count(None)
        where = ", ".join(f"{p['id']}@{s}" for p, s in zip(prompts, steps, strict=True) if s is not None)
        summary_note(f"greedy parity {reference} vs {other} ({pool.options.dtype}, {len(prompts)} chat and list "
                     f"prompts, 48 tokens): {same}/{len(prompts)} token-identical; first divergence: {where or 'none'}")
        if exact_pair(reference, other, pool.options.dtype):
            detail = describe(o0, o1, name_0=reference, name_1=other, labels=[p["id"] for p in prompts],
                              tokenizer=engines[reference].tokenizer)
            assert same == len(prompts), "\n".join(detail)
        else:
            check_logprobs_close(outputs_0=o0, outputs_1=o1, name_0=reference, name_1=other)


def test_logprobs_agree_in_fp32(engines, pool):
    """The chosen tokens' log-probabilities agree within 1e-3 in fp32 on every step both backends share."""
    names = list(engines)
    msgs = [load_prompts("chat")[0]["messages"]]
    outs = {b: engines[b].generate(msgs, options={"max_new_tokens": 8, "logprobs": 3})[0] for b in names}
    a = outs[names[0]]
    for other in names[1:]:
        b = outs[other]
        assert len(a.logprobs) == len(a.token_ids) and len(b.logprobs) == len(b.token_ids)
        shared = divergence_steps([a], [b])[0]
        if exact_pair(names[0], other, pool.options.dtype):
            assert shared is None, f"{names[0]} and {other} chose different tokens in float32"
        for step, (la, lb) in enumerate(list(zip(a.logprobs, b.logprobs, strict=False))[:shared]):
            chosen = a.token_ids[step]
            assert chosen in la and chosen in lb, f"{other} step {step}: chosen token missing from logprobs"
            if pool.options.dtype == "float32":
                assert abs(la[chosen] - lb[chosen]) < 1e-3, f"step {step}: {names[0]}={la[chosen]} {other}={lb[chosen]}"
