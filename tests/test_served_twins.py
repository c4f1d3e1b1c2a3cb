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
REFUSED = 99
"""The budget the stand-in engine refuses (as the engine refuses bad input)."""


class Engine:
    """What the pool reads of an engine: its guard, its backend; ``derive`` as the engine derives request sections."""

    def __init__(self, config, guard=None):
        self.config = SimpleNamespace(repeat_terminate=RepeatTerminateConfig(**(guard or {})))
        self.backend = SimpleNamespace(load_decisions={}, name=config["backend"] if config else "hf")

    def derive(self, **sections):
        return Engine(None, sections.get("repeat_terminate"))

    def generate(self, requests, *, options=None, stop=None, plugins=None):
        from engine.errors import RequestError

        if (options or {}).get("max_new_tokens") == REFUSED:
            raise RequestError("generation.max_new_tokens", REFUSED, "is refused by the stand-in", fix="ask less")
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

        def infer(self, requests, *, engine, adapter=None):
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


class Server:
    def __init__(self):
        self.url, self.process = "http://127.0.0.1:1", SimpleNamespace(poll=lambda: None)


def replaying_pool(pool, monkeypatch, answer):
    """``pool`` whose servers are stand-ins and whose client answers with ``answer(requests, engine)``; returns the
    list of what each call sent, in order, with the thread that sent it (the replay turned on: it is off by default)."""
    import threading

    monkeypatch.setenv("ENGINE_TWIN_REPLAY", "1")

    import engine.client

    sent = []

    def infer(requests, engine, adapter):
        sent.append((engine["options"]["max_new_tokens"], threading.current_thread().name))
        return answer(requests, engine)

    monkeypatch.setattr(engine.client, "RolloutClient", stand_in_client(infer))
    monkeypatch.setattr("conformance.subjects.served.assert_served_equal", lambda served, local, what: None)
    server = Server()
    pool.servers.server = lambda key, config: server
    return sent


def stand_in_client(infer):
    """A ``RolloutClient`` stand-in whose ``infer`` is ``infer(requests, engine, adapter)``."""

    class Client:
        def __init__(self, url, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def infer(self, requests, *, engine, adapter=None):
            return infer(requests, engine, adapter)

    return Client


def test_a_served_variant_gets_its_in_process_calls_replayed_at_once_before_it_asks(pool, monkeypatch):
    sent = replaying_pool(pool, monkeypatch, lambda requests, engine: ["served"] * len(requests))
    twin, prompt = pool.engine("hf", "/models/text"), [[{"role": "user", "content": "Hi"}]]
    pool.reach.check = "m.py::check []"
    for n in (1, 2, 3):
        twin.generate(prompt, options={"max_new_tokens": n})
    assert sent == [] and len(pool.reach.scripts["m.py::check []"]) == 3  # in-process: nothing served yet
    pool.reach.how = SERVED
    assert pool.reach.replay() == 3
    got = [twin.generate(prompt, options={"max_new_tokens": n}) for n in (1, 2, 3)]
    assert got == [["served"]] * 3 and pool.reach.served_calls == 3
    assert sorted(n for n, _ in sent) == [1, 2, 3] and all(t.startswith("twin-replay") for _, t in sent)
    twin.generate(prompt, options={"max_new_tokens": 4})  # not in the script: asked when made
    assert sent[-1] == (4, "MainThread") and pool.reach.served_calls == 4
    pool.reach.close()



def test_with_the_replay_off_by_default_no_script_is_kept_and_each_call_is_asked_when_made(pool, monkeypatch):
    sent = replaying_pool(pool, monkeypatch, lambda requests, engine: ["served"] * len(requests))
    monkeypatch.delenv("ENGINE_TWIN_REPLAY")
    twin, prompt = pool.engine("hf", "/models/text"), [[{"role": "user", "content": "Hi"}]]
    pool.reach.check = "m.py::check []"
    twin.generate(prompt, options={"max_new_tokens": 1})
    assert pool.reach.scripts == {}  # the in-process variant's calls are not held for a replay that never comes
    pool.reach.how = SERVED
    assert pool.reach.replay() == 0 and sent == []
    assert twin.generate(prompt, options={"max_new_tokens": 1}) == ["served"] and sent == [(1, "MainThread")]
    pool.reach.close()

def test_a_replayed_call_whose_server_went_away_is_asked_again_and_a_refusal_stays_one(pool, monkeypatch):
    from engine.client import RolloutServerError
    from engine.errors import RequestError

    failures = {"left": 1}

    def answer(requests, engine):
        budget = engine["options"]["max_new_tokens"]
        if budget == 1 and failures["left"]:
            failures["left"] -= 1
            raise RolloutServerError("http://127.0.0.1:1/infer/ could not be reached")
        if budget == REFUSED:
            raise RolloutServerError("/infer/ answered 400: generation.max_new_tokens")
        return ["served"] * len(requests)

    sent = replaying_pool(pool, monkeypatch, answer)
    twin, prompt = pool.engine("hf", "/models/text"), [[{"role": "user", "content": "Hi"}]]
    pool.reach.check = "m.py::check []"
    twin.generate(prompt, options={"max_new_tokens": 1})
    with pytest.raises(RequestError):
        twin.generate(prompt, options={"max_new_tokens": REFUSED})
    pool.reach.how = SERVED
    assert pool.reach.replay() == 2
    assert twin.generate(prompt, options={"max_new_tokens": 1}) == ["served"]
    assert [n for n, _ in sent].count(1) == 2, "the call whose server did not answer was not asked again"
    with pytest.raises(RequestError):  # refused in-process, and a 400 from the server: the engine's error
        twin.generate(prompt, options={"max_new_tokens": REFUSED})
    assert [n for n, _ in sent].count(REFUSED) == 1 and pool.reach.served_calls == 2
    pool.reach.close()


@pytest.mark.parametrize(("later", "ahead"), [(frozenset({"vllm"}), ["vllm"]), (frozenset(), []),
                                              (None, ["llamacpp", "vllm"])])
def test_servers_start_ahead_only_for_the_backends_the_checks_later_variants_run_on(monkeypatch, later, ahead):
    """A per-backend check's server starts the same server of the backends its later variants run on, in the
    background (``ahead_for``, set per check by the reach fixture); a cross-backend check's (None) of every one."""
    import engine
    import engine.client

    monkeypatch.setattr(engine, "GenerationEngine", Engine)
    launched = []
    monkeypatch.setattr(engine.client, "launch_server",
                        lambda config, **_: launched.append(config["backend"]) or SimpleNamespace(
                            stop=lambda: None, process=SimpleNamespace(poll=lambda: 0)))
    pool = EnginePool(PoolOptions(backends=("hf", "llamacpp", "vllm"), model="/models/text", vlm_model="/m/vlm",
                                  dtype="float32", device="cpu", gguf_models=(("/models/text", "/models/t.gguf"),)))
    servers = pool.servers
    servers.ahead_backends, servers.ahead_for = frozenset({"hf", "llamacpp", "vllm"}), later
    servers.server(*servers.served_config("hf", "/models/text", generation={"max_new_tokens": 4}))
    servers.close()
    assert sorted(launched) == sorted(["hf", *ahead])  # the ahead ones start in threads, in any order


def test_a_tiny_fixtures_servers_take_turns_among_themselves_two_at_a_time(monkeypatch, tmp_path):
    """``TINY_SERVERS_PER_BACKEND``: on HF a tiny model's servers (the engine pool's tiny KV cache) stop only each
    other, beyond two, and a full-size model's only full-size ones; on vLLM each server takes turns with all others."""
    import json as json_

    import engine
    import engine.client

    def folder(name, hidden, layers):
        path = tmp_path / name
        path.mkdir()
        path.joinpath("config.json").write_text(json_.dumps({
            "hidden_size": hidden, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": layers,
            "max_position_embeddings": 2048}))
        return str(path)

    tiny, full = folder("tiny", 128, 2), folder("full", 576, 30)
    monkeypatch.setattr(engine, "GenerationEngine", Engine)
    stopped = []

    class FakeServer:
        def __init__(self, config, **_):
            self.name = (config["model"]["path"].rsplit("/", 1)[-1], config["generation"]["max_new_tokens"])

        def stop(self):
            stopped.append(self.name)

    monkeypatch.setattr(engine.client, "launch_server", FakeServer)
    pool = EnginePool(PoolOptions(backends=("hf", "vllm"), model=full, vlm_model="/m/vlm", dtype="float32",
                                  device="cpu"))
    servers = pool.servers
    for model, budget in ((tiny, 1), (tiny, 2), (full, 3), (full, 4), (tiny, 5)):
        servers.server(*servers.served_config("hf", model, generation={"max_new_tokens": budget}))
    assert stopped == [("full", 3), ("tiny", 1)]
    stopped.clear()  # vLLM's tiny servers take turns with its full-size ones (memory; a card share on CUDA)
    for model, budget in ((tiny, 6), (full, 7)):
        servers.server(*servers.served_config("vllm", model, generation={"max_new_tokens": budget}))
    assert stopped == [("tiny", 6)]


def test_a_server_started_ahead_for_nobody_is_not_started_ahead_again(monkeypatch):
    """A cross-backend check that sizes each backend its own way (the processed-logprobs checks: vLLM's engine with
    its own context length) makes the guess from another backend's config wrong; after the first round those
    servers are no longer started ahead, and the servers the checks ask for are the only ones that start."""
    import engine
    import engine.client

    monkeypatch.setattr(engine, "GenerationEngine", Engine)
    launched = []
    def launch(config, **_):
        launched.append((config["backend"], config["model"].get("logprobs_mode"), config["model"].get("max_model_len")))
        return SimpleNamespace(stop=lambda: None, process=SimpleNamespace(poll=lambda: 0))

    monkeypatch.setattr(engine.client, "launch_server", launch)
    pool = EnginePool(PoolOptions(backends=("hf", "vllm"), model="/models/text", vlm_model="/m/vlm",
                                  dtype="float32", device="cpu"))
    servers = pool.servers
    servers.ahead_backends = frozenset({"hf", "vllm"})
    processed = {"logprobs_mode": "processed_logprobs"}
    for _ in range(3):  # three checks, each asking for both backends' processed servers
        servers.server(*servers.served_config("hf", "/models/text", model=processed))
        servers.server(*servers.served_config("vllm", "/models/text", model={**processed, "max_model_len": 2048}))
        servers.server(*servers.served_config("hf", "/models/text"))  # a text check between (hf's kept server)
    servers.close()
    mode = processed["logprobs_mode"]
    wrong = [("hf", mode, 2048), ("vllm", mode, None)]  # each backend's server of the other's config
    asked = [("hf", mode, None), ("vllm", mode, 2048)]
    assert {k for k in launched if k[1] == mode} == {*wrong, *asked}
    assert [launched.count(w) for w in wrong] == [1, 1], launched


def test_a_check_that_asks_every_backend_alike_gets_the_server_started_ahead_for_it(monkeypatch, tmp_path):
    """The processed-logprobs checks name only a small vLLM KV cache, with the same sections for every backend: the
    pool gives vLLM the context that fits (``context_that_fits``), so the server started ahead for vLLM while HF's
    check runs is the one vLLM's check asks for, and nothing is started for nobody."""
    import json as json_

    import engine
    import engine.client

    model = tmp_path / "smollm2-shape"
    model.mkdir()
    model.joinpath("config.json").write_text(json_.dumps({
        "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
        "max_position_embeddings": 8192}))
    monkeypatch.setattr(engine, "GenerationEngine", Engine)
    launched = []

    def launch(config, **_):
        launched.append((config["backend"], config["model"].get("max_model_len")))
        return SimpleNamespace(stop=lambda: None, process=SimpleNamespace(poll=lambda: 0))

    monkeypatch.setattr(engine.client, "launch_server", launch)
    pool = EnginePool(PoolOptions(backends=("hf", "vllm"), model=str(model), vlm_model="/m/vlm",
                                  dtype="float32", device="cpu"))
    servers = pool.servers
    servers.ahead_backends = frozenset({"hf", "vllm"})
    sections = {"model": {"logprobs_mode": "processed_logprobs"},
                "vllm": {**pool.config("vllm", str(model))["vllm"], "cpu_kv_cache_space_gib": 0.125}}
    for backend in ("hf", "vllm"):
        servers.server(*servers.served_config(backend, str(model), **sections))
    servers.close()
    assert sorted(launched) == [("hf", None), ("vllm", 2048)]
    assert not servers.wrong_guesses and not [s for s in pool.bill.starts if s[0] == "ahead, unused"]


def test_only_a_kv_cache_a_check_shrinks_gets_a_shorter_context(tmp_path):
    """``context_that_fits`` applies where a check shrinks vLLM's KV cache below the pool's; a model whose context the
    pool's own cache cannot hold keeps its context, so vLLM refuses it by name instead of the pool cutting it."""
    import json as json_

    long = tmp_path / "long-context"
    long.mkdir()
    long.joinpath("config.json").write_text(json_.dumps({
        "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
        "max_position_embeddings": 32768}))  # 1.4 GiB of float32 KV at full length: more than the pool's 0.5
    pool = EnginePool(PoolOptions(backends=("hf", "vllm"), model=str(long), vlm_model="/m/vlm", dtype="float32",
                                  device="cpu"))
    assert "max_model_len" not in pool.config("vllm", str(long))["model"]
    small = {**pool.config("vllm", str(long))["vllm"], "cpu_kv_cache_space_gib": 0.125}
    assert pool.config("vllm", str(long), vllm=small)["model"]["max_model_len"] == 2048
    assert "max_model_len" not in pool.config("hf", str(long), vllm=small)["model"]


def test_the_bill_counts_each_module_that_reaches_an_engine_directly_or_through_a_fixture(pool):
    pool.bill.user = "test_a.py"
    plain = pool.engine("hf", "/models/text")
    pool.engine("hf", "/models/text", repeat_terminate=GUARD)  # derived: counts for the engine it shares
    pool.bill.user = "test_b.py"  # reaches the engine through a session fixture built for test_a.py
    pool.count_fixture_users([{"hf": plain}, "unrelated", 3])
    pool.bill.user = "test_c.py"
    pool.count_fixture_users([("no", "twins")])
    [(subject, users)] = pool.bill.users.items()
    assert subject == ("engine", "hf /models/text") and users == {"test_a.py", "test_b.py"}
    assert pool.bill.plan_lines()[1] == "  engine hf /models/text: 1 starts, 2 modules: test_a.py test_b.py"


def test_an_engine_or_server_its_module_did_not_declare_fails_the_check_by_name(pool, monkeypatch):
    from conformance.subjects.plan import Roles, engines, servers, uses

    pool.bill.roles = Roles(text="/models/text", vlm="/models/vlm", fixtures="/fixtures")
    pool.bill.user, pool.bill.declared = "test_a.py", uses(engines("text"))
    pool.engine("hf", "/models/text", repeat_terminate=GUARD)  # a guard is per request: the text engine's load
    with pytest.raises(pytest.fail.Exception, match=r'test_a.py asks for engine hf /fixtures/tiny-looper, which its '
                                                    r'SUBJECTS do not declare; fix: add engines\("tiny-looper"\)'):
        pool.engine("hf", "/fixtures/tiny-looper")
    with pytest.raises(pytest.fail.Exception, match=r"fix: add engines\(\"text\", hf=\{'max_batch_size': 2\}\)"):
        pool.engine("hf", "/models/text", hf={"max_batch_size": 2})
    twin = pool.engine("hf", "/models/text")
    with pytest.raises(pytest.fail.Exception, match=r'fix: add servers\("text"\)'):
        pool.servers.server(*pool.servers.served_config("hf", "/models/text"))
    pool.bill.declared = uses(engines("text"), servers("text"))
    launched = []
    monkeypatch.setattr("engine.client.launch_server", lambda config, **_: launched.append(config) or 1)
    assert twin.server() == 1 and len(launched) == 1  # declared: started


def test_a_server_handed_over_is_the_checks_and_a_later_ask_starts_another(monkeypatch):
    """The SIGTERM check (``ends_servers``) is handed the pool's running text server instead of starting its own; the
    pool forgets it (it never stops or reuses a server the check killed), and one asked for later is new."""
    import engine
    import engine.client

    monkeypatch.setattr(engine, "GenerationEngine", Engine)
    launched = []

    def launch(config, **_):
        launched.append(SimpleNamespace(stopped=0, process=SimpleNamespace(poll=lambda: None, terminate=lambda: None)))
        launched[-1].stop = lambda timeout=None, s=launched[-1]: setattr(s, "stopped", s.stopped + 1)
        return launched[-1]

    monkeypatch.setattr(engine.client, "launch_server", launch)
    pool = EnginePool(PoolOptions(backends=("hf", "vllm"), model="/models/text", vlm_model="/m/vlm",
                                  dtype="float32", device="cpu"))
    servers = pool.servers
    key, config = servers.served_config("hf", "/models/text")
    shared = servers.server(key, config)  # the twins' server, up before the check
    handed = servers.hand_over(key, config)
    assert handed is shared and len(launched) == 1, "the running server must be handed over, not a new one started"
    assert config["serve"]["drain_timeout_s"] == 1, "the SIGTERM check's stream must outlast the server's drain"
    again = servers.server(key, config)
    assert again is not handed and len(launched) == 2
    servers.close()
    assert handed.stopped == 0 and again.stopped == 1, "the pool stopped a server it had handed over"
    totals = pool.report()[-1]
    assert "2 server starts" in totals and "1 handed over (not a start)" in totals, totals


def test_a_prefetched_text_server_is_the_one_the_first_check_gets_and_never_displaces_a_running_one(monkeypatch):
    """The session plan starts the text servers in the background at the first check (``ServerPool.prefetch``): the
    check that first asks for one gets that server, not a second start; on vLLM, whose servers take turns, a prefetch
    that would stop a running server starts nothing."""
    import engine
    import engine.client

    monkeypatch.setattr(engine, "GenerationEngine", Engine)
    launched = []

    def launch(config, **_):
        launched.append(SimpleNamespace(config=config, stop=lambda timeout=None: None,
                                        process=SimpleNamespace(poll=lambda: 0, terminate=lambda: None)))
        return launched[-1]

    monkeypatch.setattr(engine.client, "launch_server", launch)
    pool = EnginePool(PoolOptions(backends=("hf", "vllm"), model="/models/text", vlm_model="/m/vlm",
                                  dtype="float32", device="cpu"))
    servers = pool.servers
    assert servers.prefetch("hf", "/models/text") is True
    assert servers.prefetch("hf", "/models/text") is False, "one start per server"
    got = servers.server(*servers.served_config("hf", "/models/text"))
    assert launched == [got]
    processed = {"logprobs_mode": "processed_logprobs"}
    other = servers.server(*servers.served_config("vllm", "/models/text", model=processed))
    assert servers.prefetch("vllm", "/models/text") is False, "it would have stopped the running vLLM server"
    assert launched == [got, other]
    servers.close()
    assert not [s for s in pool.bill.starts if s[0] == "ahead, unused"]


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="SCHED_IDLE is Linux's scheduling class")
def test_a_server_started_ahead_starts_idle_and_serves_its_check_at_normal_priority(monkeypatch):
    """A prefetched server's process starts in the idle class (it takes a core only while the checks leave one idle)
    and the check that needs it gets it back in the normal class, its start still going or done."""
    import os
    import subprocess
    import sys
    import threading

    import engine
    import engine.client

    monkeypatch.setattr(engine, "GenerationEngine", Engine)
    seen, go = {}, threading.Event()
    own = os.sched_getscheduler(0)  # CI runs the unit tests themselves in the idle class

    def launch(config, on_start=None):
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        handle = SimpleNamespace(process=process, stop=lambda timeout=None: process.kill() or process.wait())
        on_start(handle)
        seen["while starting"] = os.sched_getscheduler(process.pid)
        go.wait(30)  # still starting: the check below waits for it
        return handle

    monkeypatch.setattr(engine.client, "launch_server", launch)
    pool = EnginePool(PoolOptions(backends=("hf",), model="/models/text", vlm_model="/m/vlm", dtype="float32",
                                  device="cpu"))
    servers = pool.servers
    assert servers.prefetch("hf", "/models/text")
    for _ in range(300):
        if "while starting" in seen:
            break
        threading.Event().wait(0.1)
    assert seen["while starting"] == os.SCHED_IDLE, "a server started ahead must start in the idle class"
    threading.Timer(1.0, go.set).start()
    server = servers.server(*servers.served_config("hf", "/models/text"))
    try:
        assert os.sched_getscheduler(server.process.pid) == os.SCHED_OTHER, "the check got an idle-class server"
        assert os.sched_getscheduler(0) == own, "the check's own thread must keep its class"
    finally:
        servers.close()


def test_a_server_still_starting_ahead_that_no_check_asked_for_is_stopped_not_waited_for(monkeypatch):
    """At the session's end, a prefetched server that is still starting is terminated: the run does not wait for it
    to serve only to stop it (the kit's run waited 39 s for vLLM's that way), and the bill says it went unused."""
    import subprocess
    import sys
    import threading
    import time

    import engine
    import engine.client
    from engine.client import RolloutServerError

    monkeypatch.setattr(engine, "GenerationEngine", Engine)
    started = threading.Event()

    def launch(config, on_start=None):
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        on_start(SimpleNamespace(process=process))
        started.set()
        process.wait()  # "serving" never comes: only its end
        raise RolloutServerError(f"the server exited with code {process.returncode} before serving")

    monkeypatch.setattr(engine.client, "launch_server", launch)
    pool = EnginePool(PoolOptions(backends=("hf",), model="/models/text", vlm_model="/m/vlm", dtype="float32",
                                  device="cpu"))
    assert pool.servers.prefetch("hf", "/models/text") and started.wait(30)
    began = time.monotonic()
    pool.servers.close()
    assert time.monotonic() - began < 10, "the pool waited for a start no check needed"
    assert [kind for kind, _, _ in pool.bill.starts] == ["ahead, unused"], pool.bill.starts


def test_a_call_mixing_adapters_goes_as_one_infer_per_adapter_and_comes_back_in_order(pool, monkeypatch):
    """``/infer/`` takes one adapter per call (swift's ``adapter_request``): a twin's call whose rows name different
    adapters is sent as one ``/infer/`` per adapter (the call's ``adapter=`` for rows naming none), and each row's
    answer put back in its place."""
    import engine.client
    from engine.types import ChatRequest

    sent = []

    def infer(requests, engine, adapter):
        sent.append((adapter, [r[0]["content"] for r in requests], "adapter" in engine))
        return [f"{adapter}:{r[0]['content']}" for r in requests]

    monkeypatch.setattr(engine.client, "RolloutClient", stand_in_client(infer))
    monkeypatch.setattr("conformance.subjects.served.assert_served_equal", lambda served, local, what: None)
    pool.servers.server = lambda key, config: Server()
    twin = pool.engine("hf", "/models/text")
    rows = [[{"role": "user", "content": str(i)}] for i in range(4)]
    mixed = [ChatRequest(tuple(rows[0]), adapter="r8"), rows[1], ChatRequest(tuple(rows[2]), adapter="r16"),
             ChatRequest(tuple(rows[3]), adapter="r8")]
    answers = twin.ask_server("http://127.0.0.1:1", mixed, {"options": {"max_new_tokens": 4}, "adapter": "base8"})
    assert answers == ["r8:0", "base8:1", "r16:2", "r8:3"]
    assert sorted(sent) == [("base8", ["1"], False), ("r16", ["2"], False), ("r8", ["0", "3"], False)]
    with pytest.raises(AssertionError, match="only a ChatRequest's messages and adapter travel"):
        twin.ask_server("http://127.0.0.1:1", [ChatRequest(tuple(rows[0]), seed=3)], {})


def test_a_call_with_a_row_of_its_own_seed_stays_in_process_under_the_served_reach(pool, monkeypatch):
    """A ``ChatRequest`` with its own seed has no ``/infer/`` field: the twin runs that call in process only (the
    check's other calls still reach the server), never a request that drops the seed."""
    import engine.client
    from engine.types import ChatRequest

    sent = []
    monkeypatch.setattr(engine.client, "RolloutClient",
                        stand_in_client(lambda requests, engine, adapter: sent.append(requests) or ["s"]))
    monkeypatch.setattr("conformance.subjects.served.assert_served_equal", lambda served, local, what: None)
    pool.servers.server = lambda key, config: Server()
    twin = pool.engine("hf", "/models/text")
    pool.reach.how = SERVED
    row = ({"role": "user", "content": "Hi"},)
    assert twin.generate([ChatRequest(row, seed=3)]) == ["in-process False"]
    assert sent == [] and pool.reach.served_calls == 0
    assert twin.generate([list(row)]) == ["s"] and pool.reach.served_calls == 1
