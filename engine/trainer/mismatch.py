"""The training-inference mismatch of a rollout: its sampled tokens' logprobs against a trainer's rescoring.

A rollout backend reports each sampled token's raw log-probability (``GenerationResult.logprobs``, the model's own,
before temperature, top-k/top-p or penalties). A trainer recomputes the same tokens teacher-forced
(``GenerationEngine.score`` on HF). :func:`logprob_mismatch` compares the two per token (|Δ logprob| mean, p99,
max) and per sequence (the importance ratio ``exp(sum trainer - sum rollout)``, what PPO/GRPO-style losses weight
a sample by when rollouts and training disagree). :func:`rescore_mismatch` runs the rescoring too.

The conformance suite holds it to a bound in float32 (``test_rollout_logprobs_equal_the_trainers_rescoring``);
the benchmark report's ``rollout_vs_trainer`` group writes it for float32 and bfloat16.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.trainer.metrics import p99


@dataclass(frozen=True)
class Mismatch:
    """Per-token |Δ logprob| and per-sequence importance ratios of one rollout against its rescoring.

    >>> m = logprob_mismatch([[-1.0, -2.0], [-0.5]], [[-1.0, -2.5], [-0.25]])
    >>> (m.tokens, m.mean, m.max, round(m.ratio_min, 4), round(m.ratio_max, 4))
    (3, 0.25, 0.5, 0.6065, 1.284)
    """

    tokens: int
    mean: float
    p99: float
    max: float
    ratio_min: float
    """The smallest sequence importance ratio, ``exp(sum(trainer) - sum(rollout))``."""
    ratio_max: float
    log_ratios: tuple[float, ...]
    """Per sequence, ``sum(trainer) - sum(rollout)`` (the importance ratio's log)."""

    def line(self) -> str:
        """One line for a summary or a progress log."""
        return (f"|dlogprob| mean {self.mean:.1e}, p99 {self.p99:.1e}, max {self.max:.1e} over {self.tokens} "
                f"tokens; sequence importance ratio {self.ratio_min:.4f}..{self.ratio_max:.4f}")


def logprob_mismatch(rollout: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]]) -> Mismatch:
    """Compare per-sequence token logprobs (the rollout's and the trainer's, for the same tokens).

    >>> logprob_mismatch([[-1.0]], [[-1.0, -2.0]])
    Traceback (most recent call last):
    ...
    ValueError: sequence 0: the rollout has 1 token logprobs, the trainer 2; score exactly the generated tokens
    """
    if len(rollout) != len(trainer) or not rollout:
        raise ValueError(f"{len(rollout)} rollout sequences, {len(trainer)} rescored; give the same non-empty list")
    deltas: list[float] = []
    log_ratios: list[float] = []
    for i, (mine, theirs) in enumerate(zip(rollout, trainer, strict=True)):
        if len(mine) != len(theirs):
            raise ValueError(f"sequence {i}: the rollout has {len(mine)} token logprobs, the trainer {len(theirs)}; "
                             "score exactly the generated tokens")
        deltas += [abs(a - b) for a, b in zip(mine, theirs, strict=True)]
        log_ratios.append(math.fsum(theirs) - math.fsum(mine))
    if not deltas:
        raise ValueError("no generated tokens to compare; generate at least one token per sequence")
    ratios = [math.exp(x) for x in log_ratios]
    return Mismatch(tokens=len(deltas), mean=math.fsum(deltas) / len(deltas), p99=p99(deltas), max=max(deltas),
                    ratio_min=min(ratios), ratio_max=max(ratios), log_ratios=tuple(log_ratios))


def chosen_logprobs(result: Any) -> list[float]:
    """The logprob the rollout reported for each token it generated (needs ``logprobs`` >= 0 in the options)."""
    if result.logprobs is None:
        raise ValueError("the rollout carries no logprobs; generate with options logprobs=0 (or more)")
    return [step[token] for step, token in zip(result.logprobs, result.token_ids, strict=True)]


def rescored(rollout: Sequence[Any], trainer: Any, processing: Any = None) -> list[list[float]]:
    """The trainer's teacher-forced logprobs of each rollout's tokens (``engine.score``; with ``processing``, under
    the sampling steps a processed-logprobs rollout reports: ``engine.rules.processing``)."""
    sequences = [list(r.prompt_token_ids) + list(r.token_ids) for r in rollout]
    starts = [len(r.prompt_token_ids) for r in rollout]
    scores = trainer.score(sequences, starts) if processing is None else trainer.score(sequences, starts,
                                                                                       processing=processing)
    return [list(s.logprobs) for s in scores]


def rescore_mismatch(rollout: Sequence[Any], trainer: Any, processing: Any = None) -> Mismatch:
    """Rescore ``rollout`` (``GenerationResult``s with logprobs) teacher-forced on ``trainer`` (an engine that
    scores, e.g. HF; ``processing`` as in :func:`rescored`) and compare."""
    return logprob_mismatch([chosen_logprobs(r) for r in rollout], rescored(rollout, trainer, processing))


def token_weights(rollout: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]]) -> list[float]:
    """Every token's importance weight ``exp(trainer - rollout)`` (a -inf rollout logprob, a token outside what
    the rollout reports as its support, gives inf).

    >>> [round(w, 4) for w in token_weights([[-1.0, -2.0]], [[-1.0, -1.5]])]
    [1.0, 1.6487]
    """
    return [math.exp(t - r) if math.isfinite(r) else math.inf
            for mine, theirs in zip(rollout, trainer, strict=True) for r, t in zip(mine, theirs, strict=True)]


def agreement(weights: Sequence[float]) -> float:
    """The worst token weight folded below 1, ``min(min(w, 1 / w))``: 1 when the trainer sees exactly what the
    rollout drew, 0.99 when some token is 1 % off (the release band of ``rollout_vs_trainer``'s float32 cases).

    >>> agreement([1.0, 1.02, 0.995])
    0.9803921568627451
    """
    return min(min(w, 1.0 / w) if w > 0 else 0.0 for w in weights)
