"""The sampling-distribution rule (``engine.rules.processing``) on small synthetic rows: vLLM's order and rules."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from engine.rules.processing import Processing, kept_mass, process, reprocess, truncate  # noqa: E402


def test_top_k_keeps_ties_and_top_p_keeps_the_likeliest():
    row = torch.tensor([[2.0, 2.0, 1.0, 0.0]])
    assert truncate(row.clone(), top_k=1, top_p=1.0).isfinite().tolist() == [[True, True, False, False]]
    assert truncate(row.clone(), top_k=0, top_p=1e-9).isfinite().sum() == 1


def test_top_p_runs_over_what_top_k_kept():
    """vLLM applies top-p to the top-k-truncated distribution: with k=2 the two kept tokens share all the mass."""
    row = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    kept = truncate(row.clone(), top_k=2, top_p=0.6).isfinite().tolist()
    assert kept == [[True, True, False, False]]  # 0.4/0.7 = 0.57 < 0.6: the second token stays


def test_processing_order_penalty_temperature_min_p_then_truncation():
    logits = torch.tensor([3.0, 2.0, -1.0, 0.5])
    out, mass = process(logits, Processing(temperature=0.5, min_p=0.1, repetition_penalty=2.0), seen=[0])
    # penalty: 3 -> 1.5; temperature: 3.0, 4.0, -2.0, 1.0; min-p drops p < 0.1 * p_max (tokens 2 and 3)
    assert out.isfinite().tolist() == [True, True, False, False]
    assert torch.allclose(out[:2], torch.tensor([3.0, 4.0]))
    full = torch.softmax(torch.tensor([3.0, 4.0, -2.0, 1.0]), dim=-1)
    assert math.isclose(float(mass), float(full[:2].sum()), rel_tol=1e-6)
    assert logits.tolist() == [3.0, 2.0, -1.0, 0.5]  # the input is untouched


def test_reprocess_penalises_what_each_position_has_seen():
    logits = torch.zeros(2, 3)  # positions predicting sequence[1] and sequence[2]
    logits[:, 0] = 1.0
    lp, mass = reprocess(logits, Processing(repetition_penalty=2.0), sequence=[1, 0, 2], start=1)
    assert torch.allclose(lp[0], torch.log_softmax(torch.tensor([1.0, 0.0, 0.0]), dim=-1))  # only 1 seen: 0 * 2
    assert torch.allclose(lp[1], torch.log_softmax(torch.tensor([0.5, 0.0, 0.0]), dim=-1))  # 0 seen now: 1 / 2
    assert torch.allclose(mass, torch.ones(2))


def test_kept_mass_of_an_untouched_row_is_one():
    row = torch.randn(50)
    assert math.isclose(float(kept_mass(row, row)), 1.0, rel_tol=1e-6)
    assert Processing(temperature=0).is_identity and not Processing(top_k=5).is_identity
