"""Rollout correction's pure rules (``engine/trainer/correction.py``): the invariants every mode keeps, on any logprobs
(hypothesis), and bad input refused by name. Equality with ms-swift's own code: ``conformance/test_correction.py``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.trainer.correction import MODES, correction_metrics, importance_weights, logged, offpolicy_metrics

LOGPROB = st.floats(-30.0, 0.0, allow_nan=False)
BATCH = st.lists(st.lists(st.tuples(LOGPROB, LOGPROB), min_size=1, max_size=6), min_size=1, max_size=4)


def split(pairs):
    return [[t for t, _ in row] for row in pairs], [[r for _, r in row] for row in pairs]


@settings(max_examples=150, deadline=None)
@given(BATCH, st.sampled_from(MODES), st.floats(1.01, 5.0))
def test_every_mode_keeps_its_weights_within_its_rule(pairs, mode, threshold):
    trainer, rollout = split(pairs)
    weights = importance_weights(trainer, rollout, mode=mode, threshold=threshold)
    assert [len(w) for w in weights] == [len(t) for t in trainer]
    flat = np.concatenate(weights)
    assert np.all(flat >= 0) and np.all(np.isfinite(flat))
    if mode in ("token_truncate", "sequence_truncate"):
        assert np.all(flat <= threshold)
    if mode == "token_mask":
        assert np.all((flat == 0) | (flat <= threshold))
    metrics = correction_metrics(trainer, rollout, mode=mode, threshold=threshold)
    assert 0 <= metrics["clipped_frac"] <= 1 and 0 < metrics["ess"] <= 1 + 1e-6


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(LOGPROB, min_size=1, max_size=6), min_size=1, max_size=4), st.sampled_from(MODES))
def test_matched_logprobs_need_no_correction(rows, mode):
    assert all(np.all(w == 1.0) for w in importance_weights(rows, rows, mode=mode))
    metrics = offpolicy_metrics(rows, rows)
    assert metrics["kl"] == 0 and metrics["k3_kl"] == 0 and metrics["chi2_token"] == 0 and metrics["chi2_seq"] == 0
    assert math.isclose(metrics["training_ppl"], metrics["rollout_ppl"]) and metrics["ppl_ratio"] == 1


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"mode": "token_clip"}, "is not one of"), ({"mode": "token_mask", "threshold": 0}, "threshold must be > 0"),
])
def test_bad_settings_are_refused_by_name(kwargs, says):
    with pytest.raises(ValueError, match=says):
        importance_weights([[-1.0]], [[-1.0]], **kwargs)


def test_ragged_inputs_must_match_token_for_token_and_names_are_ms_swifts():
    with pytest.raises(ValueError, match="sequence 0"):
        offpolicy_metrics([[-1.0, -2.0]], [[-1.0]])
    assert set(logged(offpolicy_metrics([[-1.0]], [[-1.5]]))) >= {"rollout_correction/kl", "rollout_correction/k3_kl",
                                                                   "rollout_correction/chi2_seq"}
