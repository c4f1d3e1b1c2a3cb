"""``/v1/completions`` as pure functions: prompt forms, what is accepted or refused and under which field, and the
legacy logprobs object an echoed, scored prompt gives (what lm-eval's ``local-completions`` model reads). The route
runs for real through the openai client and the lm-eval CLI in conformance/test_vllm_serve_dropin.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.backends.base import TokenScores
from engine.errors import EngineError, RequestError
from engine.serve.openai import text
from engine.serve.openai.bodies import CompletionRequest
from engine.serve.openai.text import DEFAULT_MAX_TOKENS, choice_logprobs, completion_body
from engine.serve.shared.bodies import check
from engine.serve.shared.fields import FieldTable
from engine.types import GenerationResult

TABLE = FieldTable.of(CompletionRequest, requests="prompt")  # as the route builds it


class Tok:
    """Characters are tokens (ids are code points); ``add_special_tokens`` puts id 1 first."""

    def __len__(self) -> int:
        return 300

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [1] * add_special_tokens + [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


TOK = Tok()


class Engine:
    """What the text route's parser asks of the engine: its tokenizer, and the size check before tokenizing."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def check_chars(self, field, chars, fix=""):
        if chars > 1000:
            raise RequestError(field, f"{chars} characters", "cannot fit", fix=fix)


def parse_text_completion(raw, tokenizer):
    """What the call path does with a text body: check it against its model, then parse the model."""
    return text.parse_text_completion(check(CompletionRequest, raw), Engine(tokenizer), max_prompts=64)


def parse(**fields):
    return parse_text_completion({"model": "m", **fields}, TOK)


def test_every_prompt_form_is_token_ids_and_echo_text():
    assert parse(prompt="ab").prompts == [[1, 97, 98]]
    assert parse(prompt="ab", add_special_tokens=False).prompts == [[97, 98]]
    assert parse(prompt=["a", "b"]).texts == ["a", "b"]
    assert parse(prompt=[104, 105]).prompts == [[104, 105]] and parse(prompt=[104, 105]).texts == ["hi"]
    assert parse(prompt=[[104], [105, 33]]).texts == ["h", "i!"]


def test_fields_reach_the_engine_as_on_the_chat_route():
    call = parse(prompt="x", max_tokens=5, temperature=0.5, top_k=-1, min_tokens=2, stop=["\n"], stop_token_ids=[7],
                 seed=3, logprobs=2, echo=True, repetition_penalty=1.1)
    assert call.options == {"max_new_tokens": 5, "temperature": 0.5, "top_k": 0, "min_new_tokens": 2, "seed": 3,
                            "logprobs": 2, "repetition_penalty": 1.1}
    assert call.stop == {"strings": ["\n"], "token_ids": [7]} and call.echo and call.scores_prompt
    assert parse(prompt="x").options == {"max_new_tokens": DEFAULT_MAX_TOKENS}  # OpenAI's and vLLM's default
    assert parse(prompt="x", engine={"options": {"max_new_tokens": 3}}).options == {"max_new_tokens": 3}
    scoring_only = parse(prompt="x", max_tokens=0, echo=True, logprobs=1)
    assert not scoring_only.generates and scoring_only.scores_prompt
    assert not parse(prompt="x", logprobs=1).scores_prompt  # logprobs without echo: the answer's only


@pytest.mark.parametrize(("fields", "field"), [
    ({}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": 5}, "prompt"), ({"prompt": [[1], "a", 3]}, "prompt[1]"),
    ({"prompt": [[1, 300]]}, "prompt[0][1]"), ({"prompt": [1, True]}, "prompt[1]"),
    ({"prompt": "a", "n": 0}, "n"), ({"prompt": "a", "n": 2, "stream": True}, "n"),
    ({"prompt": "a", "best_of": 2}, "best_of"), ({"prompt": "a", "suffix": "z"}, "suffix"),
    ({"prompt": "a", "logprobs": True}, "logprobs"), ({"prompt": "a", "echo": "yes"}, "echo"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"), ({"prompt": "a", "messages": []}, "messages"),
    ({"prompt": "a", "top_logprobs": 2}, "top_logprobs"), ({"prompt": "a", "min_p": [0.2]}, "min_p"),
    ({"prompt": "a", "add_special_tokens": 1}, "add_special_tokens"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_fields_are_named(fields, field):
    with pytest.raises(RequestError) as err:
        parse(**fields)
    assert err.value.field == field


def test_engine_errors_name_the_clients_field():
    assert TABLE.client_field("generation.logprobs") == "logprobs"
    assert TABLE.client_field("generation.max_new_tokens") == "max_tokens"
    assert TABLE.client_field("prompts[1][0]") == "prompt[1][0]"
    assert TABLE.client_field("stop.token_ids[0]") == "stop_token_ids[0]"


def test_an_echoed_scored_prompt_gives_lm_evals_numbers():
    """lm-eval sums ``token_logprobs[ctxlen:-1]`` and calls it greedy when each equals ``max(top_logprobs)``: the
    prompt's first token has no logprob, the last entry is the generated token."""
    call = parse(prompt=[104, 105, 33], echo=True, logprobs=1, max_tokens=1)
    scores = TokenScores(logprobs=(-0.5, -2.0), greedy=(True, False), top=({105: -0.5}, {34: -1.0, 33: -2.0}))
    answer = GenerationResult(text="?", raw_text="?", token_ids=(63,), prompt_token_ids=(104, 105, 33),
                              finish_reason="length", stop_reason=None, logprobs=({63: -0.1},))
    body = completion_body(call, [answer], [scores], model="m", tokenizer=TOK)
    (choice,) = body["choices"]
    assert choice["text"] == "hi!?" and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["h", "i", "!", "?"] and lp["text_offset"] == [0, 1, 2, 3]
    assert lp["token_logprobs"] == [None, -0.5, -2.0, -0.1]
    assert lp["top_logprobs"] == [None, {"i": -0.5}, {'"': -1.0, "!": -2.0}, {"?": -0.1}]
    ctxlen = 1
    assert sum(lp["token_logprobs"][ctxlen:-1]) == -2.5
    greedy = [t == max(top.values()) for t, top in zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1],
                                                       strict=True)]
    assert greedy == [True, False]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def test_scoring_only_and_streamed_halves():
    call = parse(prompt="hi", add_special_tokens=False, echo=True, logprobs=0, max_tokens=0)
    scores = TokenScores(logprobs=(-0.25,), greedy=(True,), top=({105: -0.25},))
    body = completion_body(call, [None], [scores], model="m", tokenizer=TOK)
    assert body["choices"][0]["text"] == "hi" and body["usage"]["completion_tokens"] == 0
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.25]
    answer = GenerationResult(text="!", raw_text="!", token_ids=(33,), prompt_token_ids=(104, 105),
                              finish_reason="length", stop_reason=None, logprobs=({33: -0.5},))
    first = choice_logprobs(call, 0, None, scores, TOK, answer=False)
    last = choice_logprobs(call, 0, answer, None, TOK, prompt=False)
    assert first["tokens"] + last["tokens"] == ["h", "i", "!"]
    assert last["text_offset"] == [2]  # after the echoed text
    assert choice_logprobs(parse(prompt="hi"), 0, answer, None, TOK) is None


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from([*CompletionRequest.model_fields, "bogus"]),
                       st.one_of(st.none(), st.booleans(), st.integers(-3, 400), st.text(max_size=3),
                                 st.lists(st.integers(0, 400), max_size=3)), max_size=6))
def test_fuzzed_bodies_parse_or_are_refused_by_field(fields):
    try:
        call = parse_text_completion(fields, TOK)
    except EngineError as err:
        assert isinstance(err, RequestError) and err.field
        return
    assert call.prompts and len(call.texts) == len(call.prompts) and call.options["max_new_tokens"] >= 0


def test_n_gives_each_prompt_n_choices_in_vllms_order():
    call = parse(prompt=["ab", "c"], n=2, echo=True)
    assert call.prompt_count == 4 and call.rows == [[1, 97, 98], [1, 97, 98], [1, 99], [1, 99]]
    answers = [GenerationResult(text=t, raw_text=t, token_ids=(ord(t),), prompt_token_ids=(), finish_reason="length",
                                stop_reason=None) for t in "wxyz"]
    body = completion_body(call, answers, [None, None], model="m", tokenizer=TOK)
    assert [c["text"] for c in body["choices"]] == ["abw", "abx", "cy", "cz"]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


def test_prompts_past_the_limits_are_refused_before_any_is_tokenized():
    """A prompt list over the call's limit, or a text that cannot fit the context, is refused by name before the
    tokenizer sees anything (the tokenizer below counts its calls)."""
    calls = []

    class Counting(Tok):
        def encode(self, text, add_special_tokens):
            calls.append(text)
            return super().encode(text, add_special_tokens)

    with pytest.raises(RequestError, match=r"more than serve\.max_prompts_per_call"):
        parse_text_completion({"model": "m", "prompt": ["hi"] * 65}, Counting())
    with pytest.raises(RequestError, match=r"prompt\[1\]"):
        parse_text_completion({"model": "m", "prompt": ["hi", "x" * 1001]}, Counting())
    assert calls == []


def test_rl_clients_get_the_ids_sampled_and_tokens_named_by_id():
    """TRL's body (token-id prompts, ``n``, ``logprobs: 0``, ``return_token_ids``, ``return_tokens_as_token_ids``):
    each choice carries its prompt's ids and its own, prompt-major; logprobs name tokens ``token_id:<id>``."""
    call = parse(prompt=[[104, 105], [33]], n=2, logprobs=0, return_token_ids=True, return_tokens_as_token_ids=True)
    answers = [GenerationResult(text=t, raw_text=t, token_ids=(ord(t), 46), prompt_token_ids=(), finish_reason="stop",
                                stop_reason=46, logprobs=({ord(t): -0.5, 50: -1.0}, {46: -0.1})) for t in "wxyz"]
    body = completion_body(call, answers, [None, None], model="m", tokenizer=TOK)
    choices = body["choices"]
    assert [c["prompt_token_ids"] for c in choices] == [[104, 105], [104, 105], [33], [33]]
    assert [c["token_ids"] for c in choices] == [[ord(t), 46] for t in "wxyz"]
    assert choices[0]["logprobs"]["tokens"] == ["token_id:119", "token_id:46"]
    assert choices[0]["logprobs"]["top_logprobs"][0] == {"token_id:119": -0.5, "token_id:50": -1.0}
    plain = completion_body(parse(prompt=[[104]], logprobs=0), answers[:1], [None], model="m", tokenizer=TOK)
    assert "token_ids" not in plain["choices"][0] and plain["choices"][0]["logprobs"]["tokens"] == ["w", "."]
    echoed = completion_body(parse(prompt=[[104]], echo=True, return_token_ids=True), answers[:1], [None], model="m",
                             tokenizer=TOK)
    assert echoed["choices"][0]["text"] == "w"  # vLLM leaves the echoed prompt's text out when ids are asked for


@pytest.mark.parametrize(("structured", "schema"), [
    ({"json": {"type": "integer"}}, {"type": "integer"}),
    ({"json": '{"type": "integer"}'}, {"type": "integer"}),
    ({"json_object": True}, {"type": "object"}),
])
def test_structured_outputs_json_is_the_engines_schema(structured, schema):
    assert parse(prompt="x", structured_outputs=structured).json_schema == schema


@pytest.mark.parametrize(("fields", "field"), [
    ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "integer"}, "json_object": True}}, "structured_outputs.json_object"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json": {}}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {}, "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
])
def test_structured_outputs_other_kinds_are_refused_by_name(fields, field):
    with pytest.raises(RequestError) as err:
        parse(prompt="x", **fields)
    assert err.value.field == field, str(err.value)
