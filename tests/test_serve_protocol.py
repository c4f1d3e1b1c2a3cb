"""The ``/infer/`` wire format: what is accepted, what is refused (naming the field), and that an enveloped item
reads back into the very ``GenerationResult`` it was made from."""

from __future__ import annotations

import json

import pytest

from engine.errors import ConfigError, RequestError
from engine.serve.rollout import infer as protocol
from engine.serve.rollout.bodies import InferRequest
from engine.serve.shared.bodies import check
from engine.serve.shared.fields import FieldTable
from engine.types import GenerationResult

FIELDS = FieldTable.of(InferRequest, requests="infer_requests")  # as the route builds it


def parse_infer(raw):
    """What the call path does with an ``/infer/`` body: check it against its model, then parse the model."""
    return protocol.parse_infer(check(InferRequest, raw))

MSG = [{"role": "user", "content": "Hi"}]
# Every field of swift 4.6's RequestConfig at its default (what VLLMInferClient sends via asdict).
SWIFT_DEFAULTS = {"max_tokens": None, "temperature": None, "top_k": None, "top_p": None, "min_p": None,
                  "repetition_penalty": None, "num_beams": 1, "stop": [], "seed": None, "stream": False,
                  "logprobs": False, "top_logprobs": None, "prompt_logprobs": None, "n": 1, "best_of": None,
                  "presence_penalty": 0.0, "frequency_penalty": 0.0, "length_penalty": 1.0, "return_details": False,
                  "structured_outputs_regex": None}
SWIFT_ITEM = {"messages": MSG, "images": [], "audios": [], "videos": [], "tools": None, "objects": {},
              "chat_template_kwargs": {}, "data_dict": {"row": 3}, "uuid": None, "add_eos": None}


class Tok:
    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def test_swift_default_body_is_accepted_as_is():
    call = parse_infer({"infer_requests": [SWIFT_ITEM], "request_config": SWIFT_DEFAULTS, "metrics": None,
                                 "use_tqdm": None, "adapter_request": None})
    assert call.requests == [MSG] and call.options == {} and call.stop is None and not call.return_details


def test_request_config_maps_onto_engine_options():
    call = parse_infer({"infer_requests": [SWIFT_ITEM], "request_config": {
        **SWIFT_DEFAULTS, "max_tokens": 9, "temperature": 0.7, "top_k": -1, "top_p": 0.9, "seed": 4,
        "stop": ["\n\n"], "logprobs": True, "top_logprobs": 3, "return_details": True, "min_p": 0.05}})
    assert call.options == {"max_new_tokens": 9, "temperature": 0.7, "top_p": 0.9, "seed": 4, "top_k": 0,
                            "logprobs": 3, "min_p": 0.05}
    assert call.stop == {"strings": ["\n\n"]} and call.return_details and call.top_logprobs == 3


@pytest.mark.parametrize(("change", "field"), [
    ({"n": 2}, "request_config.n"), ({"best_of": 3}, "request_config.best_of"),
    ({"presence_penalty": 0.5}, "request_config.presence_penalty"), ({"min_p": "0.1"}, "request_config.min_p"),
    ({"structured_outputs_regex": "a+"}, "request_config.structured_outputs_regex"),
    ({"stream": True}, "request_config.stream"), ({"n": True}, "request_config.n"),
    ({"top_logprobs": 2}, "request_config.top_logprobs"), ({"stop": [1]}, "request_config.stop[0]"),
    ({"maxtokens": 3}, "request_config.maxtokens"),
])
def test_unsupported_or_unknown_request_config_is_refused(change, field):
    with pytest.raises(RequestError) as info:
        parse_infer({"infer_requests": [SWIFT_ITEM], "request_config": {**SWIFT_DEFAULTS, **change}})
    assert info.value.field == field


def test_extension_conflicts_and_item_fields_are_refused():
    with pytest.raises(RequestError, match="also set through request_config"):
        parse_infer({"infer_requests": [], "request_config": {"max_tokens": 3},
                              "engine": {"options": {"max_new_tokens": 4}}})
    with pytest.raises(RequestError, match=r"infer_requests\[0\]\.tools"):
        parse_infer({"infer_requests": [{**SWIFT_ITEM, "tools": [{"type": "function"}]}]})
    with pytest.raises(RequestError, match="did you mean 'messages'"):
        parse_infer({"infer_requests": [{"message": MSG}]})


def test_engine_errors_name_the_wire_field():
    err = FIELDS.rename(ConfigError("generation.top_p", 2.0, "must be in (0, 1]"))
    assert err.field == "request_config.top_p"
    err = FIELDS.rename(ConfigError("generation.min_new_tokens", -1, "x"))
    assert err.field == "engine.options.min_new_tokens"
    assert FIELDS.rename(RequestError("requests[2].messages", [], "x")).field == "infer_requests[2].messages"


def test_an_enveloped_item_reads_back_into_the_same_result():
    result = GenerationResult(text="ab", raw_text="ab<end>", token_ids=(0, 1, 2), prompt_token_ids=(5, 6),
                              finish_reason="stop", stop_reason="repeat_terminate",
                              logprobs=({0: -0.1, 3: -2.5}, {1: -0.25, 5: float("-inf")}, {2: -1.0, 4: -1.5}),
                              meta={"backend": "hf", "repeat_terminate_triggered": 1, "repeat_terminate_index": 2,
                                    "repeat_terminate_reason": "ngram", "plugins": [], "fallback": None})
    call = protocol.InferCall(requests=[MSG], return_details=True, logprobs=True, top_logprobs=1)
    item = json.loads(json.dumps(protocol.rollout_item(result, call, model="m", tokenizer=Tok(), namespace="ns")))
    assert protocol.result_from_item(item, "ns") == result
    assert item["ns"]["repeat_terminate_triggered"] == 1
    content = item["response"]["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.1, -0.25, -1.0]
    assert [len(c["top_logprobs"]) for c in content] == [1, 1, 1]
    json.dumps(item, allow_nan=False)  # strict JSON: -inf travels as a string in the envelope, -9999 in content
    assert item["response"]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    bare = protocol.rollout_item(result, call, model="m", tokenizer=Tok(), namespace=None)
    assert set(bare) == set(item["response"])
    with pytest.raises(RequestError, match="no envelope"):
        protocol.result_from_item(bare, "ns")
