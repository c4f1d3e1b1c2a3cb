"""The portable sampler's pure rule (engine.rules.portable_sampler): vLLM MRV2's hash, uniforms and Gumbel noise, the
exact pruning of tokens that cannot win, and a draw that depends on (seed, position, token) only."""

from __future__ import annotations

import struct

import mmh3  # the reference murmur3 (C), the test extra's: an independent check of vLLM's hash as we write it
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.rules import portable_sampler as ps

SEEDS = st.integers(min_value=0, max_value=2**63 - 1)
POSITIONS = st.integers(min_value=0, max_value=2**31 - 1)
TOKENS = st.lists(st.integers(min_value=0, max_value=2**20), min_size=1, max_size=16)


@settings(max_examples=200, deadline=None)
@given(SEEDS, POSITIONS, TOKENS, st.sampled_from([0, ps.FP64_DOMAIN]))
def test_hash_is_murmur3_of_the_four_words(seed, pos, tokens, domain):
    """vLLM hashes (seed low, seed high, position, token) as murmur3_x86_32 of 16 bytes with the domain as its seed:
    mmh3 (the reference C implementation) must agree on every word."""
    ours = ps.hash32(seed, pos, np.array(tokens), domain)
    for token, value in zip(tokens, ours.tolist(), strict=True):
        key = struct.pack("<IIII", seed & 0xFFFFFFFF, seed >> 32, pos & 0xFFFFFFFF, token)
        assert value == mmh3.hash(key, seed=domain, signed=False)


def test_uniform32_is_the_midpoint_of_the_hash_rounded_once():
    tokens = np.arange(5000)
    u = ps.uniform32(123, 45, tokens)
    exact = (ps.hash32(123, 45, tokens).astype(np.float64) + 0.5) * 2.0**-32
    assert u.dtype == np.float32
    assert np.array_equal(u, exact.astype(np.float32))  # one rounding of the exact midpoint, as vLLM's split sum
    assert (u > 0).all() and (u <= 1).all()


def test_uniform64_uses_53_bits_of_both_hashes_and_stays_below_one():
    tokens = np.arange(5000)
    u = ps.uniform64(9, 2, tokens)
    lo = ps.hash32(9, 2, tokens).astype(np.uint64)
    hi = ps.hash32(9, 2, tokens, ps.FP64_DOMAIN).astype(np.uint64)
    r53 = ((hi << np.uint64(32)) | lo) >> np.uint64(11)
    assert np.array_equal(u, (r53.astype(np.float64) + 0.5) * 2.0**-53)
    assert (u > 0).all() and (u < 1).all()


@pytest.mark.parametrize("fp64", [False, True])
def test_the_noise_bounds_hold_and_are_what_the_pruning_uses(fp64):
    low, high = ps._noise_range(fp64)
    assert ps.NOISE_RANGE[fp64][0] <= low and high <= ps.NOISE_RANGE[fp64][1]
    assert high - ps.NOISE_RANGE[fp64][1] > -1e-3 and ps.NOISE_RANGE[fp64][0] - low > -1e-3  # rounded, not loose
    noise = ps.gumbel_noise(5, 6, np.arange(200_000), fp64=fp64)
    assert low <= noise.min() and noise.max() <= high


@pytest.mark.parametrize(("fp64", "size", "trials"), [(False, 3000, 300), (True, 3000, 300), (False, 49152, 20)])
def test_pruning_draws_exactly_what_the_whole_vocabulary_would(fp64, size, trials):
    """Flat, peaked and masked rows: the draw that computes few tokens' noise equals the argmax over all of them."""
    rng = np.random.default_rng(size)
    for trial in range(trials):
        logits = (rng.standard_normal(size) * rng.choice([0.05, 0.5, 5.0, 20.0])).astype(np.float32)
        logits[rng.random(size) < rng.choice([0.0, 0.3, 0.99])] = -np.inf
        logits[rng.integers(size)] = 0.0  # at least one token is kept
        whole = logits.astype(np.float64 if fp64 else np.float32) + ps.gumbel_noise(trial, 7, np.arange(size),
                                                                                     fp64=fp64)
        assert ps.draw(logits, seed=trial, pos=7, fp64=fp64).token == int(np.argmax(whole))


def test_draws_follow_the_distribution():
    """Gumbel-max draws token t with probability softmax(logits)[t]: 20,000 positions of one row, each frequency
    within 4 standard errors (the draw is deterministic, so the verdict is too)."""
    p = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
    logits = np.log(p).astype(np.float32)
    n = 20_000
    counts = np.bincount([ps.draw(logits, seed=42, pos=k).token for k in range(n)], minlength=len(p))
    assert np.all(np.abs(counts / n - p) <= 4 * np.sqrt(p * (1 - p) / n)), counts / n


def test_a_row_draws_alike_whatever_its_batch_mates_and_their_order():
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((6, 500)).astype(np.float32)
    seeds, positions = [11, 12, 13, 11, 12, 13], [3, 3, 3, 9, 9, 9]
    together = ps.draw_rows(rows, seeds, positions)
    reversed_ = ps.draw_rows(rows[::-1], seeds[::-1], positions[::-1])[::-1]
    alone = [ps.draw(rows[i], seed=seeds[i], pos=positions[i]) for i in range(6)]
    assert together == reversed_ == alone


def test_seed_position_and_variant_each_change_the_draw():
    logits = np.zeros(1000, dtype=np.float32)  # flat: any token may win
    base = ps.draw(logits, seed=1, pos=1).token
    assert ps.draw(logits, seed=2, pos=1).token != base
    assert ps.draw(logits, seed=1, pos=2).token != base
    assert ps.draw(logits, seed=1 + 2**40, pos=1).token != base
    assert ps.draw(logits, seed=1, pos=1, fp64=True).token != base


@pytest.mark.parametrize("fp64", [False, True])
def test_the_margin_is_the_gap_to_the_runner_up_within_the_window(fp64):
    rng = np.random.default_rng(5)
    narrow = 0
    for trial in range(300):
        logits = (rng.standard_normal(2000) * rng.choice([0.3, 3.0])).astype(np.float32)
        scores = np.sort(logits.astype(np.float64 if fp64 else np.float32)
                         + ps.gumbel_noise(trial, 1, np.arange(2000), fp64=fp64))[::-1]
        gap = float(scores[0] - scores[1])
        pick = ps.draw(logits, seed=trial, pos=1, fp64=fp64)
        assert pick.margin == pytest.approx(min(gap, ps.MARGIN_WINDOW), rel=1e-5, abs=1e-6)
        narrow += gap < ps.MARGIN_WINDOW
    assert narrow > 50  # the exact branch was exercised, not only the window
    assert ps.draw(np.array([1.0, -np.inf], dtype=np.float32), seed=3, pos=0).margin == float("inf")
