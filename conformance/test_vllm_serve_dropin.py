"""The served engine as a drop-in for ``vllm serve`` clients (issue 29), through the official ``openai`` client on every
backend's server: vLLM's sampling extras and ``response_format`` give the in-process engine's answers, a stream whose
end was held back still equals the whole answer, and ``/tokenize``, ``/detokenize``, ``/version`` answer as vLLM's
server does (``client.post`` on the routes the typed client has no method for).
"""

from __future__ import annotations

import json

import httpx
import pytest

from conformance.test_chat import FRANCE, PROMPTS, model_id, streamed

pytestmark = pytest.mark.slow
CITY = {"type": "object", "required": ["city", "population"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}}}


def test_vllm_sampling_extras_give_the_engines_answers(client, pool, backend):
    """``top_k`` (-1: off), ``repetition_penalty``, ``min_tokens``, ``stop_token_ids`` and ``seed`` at the top level,
    as vLLM takes them, equal the engine's own options and stop token ids."""
    engine = pool.text_engine(backend)
    model = model_id(client)
    free = engine.generate([PROMPTS[3]], options={"max_new_tokens": 16, "temperature": 0})[0]
    at = next(i for i in range(3, len(free.token_ids)) if free.token_ids[i] not in free.token_ids[:i])
    stop_id = free.token_ids[at]  # a token the greedy answer first reaches at `at`: the row must end there
    cases = [
        ({"top_k": -1, "repetition_penalty": 1.3, "min_tokens": 12, "temperature": 0},
         {"top_k": 0, "repetition_penalty": 1.3, "min_new_tokens": 12, "temperature": 0}, None),
        ({"temperature": 0, "stop_token_ids": [stop_id]}, {"temperature": 0}, {"token_ids": [stop_id]}),
        ({"temperature": 0.9, "top_k": 5, "seed": 77}, {"temperature": 0.9, "top_k": 5, "seed": 77}, None),
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
