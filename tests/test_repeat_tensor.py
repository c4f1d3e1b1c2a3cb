"""The vectorized id-only repeat rule fires exactly where the pure rule (the executable spec) fires."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.rules.base import RuleSet
from engine.rules.repeat import RepeatRule, RepeatThresholds

torch = pytest.importorskip("torch", reason="the vectorized rule is tensor code")

from engine.backends.repeat_tensor import BatchRepeatGuard  # noqa: E402

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
@given(t=thresholds(), rows=st.lists(row(), min_size=1, max_size=6), width=st.integers(1, 30))
def test_fires_where_the_pure_rule_fires(t, rows, width):
    """300 batches: for every row, the same fire index and reason as ``RuleSet([RepeatRule])`` fed token by
    token (terminal ids end the row there; the rule never fires after), and no row fires twice."""
    rows = [(r + [7] * width)[:width] for r in rows]  # equal width, as an HF batch (padding after the end)
    ids = torch.tensor(rows)  # (batch, width)
    guard = BatchRepeatGuard(t, batch=len(rows), terminal_ids=TERMINAL)
    fired_steps = torch.zeros(len(rows), dtype=torch.int64)
    for k in range(1, width + 1):
        fired_steps += guard.step(ids[:, :k]).long()
    assert fired_steps.max() <= 1
    for i, tokens in enumerate(rows):
        rs = RuleSet([RepeatRule(t)], terminal_ids=TERMINAL)
        for tok in tokens:
            rs.feed(tok)
        assert guard.events(i) == rs.events(), f"row {i} {tokens} with {t}"


def test_text_thresholds_are_refused():
    with pytest.raises(ValueError, match="max_object_keys reads text"):
        BatchRepeatGuard(RepeatThresholds(max_object_keys=2), batch=1, terminal_ids=TERMINAL)
