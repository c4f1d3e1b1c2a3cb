"""Bad input fails before any generation, with typed errors naming the field, on every backend."""

from __future__ import annotations

import pytest

from conformance.subjects.plan import TINY, engines, uses
from engine.errors import ConfigError, RequestError

pytestmark = pytest.mark.model_tier(TINY)  # the errors come before any generation: the model is only a payload
SUBJECTS = uses(engines(TINY))

GOOD = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def counted(engine, count_backend_calls):
    return engine, count_backend_calls(engine)


@pytest.mark.parametrize(
    ("requests", "field"),
    [
        ([GOOD, []], "requests[1].messages"),
        ([GOOD, [{"role": "wizard", "content": "x"}]], "requests[1].messages[0].role"),
        ([[{"role": "user"}]], "requests[0].messages[0].content"),
        ([[{"role": "user", "content": 3}]], "requests[0].messages[0].content"),
        (["just a string"], "requests[0].messages"),
    ],
)
def test_bad_requests_raise_before_generation(counted, requests, field):
    engine, calls = counted
    with pytest.raises(RequestError) as info:
        engine.generate(requests)
    assert info.value.field == field
    assert calls == [], "nothing may be generated for a batch with a bad request"


@pytest.mark.parametrize(
    ("options", "stop", "field"),
    [
        ({"max_new_tokens": 0}, None, "generation.max_new_tokens"),
        ({"temperature": -1.0}, None, "generation.temperature"),
        ({"top_p": 0.5}, None, "generation.top_p"),  # conflicts with greedy
        ({"max_new_tokens": 4, "min_new_tokens": 9}, None, "generation.min_new_tokens"),
        ({"logprobs": 99}, None, "generation.logprobs"),
        ({"max_tokens": 4}, None, "generation.max_tokens"),
        (None, {"strings": [""]}, "stop.strings[0]"),
        (None, {"token_ids": [-3]}, "stop.token_ids[0]"),
    ],
)
def test_bad_options_raise_before_generation(counted, options, stop, field):
    engine, calls = counted
    with pytest.raises(ConfigError) as info:
        engine.generate([GOOD], options=options, stop=stop)
    assert info.value.field == field
    assert calls == []


def test_derive_changes_only_request_sections_and_refuses_a_guard_that_cannot_run(engine, monkeypatch):
    """``GenerationEngine.derive`` (how the suite gets guard variants without a second model): load-level sections
    and unknown keys are refused by name; a guard the shared backend cannot run is refused before generating."""
    import dataclasses

    from engine.errors import UnsupportedCapabilityError

    with pytest.raises(ConfigError, match=r"^vllm belongs to the loaded backend.*Fix: build a new GenerationEngine"):
        engine.derive(vllm={"max_num_seqs": 2})
    with pytest.raises(ConfigError, match=r"^repeat_terminat is not a known key"):
        engine.derive(repeat_terminat={"enabled": True})
    with pytest.raises(ConfigError, match=r"^generation\.max_new_tokens"):
        engine.derive(generation={"max_new_tokens": 0})
    short = engine.derive(generation={"max_new_tokens": 3})
    assert short.backend is engine.backend and len(short.generate([GOOD])[0].token_ids) <= 3
    short.close()  # a derived engine leaves the shared backend open
    assert engine.generate([GOOD], options={"max_new_tokens": 2})[0].token_ids
    caps = dataclasses.replace(engine.backend.capabilities, rules_problem="no logits-processor interface")
    monkeypatch.setattr(engine.backend, "capabilities", caps)
    with pytest.raises(UnsupportedCapabilityError, match="cannot be activated: no logits-processor interface"):
        engine.derive(repeat_terminate={"enabled": True, "max_consecutive_token_repeats": 4})
