"""The suite's comparison rule by dtype (``conformance.compare``) and the repeat checks' rule for guarded rows that
part from their unguarded twins below float32, on synthetic rows: each way a comparison must fail, failing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conformance.compare import assert_same_results
from conformance.test_repeat import check_against_reference

EOS = 2
GUARD = {"enabled": True, "max_consecutive_token_repeats": 3}


def row(ids, logprobs=None, **fields):
    base = {"text": "", "raw_text": "", "finish_reason": "length", "stop_reason": None, "meta": {"backend": "x"}}
    return SimpleNamespace(token_ids=tuple(ids), logprobs=logprobs, **{**base, **fields})


def top(*tokens):
    """One step's top-k: the given tokens, best first."""
    return {t: -0.5 - i for i, t in enumerate(tokens)}


def test_a_near_tie_is_a_divergence_below_float32_and_a_failure_in_float32():
    a = row((5, 9), [top(5, 6), top(9)])
    b = row((6, 7), [top(6, 5), top(7)])
    assert assert_same_results({"a": [a], "b": [b]}, what="t", dtype="bfloat16") == 1
    with pytest.raises(AssertionError, match="request 0 token_ids"):
        assert_same_results({"a": [a], "b": [b]}, what="t", dtype="float32")


def test_a_token_outside_the_other_sides_top_k_fails_below_float32():
    a = row((5,), [top(5, 8)])
    b = row((6,), [top(6, 5)])
    with pytest.raises(AssertionError, match="b token 6 not in a top-k"):
        assert_same_results({"a": [a], "b": [b]}, what="t", dtype="bfloat16")


def test_a_divergence_without_logprobs_cannot_be_judged():
    with pytest.raises(AssertionError, match="no log-probabilities at step 0"):
        assert_same_results({"a": [row((5,))], "b": [row((6,))]}, what="t", dtype="bfloat16")


def test_a_row_that_goes_on_after_the_same_tokens_fails():
    a = row((5, 9), [top(5), top(9)])
    b = row((5, 9, 4), [top(5), top(9), top(4)])
    with pytest.raises(AssertionError, match="one row went on"):
        assert_same_results({"a": [a], "b": [b]}, what="t", dtype="bfloat16")


def test_identical_tokens_must_still_agree_on_every_field_below_float32():
    a = row((5, 9), [top(5), top(9)], stop_reason=9)
    b = row((5, 9), [top(5), top(9)], stop_reason=None)
    with pytest.raises(AssertionError, match="request 0 stop_reason"):
        assert_same_results({"a": [a], "b": [b]}, what="t", dtype="bfloat16")


def guarded(ids, index):
    meta = {"repeat_terminate_triggered": int(index is not None), "repeat_terminate_index": index}
    reason = ("stop", "repeat_terminate") if index is not None else ("length", None)
    return row(ids, [top(t, 7) for t in ids], finish_reason=reason[0], stop_reason=reason[1], meta=meta)


def test_a_guarded_row_that_parts_at_a_tie_must_still_end_where_the_rule_fires_on_its_own_tokens():
    free = row((7, 4, 4, 4, 8), [top(7, 1), top(4, 1), top(4), top(4), top(8)])  # the rule fires at 4 (three 4s)
    parted = guarded((1, 3, 3, 3, EOS), 4)  # parted at step 0 (1 is in the free row's top-k), then looped on 3
    assert check_against_reference([free], [parted], GUARD, EOS, dtype="bfloat16") == 1
    late = guarded((1, 3, 3, 3, 3, EOS), 5)  # the same, but the EOS one token after the rule fires
    with pytest.raises(AssertionError, match="fired at 5, rule: 4"):
        check_against_reference([free], [late], GUARD, EOS, dtype="bfloat16")
    missed = guarded((1, 3, 3, 3, 6), None)  # never fired although its own tokens repeat three times
    with pytest.raises(AssertionError, match="the rule fires at 4 but did not"):
        check_against_reference([free], [missed], GUARD, EOS, dtype="bfloat16")
    with pytest.raises(AssertionError, match="expected EOS at 4"):
        check_against_reference([free], [parted], GUARD, EOS, dtype="float32")


def test_a_guarded_row_with_the_same_tokens_up_to_the_cut_must_end_there():
    free = row((7, 4, 4, 4, 8), [top(7), top(4), top(4), top(4), top(8, EOS)])
    no_eos = guarded((7, 4, 4, 4, 8), None)
    with pytest.raises(AssertionError, match="same tokens up to 4, but no EOS there"):
        check_against_reference([free], [no_eos], GUARD, EOS, dtype="bfloat16")


def test_a_token_outside_the_other_sides_top_k_fails_below_float32_in_either_direction():
    a = row((5,), [top(5, 6)])
    b = row((6,), [top(6, 8)])
    with pytest.raises(AssertionError, match="a token 5 not in b top-k"):
        assert_same_results({"a": [a], "b": [b]}, what="t", dtype="bfloat16")
