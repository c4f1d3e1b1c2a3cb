"""vLLM's LoRA routes on the served engine (``engine/serve/openai/lora.py``), the HTTP layer over a stand-in engine:
they exist only with ``serve.adapter_loading``, sit behind the API key, answer vLLM's texts and statuses, refuse by
field, and ``/v1/models`` lists loaded adapters with the served model as parent. ``conformance/test_adapters.py``
drives them on real servers of every backend with the official openai client."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

httpx = pytest.importorskip("httpx", reason="the serve extra (installed by `nox -s tests`)")
pytest.importorskip("fastapi", reason="the serve extra (installed by `nox -s tests`)")

from engine.backends.base import Capabilities  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.errors import ConfigError, RequestError  # noqa: E402
from engine.serve.activation import Activation  # noqa: E402
from engine.serve.app import create_app  # noqa: E402
from engine.serve.service import ServedEngine  # noqa: E402

KEY = "lora-key"


class Adapting:
    """A backend that loads adapters by name (a path of ``/bad`` is refused as the real checks refuse one)."""

    name, runner, streams_tokens, default_seed = "vllm", None, False, None

    def __init__(self) -> None:
        self.capabilities = Capabilities(name="vllm", max_model_len=4096, adapters=("r8",))
        self.calls: list[tuple[str, ...]] = []

    def generate(self, prompts, plan):
        raise AssertionError("not used")

    async def agenerate(self, prompts, plan):
        raise AssertionError("not used")

    def load_adapter(self, name, path, *, replace=False):
        if path == "/bad":
            raise ConfigError("lora_path", path, "holds no adapter_config.json", fix="give an adapter folder")
        if name in self.capabilities.adapters and not replace:
            raise RequestError("lora_name", name, "is already loaded", fix="load it in place")
        self.calls.append(("load", name, path, str(replace)))
        adapters = tuple(dict.fromkeys((*self.capabilities.adapters, name)))
        self.capabilities = dataclasses.replace(self.capabilities, adapters=adapters)

    def unload_adapter(self, name):
        self.calls.append(("unload", name))
        self.capabilities = dataclasses.replace(
            self.capabilities, adapters=tuple(a for a in self.capabilities.adapters if a != name))


def serve(requests, *, loading=True, key=None):
    from engine import GenerationEngine

    config = EngineConfig.from_dict({"backend": "vllm", "model": {"path": "/srv/m", "adapters": {"r8": "/a/r8"}},
                                     "serve": {"adapter_loading": loading}})
    engine = object.__new__(GenerationEngine)  # the engine's own load_adapter / unload_adapter over a stand-in
    engine.config, engine.backend, engine.tokenizer = config, Adapting(), None
    app = create_app(ServedEngine(engine, Activation(None, "test"), api_key=key), close_engine=False)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine.test") as client:
            return [await client.request(r[0], r[1], json=r[2], headers=r[3] if len(r) > 3 else {})
                    for r in requests]

    return asyncio.run(run()), engine.backend


def test_the_routes_answer_as_vllms_and_models_lists_adapters_with_their_parent():
    (loaded, models, twice, inplace, gone, missing, bad, base), backend = serve([
        ("POST", "/v1/load_lora_adapter", {"lora_name": "live", "lora_path": "/a/live"}),
        ("GET", "/v1/models", None),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "live", "lora_path": "/a/live"}),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "live", "lora_path": "/a/new", "load_inplace": True}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "live"}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "live"}),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/bad"}),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "m", "lora_path": "/a/x"}),
    ])
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'live' added successfully.")
    cards = {card["id"]: card for card in models.json()["data"]}
    assert cards["live"]["parent"] == cards["r8"]["parent"] == "m" and "parent" not in cards["m"]
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "lora_name"
    assert inplace.status_code == 200
    assert (gone.status_code, gone.text) == (200, "Success: LoRA adapter 'live' removed successfully.")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "The lora adapter 'live' cannot be found."
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert base.status_code == 400 and "served base model" in base.json()["error"]["message"]
    assert backend.calls == [("load", "live", "/a/live", "False"), ("load", "live", "/a/new", "True"),
                             ("unload", "live")]


def test_without_adapter_loading_the_routes_do_not_exist():
    replies, backend = serve([("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/a/x"}),
                              ("POST", "/v1/unload_lora_adapter", {"lora_name": "r8"})], loading=False)
    assert [r.status_code for r in replies] == [404, 404] and backend.calls == []


def test_the_routes_need_the_api_key_and_refuse_unknown_fields():
    (keyless, keyed, extra), backend = serve([
        ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/a/x"}),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/a/x"}, {"Authorization": f"Bearer {KEY}"}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "x", "force": True}, {"Authorization": f"Bearer {KEY}"}),
    ], key=KEY)
    assert keyless.status_code == 401 and keyed.status_code == 200
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "force"
    assert backend.calls == [("load", "x", "/a/x", "False")]
