"""Rollout correction (``engine/trainer/correction.py``) against ms-swift's own code: the importance weights of its four
``rollout_importance_sampling_mode`` values, its off-policy metrics and its correction metrics, computed by
``swift.rlhf_trainers.grpo_trainer.GRPOTrainer``'s methods on the same arrays (padded to its ``[B, T]`` layout with
a completion mask) equal ours. Nothing is copied from ms-swift: its methods are called, unbound, with the two
attributes they read."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from conformance.subjects.plan import uses
from engine.trainer.correction import MODES, correction_metrics, importance_weights, offpolicy_metrics

SUBJECTS = uses()

THRESHOLD = 1.5


def batch(seed: int = 7) -> tuple[list[list[float]], list[list[float]]]:
    """Ragged trainer and rollout logprobs: small mismatches, a few large ones (clipped and masked), one sequence
    whose geometric-mean ratio is above the threshold, one log ratio past ms-swift's safety bound."""
    rng = np.random.default_rng(seed)
    trainer, rollout = [], []
    for length in (1, 3, 8, 17, 5):
        t = -rng.gamma(1.0, 1.5, size=length)
        r = t - rng.normal(0.0, 0.05, size=length)
        trainer.append(t.tolist())
        rollout.append(r.tolist())
    rollout[2][3] = trainer[2][3] - 1.2  # one token far above the threshold
    rollout[4] = [x - 0.6 for x in trainer[4]]  # a whole sequence above it
    rollout[3][0] = trainer[3][0] - 25.0  # past the safety bound
    return trainer, rollout


def padded(rows: list[list[float]]):
    import torch

    width = max(map(len, rows))
    values = torch.full((len(rows), width), -1e10, dtype=torch.float64)  # ms-swift's padding value
    mask = torch.zeros((len(rows), width), dtype=torch.float64)
    for i, row in enumerate(rows):
        values[i, :len(row)] = torch.tensor(row, dtype=torch.float64)
        mask[i, :len(row)] = 1.0
    return values, mask


def trainer_methods(mode: str) -> tuple[type, SimpleNamespace]:
    from swift.rlhf_trainers.grpo_trainer import GRPOTrainer

    me = SimpleNamespace(rollout_importance_sampling_mode=mode, rollout_importance_sampling_threshold=THRESHOLD)
    me._compute_sequence_level_ratios = lambda ratio, mask: GRPOTrainer._compute_sequence_level_ratios(me, ratio, mask)
    return GRPOTrainer, me


@pytest.mark.parametrize("mode", MODES)
def test_importance_weights_and_correction_metrics_equal_ms_swifts(mode):
    trainer, rollout = batch()
    grpo, me = trainer_methods(mode)
    mine_t, mask = padded(trainer)
    theirs_t, _ = padded(rollout)
    log_ratio = (mine_t - theirs_t) * mask
    weights = grpo._apply_rollout_importance_sampling(me, log_ratio, mask)
    ours = importance_weights(trainer, rollout, mode=mode, threshold=THRESHOLD)
    for i, row in enumerate(ours):
        np.testing.assert_allclose(row, weights[i, :len(row)].numpy(), rtol=1e-12, atol=1e-12, err_msg=f"row {i}")
    theirs = {k: float(v) for k, v in grpo._compute_is_correction_metrics(me, log_ratio, weights, mask).items()}
    got = correction_metrics(trainer, rollout, mode=mode, threshold=THRESHOLD)
    assert got.keys() == theirs.keys()
    for name in got:
        assert got[name] == pytest.approx(theirs[name], rel=1e-7, abs=1e-12), name  # its fractions are float32
    assert 0 < got["clipped_frac"] < 1, "the batch must exercise the threshold"


def test_offpolicy_metrics_equal_ms_swifts():
    trainer, rollout = batch()
    grpo, me = trainer_methods("token_truncate")
    mine_t, mask = padded(trainer)
    theirs_t, _ = padded(rollout)
    theirs = {k: float(v) for k, v in grpo._compute_rollout_offpolicy_metrics(me, mine_t * mask, theirs_t * mask,
                                                                               mask).items()}
    got = offpolicy_metrics(trainer, rollout)
    assert got.keys() == theirs.keys()
    for name in got:
        assert got[name] == pytest.approx(theirs[name], rel=1e-7, abs=1e-12), name  # its fractions are float32
    same = offpolicy_metrics(trainer, trainer)
    assert same["kl"] == 0 and same["chi2_token"] == 0 and same["ppl_ratio"] == 1  # no mismatch, no correction
