"""Greedy token-id parity across backends on the chat prompt set (exact in fp32; vLLM's rule otherwise)."""

from __future__ import annotations

from conformance.compare import check_logprobs_close, describe
from fixtures import load_prompts


def test_greedy_parity_on_chat_prompts(engines, pool):
    prompts = load_prompts("chat") + load_prompts("lists")
    names = list(engines)
    opts = {"max_new_tokens": 48, "logprobs": 5}
    outs = {b: engines[b].generate([p["messages"] for p in prompts], options=opts) for b in names}
    o0, o1 = outs[names[0]], outs[names[1]]
    same = sum(a.token_ids == b.token_ids for a, b in zip(o0, o1, strict=True))
    print(f"greedy parity ({pool.options.dtype}): {same}/{len(prompts)} prompts token-identical")
    if pool.options.dtype == "float32":
        detail = describe(o0, o1, name_0=names[0], name_1=names[1], labels=[p["id"] for p in prompts],
                          tokenizer=engines[names[0]].tokenizer)
        assert same == len(prompts), "\n".join(detail)
    else:
        check_logprobs_close(outputs_0=o0, outputs_1=o1, name_0=names[0], name_1=names[1])


def test_logprobs_agree_in_fp32(engines, pool):
    names = list(engines)
    msgs = [load_prompts("chat")[0]["messages"]]
    outs = {b: engines[b].generate(msgs, options={"max_new_tokens": 8, "logprobs": 3})[0] for b in names}
    a, b = outs[names[0]], outs[names[1]]
    assert len(a.logprobs) == len(a.token_ids) and len(b.logprobs) == len(b.token_ids)
    for step, (la, lb) in enumerate(zip(a.logprobs, b.logprobs, strict=True)):
        chosen = a.token_ids[step]
        assert chosen in la and chosen in lb, f"step {step}: chosen token missing from logprobs"
        if pool.options.dtype == "float32":
            assert abs(la[chosen] - lb[chosen]) < 1e-3, f"step {step}: {names[0]}={la[chosen]} {names[1]}={lb[chosen]}"
