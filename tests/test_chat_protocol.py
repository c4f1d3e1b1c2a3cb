"""The chat wire formats (``/v1/chat/completions`` and Pattern C ``/chat``) as pure functions: what is accepted,
what is refused and under which field name, and the shapes of answers and stream chunks. The servers are tested
with the official openai client in conformance/test_chat.py."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config.serve import PatternCConfig
from engine.errors import ConfigError, RequestError
from engine.serve.openai.bodies import ChatCompletionRequest
from engine.serve.openai.chat import chunk, completion_body, parse_chat
from engine.serve.pattern_c import chat as pattern_c
from engine.serve.pattern_c.bodies import PatternCRequest
from engine.serve.pattern_c.chat import pattern_c_body
from engine.serve.shared.bodies import check
from engine.serve.shared.fields import FieldTable
from engine.types import GenerationResult

MSGS = [{"role": "user", "content": "Hi"}]
wire_error = FieldTable.of(ChatCompletionRequest).rename
pattern_c_wire_error = FieldTable.of(PatternCRequest).rename


def parse_completion(raw):
    """What the call path does with a chat body: check it against its model, then parse the model."""
    return parse_chat(check(ChatCompletionRequest, raw))


def parse_pattern_c(raw, defaults):
    return pattern_c.parse_pattern_c(check(PatternCRequest, raw), defaults)


def body(**fields):
    return {"model": "m", "messages": MSGS, **fields}


def result(**meta) -> GenerationResult:
    return GenerationResult(text="Hello.", raw_text="Hello.<eos>", token_ids=(5, 6, 2), prompt_token_ids=(1, 2, 3, 4),
                            finish_reason="stop", stop_reason=2, meta=meta)


def test_fields_map_to_engine_options_and_stop():
    call = parse_completion(body(max_completion_tokens=12, temperature=0.5, top_p=0.9, seed=3, stop=["a", "b"],
                                 logprobs=True, top_logprobs=3, stream=True, stream_options={"include_usage": True},
                                 user="u1", frequency_penalty=0, n=1, engine={"options": {"top_k": 5}}))
    assert call.options == {"max_new_tokens": 12, "temperature": 0.5, "top_p": 0.9, "seed": 3, "logprobs": 3,
                            "top_k": 5}
    assert call.stop == {"strings": ["a", "b"]} and call.stream and call.include_usage
    assert parse_completion(body(max_tokens=7, max_completion_tokens=7)).options == {"max_new_tokens": 7}


@pytest.mark.parametrize(("fields", "field"), [
    ({"n": 0}, "n"), ({"n": True}, "n"), ({"n": 2, "stream": True}, "n"), ({"best_of": 1}, "best_of"),
    ({"presence_penalty": 0.1}, "presence_penalty"),
    ({"logit_bias": {"1": 5}}, "logit_bias"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "xml"}}, "response_format.type"), ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
     "response_format.json_schema.x"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"), ({"min_p": "0.1"}, "min_p"),
    ({"engine": {"stop": {"token_ids": [3]}}, "stop_token_ids": [4]}, "engine.stop"), ({"model": None}, "model"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"), ({"stream": 1}, "stream"), ({"stream_options": {}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"foo": 1}}, "stream_options.foo"), ({"stop": [1]}, "stop[0]"),
    ({"engine": {"bogus": 1}}, "engine.bogus"),
    ({"engine": {"options": {"seed": 1}}, "seed": 2}, "engine.options.seed"),
    ({"engine": {"stop": {"strings": ["x"]}}, "stop": "y"}, "engine.stop"), ({"messages": []}, "messages"),
    ({"messages": "Hi"}, "messages"), ({"user": 5}, "user"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0]"),
])
def test_bad_fields_are_named(fields, field):
    with pytest.raises(RequestError) as err:
        parse_completion(body(**fields))
    assert err.value.field == field
    assert "Fix:" in str(err.value)


def test_vllm_sampling_extras_and_response_format_reach_the_engine():
    call = parse_completion(body(top_k=-1, repetition_penalty=1.2, min_tokens=3, stop_token_ids=[7, 9], stop="x",
                                 seed=5, min_p=0.05))
    assert call.options == {"top_k": 0, "repetition_penalty": 1.2, "min_new_tokens": 3, "seed": 5, "min_p": 0.05}
    assert call.stop == {"strings": ["x"], "token_ids": [7, 9]} and call.json_schema is None
    assert parse_completion(body(top_k=40)).options == {"top_k": 40}
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    assert parse_completion(body(response_format=rf)).json_schema == schema
    assert parse_completion(body(response_format={"type": "json_object"})).json_schema == {"type": "object"}
    assert parse_completion(body(response_format={"type": "text"})).json_schema is None


def test_engine_errors_are_renamed_to_the_wire_field():
    assert wire_error(ConfigError("generation.top_k", -3, "bad")).field == "top_k"
    assert wire_error(ConfigError("generation.min_new_tokens", -1, "bad")).field == "min_tokens"
    assert wire_error(ConfigError("stop.token_ids[1]", 10**9, "bad")).field == "stop_token_ids[1]"
    assert wire_error(RequestError("json_schema", "[1]", "bad")).field == "response_format.json_schema.schema"
    renamed = wire_error(ConfigError("generation.max_new_tokens", 0, "must be in [1, inf)"))
    assert renamed.field == "max_tokens" and isinstance(renamed, ConfigError)
    assert wire_error(RequestError("requests[0].messages[2].role", "x", "bad")).field == "messages[2].role"
    assert wire_error(ConfigError("plugins[1].name", "x", "bad")).field == "engine.plugins[1].name"
    assert pattern_c_wire_error(RequestError("requests[0].messages", [], "bad")).field == "messages"


def test_completion_and_chunks_have_openai_shapes():
    call = parse_completion(body(stream=True, stream_options={"include_usage": True}))
    full = completion_body([result()], call, model="m", tokenizer=None)
    assert full["object"] == "chat.completion" and full["choices"][0]["message"] == {"role": "assistant",
                                                                                      "content": "Hello."}
    assert full["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    delta = chunk("id1", 1, "m", call, delta={"content": "He"})
    assert delta["object"] == "chat.completion.chunk" and delta["usage"] is None
    assert delta["choices"][0] == {"index": 0, "delta": {"content": "He"}, "logprobs": None, "finish_reason": None}
    last = chunk("id1", 1, "m", call, result=result(), tokenizer=None)
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["delta"] == {}
    tail = chunk("id1", 1, "m", call, result=result(), usage_only=True)
    assert tail["choices"] == [] and tail["usage"]["total_tokens"] == 7
    assert "usage" not in chunk("id1", 1, "m", parse_completion(body(stream=True)), delta={"content": "x"})


def test_pattern_c_fills_defaults_and_builds_the_two_plugins():
    defaults = PatternCConfig(min_len=10, max_len=50, punctuation_bias=0.5, temperature=0.7, top_p=0.9)
    call = parse_pattern_c({"messages": MSGS, "max_len": 70, "model": "m", "stream": True}, defaults)
    assert (call.min_len, call.max_len, call.stream) == (10, 70, True)
    assert call.plugins == [
        {"name": "min_length", "min_chars": 10, "max_chars": 70, "punctuation_bias": 0.5},
        {"name": "cleanup", "trim_whitespace": True, "close_brackets": True, "sentence_end": True}]
    assert call.options == {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 512}
    meta = {"generated_chars": 9, "returned_chars": 6, "eos_suppressed": True, "min_length_capped": False}
    answer = pattern_c_body(result(**meta), call, model="m")
    assert answer["text"] == "Hello." and answer["meta"]["returned_chars"] == len(answer["text"])
    assert answer["meta"]["strategy"] == "logits_processor" and answer["meta"]["usage"]["total_tokens"] == 7


@pytest.mark.parametrize(("fields", "field"), [
    ({"min_len": 300, "max_len": 200}, "min_len"), ({"min_len": -1}, "min_len"), ({"max_len": 0}, "max_len"),
    ({"min_len": 1.5}, "min_len"), ({"max_len": True}, "max_len"), ({"stream": "yes"}, "stream"),
    ({"model": 3}, "model"), ({"temperature": 0.2}, "temperature"), ({"messages": []}, "messages"),
])
def test_pattern_c_bad_fields_are_named(fields, field):
    with pytest.raises(RequestError) as err:
        parse_pattern_c({"messages": MSGS, **fields}, PatternCConfig())
    assert err.value.field == field


def test_pattern_c_config_and_environment():
    from engine.serve.launch import served_config

    with pytest.raises(ConfigError, match=r"serve\.chat\.top_p"):
        PatternCConfig(temperature=0)  # greedy with top_p 0.95 would fail every request
    with pytest.raises(ConfigError, match=r"serve\.chat\.max_len"):
        PatternCConfig(min_len=100, max_len=50)
    args = argparse.Namespace(config=None, backend="hf", model="/m", dtype=None, logprobs_mode=None, host=None,
                              port=None, namespace=None, repeat_terminate_from=None)
    config, _ = served_config(args, environ={"MIN_LEN": "60", "MAX_LEN": "150"})
    assert (config.serve.chat.min_len, config.serve.chat.max_len) == (60, 150)
    with pytest.raises(ConfigError, match="MAX_LEN"):
        served_config(args, environ={"MAX_LEN": "lots"})
    with pytest.raises(ConfigError, match=r"serve\.chat\.max_len"):
        served_config(args, environ={"MIN_LEN": "500"})  # above the default max_len: refused at startup


# -- fuzzing: a body is parsed, or refused with a RequestError naming a field it has; nothing else escapes ------

JSON_JUNK = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=False), st.text(max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)
COMPLETION_KEYS = st.sampled_from([*ChatCompletionRequest.model_fields, "messages", "engine", "bogus"])
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                 "content": st.one_of(st.text(max_size=4), JSON_JUNK)})


def _named(err: RequestError, body: dict) -> bool:
    root = err.field.split(".")[0].split("[")[0]
    return root in body or root in ("body", "model", "messages")


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(COMPLETION_KEYS, st.one_of(JSON_JUNK, st.lists(MESSAGE, max_size=2)), max_size=5))
def test_fuzzed_completion_bodies_parse_or_are_refused_by_field(fields):
    body = {"model": "m", "messages": MSGS, **fields}
    try:
        parse_completion(body)
    except RequestError as err:
        assert _named(err, body), (err.field, body)
        assert str(err).startswith(err.field) and "Fix:" in str(err)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["model", "messages", "min_len", "max_len", "stream", "extra"]),
                       st.one_of(JSON_JUNK, st.lists(MESSAGE, max_size=2)), max_size=4))
def test_fuzzed_pattern_c_bodies_parse_or_are_refused_by_field(fields):
    body = {"messages": MSGS, **fields}
    try:
        call = parse_pattern_c(body, PatternCConfig())
    except RequestError as err:
        assert _named(err, body), (err.field, body)
        assert str(err).startswith(err.field) and "Fix:" in str(err)
    else:
        assert 0 <= call.min_len <= call.max_len


def test_pattern_c_names_the_field_the_client_sent_when_the_default_min_len_exceeds_max_len():
    """Found by the fuzzer: ``max_len: 1`` alone met the server's default ``min_len`` (120), and the refusal named
    ``min_len``, a field the client never sent."""
    with pytest.raises(RequestError) as err:
        parse_pattern_c({"messages": MSGS, "max_len": 1}, PatternCConfig())
    assert err.value.field == "max_len" and "the server's default" in str(err.value)
    with pytest.raises(RequestError) as sent:
        parse_pattern_c({"messages": MSGS, "min_len": 50, "max_len": 10}, PatternCConfig())
    assert sent.value.field == "min_len"


def test_n_asks_for_a_group_of_choices_counted_once_for_the_prompt():
    """``n`` choices of one prompt (a GRPO group): the call generates the prompt ``n`` times, the limits count
    ``n`` rows, and the answer has ``n`` choices whose usage counts the prompt once."""
    call = parse_completion(body(n=3, seed=5))
    assert call.n == 3 and call.prompt_count == 3 and call.options == {"seed": 5}
    full = completion_body([result(), result(), result()], call, model="m", tokenizer=None)
    assert [c["index"] for c in full["choices"]] == [0, 1, 2]
    assert full["usage"] == {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}


def test_return_token_ids_gives_the_prompts_and_each_choices_ids_streamed_too():
    """vLLM's ``return_token_ids`` on the chat route: the response's ``prompt_token_ids`` (the rendered conversation)
    and each choice's ``token_ids``; streamed, the first chunk carries the prompt's ids, the closing one all the
    answer's (as it carries its logprobs), the deltas none."""
    call = parse_completion(body(n=2, return_token_ids=True))
    full = completion_body([result(), result()], call, model="m", tokenizer=None)
    assert full["prompt_token_ids"] == list(result().prompt_token_ids)
    assert [c["token_ids"] for c in full["choices"]] == [list(result().token_ids)] * 2
    assert "prompt_token_ids" not in completion_body([result()], parse_completion(body()), model="m", tokenizer=None)
    streamed = parse_completion(body(stream=True, return_token_ids=True))
    first = chunk("id1", 1, "m", streamed, delta={"role": "assistant", "content": ""}, prompt_ids=[1, 2])
    assert first["prompt_token_ids"] == [1, 2] and first["choices"][0]["token_ids"] == []
    delta = chunk("id1", 1, "m", streamed, delta={"content": "He"})
    assert "prompt_token_ids" not in delta and delta["choices"][0]["token_ids"] == []
    last = chunk("id1", 1, "m", streamed, result=result(), tokenizer=None)
    assert last["choices"][0]["token_ids"] == list(result().token_ids)
