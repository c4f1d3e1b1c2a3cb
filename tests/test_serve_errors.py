"""The served app's last line of defence: an exception no typed refusal caught becomes a JSON 500 in the wire format
(OpenAI's error object) that names the request, and the server log keeps the traceback under that name.

The engine here is a stand-in whose ``agenerate`` raises: what is under test is the app's error path, which no
real request should reach (``conformance/test_hostile.py`` checks that the named hostile requests do not)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx", reason="the serve extra (installed by `nox -s tests`)")
pytest.importorskip("fastapi", reason="the serve extra (installed by `nox -s tests`)")

from engine.config import EngineConfig  # noqa: E402
from engine.serve.activation import Activation  # noqa: E402
from engine.serve.app import create_app  # noqa: E402
from engine.serve.service import ServedEngine  # noqa: E402

NORMAL = {"infer_requests": [{"messages": [{"role": "user", "content": "Hi"}]}], "request_config": {"max_tokens": 4}}


class Broken:
    """An engine whose generation fails in a way nothing anticipated."""

    config = EngineConfig.from_dict({"backend": "hf", "model": {"path": "/models/broken"}})
    backend = SimpleNamespace(name="hf", capabilities=SimpleNamespace(max_model_len=64))
    tokenizer = None

    def prepare(self, requests, **kwargs):  # the engine's checks: nothing to refuse here
        return None

    async def agenerate(self, *args, **kwargs):
        raise RuntimeError("an internal fault")


def post(path, body, headers=None):
    app = create_app(ServedEngine(Broken(), Activation(None, "test")), close_engine=False)

    async def call():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine.test") as client:
            return await client.post(path, json=body, headers=headers or {})

    return asyncio.run(call())


def test_an_unexpected_fault_is_a_json_500_naming_the_request(caplog):
    with caplog.at_level(logging.ERROR, logger="engine.serve.app"):
        reply = post("/infer/", NORMAL, {"x-request-id": "learner-step-7"})
    assert reply.status_code == 500 and reply.headers["x-request-id"] == "learner-step-7"
    error = reply.json()["error"]
    assert error["type"] == "internal_error" and error["code"] == 500
    assert "learner-step-7" in error["message"] and "POST /infer/" in error["message"]
    assert "RuntimeError" in error["message"] and "an internal fault" not in error["message"]  # no internals leak
    [record] = [r for r in caplog.records if "learner-step-7" in r.getMessage()]
    assert record.exc_info and record.exc_info[0] is RuntimeError, "the log keeps the traceback under that id"


def test_a_request_without_an_id_gets_one_it_can_quote():
    reply = post("/v1/chat/completions", {"model": "broken", "messages": [{"role": "user", "content": "Hi"}]})
    assert reply.status_code == 500
    request_id = reply.headers["x-request-id"]
    assert len(request_id) == 16 and request_id in reply.json()["error"]["message"]


@pytest.mark.parametrize(("method", "path", "status"), [("POST", "/nowhere", 404), ("GET", "/infer/", 405)])
def test_an_unknown_route_or_method_is_the_same_error_object(method, path, status):
    app = create_app(ServedEngine(Broken(), Activation(None, "test")), close_engine=False)

    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine.test") as client:
            return await client.request(method, path)

    reply = asyncio.run(call())
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["code"] == status and path in error["message"]


def test_every_request_gets_an_id_and_one_access_line(caplog):
    """The access log (``engine.serve.access``): one line per request with its id (the client's, else a new one),
    method, path and status; the id also comes back in the ``x-request-id`` header, refusals included."""
    import logging

    with caplog.at_level(logging.INFO, logger="engine.serve.access"):
        failed = post("/infer/", NORMAL, {"x-request-id": "step-9"})  # this stand-in's generation fails: a 500
        missing = post("/no/such/route", {})
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.serve.access"]
    assert failed.headers.get_list("x-request-id") == ["step-9"] and len(missing.headers["x-request-id"]) == 16
    assert len(lines) == 2
    assert lines[0].startswith("step-9 ") and '"POST /infer/" 500 ' in lines[0] and lines[0].endswith("ms")
    assert lines[1].startswith(missing.headers["x-request-id"]) and '"POST /no/such/route" 404' in lines[1]


def test_a_path_cannot_write_a_line_of_its_own_into_the_access_log(caplog):
    """Hostile round 4: ``%0A`` in a URL is decoded to a newline in the path, which the access line wrote as is."""
    with caplog.at_level(logging.INFO, logger="engine.serve.access"):
        post("/v1/models%0A2026-12-01 engine.serve.access: forged 200", {})
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.serve.access"]
    assert len(lines) == 1 and "\n" not in lines[0] and "\\x0a2026-12-01" in lines[0], lines
