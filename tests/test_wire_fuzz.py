"""Hypothesis over the three wire formats (``/infer/``, ``/v1/chat/completions``, Pattern C ``/chat``): whatever JSON
a client sends, checking it against its body model, parsing the model and checking the call against the server's
limits either gives a call or raises a typed
``EngineError`` (a 4xx naming the field), never another exception (a 500). JSON here is what ``json.loads`` can
give: nested objects and arrays of strings (lone surrogates included), integers of any size, floats, booleans, null.
The real servers get the named hostile cases in ``conformance/test_hostile.py``.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import GenerationOptions, ServeConfig, StopPolicy
from engine.config.serve import PatternCConfig
from engine.errors import EngineError
from engine.plugins import create_plugins
from engine.serve.openai.bodies import ChatCompletionRequest
from engine.serve.openai.chat import parse_chat
from engine.serve.pattern_c.bodies import PatternCRequest
from engine.serve.pattern_c.chat import parse_pattern_c
from engine.serve.rollout.bodies import InferRequest
from engine.serve.rollout.infer import parse_infer
from engine.serve.shared import bodies
from engine.serve.shared.limits import check_call
from engine.types import ChatRequest

CASES = 300
KEYS = st.sampled_from(["infer_requests", "request_config", "engine", "messages", "role", "content", "model",
                        "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "plugins", "name", "options",
                        "strings", "token_ids", "logprobs", "top_logprobs", "stream", "min_len", "max_len", "n",
                        "repetition_penalty", "min_new_tokens", "return_details", "x"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(10**40), 10**40),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
                    st.sampled_from(["user", "assistant", "system", "wizard", "cleanup", "min_length", "\ud800", ""]))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(KEYS, inner, max_size=5)), max_leaves=25)
MESSAGES = st.lists(st.dictionaries(KEYS, JSON, max_size=3), max_size=3)
SERVE = ServeConfig(max_stop_strings=3, max_stop_string_chars=4, max_prompts_per_call=2)


def check(call, conversations) -> None:
    """The server's limits, then every check the engine makes before it tokenizes (options, stop policy,
    plugins, messages), as ``GenerationEngine.prepare`` makes them."""
    stop = getattr(call, "stop", None)
    check_call(SERVE, prompts=len(conversations), options=call.options, stop=stop, max_model_len=64)
    GenerationOptions().merged(call.options or None)
    StopPolicy().merged(stop)
    if call.plugins is not None:
        create_plugins(call.plugins)
    for i, messages in enumerate(conversations):
        ChatRequest.of(messages, index=i)


@settings(max_examples=CASES, deadline=None)
@given(st.one_of(JSON, st.fixed_dictionaries({"infer_requests": st.lists(st.fixed_dictionaries(
    {"messages": MESSAGES}), max_size=3)}, optional={"request_config": JSON, "engine": JSON})))
def test_infer_bodies_are_a_call_or_a_typed_refusal(body):
    try:
        call = parse_infer(bodies.check(InferRequest, body))
        check(call, call.requests)
    except EngineError as err:
        assert err.args and str(err)


@settings(max_examples=CASES, deadline=None)
@given(st.one_of(JSON, st.fixed_dictionaries({"model": st.just("m"), "messages": MESSAGES},
                                            optional={"max_tokens": JSON, "stop": JSON, "engine": JSON,
                                                      "temperature": JSON, "stream": JSON})))
def test_chat_completion_bodies_are_a_call_or_a_typed_refusal(body):
    try:
        call = parse_chat(bodies.check(ChatCompletionRequest, body))
        check(call, [call.messages])
    except EngineError as err:
        assert err.args and str(err)


@settings(max_examples=CASES, deadline=None)
@given(st.one_of(JSON, st.fixed_dictionaries({"messages": MESSAGES}, optional={"min_len": JSON, "max_len": JSON,
                                                                               "stream": JSON, "model": JSON})))
def test_pattern_c_bodies_are_a_call_or_a_typed_refusal(body):
    try:
        call = parse_pattern_c(bodies.check(PatternCRequest, body), PatternCConfig())
        check(call, [call.messages])
    except EngineError as err:
        assert err.args and str(err)
