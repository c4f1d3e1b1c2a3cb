"""Bad input fails before any generation, with typed errors naming the field, on every backend."""

from __future__ import annotations

import pytest

from engine.errors import ConfigError, RequestError

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
