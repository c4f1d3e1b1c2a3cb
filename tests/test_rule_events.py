"""Rule events past a row's returned ids do not count (vLLM's async scheduling, the CUDA default, may decode a
finished row one more step, and after a stop string the engine core keeps feeding the rules until the abort lands).

Events are fed here as a backend would hand them over, some past the end; the engine's result must show none of
them: no trigger flag, no index, no rule end, no plugin meta."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.backends.base import BackendOutput, CallPlan
from engine.config import GenerationOptions, StopPolicy
from engine.plugins import create_plugin
from engine.results import ResultBuilder
from engine.rules.events import events_within
from engine.rules.json_boundary import JsonBoundaryRule
from engine.rules.min_length import MinLengthRule
from engine.rules.repeat import RepeatRule, RepeatThresholds
from engine.templates import RenderedPrompt

EOS = 2
WORDS = {5: "a", 6: "b", 7: " {", 8: "}", 9: ".", EOS: ""}


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(WORDS[i] for i in ids if not (skip_special_tokens and i == EOS))


def builder() -> ResultBuilder:
    """What the engine builds results with: the tokenizer and the load facts."""
    return ResultBuilder(Tokenizer(), SimpleNamespace(pad_token_fallback=None))


def result(events, ids=(5, 6, 5, 6, EOS), plugins=()):
    plan = CallPlan(GenerationOptions(max_new_tokens=8), StopPolicy(), (EOS,))
    out = BackendOutput(token_ids=tuple(ids), events=events)
    return builder().result(RenderedPrompt("p", (1,), None), out, plan, "vllm", list(plugins))


def test_a_trigger_that_forced_the_last_token_counts():
    got = result({"repeat_terminate": ("ngram_repeats", 4)})
    assert (got.meta["repeat_terminate_triggered"], got.meta["repeat_terminate_index"]) == (1, 4)
    assert (got.finish_reason, got.stop_reason) == ("stop", "repeat_terminate")


@pytest.mark.parametrize("past", [5, 6, 40])
def test_a_trigger_past_the_returned_ids_is_dropped(past):
    got = result({"repeat_terminate": ("ngram_repeats", past)})
    assert got.meta["repeat_terminate_triggered"] == 0
    assert got.meta["repeat_terminate_index"] is None and got.meta["repeat_terminate_reason"] is None
    assert got.stop_reason != "repeat_terminate"


def test_a_boundary_or_cap_past_the_end_is_no_rule_end_and_no_plugin_meta():
    late = {"json_boundary_closed": True, "json_boundary_closed_at": 5, "min_length_capped": True,
            "min_length_capped_at": 7, "min_length_eos_suppressed": True, "min_length_eos_suppressed_at": 6}
    plugin = create_plugin({"name": "min_length", "min_chars": 1}, index=0)
    got = result(late, plugins=[plugin])
    assert got.stop_reason not in ("json_boundary", "min_length")
    assert got.meta["eos_suppressed"] is False and got.meta["min_length_capped"] is False
    early = {**late, "min_length_eos_suppressed_at": 1, "json_boundary_closed_at": 4}
    got = result(early, plugins=[plugin])
    assert got.stop_reason == "json_boundary" and got.meta["eos_suppressed"] is True


def test_rules_report_the_position_their_decision_shaped():
    """Each rule's position is the tokens it had seen: the index of the token its decision shaped."""
    repeat = RepeatRule(RepeatThresholds(max_consecutive_token_repeats=3))
    for t in (5, 6, 6, 6):
        repeat.push(t)
    assert repeat.events()["repeat_terminate"][1] == 4
    boundary = JsonBoundaryRule()
    for t in (7, 8):
        boundary.push(t, WORDS[t])
    assert boundary.events()["json_boundary_closed_at"] == 2
    capped = MinLengthRule(min_chars=1, max_chars=2, punctuation_bias=0.0, sentence_end_ids=())
    for t in (5, 6, 5):
        capped.push(t, WORDS[t])
        capped.decision()
    capped.note_eos_suppressed()
    assert capped.events()["min_length_capped_at"] == 2
    held = MinLengthRule(min_chars=5, max_chars=None, punctuation_bias=0.0, sentence_end_ids=())
    held.push(5, "a")
    held.note_eos_suppressed()
    held.push(6, "b")
    held.note_eos_suppressed()
    assert held.events()["min_length_eos_suppressed_at"] == 1


def test_events_within_is_a_pure_filter():
    events = {"repeat_terminate": ("consecutive_token_repeats", 3), "min_length_capped": True,
              "min_length_capped_at": 3}
    assert events_within(events, generated=4) == events
    assert events_within(events, generated=3) == {"min_length_capped": False, "min_length_capped_at": None}
    assert events == {"repeat_terminate": ("consecutive_token_repeats", 3), "min_length_capped": True,
                      "min_length_capped_at": 3}, "the backend's events are left as they were"


def test_a_stopping_criterion_ending_on_the_last_token_counts():
    """HF's stopping-criteria mechanism stops on the closing token itself (no EOS after it): the adapters shift
    its position to that token, so the rule end is kept."""
    from engine.rules.events import stopped_on_seen_token

    seen_all = {"json_boundary_closed": True, "json_boundary_closed_at": 4}
    got = result(stopped_on_seen_token(seen_all), ids=(7, 5, 6, 8))
    assert (got.finish_reason, got.stop_reason) == ("stop", "json_boundary")
    assert result(seen_all, ids=(7, 5, 6, 8)).stop_reason != "json_boundary"  # unshifted it would not count
