"""Rollout correction, computed: the importance weights an importance-sampled GRPO trainer gives each token when
its rollouts came from another engine (ms-swift's ``rollout_importance_sampling_mode``, verl's rollout correction),
and the off-policy metrics it logs, under the names ms-swift logs them (``rollout_correction/<name>``).

Inputs are ragged: per sequence, the logprob of each generated token under the trainer (``trainer``) and under the
rollout engine (``rollout``), the same tokens in the same order. Every function is pure (numpy, float64) and follows
ms-swift 4.6's ``GRPOTrainer`` formulas, which ``conformance/test_correction.py`` checks by calling ms-swift's own
methods on the same arrays. With ``ρ_t = exp(clip(trainer_t - rollout_t, -20, 20))`` (ms-swift's safety bound):

- token weights (:func:`importance_weights`): ``token_truncate`` ``min(ρ_t, C)`` (TIS), ``token_mask`` ``ρ_t`` where
  ``ρ_t <= C`` else 0 (MIS); ``sequence_truncate`` ``min(ρ_seq, C)`` on every token of the sequence,
  ``sequence_mask`` ``ρ_t`` where ``ρ_seq <= C`` else 0, with ``ρ_seq`` the geometric mean of the sequence's
  ``ρ_t`` (``exp(mean_t log ρ_t)``).
- off-policy metrics (:func:`offpolicy_metrics`): ``kl = mean_t(rollout - trainer)`` (KL(rollout || trainer) by
  its direct estimator), ``k3_kl = mean_t(clip(ρ_t - log ρ_t - 1, -10, 10))``, per-sequence perplexities
  ``exp(-mean_t logp)`` averaged over sequences (``training_ppl``, ``rollout_ppl``) and their logs,
  ``log_ppl_diff = mean_t rollout - mean_t trainer`` per sequence (mean, mean |.|, max, min),
  ``ppl_ratio = mean_seq exp(log_ppl_diff)``, ``chi2_token = mean_t ρ_t² - 1`` and
  ``chi2_seq = mean_seq ρ_seq² - 1`` (ms-swift's sequence χ² uses the geometric-mean ratio).
- correction metrics (:func:`correction_metrics`): ``is_weight_mean`` (mean weight per token), ``ess`` (effective
  sample size ``1 / mean_t (w'_t / mean w')²`` with ``w' = clip(w, 1/C, C)``) and ``clipped_frac`` (tokens with
  ``ρ_t > C`` for ``token_truncate``, zero weights for ``token_mask``, sequences with ``ρ_seq > C`` for the
  sequence modes).
Means over tokens run over every token of every sequence (ms-swift's masked mean); means over sequences give each
sequence one vote.

>>> trainer, rollout = [[-1.0, -2.0], [-0.5]], [[-1.0, -2.5], [-0.25]]
>>> [w.round(4).tolist() for w in importance_weights(trainer, rollout, mode="token_truncate", threshold=1.5)]
[[1.0, 1.5], [0.7788]]
>>> m = offpolicy_metrics(trainer, rollout)
>>> round(m["kl"], 4), round(m["chi2_token"], 4)
(-0.0833, 0.4416)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""ms-swift's ``rollout_importance_sampling_mode`` values."""
SAFETY_BOUND = 20.0
"""ms-swift clips every log ratio to [-20, 20] before exponentiating (exp(20) is already 4.9e8)."""
PREFIX = "rollout_correction/"
"""The name ms-swift logs these metrics under."""


def log_ratios(trainer: Sequence[Sequence[float]], rollout: Sequence[Sequence[float]]) -> list[np.ndarray]:
    """Per sequence, ``trainer - rollout`` per token (``log ρ_t`` before the safety bound).

    >>> log_ratios([[-1.0]], [[-1.0, -2.0]])
    Traceback (most recent call last):
    ...
    ValueError: sequence 0: the trainer has 1 token logprobs, the rollout 2; give both for the same tokens
    """
    if len(trainer) != len(rollout) or not trainer:
        raise ValueError(f"{len(trainer)} trainer sequences, {len(rollout)} rollout ones; give the same non-empty list")
    out = []
    for i, (mine, theirs) in enumerate(zip(trainer, rollout, strict=True)):
        if len(mine) != len(theirs) or not len(mine):
            raise ValueError(f"sequence {i}: the trainer has {len(mine)} token logprobs, the rollout {len(theirs)}; "
                             "give both for the same tokens")
        out.append(np.asarray(mine, dtype=np.float64) - np.asarray(theirs, dtype=np.float64))
    return out


def _ratios(trainer: Any, rollout: Any) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """(log ratios, ρ_t per sequence with the safety bound, ρ_seq per sequence)."""
    logs = log_ratios(trainer, rollout)
    rho = [np.exp(np.clip(x, -SAFETY_BOUND, SAFETY_BOUND)) for x in logs]
    rho_seq = np.array([np.exp(np.mean(np.log(np.maximum(r, 1e-10)))) for r in rho])
    return logs, rho, rho_seq


def _check(mode: str, threshold: float) -> None:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)} "
                         "(ms-swift's rollout_importance_sampling_mode)")
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0 (ms-swift's rollout_importance_sampling_threshold), got {threshold}")


def importance_weights(trainer: Sequence[Sequence[float]], rollout: Sequence[Sequence[float]], *, mode: str,
                       threshold: float = 2.0) -> list[np.ndarray]:
    """Per sequence, each token's importance weight under ``mode`` with cap or cut ``threshold`` (ms-swift's default
    2.0); formulas in the module docstring.

    >>> [w.tolist() for w in importance_weights([[0.0, 0.0]], [[-1.0, 0.0]], mode="sequence_mask", threshold=1.5)]
    [[0.0, 0.0]]
    """
    _check(mode, threshold)
    _, rho, rho_seq = _ratios(trainer, rollout)
    if mode == "token_truncate":
        return [np.minimum(r, threshold) for r in rho]
    if mode == "token_mask":
        return [np.where(r <= threshold, r, 0.0) for r in rho]
    if mode == "sequence_truncate":
        return [np.full_like(r, min(s, threshold)) for r, s in zip(rho, rho_seq, strict=True)]
    return [r * float(s <= threshold) for r, s in zip(rho, rho_seq, strict=True)]


def offpolicy_metrics(trainer: Sequence[Sequence[float]], rollout: Sequence[Sequence[float]]) -> dict[str, float]:
    """ms-swift's off-policy diagnostics of a batch (formulas in the module docstring), by the names it logs."""
    logs, rho, _ = _ratios(trainer, rollout)
    flat = np.concatenate(logs)
    train_mean = np.array([np.mean(np.asarray(t, dtype=np.float64)) for t in trainer])
    roll_mean = np.array([np.mean(np.asarray(r, dtype=np.float64)) for r in rollout])
    clipped = np.clip(flat, -SAFETY_BOUND, SAFETY_BOUND)
    diff = roll_mean - train_mean
    seq_log = np.clip([np.mean(x) for x in logs], -SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": float(np.mean(np.exp(-train_mean))),
        "training_log_ppl": float(np.mean(-train_mean)),
        "kl": float(np.mean(-flat)),
        "k3_kl": float(np.mean(np.clip(np.exp(clipped) - clipped - 1.0, -10.0, 10.0))),
        "rollout_ppl": float(np.mean(np.exp(-roll_mean))),
        "rollout_log_ppl": float(np.mean(-roll_mean)),
        "log_ppl_diff": float(np.mean(diff)),
        "log_ppl_abs_diff": float(np.mean(np.abs(diff))),
        "log_ppl_diff_max": float(np.max(diff)),
        "log_ppl_diff_min": float(np.min(diff)),
        "ppl_ratio": float(np.mean(np.exp(diff))),
        "chi2_token": float(np.mean(np.concatenate(rho) ** 2) - 1.0),
        "chi2_seq": float(np.mean(np.exp(seq_log) ** 2) - 1.0),
    }


def correction_metrics(trainer: Sequence[Sequence[float]], rollout: Sequence[Sequence[float]], *, mode: str,
                       threshold: float = 2.0) -> dict[str, float]:
    """What the correction did to a batch (``is_weight_mean``, ``ess``, ``clipped_frac``), by ms-swift's names.

    >>> {k: round(v, 6) for k, v in correction_metrics([[0.0, 0.0]], [[0.0, 0.0]], mode="token_truncate").items()}
    {'is_weight_mean': 1.0, 'ess': 1.0, 'clipped_frac': 0.0}
    """
    weights = np.concatenate(importance_weights(trainer, rollout, mode=mode, threshold=threshold))
    _, rho, rho_seq = _ratios(trainer, rollout)
    bounded = np.clip(weights, 1.0 / threshold, threshold)
    normalized = bounded / (np.mean(bounded) + 1e-8)
    if mode == "token_truncate":
        clipped = float(np.mean(np.concatenate(rho) > threshold))
    elif mode == "token_mask":
        clipped = float(np.mean(weights == 0))
    else:
        clipped = float(np.mean(rho_seq > threshold))
    ess = 1.0 / max(float(np.mean(normalized ** 2)), 1e-10)
    return {"is_weight_mean": float(np.mean(weights)), "ess": ess, "clipped_frac": clipped}


def logged(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` under the names ms-swift logs them (``rollout_correction/kl``, ...).

    >>> logged({"kl": 0.0})
    {'rollout_correction/kl': 0.0}
    """
    return {PREFIX + name: value for name, value in metrics.items()}
