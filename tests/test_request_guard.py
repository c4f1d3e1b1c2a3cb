"""A call's own repeat guard (``generate(..., repeat_terminate=...)``, the served ``engine.repeat_terminate``): the
engine's subtree with the call's fields laid over it, by the vLLM plugin's per-request rule, refused before any
generation where the backend cannot run it. Pure rules: a stand-in backend, no model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.config.repeat import RepeatTerminateConfig
from engine.errors import ConfigError, UnsupportedCapabilityError
from engine.planning import plan_guard
from engine.vllm_plugin.settings import GuardSettings

ON = RepeatTerminateConfig(enabled=True, max_consecutive_token_repeats=4, ngram_size=3, ngram_repeats=3)
OFF_WITH_THRESHOLDS = RepeatTerminateConfig(enabled=False, max_consecutive_token_repeats=9)
RUNS_RULES = SimpleNamespace(name="hf", capabilities=SimpleNamespace(rules_problem=None))
NO_RULES = SimpleNamespace(name="other", capabilities=SimpleNamespace(rules_problem="it has no logits hook"))


def test_no_guard_asked_keeps_the_engines_own():
    assert plan_guard(ON, None, NO_RULES) is ON  # the engine's own was checked when it started


@pytest.mark.parametrize(("asked", "want"), [
    ({"enabled": False}, RepeatTerminateConfig(**{**ON.as_dict(), "enabled": False})),
    ({"min_new_tokens": 12}, RepeatTerminateConfig(**{**ON.as_dict(), "min_new_tokens": 12})),
    ({"ngram_repeats": 5}, RepeatTerminateConfig(**{**ON.as_dict(), "ngram_repeats": 5})),
    (RepeatTerminateConfig(enabled=True, max_object_keys=2), RepeatTerminateConfig(enabled=True, max_object_keys=2)),
])
def test_the_calls_fields_are_laid_over_the_engines_guard(asked, want):
    assert plan_guard(ON, asked, RUNS_RULES) == want


def test_a_threshold_turns_an_off_guard_on_over_the_defaults_not_the_unused_thresholds():
    got = plan_guard(OFF_WITH_THRESHOLDS, {"ngram_size": 4, "ngram_repeats": 2}, RUNS_RULES)
    assert got.enabled and (got.ngram_size, got.ngram_repeats) == (4, 2)
    assert got.max_consecutive_token_repeats is None, "an off guard's own threshold leaked into the call's"
    assert not plan_guard(OFF_WITH_THRESHOLDS, {"min_new_tokens": 3}, RUNS_RULES).enabled


@pytest.mark.parametrize("server", [ON, OFF_WITH_THRESHOLDS, RepeatTerminateConfig()])
@pytest.mark.parametrize("asked", [{"enabled": False}, {"min_new_tokens": 5}, {"max_object_keys": 2},
                                   {"ngram_size": 2, "ngram_repeats": 4, "enabled": True}])
def test_the_engine_and_the_vllm_plugin_lay_a_requests_fields_alike(server, asked):
    """One rule for both per-request surfaces: the plugin's ``repeat_terminate.*`` keys and the engine's call."""
    plugin = GuardSettings.resolve({f"repeat_terminate.{k}": v for k, v in asked.items()}, server=server)
    engine = plan_guard(server, asked, RUNS_RULES)
    assert (plugin.repeat if plugin is not None else None) == (engine if engine.enabled else None)


def test_a_guard_the_backend_cannot_run_is_refused_before_generation():
    with pytest.raises(UnsupportedCapabilityError, match=r"repeat_terminate\.enabled"):
        plan_guard(RepeatTerminateConfig(), {"max_consecutive_token_repeats": 4}, NO_RULES)
    assert not plan_guard(ON, {"enabled": False}, NO_RULES).enabled  # turning it off needs no hook


@pytest.mark.parametrize(("asked", "field"), [
    ({"ngram_size": 1, "ngram_repeats": 2}, "repeat_terminate.ngram_size"),
    ({"ngram_size": 3}, "repeat_terminate.ngram_repeats"),
    ({"ngram_sise": 3}, "repeat_terminate.ngram_sise"),
    ([4], "repeat_terminate"),
])
def test_a_bad_guard_names_its_field(asked, field):
    with pytest.raises(ConfigError) as info:
        plan_guard(RepeatTerminateConfig(), asked, RUNS_RULES)
    assert info.value.field == field and "Fix:" in str(info.value)
