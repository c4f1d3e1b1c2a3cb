"""Request bodies as pydantic models (``engine/serve/shared/bodies.py``, each surface's ``bodies.py``): every refusal
names the field as the client sent it (never a union member's internal tag), and ``/openapi.json`` is truthful: the
JSON schema it publishes for a route accepts exactly the bodies the route's model accepts (checked with
``jsonschema`` on generated bodies), and every body route of the served app references its model."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi", reason="the serve extra (installed by `nox -s tests`)")
jsonschema = pytest.importorskip("jsonschema", reason="the lm-eval extra (installed by `nox -s tests`)")
httpx = pytest.importorskip("httpx", reason="the serve extra (installed by `nox -s tests`)")

from engine.errors import RequestError  # noqa: E402
from engine.serve.app import SURFACES  # noqa: E402
from engine.serve.openai import bodies as openai_bodies  # noqa: E402
from engine.serve.pattern_c import bodies as pattern_c_bodies  # noqa: E402
from engine.serve.rollout import bodies as rollout_bodies  # noqa: E402
from engine.serve.shared import bodies as shared  # noqa: E402

bodies = SimpleNamespace(  # every surface's models and the shared check, under one name for these tables
    check=shared.check, ROUTES={path: model for surface in SURFACES for path, model in surface.BODIES.items()},
    ChatCompletionRequest=openai_bodies.ChatCompletionRequest, CompletionRequest=openai_bodies.CompletionRequest,
    TokenizeRequest=openai_bodies.TokenizeRequest, DetokenizeRequest=openai_bodies.DetokenizeRequest,
    InferRequest=rollout_bodies.InferRequest, UpdateNamedParamRequest=rollout_bodies.UpdateNamedParamRequest,
    PatternCRequest=pattern_c_bodies.PatternCRequest)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def refused(model, body) -> RequestError:
    with pytest.raises(RequestError) as info:
        bodies.check(model, body)
    return info.value


@pytest.mark.parametrize(("model", "body", "field", "says"), [
    (bodies.ChatCompletionRequest, {**CHAT, "stop": 5}, "stop", "must be a string or an array"),
    (bodies.ChatCompletionRequest, {**CHAT, "stop": ["a", 1]}, "stop[1]", "must be a string"),
    (bodies.ChatCompletionRequest, {**CHAT, "temperature": True}, "temperature", "must be a number"),
    (bodies.ChatCompletionRequest, {**CHAT, "max_tokens": "8"}, "max_tokens", "must be an integer"),
    (bodies.ChatCompletionRequest, {**CHAT, "max_tokens": 8.0}, "max_tokens", "must be an integer"),
    (bodies.ChatCompletionRequest, {**CHAT, "stream": 1}, "stream", "must be true or false"),
    (bodies.ChatCompletionRequest, {"messages": CHAT["messages"]}, "model", "is required"),
    (bodies.ChatCompletionRequest, {**CHAT, "messages": [{"content": "x"}]}, "messages[0].role", "is required"),
    (bodies.ChatCompletionRequest, {**CHAT, "response_format": {"type": "xml"}}, "response_format.type",
     "must be one of"),
    (bodies.ChatCompletionRequest, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"shema": {}}}},
     "response_format.json_schema.shema", "did you mean 'schema'"),
    (bodies.ChatCompletionRequest, {**CHAT, "stream_options": {"include_usge": True}},
     "stream_options.include_usge", "did you mean 'include_usage'"),
    (bodies.ChatCompletionRequest, {**CHAT, "engine": {"option": {}}}, "engine.option", "did you mean 'options'"),
    (bodies.CompletionRequest, {"model": "m", "prompt": [1, True]}, "prompt[1]", "must be an integer"),
    (bodies.CompletionRequest, {"model": "m", "prompt": [[1, "a"]]}, "prompt[0][1]", "must be an integer"),
    (bodies.CompletionRequest, {"model": "m", "prompt": [[1], "a"]}, "prompt[1]", "must be an array"),
    (bodies.InferRequest, {"infer_requests": [{"mesages": []}]}, "infer_requests[0].mesages",
     "did you mean 'messages'"),
    (bodies.InferRequest, {"infer_requests": [], "request_config": {"top_k": "5"}}, "request_config.top_k",
     "must be an integer"),
    (bodies.DetokenizeRequest, {"tokens": [1, None]}, "tokens[1]", "must be an integer"),
    (bodies.UpdateNamedParamRequest, {"name": "w", "dtype": "float32", "shape": [2, -1.5]}, "shape[1]",
     "must be an integer"),
])
def test_a_body_that_does_not_fit_its_model_is_refused_naming_the_clients_field(model, body, field, says):
    err = refused(model, body)
    assert err.field == field and says in str(err), str(err)
    assert "[str]" not in str(err) and "list[" not in err.field, "a union member's tag leaked into the message"


def test_nulls_mean_the_default_and_a_non_object_body_is_refused():
    bodies.check(bodies.ChatCompletionRequest, {**CHAT, "stop": None, "stream": None, "engine": None, "n": None})
    assert refused(bodies.InferRequest, [1, 2]).field == "body"


def openapi_document():
    from types import SimpleNamespace

    from engine.config import EngineConfig
    from engine.serve.activation import Activation
    from engine.serve.app import create_app
    from engine.serve.service import ServedEngine

    class Idle:
        config = EngineConfig.from_dict({"backend": "hf", "model": {"path": "/models/idle"},
                                         "serve": {"adapter_loading": True}})  # vLLM's LoRA routes exist
        backend = SimpleNamespace(name="hf", capabilities=SimpleNamespace(max_model_len=64))
        tokenizer = None

    app = create_app(ServedEngine(Idle(), Activation(None, "test")), close_engine=False)

    async def get():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine.test") as client:
            return (await client.get("/openapi.json")).json()

    return asyncio.run(get())


DOC = None


def document():
    global DOC
    if DOC is None:
        DOC = openapi_document()
    return DOC


def validator(model):
    """The published schema's validator, reading ``integer`` as JSON text does: ``0.0`` is a float there (and the
    engine refuses it where an integer is due, "send an integer"), though JSON Schema's own ``integer`` admits it."""
    doc = document()
    schema = {"$ref": f"#/components/schemas/{model.__name__}", "components": doc["components"]}
    base = jsonschema.Draft202012Validator
    checker = base.TYPE_CHECKER.redefine("integer", lambda _, x: isinstance(x, int) and not isinstance(x, bool))
    return jsonschema.validators.extend(base, type_checker=checker)(schema)


def test_every_body_route_of_the_app_references_its_model_in_openapi_json():
    doc = document()
    posts = {path: ops["post"] for path, ops in doc["paths"].items() if "post" in ops}
    assert set(bodies.ROUTES) <= set(posts), sorted(set(bodies.ROUTES) - set(posts))
    for path, model in bodies.ROUTES.items():
        ref = posts[path]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model.__name__}" and posts[path]["requestBody"]["required"]
        assert doc["components"]["schemas"][model.__name__]["additionalProperties"] is False
    # the routes that take no body publish none (swift posts them empty)
    assert "requestBody" not in posts["/close_communicator/"] and "requestBody" not in posts["/get_engine_type/"]


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-2, 2) | st.text(max_size=2),
                    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=2), inner, max_size=2),
                    max_leaves=4)


def bodies_for(model, base):
    names = [f.alias or n for n, f in model.model_fields.items()]
    return st.builds(lambda extra: {**base, **extra},
                     st.dictionaries(st.sampled_from([*names, "bogus"]), JSON | st.just([]) | st.just(["a"]),
                                     max_size=3))


@settings(max_examples=120, deadline=None)
@given(st.data())
@pytest.mark.parametrize(("model", "base"), [
    (bodies.ChatCompletionRequest, CHAT), (bodies.CompletionRequest, {"model": "m", "prompt": "x"}),
    (bodies.InferRequest, {"infer_requests": [{"messages": CHAT["messages"]}]}), (bodies.TokenizeRequest, {}),
    (bodies.PatternCRequest, {"messages": CHAT["messages"]}), (bodies.DetokenizeRequest, {"tokens": [1]}),
])
def test_the_published_schema_accepts_exactly_what_the_model_accepts(model, base, data):
    body = data.draw(bodies_for(model, base))
    try:
        bodies.check(model, body)
        accepted = True
    except RequestError:
        accepted = False
    assert validator(model).is_valid(body) == accepted, body


class Stalling:
    """A request whose body sends ``parts`` and then nothing more (the client stalled), declaring ``declared``."""

    def __init__(self, parts, declared=""):
        self.headers = {"content-length": declared} if declared else {}
        self.parts = parts

    async def stream(self):
        for part in self.parts:
            yield part
        await asyncio.sleep(3600)
        yield b""


class Trickling:
    """A request whose body comes a byte every 10 ms, never ending (hostile round 3's trickle)."""

    def __init__(self):
        self.headers = {}

    async def stream(self):
        while True:
            await asyncio.sleep(0.01)
            yield b" "


def test_a_stalled_or_trickled_body_is_a_408_and_a_stalled_oversized_one_its_413():
    """A body that stops part-way, or trickles without end, is refused once ``within_s`` has passed (408: a total
    deadline), naming the body; one that declared more than the limit gets its 413 as soon as its drain stalls
    (``Content-Length: 10**12`` and ten bytes), not never."""
    from engine.errors import RequestTimedOut, RequestTooLarge
    from engine.serve.shared import limits

    with pytest.raises(RequestTimedOut, match=r"serve\.body_timeout_s"):
        asyncio.run(limits.read_bytes(Stalling([b'{"a": ']), max_bytes=100, within_s=0.05))
    with pytest.raises(RequestTimedOut, match=r"did not arrive whole within serve\.body_timeout_s"):
        asyncio.run(limits.read_bytes(Trickling(), max_bytes=10**6, within_s=0.2))
    saved, limits.DRAIN_IDLE_S = limits.DRAIN_IDLE_S, 0.05
    try:
        with pytest.raises(RequestTooLarge, match=r"larger than serve\.max_body_bytes"):
            asyncio.run(limits.read_bytes(Stalling([b"0123456789"], declared=str(10**12)), max_bytes=100,
                                          within_s=30))
    finally:
        limits.DRAIN_IDLE_S = saved


def test_a_client_that_leaves_mid_body_is_a_typed_refusal_not_a_500():
    """Hostile round 4: a client closing its connection part-way through the body was a 500 and a traceback per
    request; it is the body's refusal now (nobody hears it: the client is gone; the log keeps one access line)."""
    from starlette.requests import ClientDisconnect

    from engine.errors import RequestTimedOut
    from engine.serve.shared import limits

    class Leaving(Stalling):
        async def stream(self):
            yield b'{"a": '
            raise ClientDisconnect()

    with pytest.raises(RequestTimedOut, match=r"was cut off: the client closed the connection"):
        asyncio.run(limits.read_bytes(Leaving([]), max_bytes=100, within_s=5))
