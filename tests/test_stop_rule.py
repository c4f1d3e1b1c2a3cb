"""Property tests of the stop-truncation rule (pure; no backend)."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from engine.rules.stop import find_earliest_stop, finish_reason, truncate_at_stop

alphabet = st.sampled_from(list("ab.\n é漢🙂"))
texts = st.text(alphabet=alphabet, max_size=40)
stop_lists = st.lists(st.text(alphabet=alphabet, min_size=1, max_size=5), max_size=4)


def brute_force(text: str, stops: list[str]) -> tuple[int, int, str] | None:
    """Every occurrence of every stop; the winner completes first, ties go to the longest."""
    found = [(i + len(s), -len(s), s) for s in stops for i in range(len(text)) if text.startswith(s, i)]
    return min(found) if found else None


@given(texts, stop_lists)
@example("The answer.\n\nUser:", ["\n\n", "User:"])
@example("abcd", ["abcd", "bc"])
@example("short", ["much longer than the text"])
@example("anything", [])
def test_matches_brute_force(text, stops):
    got = find_earliest_stop(text, stops)
    want = brute_force(text, stops)
    if want is None:
        assert got is None
    else:
        end, neg_len, stop = want
        assert got is not None and (got.end, got.stop) == (end, stop)
        assert got.start == end + neg_len


@given(texts, stop_lists, st.booleans())
def test_idempotent(text, stops, include):
    once, _ = truncate_at_stop(text, stops, include_stop=include)
    twice, _ = truncate_at_stop(once, stops, include_stop=include)
    assert twice == once


@given(texts, stop_lists)
def test_cut_text_is_a_prefix_without_any_stop(text, stops):
    cut, matched = truncate_at_stop(text, stops)
    assert text.startswith(cut)
    assert not any(s in cut for s in stops)
    assert (matched is None) == (cut == text and not any(s in text for s in stops))


@given(texts, stop_lists, st.integers(min_value=0, max_value=45))
def test_min_end_ignores_early_occurrences(text, stops, min_end):
    got = find_earliest_stop(text, stops, min_end=min_end)
    if got is not None:
        assert got.end > min_end
    late = [(i + len(s)) for s in stops for i in range(len(text)) if text.startswith(s, i) and i + len(s) > min_end]
    assert (got is None) == (not late)


def test_overlapping_stops_earliest_completion_wins():
    assert truncate_at_stop("xxabcd", ["abcd", "bc"]) == ("xxa", "bc")
    assert truncate_at_stop("aaa", ["aa", "a"]) == ("", "a")


def test_unicode_stops():
    assert truncate_at_stop("答案是🙂然后", ["🙂"]) == ("答案是", "🙂")


def test_include_stop_keeps_longest_at_same_end():
    assert truncate_at_stop("say hello.", ["o.", "lo."], include_stop=True) == ("say hello.", "lo.")


def test_empty_stop_list_and_stop_longer_than_text():
    assert truncate_at_stop("abc", []) == ("abc", None)
    assert truncate_at_stop("abc", ["abcdef"]) == ("abc", None)


def test_finish_reason_priority():
    assert finish_reason([1, 2], stop_token_ids=[2], matched_stop="x") == ("stop", "x")
    assert finish_reason([1, 2], stop_token_ids=[2], matched_stop=None) == ("stop", 2)
    assert finish_reason([], stop_token_ids=[2], matched_stop=None) == ("length", None)


pieces = st.lists(st.text(alphabet=alphabet, max_size=3), min_size=1, max_size=8)  # a tiny vocabulary


@given(pieces, st.lists(st.integers(0, 7), max_size=30), st.lists(st.text(alphabet=alphabet, min_size=1, max_size=5),
                                                                  min_size=1, max_size=3), st.integers(0, 6))
def test_the_stop_watch_ends_the_row_at_the_first_prefix_whose_text_completes_a_stop(vocab, ids, stops, min_new):
    """StopStringWatch, fed one token at a time with a bounded tail of text, fires on exactly the token whose
    prefix text first holds a stop completing after the text of the first ``min_new`` tokens (full decodes)."""
    from engine.rules.detok import IncrementalDetokenizer
    from engine.rules.stop import StopStringWatch

    ids = [i % len(vocab) for i in ids]
    decode = lambda seq: "".join(vocab[i] for i in seq)  # noqa: E731
    watch = StopStringWatch(stops, IncrementalDetokenizer(decode), min_new_tokens=min_new)
    fired = next((k for k, token in enumerate(ids, 1) if watch.feed(token)), None)
    floor = len(decode(ids[:min_new]))
    want = next((k for k in range(min_new + 1, len(ids) + 1)
                 if find_earliest_stop(decode(ids[:k]), stops, min_end=floor) is not None), None)
    assert fired == want
