"""Stop policy: native early stop + the engine's deterministic truncation give the same ``text`` everywhere."""

from __future__ import annotations

import pytest

from conformance.compare import assert_same_results, close_at_divergence, first_divergence
from conformance.subjects.plan import engines, servers, uses
from engine_fixtures import load_prompts

SUBJECTS = uses(engines("text"), servers("text"))

pytestmark = [pytest.mark.servable, pytest.mark.dtype_dependent]

CHAT = [p["messages"] for p in load_prompts("chat")]


def reference_cut(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The text before the stop string that completes first (plain ``str.find``; the earlier start wins a tie),
    and that stop. Written here, independent of ``engine.rules.stop``."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    _, start, stop = min(found)
    return text[:start], stop


@pytest.fixture(scope="session")
def plain(pool, backend):
    """Unstopped greedy results, to derive stops that really occur in the output (in-process: a reference)."""
    return pool.reference(backend, pool.options.model).generate(CHAT, options={"max_new_tokens": 40})


def test_stop_string_truncates_text_and_reports_it(engine, plain):
    stops = [" is", "."]
    results = engine.generate(CHAT, options={"max_new_tokens": 40}, stop={"strings": stops})
    matched = 0
    for free, r in zip(plain, results, strict=True):
        expected_text, expected_stop = reference_cut(free.text, stops)
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
    """Every row that meets " is" ends right after its first one, the stop string kept in ``text``; a row that
    never meets it ends otherwise and holds no " is" in its text. (Which rows meet it is the model's doing, and in
    lower precision the kernels' too: each row is held to the rule on its own text.)"""
    stop = {"strings": [" is"], "include_stop_str": True}
    results = engine.generate(CHAT, options={"max_new_tokens": 40}, stop=stop)
    for i, r in enumerate(results):
        if r.stop_reason != " is":  # ended by EOS (its id) or the budget (None)
            assert " is" not in r.text, f"row {i}: {r.text!r} holds the stop string but was not stopped"
            continue
        assert (r.finish_reason, r.stop_reason) == ("stop", " is"), f"row {i}"
        assert r.text.endswith(" is") and r.text.count(" is") == 1, f"row {i}: {r.text!r}"
    assert any(r.stop_reason == " is" for r in results), "no row met the stop string; the check proves nothing"


def test_stop_token_id_ends_row(engine, plain, pool):
    """Against the unstopped rows: each row holding the stop id ends on its first occurrence, the others are
    untouched. In lower precision a row that stops changes its batch-mates' shapes, and so their rounding: a row may
    part from its unstopped twin at a near-tie (vLLM's rule), and is then held to the rule on its own tokens."""
    stop_id = plain[0].token_ids[3]
    results = engine.generate(CHAT, options={"max_new_tokens": 40}, stop={"token_ids": [stop_id]})
    tok = engine.tokenizer
    for i, (free, r) in enumerate(zip(plain, results, strict=True)):
        step = first_divergence(free.token_ids, r.token_ids)
        if pool.options.dtype != "float32" and step is not None and step < min(len(free.token_ids),
                                                                              len(r.token_ids)):
            close_at_divergence(free, r, what=f"row {i}", name_0="unstopped", name_1="stopped")
            ends = stop_id in r.token_ids
            assert not ends or r.token_ids.index(stop_id) == len(r.token_ids) - 1, f"row {i} went on past its stop id"
            assert (r.stop_reason == stop_id) == ends, f"row {i}: stop reason {r.stop_reason}"
            continue
        if stop_id not in free.token_ids:
            assert (r.token_ids, r.text, r.stop_reason) == (free.token_ids, free.text, free.stop_reason), f"row {i}"
            continue
        assert r.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1], f"row {i}"
        assert r.finish_reason == "stop" and r.stop_reason == stop_id
        assert r.text == tok.decode(list(r.token_ids[:-1]), skip_special_tokens=True), "stop id text excluded"
        assert r.raw_text == tok.decode(list(r.token_ids), skip_special_tokens=False)


def test_never_matched_stops_leave_text_alone(engine, plain):
    results = engine.generate(CHAT, options={"max_new_tokens": 40}, stop={"strings": ["@@never@@"]})
    assert [r.text for r in results] == [r.text for r in plain]
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]


@pytest.mark.quick  # with its served twin: every backend's server through /infer/ (conformance.kit.tiers)
def test_stop_text_identical_across_backends(engines, pool):
    stop = {"strings": [" is", ",", "\n"]}
    got = {b: e.generate(CHAT, options={"max_new_tokens": 40}, stop=stop) for b, e in engines.items()}
    assert any(r.stop_reason in stop["strings"] for rows in got.values() for r in rows), "no row met a stop string"
    assert_same_results(got, what="stop strings", dtype=pool.options.dtype)


def reference_end_after(ids, stops, decode, head_chars):
    """(tokens kept, text, stop) for the first stop occurrence that ends after ``head_chars`` characters,
    found by decoding growing prefixes; None when no stop completes after the head."""
    for j in range(1, len(ids) + 1):
        text = decode(ids[:j])
        found = [(i + len(s), i, s) for s in stops if (i := text.find(s, max(0, head_chars - len(s) + 1))) >= 0]
        if found:
            _, start, stop = min(found)
            return ids[:j], text[:start], stop
    return None


def test_stop_strings_inside_min_new_tokens_do_not_count(engines, pool, workload):
    """While ``min_new_tokens`` holds EOS back, stop strings are not matched either (vLLM's ``min_tokens``
    rule, adopted by the engine): a stop string complete within the first N tokens is kept in ``text``, and the
    row ends at the first stop string that completes after them."""
    n, stops = 10, [".", ","]
    opts = {"max_new_tokens": 40, "min_new_tokens": n}
    prompts = workload.pick(full=CHAT, quick=CHAT[:3])
    got = {}
    inside = after = 0
    for b, e in engines.items():
        decode = lambda ids: e.tokenizer.decode(list(ids), skip_special_tokens=True)  # noqa: B023, E731
        held = e.generate(prompts, options=opts)
        rows = e.generate(prompts, options=opts, stop={"strings": stops})
        for i, (h, r) in enumerate(zip(held, rows, strict=True)):
            head = decode(h.token_ids[:n])
            inside += any(s in head for s in stops)
            want = reference_end_after(h.token_ids, stops, decode, len(head))
            if want is None:
                assert (r.token_ids, r.text) == (h.token_ids, h.text), f"{b} row {i}"
                continue
            after += 1
            ids, text, stop = want
            assert r.token_ids == ids, f"{b} row {i}: stopped at {len(r.token_ids)} tokens, want {len(ids)}"
            assert (r.text, r.finish_reason, r.stop_reason) == (text, "stop", stop), f"{b} row {i}"
            assert len(r.token_ids) > n
        got[b] = rows
    assert inside and after, f"stops inside the first {n} tokens: {inside} rows, after them: {after}; proves little"
    assert_same_results(got, what="stop strings inside min_new_tokens", dtype=pool.options.dtype)


def test_a_stop_string_that_is_a_special_tokens_text_ends_the_row_at_that_token(engine, plain):
    """``stop: ["<|im_end|>"]`` (what every ChatML client sends, and ``vllm serve`` answers): the string becomes
    that token's stop id, on every backend alike, recorded in the result; with ``ignore_eos`` (EOS alone no longer
    ends a row) the row still ends at that token, exactly where the free row ended."""
    tok = engine.tokenizer
    eos_text, eos_id = tok.eos_token, tok.eos_token_id
    ignoring = engine.generate(CHAT, options={"max_new_tokens": 40, "ignore_eos": True},
                               stop={"strings": [eos_text, "@@never@@"]})
    running = engine.generate(CHAT, options={"max_new_tokens": 40, "ignore_eos": True})
    ended = 0
    for i, (free, g, run) in enumerate(zip(plain, ignoring, running, strict=True)):
        assert (g.token_ids, g.text, g.finish_reason) == (free.token_ids, free.text, free.finish_reason), \
            f"row {i}: ignore_eos with the EOS text as a stop string"
        assert g.meta["stop_strings_as_token_ids"] == {eos_text: eos_id}, g.meta
        assert len(run.token_ids) == 40 and run.finish_reason == "length", f"row {i}: ignore_eos ended early"
        assert list(run.token_ids[: len(free.token_ids) - 1]) == list(free.token_ids[:-1]), f"row {i}"
        ended += free.token_ids[-1] == eos_id
    assert ended, "no free row ended at EOS: the check proves nothing"
