"""One answering path for every surface (``engine.serve.shared.calls``): ``/infer/``, ``/v1/chat/completions`` and
Pattern C ``/chat`` count their answers alike in ``/metrics`` (sequences, tokens, and the sequences the repeat guard
ended, by the guard's own flag), and refuse by the field the client sent.

The engine is a stand-in that answers every request with one guard-ended result: what is under test is the HTTP
layer's bookkeeping (``conformance/test_served.py`` and ``test_chat.py`` run the real backends)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx", reason="the serve extra (installed by `nox -s tests`)")
pytest.importorskip("fastapi", reason="the serve extra (installed by `nox -s tests`)")

from engine.config import EngineConfig, ServeConfig  # noqa: E402
from engine.errors import ConfigError  # noqa: E402
from engine.serve.activation import Activation  # noqa: E402
from engine.serve.app import create_app  # noqa: E402
from engine.serve.service import ServedEngine  # noqa: E402
from engine.types import GenerationResult  # noqa: E402

MESSAGES = [{"role": "user", "content": "Hi"}]
TRIGGERED = GenerationResult(
    text="a a a", raw_text="a a a</s>", token_ids=(5, 5, 5, 2), prompt_token_ids=(1, 2), finish_reason="stop",
    stop_reason="repeat_terminate",
    meta={"repeat_terminate_triggered": 1, "repeat_terminate_index": 3, "repeat_terminate_reason": "ngram",
          "generated_chars": 5, "returned_chars": 5, "eos_suppressed": 0, "min_length_capped": False})


class Looping:
    """An engine whose every answer the repeat guard ended; ``min_new_tokens: -1`` is refused as the engine would."""

    config = EngineConfig.from_dict({"backend": "hf", "model": {"path": "/models/stand-in"},
                                     "repeat_terminate": {"enabled": True, "max_consecutive_token_repeats": 3}})
    backend = SimpleNamespace(name="hf", load_decisions={}, capabilities=SimpleNamespace(max_model_len=4096))
    tokenizer = None

    def prepare(self, requests, options=None, **kwargs):
        """The engine's checks, which the call path runs before the route (off the event loop)."""
        if (options or {}).get("min_new_tokens") == -1:
            raise ConfigError("generation.min_new_tokens", -1, "must be in [0, inf)")

    async def agenerate(self, requests, options=None, prepared=None, **kwargs):
        return [TRIGGERED for _ in requests]


def session(calls, serve=None):
    app = create_app(ServedEngine(Looping(), Activation(None, "test"), serve=serve), close_engine=False)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine.test") as client:
            replies = [await client.post(path, json=body) for path, body in calls]
            return replies, (await client.get("/metrics")).text

    return asyncio.run(run())


def metric(text, name, **labels):
    """One sample of the exposition, read with prometheus_client's own parser (every series names the model)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and {**labels, "model_name": "stand-in"}.items() <= sample.labels.items():
                return sample.value
    raise AssertionError(f"no sample {name} {labels} in /metrics")


def test_every_surface_counts_its_answers_and_the_guards_triggers_alike():
    replies, text = session([
        ("/infer/", {"infer_requests": [{"messages": MESSAGES}] * 2, "request_config": {"max_tokens": 4}}),
        ("/v1/chat/completions", {"model": "stand-in", "messages": MESSAGES}),
        ("/chat", {"messages": MESSAGES}),
    ])
    assert [r.status_code for r in replies] == [200, 200, 200]
    assert metric(text, "engine_sequences_total") == 4
    assert metric(text, "engine_generation_tokens_total") == 16
    assert metric(text, "engine_repeat_terminate_triggered_total") == 4
    for endpoint in ("infer", "chat_completions", "chat"):
        assert metric(text, "engine_requests_total", endpoint=endpoint, status="200") == 1


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/infer/", {"infer_requests": [{"messages": MESSAGES}], "engine": {"options": {"min_new_tokens": -1}}},
     "engine.options.min_new_tokens"),
    ("/v1/chat/completions", {"model": "stand-in", "messages": MESSAGES, "engine": {"options": {"min_new_tokens": -1}}},
     "engine.options.min_new_tokens"),
])
def test_an_engine_refusal_names_the_clients_field_and_is_counted(path, body, field):
    replies, text = session([(path, body)])
    assert replies[0].status_code == 400 and replies[0].json()["error"]["param"] == field
    assert metric(text, "engine_sequences_total") == 0 and metric(text, "engine_requests_total", status="400") == 1


LIMITS = ServeConfig(max_prompts_per_call=2, max_stop_strings=2, max_body_bytes=600)


@pytest.mark.parametrize(("path", "endpoint", "body", "status", "param"), [
    ("/v1/chat/completions", "chat_completions", {"model": "other", "messages": MESSAGES}, 404, "model"),
    ("/chat", "chat", {"model": "other", "messages": MESSAGES}, 404, "model"),
    ("/tokenize", "tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/infer/", "infer", {"infer_requests": [{"messages": MESSAGES}] * 3}, 400, "infer_requests"),
    ("/infer/", "infer", {"infer_requests": [{"messages": MESSAGES}], "request_config": {"stop": ["a", "b", "c"]}},
     400, "request_config.stop"),
    ("/infer/", "infer", {"infer_requests": [{"messages": MESSAGES}], "engine": {"stop": {"strings": ["a"] * 3}}},
     400, "engine.stop.strings"),
    ("/v1/chat/completions", "chat_completions", {"model": "stand-in", "messages": MESSAGES, "stop": ["a"] * 3},
     400, "stop"),
    ("/chat", "chat", {"messages": [{"role": "user", "content": "x" * 700}]}, 413, "body"),
])
def test_every_refusal_takes_its_status_from_one_table_and_names_the_clients_field(path, endpoint, body, status,
                                                                                    param):
    """The call path's refusals on every surface: the unknown model (404), a limit (400, named as this surface's
    client sent it: ``request_config.stop`` and ``engine.stop.strings`` are two fields of one engine field), a body
    over ``serve.max_body_bytes`` (413); each counted under its route and status."""
    replies, text = session([(path, body)], serve=LIMITS)
    error = replies[0].json()["error"]
    assert (replies[0].status_code, error["param"], error["code"]) == (status, param, status), error
    assert metric(text, "engine_requests_total", endpoint=endpoint, status=str(status)) == 1


def test_every_served_name_and_the_path_are_answered_and_others_are_404():
    """``--served-model-name A B``: /v1/models lists both, a keyless server's ``root`` is the name (no path), and a
    request naming A, B or the model's path is answered; any other name is a 404 before any engine work."""
    from engine.config import ServeConfig

    serve = ServeConfig(model_name="stand-in", model_aliases=("alias",))
    replies, _ = session([("/v1/chat/completions", {"model": name, "messages": MESSAGES})
                          for name in ("stand-in", "alias", "/models/stand-in", "other")], serve=serve)
    assert [r.status_code for r in replies] == [200, 200, 200, 404]
    app = create_app(ServedEngine(Looping(), Activation(None, "test"), serve=serve), close_engine=False)

    async def models():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine.test") as client:
            return (await client.get("/v1/models")).json()["data"]

    listed = asyncio.run(models())
    assert [(m["id"], m["root"]) for m in listed] == [("stand-in", "stand-in"), ("alias", "stand-in")]


class Counting(Looping):
    """``Looping`` with a real ``AsyncBatcher``: records how many requests it counted on their way while preparing."""

    def __init__(self) -> None:
        from engine.batcher import AsyncBatcher

        self._batcher = AsyncBatcher(self.backend)
        self.seen: list[int] = []

    def batcher(self):
        return self._batcher

    def prepare(self, requests, options=None, **kwargs):
        self.seen.append(self._batcher.incoming)
        return super().prepare(requests, options=options, **kwargs)


def test_a_request_is_counted_on_its_way_to_the_batcher_while_it_is_checked():
    engine = Counting()
    app = create_app(ServedEngine(engine, Activation(None, "test")), close_engine=False)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine.test") as client:
            return [(await client.post("/v1/chat/completions", json=body)).status_code for body in (
                {"model": "stand-in", "messages": MESSAGES},
                {"model": "stand-in", "messages": MESSAGES, "min_tokens": -1})]

    assert asyncio.run(run()) == [200, 400]
    assert engine.seen == [1, 1]  # the batcher would wait for each while it was prepared
    assert engine._batcher.incoming == 0  # answered or refused, neither is counted after


class Recording(Looping):
    """The stand-in, remembering each call's ``repeat_terminate`` and refusing a bad one as the engine would
    (``RepeatTerminateConfig.overlaid`` names ``repeat_terminate.<field>``)."""

    def __init__(self):
        self.guards = []

    def prepare(self, requests, options=None, repeat_terminate=None, **kwargs):
        if (repeat_terminate or {}).get("ngram_size") == 1:
            raise ConfigError("repeat_terminate.ngram_size", 1, "must be in [2, 1024]")
        self.guards.append(repeat_terminate)


def test_a_requests_guard_reaches_the_engine_call_and_its_refusal_names_the_extension_field():
    engine = Recording()
    app = create_app(ServedEngine(engine, Activation(None, "test")), close_engine=False)
    guard = {"enabled": False}
    calls = [("/infer/", {"infer_requests": [{"messages": MESSAGES}], "engine": {"repeat_terminate": guard}}),
             ("/v1/chat/completions", {"model": "stand-in", "messages": MESSAGES,
                                       "engine": {"repeat_terminate": guard}}),
             ("/infer/", {"infer_requests": [{"messages": MESSAGES}]}),
             ("/infer/", {"infer_requests": [{"messages": MESSAGES}],
                          "engine": {"repeat_terminate": {"ngram_size": 1, "ngram_repeats": 2}}})]

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine.test") as client:
            return [await client.post(path, json=body) for path, body in calls]

    replies = asyncio.run(run())
    assert [r.status_code for r in replies] == [200, 200, 200, 400]
    assert engine.guards == [guard, guard, None]
    assert replies[3].json()["error"]["param"] == "engine.repeat_terminate.ngram_size"
