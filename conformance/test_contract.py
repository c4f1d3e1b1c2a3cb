"""The result contract on every backend: ``text`` vs ``raw_text``, token ids cut at the end, finish reasons."""

from __future__ import annotations

from conformance.subjects.plan import engines, uses
from engine_fixtures import load_prompts

SUBJECTS = uses(engines("text"))

CHAT = [p["messages"] for p in load_prompts("chat")]


def test_text_and_raw_text_contract(engine):
    tok = engine.tokenizer
    eos = tok.eos_token_id
    for r in engine.generate(CHAT, options={"max_new_tokens": 64}):
        assert r.raw_text == tok.decode(list(r.token_ids), skip_special_tokens=False)
        assert r.text == tok.decode(list(r.token_ids), skip_special_tokens=True)
        assert eos not in r.token_ids[:-1], "nothing may follow the EOS that ended the row"
        if r.finish_reason == "stop":
            assert r.token_ids[-1] == eos and r.stop_reason == eos
            assert r.raw_text.endswith(tok.eos_token) and tok.eos_token not in r.text
        else:
            assert r.finish_reason == "length" and r.stop_reason is None and len(r.token_ids) == 64
        assert r.meta["num_generated_tokens"] == len(r.token_ids)
        assert r.meta["num_prompt_tokens"] == len(r.prompt_token_ids)


def test_length_finish(engine):
    for r in engine.generate(CHAT[:3], options={"max_new_tokens": 3}):
        assert len(r.token_ids) == 3 and r.finish_reason == "length" and r.stop_reason is None


def test_min_new_tokens_holds_eos_back(engine):
    short = engine.generate(CHAT[:2], options={"max_new_tokens": 64})
    natural = min(len(r.token_ids) for r in short)
    forced = engine.generate(CHAT[:2], options={"max_new_tokens": 64, "min_new_tokens": natural + 5})
    for r in forced:
        assert len(r.token_ids) >= natural + 5
        assert engine.tokenizer.eos_token_id not in r.token_ids[: natural + 5 - 1]


def test_empty_batch_returns_empty(engine):
    assert engine.generate([]) == []
