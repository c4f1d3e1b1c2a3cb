"""Whether a repeat rule runs in a bank is decided once, when the engine makes its spec (``RuleSpec.bank``): the
adapters read that decision and never build the rule to find out, and vLLM's processors build a request's rules at
admission (to refuse a bad spec there) and once per row, not again when the request joins a batch."""

from __future__ import annotations

import pytest

from engine.backends.vllm.rules import build_row, parse_request_args, request_args
from engine.rules.base import RuleSpec
from engine.rules.repeat import RepeatRule, RepeatThresholds
from engine.rules.repeat_bank import split_vectorizable

ID_ONLY = RepeatThresholds(max_consecutive_token_repeats=3)
TEXT = RepeatThresholds(max_object_keys=2)


@pytest.fixture
def no_building(monkeypatch):
    """Any rule built from a spec now fails the test."""
    def build(self):
        raise AssertionError(f"{self.target} was built")

    monkeypatch.setattr(RuleSpec, "build", build)


def test_the_engine_decides_the_bank_when_it_makes_the_spec():
    assert RepeatRule.spec(ID_ONLY).bank and not RepeatRule.spec(TEXT).bank
    assert RepeatRule.spec(ID_ONLY).as_dict()["bank"] is True


def test_adapters_split_by_the_decision_without_building(no_building):
    json_boundary = RuleSpec("engine.rules.json_boundary:JsonBoundaryRule")
    vector, rows = split_vectorizable([RepeatRule.spec(ID_ONLY), json_boundary])
    assert vector == [ID_ONLY] and rows == [json_boundary]


def test_vllm_reads_admitted_arguments_again_without_building(no_building):
    extra = request_args([RepeatRule.spec(ID_ONLY)], key="k", eos_id=2, terminal_ids=[2])
    args = parse_request_args(extra, check=False)
    assert args.specs[0].bank
    row = build_row(args, decode=None)
    assert row.repeat == [ID_ONLY] and row.rules.rules == []


@pytest.mark.parametrize(("spec", "says"), [
    (RuleSpec("engine.rules.repeat:RepeatRule", {"thresholds": {"max_object_keys": 2}}, bank=True), "read text"),
    (RuleSpec("engine.rules.json_boundary:JsonBoundaryRule", {}, bank=True), "only RepeatRule runs in a bank"),
    (RuleSpec("engine.rules.repeat:RepeatRule", {"thresholds": {"bogus": 1}}, bank=True),
     "cannot be built"),
])
def test_admission_refuses_a_bank_spec_that_is_not_an_id_only_repeat_rule(spec, says):
    with pytest.raises(ValueError, match=says):
        parse_request_args(request_args([spec], key="k", eos_id=2, terminal_ids=[2]))
