"""The served engine beside stock ``vllm serve`` (issue 47): vLLM's own OpenAI server started on the same model and
vLLM settings as the suite's vLLM server (``conformance/subjects/stock.py``), both sent the same requests through the
official ``openai`` client. Where both answer, the answers are equal (text, token strings and logprobs, finish
reasons, usage); where both refuse, both answer a 4xx; every difference that remains is asserted as documented
(``docs/serving.md``, "Beside stock vllm serve").
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from conformance.subjects.plan import processes, servers, uses
from conformance.test_chat import FRANCE, PROMPTS

SUBJECTS = uses(servers("text"), processes("stock vllm serve", why="the other side of the side-by-side comparison"))

pytestmark = pytest.mark.slow
SHORT = [{"role": "user", "content": "Say hello in one short sentence."}]
CHAT = {  # what both servers must answer alike (greedy: one answer exists)
    "plain": {"messages": FRANCE, "max_tokens": 16, "temperature": 0},
    "stop special token text": {"messages": SHORT, "max_tokens": 40, "temperature": 0, "stop": ["<|im_end|>"]},
    "stop string kept": {"messages": FRANCE, "max_tokens": 24, "temperature": 0, "stop": [" of"],
                         "extra_body": {"include_stop_str_in_output": True}},
    "ignore_eos": {"messages": SHORT, "max_tokens": 40, "temperature": 0, "extra_body": {"ignore_eos": True}},
    "thinking on": {"messages": FRANCE, "max_tokens": 12, "temperature": 0,
                    "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}},
    "top logprobs": {"messages": PROMPTS[1], "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3},
    "vLLM extras": {"messages": PROMPTS[2], "max_tokens": 16, "temperature": 0,
                    "extra_body": {"top_k": -1, "min_tokens": 6, "repetition_penalty": 1.2,
                                   "skip_special_tokens": True, "spaces_between_special_tokens": True,
                                   "vllm_xargs": {}}},
}
TEXT = {
    "text prompt": {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "logprobs": 2},
    "token-id prompt": {"prompt": [504, 3575, 282, 4649, 314], "max_tokens": 8, "temperature": 0},
    "echo scoring": {"prompt": "The capital of France is Paris.", "max_tokens": 0, "echo": True, "logprobs": 1},
    "ignore_eos": {"prompt": "Hello", "max_tokens": 20, "temperature": 0, "extra_body": {"ignore_eos": True}},
}
SCORED_ONLY = {"echo scoring"}
"""``max_tokens: 0`` with ``echo``: the same prompt logprobs and text; vLLM reports ``completion_tokens: 1`` (it
generates one token and drops it), the served engine 0 (docs/serving.md's table)."""
REFUSED = {  # both answer a 4xx
    "temperature -1": ("chat", {"messages": FRANCE, "temperature": -1}),
    "top_p 0": ("chat", {"messages": FRANCE, "top_p": 0}),
    "top_logprobs 50": ("chat", {"messages": FRANCE, "logprobs": True, "top_logprobs": 50}),
    "n 0": ("chat", {"messages": FRANCE, "n": 0}),
    "max_tokens past the context": ("chat", {"messages": FRANCE, "max_tokens": 10**9}),
    "unknown model": ("chat", {"messages": FRANCE, "model": "no-such-model"}),
    "text prompt token id past the vocabulary": ("text", {"prompt": [10**9], "max_tokens": 2}),
}
DIFFERENT = {  # (request, vllm serve's status, ours): each is a row of docs/serving.md's table
    "logit_bias": ("chat", {"messages": FRANCE, "max_tokens": 4, "extra_body": {"logit_bias": {"42": 5}}}, 200, 400),
    "frequency_penalty": ("chat", {"messages": FRANCE, "max_tokens": 4, "frequency_penalty": 0.5}, 200, 400),
    "an unknown field": ("chat", {"messages": FRANCE, "max_tokens": 4, "extra_body": {"bogus_field": 1}}, 200, 400),
    "the model's path as its name": ("chat", {"messages": FRANCE, "max_tokens": 4, "model": "PATH"}, 404, 200),
    "n=2 greedy": ("chat", {"messages": FRANCE, "max_tokens": 4, "temperature": 0, "n": 2}, 400, 200),
}


@pytest.fixture(scope="module")
def stock(pool, backend_names):
    """(stock vllm serve's openai client, the suite's vLLM server's), on one model and vLLM's settings."""
    import openai

    from conformance.subjects.stock import start_vllm_serve

    if "vllm" not in backend_names:
        pytest.skip(f"stock vllm serve runs beside this session's vLLM server; backends here: {backend_names}")
    ours = pool.text_server("vllm")
    _, config = pool.servers.served_config("vllm", pool.options.model)
    name = openai.OpenAI(base_url=f"{ours.url}/v1", api_key="none").models.list().data[0].id
    theirs = start_vllm_serve(config, name, env={"VLLM_SERVER_DEV_MODE": "1"})  # /server_info, /get_world_size
    try:
        yield (openai.OpenAI(base_url=f"{theirs.url}/v1", api_key="none", max_retries=0, timeout=300),
               openai.OpenAI(base_url=f"{ours.url}/v1", api_key="none", max_retries=0, timeout=300), name,
               config["model"]["path"])
    finally:
        theirs.stop()


def ask(client: Any, kind: str, request: dict[str, Any], model: str, path: str) -> tuple[int, Any]:
    """(HTTP status, the answer or the error body) of one request."""
    import openai

    kwargs = {"model": model, **request}
    if kwargs["model"] == "PATH":
        kwargs["model"] = path
    try:
        create = client.chat.completions.create if kind == "chat" else client.completions.create
        return 200, create(**kwargs)
    except openai.APIStatusError as err:
        return err.status_code, err.body


def same_logprobs(a: Any, b: Any, what: str) -> None:
    """Equal token strings, logprobs within 1e-4 (one engine, one model: the numbers are vLLM's on both sides)."""
    if a is None or b is None:
        assert a is None and b is None, f"{what}: logprobs on one side only"
        return
    if hasattr(a, "content"):  # chat
        assert [t.token for t in a.content] == [t.token for t in b.content], what
        pairs = [(x.logprob, y.logprob) for x, y in zip(a.content, b.content, strict=True)]
        pairs += [(p.logprob, q.logprob) for x, y in zip(a.content, b.content, strict=True)
                  for p, q in zip(x.top_logprobs, y.top_logprobs, strict=True)]
    else:  # legacy text completions
        assert a.tokens == b.tokens and a.text_offset == b.text_offset, what
        pairs = list(zip(a.token_logprobs, b.token_logprobs, strict=True))
    for x, y in pairs:
        assert (x is None and y is None) or math.isclose(x, y, abs_tol=1e-4), f"{what}: logprob {x} vs {y}"


def test_both_servers_answer_alike_where_both_answer(stock, summary_note):
    """Every request of :data:`CHAT` and :data:`TEXT` answered by both, equal choice by choice."""
    theirs, ours, model, path = stock
    for kind, cases in (("chat", CHAT), ("text", TEXT)):
        for case, request in cases.items():
            (s1, a), (s2, b) = ask(theirs, kind, request, model, path), ask(ours, kind, request, model, path)
            assert s1 == s2 == 200, f"{case}: vllm serve {s1} {'' if s1 == 200 else a}, ours {s2} " \
                                    f"{'' if s2 == 200 else b}"
            assert len(a.choices) == len(b.choices), case
            for x, y in zip(a.choices, b.choices, strict=True):
                text_a = x.message.content if kind == "chat" else x.text
                text_b = y.message.content if kind == "chat" else y.text
                assert text_a == text_b, f"{case}: {text_a!r} vs {text_b!r}"
                assert x.finish_reason == y.finish_reason, f"{case}: {x.finish_reason} vs {y.finish_reason}"
                same_logprobs(x.logprobs, y.logprobs, case)
            usage_a, usage_b = a.usage, b.usage
            assert usage_a.prompt_tokens == usage_b.prompt_tokens, case
            if case in SCORED_ONLY:  # documented: vLLM counts the one token it generates and drops, we count none
                assert (usage_a.completion_tokens, usage_b.completion_tokens) == (1, 0), case
                continue
            assert usage_a.completion_tokens == usage_b.completion_tokens, case
    summary_note(f"vllm serve beside ours: {len(CHAT) + len(TEXT)} requests answered alike")


def test_both_servers_refuse_alike_where_both_refuse(stock):
    """Every request of :data:`REFUSED` is a 4xx on both servers."""
    theirs, ours, model, path = stock
    for case, (kind, request) in REFUSED.items():
        request = {"max_tokens": 4, **request}
        (s1, _), (s2, body) = ask(theirs, kind, request, model, path), ask(ours, kind, request, model, path)
        assert 400 <= s1 < 500 and 400 <= s2 < 500, f"{case}: vllm serve {s1}, ours {s2}"
        assert (body.get("error") or body)["message"], case  # the openai client hands over the error object


def test_the_documented_differences_hold(stock):
    """Each row of :data:`DIFFERENT` (docs/serving.md's table): vLLM's status and ours, as documented."""
    theirs, ours, model, path = stock
    for case, (kind, request, want_theirs, want_ours) in DIFFERENT.items():
        (s1, _), (s2, _) = ask(theirs, kind, request, model, path), ask(ours, kind, request, model, path)
        assert (s1, s2) == (want_theirs, want_ours), f"{case}: vllm serve {s1}, ours {s2}"


# -- RL clients of vLLM's API (issue 61): token ids in, token ids out -----------------------------------------------

IDS = ([504, 3575, 282, 4649, 314], [19556, 314, 253, 1345])
"""Two token-id prompts, as TRL's ``VLLMClient.generate`` sends its batch (``prompt: [[...], [...]]``)."""
RL_TEXT = {"prompt": [list(p) for p in IDS], "max_tokens": 8, "logprobs": 0, "return_token_ids": True,
           "return_tokens_as_token_ids": True}
"""TRL 1.16's completions body (``trl/generation/vllm_client.py``), less its sampling settings."""


def raw(client: Any) -> str:
    """The server's root URL from its ``openai`` client."""
    return str(client.base_url).rstrip("/").removesuffix("/v1")


def post(client: Any, path: str, body: dict[str, Any], model: str) -> dict[str, Any]:
    import httpx

    answer = httpx.post(f"{raw(client)}{path}", json={"model": model, **body}, timeout=300)
    assert answer.status_code == 200, f"{path} {body}: {answer.status_code} {answer.text[:400]}"
    return answer.json()


def as_ids(logprobs: dict[str, Any], token_ids: list[int], what: str) -> None:
    """``return_tokens_as_token_ids``: every logprob token (and alternative) is named ``token_id:<id>``, the chosen
    ones are exactly the returned ids."""
    tokens = logprobs["tokens"] if "tokens" in logprobs else [e["token"] for e in logprobs["content"]]
    assert tokens == [f"token_id:{t}" for t in token_ids], f"{what}: {tokens} vs ids {token_ids}"


def test_rl_clients_token_ids_answer_alike(stock):
    """TRL's requests on both servers: token-id prompts in, each choice's ``token_ids`` and ``prompt_token_ids`` out
    (choices prompt-major with ``n``), logprobs named ``token_id:<id>``; greedy ids equal across the two servers,
    logprobs within 1e-4; chat's ``prompt_token_ids`` equal (one template); a stream's ids equal the answer's."""
    theirs, ours, model, _ = stock
    greedy = {**RL_TEXT, "temperature": 0}
    a, b = post(theirs, "/v1/completions", greedy, model), post(ours, "/v1/completions", greedy, model)
    for k, (x, y) in enumerate(zip(a["choices"], b["choices"], strict=True)):
        assert x["prompt_token_ids"] == y["prompt_token_ids"] == list(IDS[k]), k
        assert x["token_ids"] == y["token_ids"], f"prompt {k}: {x['token_ids']} vs {y['token_ids']}"
        for side, choice in (("vllm serve", x), ("ours", y)):
            as_ids(choice["logprobs"], choice["token_ids"], f"{side} prompt {k}")
        for p, q in zip(x["logprobs"]["token_logprobs"], y["logprobs"]["token_logprobs"], strict=True):
            assert math.isclose(p, q, abs_tol=1e-4), f"prompt {k}: logprob {p} vs {q}"
    group = {**RL_TEXT, "n": 3, "temperature": 1.0, "seed": 11}
    for side, client in (("vllm serve", theirs), ("ours", ours)):
        choices = post(client, "/v1/completions", group, model)["choices"]
        assert len(choices) == 3 * len(IDS), side
        for k, choice in enumerate(choices):
            assert choice["prompt_token_ids"] == list(IDS[k // 3]), f"{side}: choice {k} is not prompt-major"
            assert 1 <= len(choice["token_ids"]) <= 8, side
            as_ids(choice["logprobs"], choice["token_ids"], f"{side} sampled choice {k}")
    chat = {"messages": FRANCE, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    a, b = post(theirs, "/v1/chat/completions", chat, model), post(ours, "/v1/chat/completions", chat, model)
    assert a["prompt_token_ids"] == b["prompt_token_ids"], "chat: the rendered prompts' ids differ"
    x, y = a["choices"][0], b["choices"][0]
    assert x["token_ids"] == y["token_ids"], f"chat: {x['token_ids']} vs {y['token_ids']}"
    as_ids(y["logprobs"], y["token_ids"], "ours chat")
    assert [[t["token"] for t in e["top_logprobs"]] for e in x["logprobs"]["content"]] == \
           [[t["token"] for t in e["top_logprobs"]] for e in y["logprobs"]["content"]], "chat: alternatives differ"
    one = {**greedy, "prompt": list(IDS[0]), "stream": True}
    for side, client in (("vllm serve", theirs), ("ours", ours)):
        chunks = streamed(client, "/v1/completions", one, model)
        ids = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
        prompts = [choice["prompt_token_ids"] for c in chunks for choice in c["choices"]
                   if choice.get("prompt_token_ids") is not None]
        assert ids == a_text_ids(theirs, model), f"{side}: streamed ids {ids}"
        assert prompts == [list(IDS[0])], f"{side}: prompt_token_ids in {len(prompts)} chunks"


def a_text_ids(client: Any, model: str) -> list[int]:
    """The greedy answer's ids of the first prompt (non-streamed), from ``client``."""
    body = {**RL_TEXT, "prompt": list(IDS[0]), "temperature": 0}
    return post(client, "/v1/completions", body, model)["choices"][0]["token_ids"]


def streamed(client: Any, path: str, body: dict[str, Any], model: str) -> list[dict[str, Any]]:
    """A stream's chunks, read as server-sent events."""
    import json

    import httpx

    chunks = []
    with httpx.stream("POST", f"{raw(client)}{path}", json={"model": model, **body}, timeout=300) as answer:
        assert answer.status_code == 200, f"{path}: {answer.status_code}"
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_rl_clients_read_server_info_and_world_size_alike(stock):
    """``GET /server_info?config_format=json`` (where TRL reads the logprobs mode and the weight-transfer config) and
    ``/get_world_size`` (both spellings on ours) answer in vLLM's shape with the same values."""
    import httpx

    theirs, ours, _, _ = stock
    infos = [httpx.get(f"{raw(c)}/server_info", params={"config_format": "json"}, timeout=60) for c in (theirs, ours)]
    assert [i.status_code for i in infos] == [200, 200], [i.text[:300] for i in infos]
    a, b = (i.json()["vllm_config"] for i in infos)
    assert a["model_config"]["logprobs_mode"] == b["model_config"]["logprobs_mode"]
    assert a["model_config"]["max_model_len"] == b["model_config"]["max_model_len"]
    assert "weight_transfer_config" in a and "weight_transfer_config" in b
    text = httpx.get(f"{raw(ours)}/server_info", timeout=60).json()["vllm_config"]
    assert isinstance(text, str) and "logprobs_mode" in text
    bad = httpx.get(f"{raw(ours)}/server_info", params={"config_format": "yaml"}, timeout=60)
    assert bad.status_code == 400 and "config_format" in bad.text
    sizes = [httpx.get(f"{raw(c)}{path}", timeout=60).json() for c, path in
             ((theirs, "/get_world_size"), (ours, "/get_world_size"), (ours, "/get_world_size/"))]
    assert sizes == [{"world_size": 1}] * 3, sizes


def test_structured_outputs_json_answer_alike_and_other_kinds_are_refused_by_name(stock):
    """vLLM's ``structured_outputs``: ``json`` builds the same value on both (ours compact: the engine's grammar
    writes no optional whitespace, stock's lets the model choose); ``regex`` and ``choice`` are refused by name here
    (stock vLLM constrains to them: docs/serving.md's table)."""
    import json

    theirs, ours, model, _ = stock
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
              "required": ["capital"], "additionalProperties": False}
    body = {"messages": FRANCE, "max_tokens": 30, "temperature": 0, "structured_outputs": {"json": schema}}
    a, b = post(theirs, "/v1/chat/completions", body, model), post(ours, "/v1/chat/completions", body, model)
    answer = b["choices"][0]["message"]["content"]
    assert set(json.loads(answer)) == {"capital"}, answer
    theirs_answer = a["choices"][0]["message"]["content"]  # stock's grammar lets the model pick whitespace
    assert json.loads(theirs_answer) == json.loads(answer), f"{theirs_answer!r} vs {answer!r}"
    import httpx

    for kind, value in (("regex", "[0-9]+"), ("choice", ["yes", "no"])):
        refused = httpx.post(f"{raw(ours)}/v1/chat/completions", timeout=60,
                             json={"model": model, "messages": FRANCE, "structured_outputs": {kind: value}})
        assert refused.status_code == 400 and f"structured_outputs.{kind}" in refused.text, refused.text[:300]
