"""The streaming rule: deltas concatenate to exactly the non-streamed text, and nothing streamed is taken back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.plugins.builtin import CleanupPlugin
from engine.rules.cleanup import cleanup
from engine.rules.stop import truncate_at_stop
from engine.rules.stream import REPLACEMENT, StreamMismatchError, TextStream, stop_safe_prefix

ALPHABET = "ab .!?\n{}[]\"'"
texts = st.text(alphabet=ALPHABET, max_size=40)
stops = st.lists(st.text(alphabet="ab.\n", min_size=1, max_size=4), max_size=3)
cleanups = st.fixed_dictionaries({"trim_whitespace": st.booleans(), "close_brackets": st.booleans(),
                                  "sentence_end": st.booleans()})


def stream(text: str, cuts: list[int], s: TextStream, min_end: int) -> str:
    """Feed ``text`` in pieces at ``cuts`` (token boundaries; ``min_end`` is known once the text reaches it)."""
    out = ""
    for cut in sorted({*cuts, min_end, len(text)}):
        piece = text[:cut]
        out += s.feed(piece, min_end=min_end if cut >= min_end else None)
    return out


@settings(max_examples=400, deadline=None)
@given(texts, stops, st.booleans(), st.data(), cleanups)
def test_deltas_concatenate_to_the_non_streamed_text(text, stop_strings, include_stop, data, options):
    min_end = data.draw(st.integers(0, len(text)), label="min_end")
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12), label="cuts")
    truncated, _ = truncate_at_stop(text, stop_strings, include_stop=include_stop, min_end=min_end)
    final = cleanup(truncated, **options)
    plugin = CleanupPlugin(**options)
    s = TextStream(stops=stop_strings, include_stop=include_stop, post=[plugin.stream_prefix])
    streamed = stream(text, cuts, s, min_end)  # raises StreamMismatchError if anything must be taken back
    assert final.startswith(streamed)
    assert streamed + s.finish(final) == final


def test_text_without_stops_or_steps_streams_at_once():
    s = TextStream()
    assert [s.feed(t, min_end=0) for t in ["He", "Hello", "Hello!"]] == ["He", "llo", "!"]
    assert s.finish("Hello!") == ""


def test_a_possible_stop_is_held_back_then_released():
    s = TextStream(stops=["END"])
    assert s.feed("done E", min_end=0) == "done "
    assert s.feed("done EN", min_end=0) == ""
    assert s.feed("done ENx", min_end=0) == "ENx"  # it was not the stop after all


def test_a_stop_inside_min_new_tokens_does_not_end_the_stream():
    s = TextStream(stops=["."])
    assert s.feed("a.", min_end=None) == "a."
    assert s.feed("a.b.", min_end=2) == "b" and s.stopped
    assert s.feed("a.b.c", min_end=2) == ""


def test_half_a_character_waits_for_the_rest():
    assert stop_safe_prefix("na" + REPLACEMENT, []) == ("na", False)
    s = TextStream()
    assert s.feed("caf" + REPLACEMENT, min_end=0) == "caf"
    assert s.feed("café", min_end=0) == "é"


def test_a_step_that_cannot_say_holds_everything_until_the_end():
    from engine.plugins import Plugin

    class Shout(Plugin):
        name = "shout"

        def hooks(self, backend):
            return frozenset({"post_decode"})

        def post_decode(self, text):
            return text.upper()

    s = TextStream(post=[Shout().stream_prefix])
    assert s.feed("quiet", min_end=0) == ""
    assert s.finish("QUIET") == "QUIET"


def test_a_final_text_that_disowns_the_stream_fails_loudly():
    s = TextStream()
    s.feed("abc", min_end=0)
    with pytest.raises(StreamMismatchError, match="already streamed 'abc'"):
        s.finish("abd")
