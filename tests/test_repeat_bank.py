"""The batched id-only repeat rule (numpy) fires exactly where the pure rule (the executable spec) fires."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.rules.base import RuleSet
from engine.rules.repeat import RepeatRule, RepeatThresholds

np = pytest.importorskip("numpy", reason="the batched rule is numpy code")

from engine.rules.repeat_bank import RepeatBank  # noqa: E402

TERMINAL = {0}


@st.composite
def thresholds(draw):
    consecutive = draw(st.none() | st.integers(1, 5))
    n = draw(st.none() | st.integers(2, 4))
    r = draw(st.integers(2, 4)) if n is not None else None
    if consecutive is None and n is None:
        consecutive = 3
    return RepeatThresholds(min_new_tokens=draw(st.integers(0, 8)), max_consecutive_token_repeats=consecutive,
                            ngram_size=n, ngram_repeats=r)


@st.composite
def row(draw):
    """A row with loops in it, sometimes a terminal id (after which nothing may fire)."""
    parts = draw(st.lists(st.one_of(st.lists(st.integers(0, 5), max_size=4),
                                    st.lists(st.integers(1, 5), min_size=1, max_size=3).flatmap(
                                        lambda g: st.integers(2, 5).map(lambda k: g * k))), max_size=6))
    return [t for p in parts for t in p]


@settings(max_examples=300, deadline=None)
@given(t=thresholds(), rows=st.lists(row(), min_size=1, max_size=6), width=st.integers(1, 30),
       other=thresholds(), order=st.sampled_from(["dense", "index", "reversed"]))
def test_fires_where_the_pure_rule_fires(t, rows, width, other, order):
    """300 batches: for every row, the same fire index and reason as ``RuleSet([RepeatRule])`` fed token by
    token (terminal ids end the row there; the rule never fires after), and no row fires twice. Odd rows carry
    other thresholds (rows of one bank may differ, as vLLM requests do). Rows are pushed as the whole batch
    (``rows=None``, the HF path), by index, and by index in reverse order (fire flags align with the rows given)."""
    rows = [(r + [7] * width)[:width] for r in rows]  # equal width, as an HF batch (padding after the end)
    bank = RepeatBank()
    per_row = [t if i % 2 == 0 else other for i in range(len(rows))]
    for i, th in enumerate(per_row):
        bank.assign(i, th, terminal_ids=TERMINAL)
    fired = np.zeros(len(rows), dtype=int)
    for k in range(width):
        tokens = np.array([r[k] for r in rows])
        if order == "dense":
            fired += bank.push(None, tokens)
        elif order == "index":
            fired += bank.push(np.arange(len(rows)), tokens)
        else:
            fired += bank.push(np.arange(len(rows))[::-1], tokens[::-1])[::-1]
    assert fired.max() <= 1
    for i, tokens in enumerate(rows):
        rs = RuleSet([RepeatRule(per_row[i])], terminal_ids=TERMINAL)
        for tok in tokens:
            rs.feed(tok)
        assert bank.events(i) == rs.events(), f"row {i} {tokens} with {per_row[i]}"


def test_growing_the_ring_keeps_every_rows_history():
    """A row with a longer n-gram arriving later widens the ring; earlier rows go on as if nothing happened."""
    bank = RepeatBank()
    bank.assign(0, RepeatThresholds(ngram_size=2, ngram_repeats=3), terminal_ids=TERMINAL)
    for tok in (1, 2, 1, 2):
        bank.push([0], [tok])
    bank.assign(5, RepeatThresholds(ngram_size=4, ngram_repeats=2), terminal_ids=TERMINAL)
    assert bank.push([0], [1]).tolist() == [False] and bank.push([0], [2]).tolist() == [True]
    assert bank.events(0) == {"repeat_terminate": ("ngram_repeats", 6)}


def test_text_thresholds_are_refused():
    with pytest.raises(ValueError, match="max_object_keys reads text"):
        RepeatBank().assign(0, RepeatThresholds(max_object_keys=2), terminal_ids=TERMINAL)
