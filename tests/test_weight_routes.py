"""The weight-sync routes (``engine.serve.rollout.weights``) as swift's client calls them: what is refused by field
before anything joins a group, and the order of the backend calls (a push session ends before any generation). The
backend is a stand-in that records its calls; ``conformance/test_weight_sync.py`` pushes real weights into HF and
vLLM servers."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx", reason="the serve extra (installed by `nox -s tests`)")
pytest.importorskip("fastapi", reason="the serve extra (installed by `nox -s tests`)")

from engine.batcher import AsyncBatcher  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.serve.activation import Activation  # noqa: E402
from engine.serve.app import create_app  # noqa: E402
from engine.serve.service import ServedEngine  # noqa: E402
from engine.types import GenerationResult  # noqa: E402

ANSWER = GenerationResult(text="a", raw_text="a", token_ids=(5,), prompt_token_ids=(1,), finish_reason="length",
                          stop_reason=None, meta={})
META = [{"name": "a", "shape": [2], "dtype": "torch.float32", "start_idx": 0, "end_idx": 8, "numel": 8},
        {"name": "b", "shape": [1], "dtype": "torch.float16", "start_idx": 8, "end_idx": 10, "numel": 2}]


class Recording:
    """A backend that takes weights (the ``WeightLoading`` protocol) and records each call and its thread."""

    name, runner, streams_tokens, default_seed = "hf", None, False, None
    capabilities = SimpleNamespace(max_model_len=4096)

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.threads: set[str] = set()

    def _note(self, call: str) -> None:
        self.calls.append(call)
        self.threads.add(threading.current_thread().name)

    def generate(self, prompts, plan):
        raise AssertionError("not used")

    def open_weights(self, host, port, world_size, transport):
        self._note(f"open {host}:{port} {world_size} {transport}")

    def load_weights(self, announced):
        self._note("load " + (announced["name"] if "name" in announced else f"{len(announced['metadatas'])} tensors"))
        return 1

    def finish_weights(self):
        self._note("finish")

    def close_weights(self):
        self._note("close")

    def state_keys(self):
        self._note("keys")
        return ["a", "b"]

    def reset_cache(self, kind):
        self._note(f"reset {kind}")


class Engine:
    def __init__(self, backend) -> None:
        self.config = EngineConfig.from_dict({"backend": "hf", "model": {"path": "/models/m"}})
        self.backend, self.tokenizer = backend, None
        self._batcher = AsyncBatcher(backend)

    def batcher(self):
        return self._batcher

    async def agenerate(self, requests, **kwargs):
        self.backend.calls.append("generate")
        return [ANSWER for _ in requests]


def session(backend, calls):
    app = create_app(ServedEngine(Engine(backend), Activation(None, "test")), close_engine=False)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine.test") as client:
            return [await client.request(method, path, json=body) for method, path, body in calls]

    return asyncio.run(run())


OPEN = ("POST", "/init_communicator/", {"host": "127.0.0.1", "port": 29500, "world_size": 2, "transport": "tcp"})
INFER = ("POST", "/infer/", {"infer_requests": [{"messages": [{"role": "user", "content": "Hi"}]}]})


def test_a_push_session_ends_before_the_next_generation_and_runs_on_the_batchers_thread():
    backend = Recording()
    replies = session(backend, [
        OPEN, ("POST", "/update_named_param/", {"name": "a", "dtype": "torch.float32", "shape": [2]}),
        ("POST", "/update_flattened_params/", {"metadatas": META}), INFER,
        ("POST", "/reset_prefix_cache/", None), ("POST", "/reset_encoder_cache/", None),
        ("POST", "/reset_mm_cache/", None), ("GET", "/get_model_state_keys/", None),
        ("POST", "/close_communicator/", None)])
    assert [r.status_code for r in replies] == [200] * 9
    assert replies[7].json() == {"keys": ["a", "b"]}
    assert backend.calls == ["open 127.0.0.1:29500 2 tcp", "load a", "load 2 tensors", "finish", "generate",
                             "reset prefix", "reset encoder", "reset mm", "keys", "close"]
    assert backend.threads == {"engine-batcher_0"}, "the model is touched only between two generate calls"


@pytest.mark.parametrize(("route", "body", "field"), [
    ("/init_communicator/", {"host": "127.0.0.1", "port": 29500, "world_size": 3}, "world_size"),
    ("/init_communicator/", {"host": "127.0.0.1", "port": 70000, "world_size": 2}, "port"),
    ("/init_communicator/", {"host": "127.0.0.1", "port": 29500, "world_size": 2, "transport": "udp"},
     "transport"),
    ("/init_communicator/", {"port": 29500, "world_size": 2}, "host"),
    ("/init_communicator/", {"host": "h", "port": 1, "world_size": 2, "grup_port": 1}, "grup_port"),
    ("/update_named_param/", {"name": "a", "dtype": "torch.float33", "shape": [2]}, "dtype"),
    ("/update_named_param/", {"name": "a", "dtype": "torch.float32", "shape": "2"}, "shape"),
    ("/update_flattened_params/", {"metadatas": [META[0], {**META[1], "start_idx": 9}]}, "metadatas[1].start_idx"),
    ("/update_flattened_params/", {"metadatas": []}, "metadatas"),
])
def test_a_malformed_call_is_refused_by_field_and_reaches_no_backend(route, body, field):
    backend = Recording()
    [reply] = session(backend, [("POST", route, body)])
    assert reply.status_code == 400 and reply.json()["error"]["param"] == field
    assert backend.calls == []


def test_a_backend_without_weight_loading_is_refused_by_name():
    class Plain(Recording):
        open_weights = load_weights = finish_weights = close_weights = state_keys = reset_cache = None

    [reply] = session(Plain(), [OPEN])
    assert reply.status_code == 400 and "cannot load a learner's weights" in reply.json()["error"]["message"]


def test_a_push_without_an_open_communicator_is_refused_at_once_and_the_next_caller_is_unaffected():
    """A push before ``/init_communicator/`` (or after closing) used to answer 200, fail in the background, and hand
    that failure to the next unrelated ``/infer/``: it is a 409 naming the cause, nothing reaches the backend."""
    backend = Recording()
    push = ("POST", "/update_named_param/", {"name": "a", "dtype": "torch.float32", "shape": [2]})
    replies = session(backend, [push, INFER, OPEN, ("POST", "/close_communicator/", None), push])
    assert [r.status_code for r in replies] == [409, 200, 200, 200, 409]
    assert "call /init_communicator/ first" in replies[0].json()["error"]["message"]
    assert backend.calls == ["generate", "open 127.0.0.1:29500 2 tcp", "close"]
