"""The low-precision value rule calibrated in the run (``conformance.precision``), on synthetic top-k steps: each
condition fails in each direction, so a rule that checks one side only fails here."""

from __future__ import annotations

import pytest

from conformance.precision import OwnError, assert_top_k_close, own_error, value_bound


def own(name: str, worst: float) -> OwnError:
    return OwnError(name, worst=worst, compared=10, where="request 0 step 0 token 1")


def close(la, lb, bound=0.3):
    return assert_top_k_close(la, lb, bound=bound, what="step", name_a="a", name_b="b")


@pytest.mark.parametrize(("la", "lb"), [({1: -0.1, 2: -2.0}, {1: -0.5, 2: -2.0}),
                                        ({1: -0.5, 2: -2.0}, {1: -0.1, 2: -2.0})], ids=["a-above", "b-above"])
def test_a_shared_token_past_the_bound_fails_whichever_side_is_higher(la, lb):
    with pytest.raises(AssertionError, match=r"token 1: a=.* vs b=.*, 0.4 apart \(bound 0.3\)"):
        close(la, lb)


def test_shared_tokens_within_the_bound_pass_and_the_largest_difference_is_returned():
    assert close({1: -0.1, 2: -2.0}, {1: -0.35, 2: -2.1}) == pytest.approx(0.25)


@pytest.mark.parametrize(("la", "lb", "alone"), [
    ({1: -0.1, 2: -1.0}, {1: -0.1, 3: -2.0}, "in a's top-k only"),
    ({1: -0.1, 3: -2.0}, {1: -0.1, 2: -1.0}, "in b's top-k only"),
], ids=["a-only", "b-only"])
def test_a_token_in_one_top_k_only_must_be_a_near_tie_at_the_other_sides_edge(la, lb, alone):
    with pytest.raises(AssertionError, match=alone):
        close(la, lb)


def test_a_near_tie_at_the_edge_may_differ_in_either_side():
    close({1: -0.1, 2: -2.0}, {1: -0.1, 3: -2.1})
    close({1: -0.1, 3: -2.1}, {1: -0.1, 2: -2.0})


def test_the_bound_adds_both_sides_own_errors_and_the_float32_tolerance():
    small, large = own("a", 0.05), own("b", 0.3)
    assert value_bound(small, large, 0.001) == pytest.approx(0.351)
    assert value_bound(large, small, 0.001) == pytest.approx(0.351)
    # a difference only the larger side's error explains: a rule reading one side (either one) fails it
    close({1: -0.1}, {1: -0.4}, bound=value_bound(small, large))
    close({1: -0.1}, {1: -0.4}, bound=value_bound(large, small))
    with pytest.raises(AssertionError):
        close({1: -0.1}, {1: -0.4}, bound=2 * small.worst + 0.001)


def test_own_error_is_the_largest_difference_over_every_request_step_and_shared_token():
    low = [[{5: -0.1, 6: -2.0}, {7: -0.3}], [{8: -1.0, 9: -1.5}]]
    ref = [[{5: -0.1, 6: -2.2, 4: -3.0}, {7: -0.25}], [{8: -1.45, 10: -1.4}]]
    got = own_error("a", low, ref)
    assert got.worst == pytest.approx(0.45) and got.where == "request 1 step 0 token 8"
    assert got.compared == 4  # 5, 6, 7, 8 (9 was not re-scored)


def test_a_calibration_that_compares_nothing_is_refused():
    with pytest.raises(AssertionError, match="nothing calibrated"):
        own_error("a", [[{5: -0.1}]], [[{6: -0.1}]])
    with pytest.raises(AssertionError, match="only 1 re-scored"):
        own_error("a", [[{5: -0.1}, {6: -0.2}]], [[{5: -0.1}]])
