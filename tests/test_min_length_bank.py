"""The batched min-length rule decides, notes and reports exactly what the pure rule (the executable spec) does,
and HF's adapter edits logits identically with the bank and with a rule set per row."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.rules.base import RuleSet
from engine.rules.min_length import MinLengthRule
from engine.rules.token_text import TokenBytes

np = pytest.importorskip("numpy", reason="the batched rule is numpy code")

from engine.rules.min_length_bank import MinLengthBank  # noqa: E402

# Pieces with ASCII, a space-led word, a 3-byte character split over two tokens, a 4-byte one, invalid bytes,
# an empty piece; id 0 is the terminal (special), id 1 another special token.
PIECES = [b"</s>", b"<pad>", b"a", b" b", b"cd", b"\xe2\x82", b"\xac", b"\xf0\x9f\x8d\xae", b"\xff", b"", b".",
          b" ef", b"\xc3"]
SPECIAL = {0, 1}
SENTENCE_ENDS = (10,)


@st.composite
def params(draw):
    min_chars = draw(st.integers(0, 14))
    max_chars = draw(st.none() | st.integers(max(1, min_chars), max(1, min_chars) + 5))  # reached in a few tokens
    bias = draw(st.sampled_from([0.0, 1.5]))
    return {"min_chars": min_chars, "max_chars": max_chars, "punctuation_bias": bias,
            "sentence_end_ids": SENTENCE_ENDS}


def spec_sets(p, rows, table, min_new):
    return [RuleSet([MinLengthRule(**p)], terminal_ids={0}, decode=table, min_new_tokens=min_new) for _ in range(rows)]


@settings(max_examples=400, deadline=None)
@given(p=params(), strip=st.booleans(), min_new=st.integers(0, 4),
       rows=st.lists(st.lists(st.integers(0, len(PIECES) + 1), max_size=16), min_size=1, max_size=5),
       width=st.integers(1, 16), data=st.data())
def test_decides_notes_and_reports_as_the_pure_rule(p, strip, min_new, rows, width, data):
    """400 batches: each step, the bank's (force, ban, bias) for the rows asked equal each row's ``RuleSet``
    decision; rows another rule ends now are not asked (random); "EOS on top" arrives at random steps and is noted
    once; the events equal the rule's at every step. Ids past the table (text-less) and the terminal id occur."""
    table = TokenBytes(PIECES, special=SPECIAL, strip_first_space=strip)
    batch = [(r + [2] * width)[:width] for r in rows]
    bank = MinLengthBank(p, len(batch), table=table, terminal_ids={0}, min_new_tokens=min_new)
    sets = spec_sets(p, len(batch), table, min_new)
    for k in range(width + 1):
        if k:  # k = 0: decided before any token, as HF asks for the first one
            column = np.array([r[k - 1] for r in batch])
            bank.push(column[:, None])
            for rs, tok in zip(sets, column.tolist(), strict=True):
                rs.feed(tok)
        asked = np.array(data.draw(st.lists(st.booleans(), min_size=len(batch), max_size=len(batch))))
        force, ban, bias = bank.decide(asked)
        on_top = data.draw(st.lists(st.booleans(), min_size=len(batch), max_size=len(batch)))
        for row, rs in enumerate(sets):
            if not asked[row]:
                assert not (force[row] or ban[row] or bias[row])
                continue
            d = rs.decision()
            assert (bool(force[row]), bool(ban[row] and not force[row]), bool(bias[row])) == \
                   (d.force_eos, d.ban_eos and not d.force_eos, bool(d.bias)), (k, row, d)
            if d.bias:
                assert dict(d.bias) == bank.bias
            if d.ban_eos and not d.force_eos and not rs.eos_noted and on_top[row]:
                rs.note_eos_suppressed()  # what row_apply.decide does for the spec
        bank.note_eos_on_top(np.flatnonzero(ban & np.array(on_top)))
        for row, rs in enumerate(sets):
            assert bank.events(row) == rs.events(), (k, row)


@settings(max_examples=60, deadline=None)
@given(p=params(), min_new=st.integers(0, 3), batch=st.integers(8, 12), width=st.integers(1, 10),
       seed=st.integers(0, 2**16))
def test_hf_adapter_edits_alike_with_the_bank_and_per_row(p, min_new, batch, width, seed):
    """HF's logits processor with the bank (``vectorize=True``) and with a rule set per row (``vectorize=False``)
    leave the same logits every step and report the same events, on random logits where EOS is sometimes on top,
    sometimes masked, and sometimes the only token a mask leaves."""
    torch = pytest.importorskip("torch", reason="the HF adapter edits torch tensors")
    from engine.backends.hf.rules import HfRowRules
    from engine.rules.base import RuleSpec

    gen = torch.Generator().manual_seed(seed)
    table = TokenBytes(PIECES, special=SPECIAL)
    spec = RuleSpec("engine.rules.min_length:MinLengthRule", {**p, "sentence_end_ids": list(SENTENCE_ENDS)})
    eos, vocab = 0, len(PIECES)
    procs = [HfRowRules([spec], prompt_len=2, eos_id=eos, terminal_ids=[eos], decode=table, vectorize=v,
                        vector_min_batch=8, min_new_tokens=min_new) for v in (True, False)]
    ids = torch.randint(2, vocab, (batch, 2 + width), generator=gen)
    for end in range(2, 2 + width + 1):
        logits = torch.randn(batch, vocab, generator=gen)
        kind = torch.randint(0, 4, (batch,), generator=gen)
        logits[kind == 1, eos] = 9.0  # EOS on top
        logits[kind == 2, eos] = float("-inf")  # EOS masked (a grammar)
        only = kind == 3  # EOS the only token a grammar leaves
        logits[only] = float("-inf")
        logits[only, eos] = 0.5
        edited = [proc(ids[:, :end], logits.clone()) for proc in procs]
        assert torch.equal(edited[0], edited[1]), end
    assert procs[0].min_length is not None and not procs[1].min_length, "the first runs the bank, the other not"
    assert [procs[0].events(r) for r in range(batch)] == [procs[1].events(r) for r in range(batch)]
