"""The served twins' reach (``conformance/subjects/pool.py``, ``served.py``): a guarded engine's twin reaches the server
of its unguarded engine and sends its guard with every call (``engine.repeat_terminate``), so no server is started per
guard setting. A stand-in engine and client: the real servers answer in ``conformance/test_repeat.py``'s twins."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conformance.subjects.pool import EnginePool, PoolOptions
from conformance.subjects.served import SERVED
from engine.config.repeat import RepeatTerminateConfig

GUARD = {"enabled": True, "max_consecutive_token_repeats": 4}


class Engine:
    """What the pool reads of an engine: its guard, its backend; ``derive`` as the engine derives request sections."""

    def __init__(self, config, guard=None):
        self.config = SimpleNamespace(repeat_terminate=RepeatTerminateConfig(**(guard or {})))
        self.backend = SimpleNamespace(runner=None, name=config["backend"] if config else "hf")

    def derive(self, **sections):
        return Engine(None, sections.get("repeat_terminate"))

    def generate(self, requests, *, options=None, stop=None, plugins=None):
        return [f"in-process {self.config.repeat_terminate.enabled}"] * len(requests)


@pytest.fixture
def pool(monkeypatch):
    import engine

    monkeypatch.setattr(engine, "GenerationEngine", Engine)
    return EnginePool(PoolOptions(backends=("hf", "vllm"), model="/models/text", vlm_model="/models/vlm",
                                  dtype="float32", device="cpu"))


def test_a_guarded_twin_reaches_the_unguarded_engines_server(pool):
    plain, guarded = pool.engine("hf", "/models/text"), pool.engine("hf", "/models/text", repeat_terminate=GUARD)
    started = []
    pool.servers.server = lambda key, config: started.append(key) or SimpleNamespace(url="http://127.0.0.1:1")
    plain.server(), guarded.server()
    assert started[0] == started[1] == pool.servers.served_config("hf", "/models/text")[0]
    assert guarded._guard == RepeatTerminateConfig(**GUARD).as_dict() and plain._guard is None


def test_a_guarded_twin_sends_its_guard_and_asks_the_server_for_none(pool, monkeypatch):
    import engine.client

    sent = []

    class Client:
        def __init__(self, url, *, repeat_terminate, **kwargs):
            sent.append(("learner", repeat_terminate))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def infer(self, requests, *, engine):
            sent.append(("engine", engine))
            return ["in-process True"] * len(requests)

    monkeypatch.setattr(engine.client, "RolloutClient", Client)
    monkeypatch.setattr("conformance.subjects.served.assert_served_equal", lambda served, local, what: None)
    pool.servers.server = lambda key, config: SimpleNamespace(url="http://127.0.0.1:1")
    twin = pool.engine("hf", "/models/text", repeat_terminate=GUARD)
    pool.reach.how = SERVED
    twin.generate([[{"role": "user", "content": "Hi"}]], options={"max_new_tokens": 4})
    assert sent == [("learner", None), ("engine", {"options": {"max_new_tokens": 4},
                                                   "repeat_terminate": RepeatTerminateConfig(**GUARD).as_dict()})]
    assert pool.reach.served_calls == 1
