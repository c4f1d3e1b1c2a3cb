"""The served engine as a drop-in for ``vllm serve`` clients (issue 29), through the official ``openai`` client on every
backend's server: vLLM's sampling extras and ``response_format`` give the in-process engine's answers, a stream whose
end was held back still equals the whole answer, and ``/tokenize``, ``/detokenize``, ``/version`` answer as vLLM's
server does (``client.post`` on the routes the typed client has no method for).
"""

from __future__ import annotations

import json

import httpx
import pytest

from conformance.subjects.plan import engines, servers, uses
from conformance.test_chat import FRANCE, PROMPTS, model_id, streamed

SUBJECTS = uses(engines("text"), servers("text"))

pytestmark = pytest.mark.slow
CITY = {"type": "object", "required": ["city", "population"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}}}


def test_vllm_sampling_extras_give_the_engines_answers(client, pool, backend):
    """``top_k`` (-1: off), ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids`` and ``seed`` at the
    top level, as vLLM takes them, equal the engine's own options and stop token ids."""
    engine = pool.text_engine(backend)
    model = model_id(client)
    free = engine.generate([PROMPTS[3]], options={"max_new_tokens": 16, "temperature": 0})[0]
    at = next(i for i in range(3, len(free.token_ids)) if free.token_ids[i] not in free.token_ids[:i])
    stop_id = free.token_ids[at]  # a token the greedy answer first reaches at `at`: the row must end there
    cases = [
        ({"top_k": -1, "repetition_penalty": 1.3, "min_tokens": 12, "temperature": 0},
         {"top_k": 0, "repetition_penalty": 1.3, "min_new_tokens": 12, "temperature": 0}, None),
        ({"temperature": 0, "stop_token_ids": [stop_id]}, {"temperature": 0}, {"token_ids": [stop_id]}),
        ({"temperature": 0.9, "top_k": 5, "seed": 77, "min_p": 0.1},
         {"temperature": 0.9, "top_k": 5, "seed": 77, "min_p": 0.1}, None),
    ]
    for extra, options, stop in cases:
        local = engine.generate([PROMPTS[3]], options={"max_new_tokens": 16, **options}, stop=stop)[0]
        plain = client.chat.completions.create(model=model, messages=PROMPTS[3], max_tokens=16, extra_body=extra)
        assert plain.choices[0].message.content == local.text, extra
        assert plain.usage.completion_tokens == len(local.token_ids), extra
        assert plain.choices[0].finish_reason == local.finish_reason, extra
    assert local.token_ids != free.token_ids  # the sampled case is not the greedy answer
    stopped = engine.generate([PROMPTS[3]], options={"max_new_tokens": 16, "temperature": 0},
                              stop={"token_ids": [stop_id]})[0]
    assert stopped.token_ids in (free.token_ids[:at], free.token_ids[:at + 1]) and stopped.finish_reason == "stop"


def test_response_format_json_schema_constrains_like_the_engine(client, pool, backend):
    """``response_format`` with a ``json_schema`` is the engine's constrained decoding: the same answer as
    ``generate(json_schema=...)``, valid against the schema, streamed or not; llama.cpp refuses it by name."""
    import openai

    engine = pool.text_engine(backend).local  # the engine itself (json_schema is not a served-twin call)
    messages = [{"role": "user", "content": "Give a city and its population as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    kwargs = {"model": model_id(client), "messages": messages, "max_tokens": 40, "temperature": 0,
              "response_format": fmt}
    if not engine.backend.capabilities.structured_outputs:
        with pytest.raises(openai.BadRequestError, match="JSON Schema"):
            client.chat.completions.create(**kwargs)
        return
    local = engine.generate([messages], options={"max_new_tokens": 40, "temperature": 0}, json_schema=CITY)[0]
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    text, _ = streamed(client, **kwargs)
    assert plain == text == local.text
    answer = json.loads(plain)
    assert set(answer) == {"city", "population"} and isinstance(answer["population"], int)
    free = engine.generate([messages], options={"max_new_tokens": 40, "temperature": 0})[0]
    assert free.text != local.text, "the schema changed nothing: this prompt proves no constraint"
    obj = client.chat.completions.create(**{**kwargs, "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_a_stream_whose_end_was_held_back_equals_the_whole_answer(client, pool, backend):
    """A stop string that begins with the answer's last 12 characters and never completes: while they arrive they
    may be the start of the stop, so the stream holds them back and the closing chunk must carry all of them."""
    engine = pool.text_engine(backend)
    model = model_id(client)
    whole = engine.generate([FRANCE], options={"max_new_tokens": 20, "temperature": 0})[0].text
    tail = whole[-12:]
    assert len(engine.tokenizer.encode(tail, add_special_tokens=False)) >= 3, "the tail must span several tokens"
    stop = tail + "\u2403never"
    text, chunks = streamed(client, model=model, messages=FRANCE, max_tokens=20, temperature=0, stop=[stop])
    plain = client.chat.completions.create(model=model, messages=FRANCE, max_tokens=20, temperature=0, stop=[stop])
    assert text == plain.choices[0].message.content == whole
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert deltas[-1].endswith(tail), f"the held-back end came in pieces: {deltas[-4:]}"
    assert "".join(deltas[:-1]) + deltas[-1] == whole and len(deltas) >= 2


def test_tokenize_detokenize_and_version_answer_as_vllm_serve(client, pool, backend, chat_server):
    engine = pool.text_engine(backend)
    url = chat_server(backend).url
    model = model_id(client)

    def post(path: str, body: dict) -> httpx.Response:
        return client.post(f"{url}{path}", body=body, cast_to=httpx.Response)

    rendered, _ = engine.prepare([FRANCE])
    chat = post("/tokenize", {"model": model, "messages": FRANCE}).json()
    assert chat["tokens"] == list(rendered[0].token_ids) and chat["count"] == len(chat["tokens"])
    assert chat["max_model_len"] == engine.backend.capabilities.max_model_len and chat["token_strs"] is None
    text = post("/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert text["tokens"] == engine.tokenizer.encode("Hello world")
    assert text["token_strs"] == engine.tokenizer.convert_ids_to_tokens(text["tokens"])
    bare = post("/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()["tokens"]
    assert bare == engine.tokenizer.encode("Hello world", add_special_tokens=False)
    assert post("/detokenize", {"model": model, "tokens": chat["tokens"]}).json() == {
        "prompt": engine.tokenizer.decode(chat["tokens"])}
    version = client.get(f"{url}/version", cast_to=httpx.Response).json()
    assert version["backend"] == backend and version["version"] and version["backend_version"]
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        post("/detokenize", {"tokens": [0, len(engine.tokenizer) + 5]})
    assert err.value.body["param"] == "tokens[1]"
    with pytest.raises(openai.NotFoundError):
        post("/tokenize", {"model": "no-such-model", "prompt": "x"})


def test_a_stream_cut_inside_a_utf8_character_equals_the_whole_answer(client, pool, backend):
    """SmolLM2 writes Japanese a byte at a time: with ``max_tokens`` ending inside a character the answer ends with
    U+FFFD (what decoding those ids gives). A stream holds a trailing U+FFFD back (the next token may complete it), so
    the closing chunk must carry it, and the streamed text must still equal the whole answer."""
    engine = pool.text_engine(backend)
    model = model_id(client)
    messages = [{"role": "user", "content": "Write the Japanese word for cat."}]
    ids = engine.generate([messages], options={"max_new_tokens": 12, "temperature": 0})[0].token_ids
    cuts = [k for k in range(2, len(ids) + 1)
            if engine.tokenizer.decode(list(ids[:k]), skip_special_tokens=True).endswith("\ufffd")]
    assert cuts, f"{backend}: {engine.tokenizer.decode(list(ids))!r} splits no character: pick another prompt"
    k = cuts[0]
    whole = engine.generate([messages], options={"max_new_tokens": k, "temperature": 0})[0].text
    assert whole.endswith("\ufffd")
    text, chunks = streamed(client, model=model, messages=messages, max_tokens=k, temperature=0)
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=k, temperature=0)
    assert text == plain.choices[0].message.content == whole
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert deltas[-1].endswith("\ufffd") and "\ufffd" not in "".join(deltas[:-1])


TEXT_PROMPTS = ["The capital of France is", "Once upon a time, there was"]


def test_text_completions_equal_the_engines_complete(client, pool, backend):
    """``/v1/completions``: text and token-id prompts, several per request (a choice each), streamed or not, with a
    stop string and echo, all give ``GenerationEngine.complete``'s text (no chat template), token for token."""
    engine = pool.text_engine(backend).local
    model = model_id(client)
    local = engine.complete(TEXT_PROMPTS, options={"max_new_tokens": 12, "temperature": 0})
    plain = client.completions.create(model=model, prompt=TEXT_PROMPTS, max_tokens=12, temperature=0,
                                      extra_body={"add_special_tokens": False})
    assert [c.text for c in sorted(plain.choices, key=lambda c: c.index)] == [r.text for r in local]
    assert plain.usage.completion_tokens == sum(len(r.token_ids) for r in local)
    ids = [engine.tokenizer.encode(p, add_special_tokens=False) for p in TEXT_PROMPTS]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(by_ids.choices, key=lambda c: c.index)] == [r.text for r in local]
    assert [c.finish_reason for c in by_ids.choices] == [r.finish_reason for r in local]
    stop = local[1].text[4:9]
    stopped = engine.complete([ids[1]], options={"max_new_tokens": 12, "temperature": 0}, stop={"strings": [stop]})[0]
    chunks = list(client.completions.create(model=model, prompt=ids[1], max_tokens=12, temperature=0, stop=[stop],
                                            echo=True, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT_PROMPTS[1] + stopped.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop" == stopped.finish_reason
    assert chunks[-1].usage.completion_tokens == len(stopped.token_ids)
    default = client.completions.create(model=model, prompt=ids[0], temperature=0)
    assert default.usage.completion_tokens == 16 or default.choices[0].finish_reason == "stop"  # OpenAI's default


@pytest.mark.quick_on("hf", reason=(
    "the claim is the scores a scoring backend echoes: llama.cpp's variant only sees the refusal (it cannot score); "
    "HF's text server is up for the module's other checks"))
def test_echoed_prompt_logprobs_are_the_engines_scores(client, pool, backend):
    """``echo`` with ``logprobs`` (lm-eval's ``local-completions`` log-likelihood call): each prompt token's logprob
    equals ``GenerationEngine.score``'s, its alternatives hold the argmax, the first token has none, and the one
    generated token follows with its own; ``max_tokens: 0`` scores only. llama.cpp, which cannot score, refuses by
    name before generating."""
    import openai

    local = pool.text_engine(backend).local
    model = model_id(client)
    ids = local.tokenizer.encode(TEXT_PROMPTS[0], add_special_tokens=False)
    if not local.backend.capabilities.scoring:
        with pytest.raises(openai.BadRequestError, match="cannot score"):
            client.completions.create(model=model, prompt=ids, max_tokens=1, echo=True, logprobs=1)
        return
    (want,) = local.score([ids], [1], top=2)
    answer = local.complete([ids], options={"max_new_tokens": 1, "temperature": 0, "logprobs": 2})[0]
    got = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = got.choices[0].logprobs
    assert got.choices[0].text == TEXT_PROMPTS[0] + answer.text
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:-1] == pytest.approx(list(want.logprobs), abs=1e-5)
    assert lp.token_logprobs[-1] == pytest.approx(answer.logprobs[0][answer.token_ids[0]], abs=1e-5)
    for position, (chosen, top, greedy) in enumerate(zip(lp.token_logprobs[1:-1], lp.top_logprobs[1:-1], want.greedy,
                                                         strict=True)):
        assert 2 <= len(top) <= 3, position  # the two likeliest and the prompt's own token
        assert (chosen == max(top.values())) == greedy, position
    only = client.completions.create(model=model, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert only.choices[0].text == TEXT_PROMPTS[0] and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(list(want.logprobs), abs=1e-5)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=[ids, [len(local.tokenizer) + 1]], max_tokens=1)
    assert err.value.body["param"] == "prompt[1][0]"


def test_tokenizer_info_names_the_served_tokenizer(client, pool, backend, chat_server):
    engine = pool.text_engine(backend).local
    info = client.get(f"{chat_server(backend).url}/tokenizer_info", cast_to=httpx.Response).json()
    assert info["eos_token"] == engine.tokenizer.eos_token and info["chat_template"] == engine.tokenizer.chat_template
    assert info["model_max_length"] == engine.backend.capabilities.max_model_len


def test_openapi_json_describes_every_body_the_openai_client_sends(chat_server):
    """``/openapi.json`` is truthful: the request bodies the official client sends (its own serialization, caught on
    the wire) validate against the schema the server publishes for their route, and a body the schema refuses (a
    misspelled field) is refused by the server too, naming that field. The bodies and the app are the same on every
    backend: checked once, on HF's server."""
    import jsonschema
    import openai

    url = chat_server("hf").url
    doc = httpx.get(f"{url}/openapi.json", timeout=30).json()
    sent: list[tuple[str, dict]] = []

    def record(request: httpx.Request) -> None:
        if request.method == "POST":
            sent.append((request.url.path, json.loads(request.content)))

    with httpx.Client(event_hooks={"request": [record]}, timeout=120) as http, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=http) as c:
        model = model_id(c)
        c.chat.completions.create(model=model, messages=FRANCE, max_tokens=2, temperature=0, top_p=1.0, seed=3,
                                  stop=["\n\n", "###"], logprobs=True, top_logprobs=2, n=1, user="u",
                                  frequency_penalty=0, presence_penalty=0,
                                  extra_body={"top_k": -1, "min_tokens": 1, "stop_token_ids": [0]})
        streamed(c, model=model, messages=FRANCE, max_tokens=2, temperature=0,
                 stream_options={"include_usage": True})
        c.completions.create(model=model, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0, echo=False,
                             logprobs=1, stop="\n", best_of=1)
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model=model, messages=FRANCE, max_tokens=2, extra_body={"top_kk": 5})
    assert err.value.body["param"] == "top_kk" and "did you mean 'top_k'" in err.value.body["message"]
    assert [path for path, _ in sent] == ["/v1/chat/completions"] * 2 + ["/v1/completions", "/v1/chat/completions"]
    for path, body in sent:
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        valid = jsonschema.Draft202012Validator({**ref, "components": doc["components"]}).is_valid(body)
        assert valid == ("top_kk" not in body), (path, body)
