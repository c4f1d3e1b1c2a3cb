"""The training-inference mismatch rule (``engine.trainer.mismatch``) on synthetic logprobs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from engine.trainer.mismatch import chosen_logprobs, logprob_mismatch, rescore_mismatch


def test_identical_logprobs_give_zero_deltas_and_unit_ratios():
    rollout = [[-0.1, -2.0, -0.7], [-1.5]]
    got = logprob_mismatch(rollout, [list(r) for r in rollout])
    assert (got.tokens, got.mean, got.p99, got.max) == (4, 0.0, 0.0, 0.0)
    assert got.ratio_min == got.ratio_max == 1.0 and got.log_ratios == (0.0, 0.0)


def test_a_constant_shift_gives_exp_of_the_summed_shift_per_sequence():
    rollout = [[-1.0] * 10, [-2.0] * 4]
    trainer = [[x + 0.01 for x in row] for row in rollout]  # the trainer finds every drawn token likelier
    got = logprob_mismatch(rollout, trainer)
    assert got.mean == pytest.approx(0.01) and got.max == pytest.approx(0.01)
    assert got.ratio_max == pytest.approx(math.exp(0.10)) and got.ratio_min == pytest.approx(math.exp(0.04))


def test_p99_is_taken_over_every_token_of_every_sequence():
    rollout = [[0.0] * 100, [0.0] * 100]
    trainer = [[0.0] * 99 + [5.0], [0.0] * 97 + [1.0, 2.0, 3.0]]  # the 4 largest of 200: 1, 2, 3, 5
    got = logprob_mismatch(rollout, trainer)
    assert got.max == 5.0 and got.p99 == 2.0 and got.tokens == 200  # nearest rank: the 198th of 200


@pytest.mark.parametrize(("rollout", "trainer", "message"), [
    ([[-1.0]], [[-1.0, -2.0]], "sequence 0: the rollout has 1 token logprobs, the trainer 2"),
    ([[-1.0]], [], "1 rollout sequences, 0 rescored"),
    ([[]], [[]], "no generated tokens"),
])
def test_mismatched_inputs_are_refused_by_name(rollout, trainer, message):
    with pytest.raises(ValueError, match=message):
        logprob_mismatch(rollout, trainer)


def test_rescoring_sends_prompt_plus_generated_ids_and_compares_the_chosen_tokens():
    result = SimpleNamespace(prompt_token_ids=(7, 8), token_ids=(3, 4),
                             logprobs=({3: -0.5, 9: -1.0}, {4: -0.25}))
    calls = []

    class Trainer:
        def score(self, sequences, starts):
            calls.append((sequences, starts))
            return [SimpleNamespace(logprobs=(-0.5, -0.5))]

    got = rescore_mismatch([result], Trainer())
    assert calls == [([[7, 8, 3, 4]], [2])]
    assert chosen_logprobs(result) == [-0.5, -0.25] and got.max == 0.25
    assert got.ratio_min == pytest.approx(math.exp(-0.25))
    with pytest.raises(ValueError, match="logprobs=0"):
        chosen_logprobs(SimpleNamespace(logprobs=None, token_ids=(1,)))
