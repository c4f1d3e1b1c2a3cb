"""Property tests: the incremental repeat rule agrees with the brute-force reference on random inputs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.rules.detok import IncrementalDetokenizer
from engine.rules.repeat import (
    CONSECUTIVE,
    NGRAM,
    OBJECT_KEYS,
    JsonKeyCounter,
    RepeatRule,
    RepeatThresholds,
    reference_fire_index,
)

tokens = st.lists(st.integers(min_value=0, max_value=3), max_size=60)  # small alphabet: repeats are common
thresholds = st.builds(
    RepeatThresholds,
    min_new_tokens=st.integers(0, 10),
    max_consecutive_token_repeats=st.one_of(st.none(), st.integers(2, 6)),
    ngram_size=st.one_of(st.none(), st.integers(2, 4)),
    ngram_repeats=st.integers(2, 4),
).filter(lambda t: t.max_consecutive_token_repeats is not None or t.ngram_size is not None)


def incremental_fire_index(seq, t, text_of=None):
    rule = RepeatRule(t)
    detok = IncrementalDetokenizer(text_of) if text_of else None
    for tok in seq:
        if rule.push(tok, detok.push(tok) if detok else "") is not None:
            return rule.fired_at
    return None


@settings(max_examples=400)
@given(tokens, thresholds)
def test_incremental_equals_reference(seq, t):
    if t.ngram_size is None:
        t = RepeatThresholds(t.min_new_tokens, t.max_consecutive_token_repeats, None, None, None)
    assert incremental_fire_index(seq, t) == reference_fire_index(seq, t)


VOCAB = ['{', '}', '[', ']', '"', 'a', ':', ',', ' ', '\\', 'x"', '":']


@settings(max_examples=300)
@given(st.lists(st.integers(0, len(VOCAB) - 1), max_size=50), st.integers(1, 3))
def test_object_keys_incremental_equals_reference(seq, k):
    def text_of(ids):
        return "".join(VOCAB[i] for i in ids)

    t = RepeatThresholds(max_object_keys=k)
    assert incremental_fire_index(seq, t, text_of) == reference_fire_index(seq, t, text_of)


def test_each_threshold_fires_on_its_case_and_not_on_a_near_miss():
    consecutive = RepeatThresholds(max_consecutive_token_repeats=4)
    assert incremental_fire_index([1, 7, 7, 7, 7], consecutive) == 5
    assert incremental_fire_index([7, 7, 7, 1, 7, 7, 7], consecutive) is None  # three in a row, twice
    ngram = RepeatThresholds(ngram_size=3, ngram_repeats=3)
    assert incremental_fire_index([9, 1, 2, 3, 1, 2, 3, 1, 2, 3], ngram) == 10
    assert incremental_fire_index([1, 2, 3, 1, 2, 3, 1, 2, 4], ngram) is None  # broken on the last token
    text = lambda ids: "".join(VOCAB[i] for i in ids)  # noqa: E731
    keys = RepeatThresholds(max_object_keys=2)
    three_keys = [0, 4, 5, 11, 5, 7, 4, 5, 11, 5, 7, 4, 5, 11]  # {"a":a,"a":a,"a":
    assert incremental_fire_index(three_keys, keys, text) == len(three_keys)
    assert incremental_fire_index(three_keys[:-3], keys, text) is None  # two keys only


def test_min_new_tokens_gates_without_losing_state():
    t = RepeatThresholds(min_new_tokens=6, max_consecutive_token_repeats=3)
    assert incremental_fire_index([5, 5, 5, 5, 5, 5, 5], t) == 6


def test_fires_once_with_its_reason():
    rule = RepeatRule(RepeatThresholds(max_consecutive_token_repeats=2, ngram_size=2, ngram_repeats=2))
    reasons = [rule.push(t) for t in [1, 1, 1, 1]]
    assert reasons == [None, CONSECUTIVE, None, None] and rule.fired_at == 2
    rule = RepeatRule(RepeatThresholds(ngram_size=2, ngram_repeats=2))
    assert [rule.push(t) for t in [1, 2, 1, 2]][-1] == NGRAM


def test_json_key_counter_respects_strings_escapes_and_nesting():
    c = JsonKeyCounter()
    c.feed('{"k\\":": "v:", "a": {"b": 1, "c": 2, "d": 3}, "e": ["f", "g"]}')
    assert c.max_keys == 3  # the nested object; the outer has 3 too (k\", a, e); values and array items are no keys
    c2 = JsonKeyCounter()
    c2.feed('["a": 1]')
    assert c2.max_keys == 0
    assert OBJECT_KEYS == "object_keys"
