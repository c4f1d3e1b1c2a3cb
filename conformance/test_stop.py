"""Stop policy: native early stop + the engine's deterministic truncation give the same ``text`` everywhere."""

from __future__ import annotations

import pytest

from engine.rules.stop import truncate_at_stop
from fixtures import load_prompts

CHAT = [p["messages"] for p in load_prompts("chat")]


@pytest.fixture(scope="session")
def plain(engine):
    """Unstopped greedy results, to derive stops that really occur in the output."""
    return engine.generate(CHAT, options={"max_new_tokens": 40})


def test_stop_string_truncates_text_and_reports_it(engine, plain):
    stops = [" is", "."]
    results = engine.generate(CHAT, options={"max_new_tokens": 40}, stop={"strings": stops})
    matched = 0
    for free, r in zip(plain, results, strict=True):
        expected_text, expected_stop = truncate_at_stop(free.text, stops)
        if expected_stop is None:
            assert r.text == free.text and r.stop_reason == free.stop_reason
            continue
        matched += 1
        assert (r.text, r.finish_reason, r.stop_reason) == (expected_text, "stop", expected_stop)
        assert expected_stop in r.raw_text, "raw_text keeps what was generated, stop string included"
        assert len(r.token_ids) < len(free.token_ids), "the native stop ended generation early"
        assert r.token_ids == free.token_ids[: len(r.token_ids)]
    assert matched >= 4, f"only {matched} outputs contained a stop string; the check would prove little"


def test_include_stop_str_keeps_it(engine):
    stop = {"strings": [" is"], "include_stop_str": True}
    r = engine.generate(CHAT[:1], options={"max_new_tokens": 40}, stop=stop)[0]
    assert r.text.endswith(" is") and r.stop_reason == " is"


def test_stop_token_id_ends_row(engine, plain):
    free = plain[0]
    stop_id = free.token_ids[3]
    r = engine.generate(CHAT[:1], options={"max_new_tokens": 40}, stop={"token_ids": [stop_id]})[0]
    assert r.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert r.finish_reason == "stop" and r.stop_reason == stop_id
    tok = engine.tokenizer
    assert r.text == tok.decode(list(r.token_ids[:-1]), skip_special_tokens=True), "stop id text excluded"
    assert r.raw_text == tok.decode(list(r.token_ids), skip_special_tokens=False)


def test_never_matched_stops_leave_text_alone(engine, plain):
    results = engine.generate(CHAT, options={"max_new_tokens": 40}, stop={"strings": ["@@never@@"]})
    assert [r.text for r in results] == [r.text for r in plain]
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]


def test_stop_text_identical_across_backends(engines):
    stop = {"strings": [" is", ",", "\n"]}
    texts = {b: [(r.text, r.stop_reason, r.finish_reason) for r in e.generate(CHAT, options={"max_new_tokens": 40},
                                                                              stop=stop)]
             for b, e in engines.items()}
    first, second = texts.values()
    assert first == second
