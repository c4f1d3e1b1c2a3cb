"""The API key (``engine.serve.auth``): with a key set every route but the health probe needs the bearer token, and
the probe shows filesystem paths only to a caller that sent it. The engine is a stand-in (the HTTP layer is under
test); ``conformance/test_served.py`` checks the key on a real server with the official openai client and curl."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx", reason="the serve extra (installed by `nox -s tests`)")
pytest.importorskip("fastapi", reason="the serve extra (installed by `nox -s tests`)")

from engine.config import EngineConfig  # noqa: E402
from engine.serve.activation import Activation  # noqa: E402
from engine.serve.app import create_app  # noqa: E402
from engine.serve.service import ServedEngine  # noqa: E402
from engine.types import GenerationResult  # noqa: E402

KEY = "s3cret-key"
MESSAGES = [{"role": "user", "content": "Hi"}]
ANSWER = GenerationResult(text="Hello.", raw_text="Hello.</s>", token_ids=(5, 2), prompt_token_ids=(1,),
                          finish_reason="stop", stop_reason=2, meta={"generated_chars": 6, "returned_chars": 6,
                                                                     "eos_suppressed": 0, "min_length_capped": False})
ROUTES = [("POST", "/infer/", {"infer_requests": [{"messages": MESSAGES}]}),
          ("POST", "/v1/chat/completions", {"model": "m", "messages": MESSAGES}),
          ("GET", "/v1/models", None), ("POST", "/chat", {"messages": MESSAGES, "min_len": 0}),
          ("GET", "/metrics", None), ("GET", "/get_world_size/", None), ("POST", "/get_engine_type/", None),
          ("GET", "/openapi.json", None), ("GET", "/docs", None), ("POST", "/nowhere", None)]


class Answering:
    config = EngineConfig.from_dict({"backend": "hf", "model": {"path": "/srv/models/m"}})
    backend = SimpleNamespace(name="hf", load_decisions={}, capabilities=SimpleNamespace(max_model_len=4096))
    tokenizer = None

    def prepare(self, requests, **kwargs):  # the engine's checks: nothing to refuse here
        return None

    async def agenerate(self, requests, **kwargs):
        return [ANSWER for _ in requests]


NO_SUBTREE = Activation(None, "default (disabled)")


def call(key, requests, activation=NO_SUBTREE):
    app = create_app(ServedEngine(Answering(), activation, api_key=key), close_engine=False)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine.test") as client:
            return [await client.request(method, path, json=body, headers=headers)
                    for method, path, body, headers in requests]

    return asyncio.run(run())


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}], ids=["none", "wrong", "no-scheme", "basic"])
def test_every_route_but_health_refuses_a_caller_without_the_key(headers):
    replies = call(KEY, [(m, p, b, headers) for m, p, b in ROUTES])
    assert [r.status_code for r in replies] == [401] * len(ROUTES)
    for reply in replies:
        assert reply.headers["www-authenticate"] == "Bearer"
        assert reply.json()["error"]["type"] == "authentication_error" and KEY not in reply.text


def test_the_key_opens_every_route():
    replies = call(KEY, [(m, p, b, {"Authorization": f"Bearer {KEY}"}) for m, p, b in ROUTES])
    assert [r.status_code for r in replies] == [200] * (len(ROUTES) - 1) + [404]


def test_health_is_open_and_shows_paths_only_with_the_key():
    source = Activation({"enabled": False}, "env:ENGINE_REPEAT_TERMINATE_FILE=/home/me/rt.json")
    anonymous, keyed = call(KEY, [("GET", "/health", None, {}),
                                  ("GET", "/health", None, {"Authorization": f"Bearer {KEY}"})], source)
    assert anonymous.status_code == keyed.status_code == 200
    assert "/srv/models" not in anonymous.text and "/home/me" not in anonymous.text
    assert anonymous.json()["repeat_terminate_source"] == "env:ENGINE_REPEAT_TERMINATE_FILE"
    assert keyed.json()["model_path"] == "/srv/models/m"
    assert keyed.json()["repeat_terminate_source"] == "env:ENGINE_REPEAT_TERMINATE_FILE=/home/me/rt.json"


def test_without_a_key_every_route_is_open_and_health_shows_no_path():
    replies = call(None, [(m, p, b, {}) for m, p, b in ROUTES] + [("GET", "/health", None, {})])
    assert [r.status_code for r in replies] == [200] * (len(ROUTES) - 1) + [404, 200]
    assert "model_path" not in replies[-1].json() and "/srv/models" not in replies[-1].text


def test_the_launcher_takes_the_key_one_way_and_never_prints_it(tmp_path):
    import json
    import os
    import subprocess
    import sys

    config = tmp_path / "served.yaml"
    config.write_text(json.dumps({"backend": "hf", "model": "/srv/models/m"}))
    env = {k: v for k, v in os.environ.items() if k != "ENGINE_API_KEY"}
    run = lambda *args, **extra: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "engine.serve", "--config", str(config), "--check", *args], capture_output=True,
        text=True, env={**env, **extra}, timeout=60)
    ok = run(ENGINE_API_KEY=KEY)
    assert ok.returncode == 0 and "api_key=set" in ok.stdout and KEY not in ok.stdout + ok.stderr
    both = run("--api-key", "other", ENGINE_API_KEY=KEY)
    assert both.returncode == 2 and "--api-key differs from ENGINE_API_KEY" in both.stderr
    assert KEY not in both.stderr and "other" not in both.stderr
    blank = run("--api-key", " ")
    assert blank.returncode == 2 and "must be a non-empty key" in blank.stderr
