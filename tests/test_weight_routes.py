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

    def open_weights(self, host, port, world_size, transport, timeout_s=300.0, *, learner_rank=None, packed=None,
                     secret=None):
        self.secret = secret
        first = " trainer-first" if learner_rank == 0 else ""
        self.calls.append(f"open {host}:{port} {world_size} {transport}{first}")  # the join: a thread of its own

    def check_announced(self, announced):
        pass

    def load_weights(self, announced, within_s=300.0):
        listed = announced.get("metadatas") or announced.get("tensors")
        self._note("load " + (announced["name"] if "name" in announced else f"{len(listed)} tensors"))
        if announced.get("name") == "broken":
            raise RuntimeError("the learner sent nothing")
        return 1

    def receive_adapter(self, announced, folder, config, within_s=300.0):
        self._note("receive adapter")
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

    def load_checkpoint(self, path):
        self._note(f"checkpoint {path}")
        return 2


class Engine:
    def __init__(self, backend, serve=None) -> None:
        self.config = EngineConfig.from_dict({"backend": "hf", "model": {"path": "/models/m"}, "serve": serve or {}})
        self.backend, self.tokenizer = backend, None
        self._batcher = AsyncBatcher(backend)

    def batcher(self):
        return self._batcher

    def prepare(self, requests, **kwargs):  # the engine's checks: nothing to refuse here
        return None

    async def agenerate(self, requests, **kwargs):
        self.backend.calls.append("generate")
        if "slow" in str(requests[0]):
            await asyncio.sleep(0.3)
            self.backend.calls.append("generated slowly")
        return [ANSWER for _ in requests]


def session(backend, calls, serve=None):
    app = create_app(ServedEngine(Engine(backend, serve), Activation(None, "test")), close_engine=False)

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
        ("POST", "/update_flattened_params/", {"metadatas": META}), ("POST", "/process_weights_after_loading/", None),
        INFER, ("POST", "/reset_prefix_cache/", None), ("POST", "/reset_encoder_cache/", None),
        ("POST", "/reset_mm_cache/", None), ("GET", "/get_model_state_keys/", None),
        ("POST", "/close_communicator/", None)])
    assert [r.status_code for r in replies] == [200] * 10
    assert replies[8].json() == {"keys": ["a", "b"]}
    assert backend.calls == ["open 127.0.0.1:29500 2 tcp", "load a", "load 2 tensors", "finish", "generate",
                             "reset prefix", "reset encoder", "reset mm", "keys", "close"]
    assert backend.threads == {"engine-batcher_0"}, "the model is touched only between two generate calls"


def test_a_push_waits_for_the_generations_in_flight():
    """A push that arrives while a generation runs loads only after it ended (vLLM's layerwise reload under a
    generating batch killed its engine core): that row runs wholly on the old weights."""
    backend = Recording()
    app = create_app(ServedEngine(Engine(backend), Activation(None, "test")), close_engine=False)
    slow = {"infer_requests": [{"messages": [{"role": "user", "content": "slow"}]}]}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine.test") as client:
            await client.post(OPEN[1], json=OPEN[2])
            generating = asyncio.ensure_future(client.post("/infer/", json=slow))
            await asyncio.sleep(0.05)
            pushed = await client.post("/update_named_param/", json={"name": "a", "dtype": "torch.float32",
                                                                      "shape": [2]})
            done = await generating
            settled = await client.post("/reset_prefix_cache/")
            return [pushed.status_code, done.status_code, settled.status_code]

    assert asyncio.run(run()) == [200, 200, 200]
    assert backend.calls[1:] == ["generate", "generated slowly", "load a", "finish", "reset prefix"]


def test_a_generation_arriving_mid_session_waits_for_the_whole_step():
    """A generation that arrives between two pushes of one training step waits for the learner's cache reset (the
    end of the step): it never runs on a half-pushed model."""
    backend = Recording()
    app = create_app(ServedEngine(Engine(backend), Activation(None, "test")), close_engine=False)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine.test") as client:
            await client.post(OPEN[1], json=OPEN[2])
            await client.post("/update_named_param/", json={"name": "a", "dtype": "torch.float32", "shape": [2]})
            waiting = asyncio.ensure_future(client.post(INFER[1], json=INFER[2]))
            await asyncio.sleep(0.1)
            await client.post("/update_flattened_params/", json={"metadatas": META})
            await client.post("/reset_prefix_cache/")
            return (await waiting).status_code

    assert asyncio.run(run()) == 200
    assert backend.calls[1:] == ["load a", "load 2 tensors", "finish", "reset prefix", "generate"] or \
        backend.calls[1:] == ["load a", "load 2 tensors", "finish", "generate", "reset prefix"]


def test_a_failed_push_is_the_next_weight_calls_never_a_generations():
    """A load that fails in the background (after its 200) is answered to the learner's next weight call; the
    generation between them runs (the session is ended first) and gets its 200."""
    backend = Recording()
    replies = session(backend, [OPEN, ("POST", "/update_named_param/", {"name": "broken", "dtype": "torch.float32",
                                                                         "shape": [2]}),
                                INFER, ("POST", "/reset_prefix_cache/", None), ("POST", "/reset_prefix_cache/", None)],
                      serve={"weight_sync_session_timeout_s": 0.2})  # the generation ends the silent session
    assert [r.status_code for r in replies] == [200, 200, 200, 500, 200]
    assert "the learner sent nothing" in replies[3].json()["error"]["message"]
    assert backend.calls[1:] == ["load broken", "finish", "generate", "reset prefix"]


@pytest.mark.parametrize(("host", "opened"), [("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"), ("127.0.0.1", "127.0.0.1"),
                                              ("203.0.113.9", None), ("127.evil.example", None)])
def test_the_group_store_listens_only_on_loopback_or_the_servers_own_address(host, opened):
    """swift's client asks for the wildcard; the store then listens where the HTTP server does (127.0.0.1 here),
    never on every interface of a server that serves loopback only, nor on an address a client names."""
    backend = Recording()
    reply, _closed = session(backend, [("POST", "/init_communicator/", {**OPEN[2], "host": host}),
                                       ("POST", "/close_communicator/", None)])
    if opened is None:
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "host" and backend.calls == ["close"]
    else:
        assert reply.status_code == 200 and backend.calls == [f"open {opened}:29500 2 tcp", "close"]


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
    ("/update_named_param/", {"name": "a", "dtype": "torch.qint8", "shape": [2]}, "dtype"),
    ("/update_named_param/", {"name": "a", "dtype": "torch.float32", "shape": [10**30]}, "shape"),
    ("/update_flattened_params/", {"metadatas": [{**META[0], "end_idx": "8"}]}, "metadatas[0].end_idx"),
    ("/update_flattened_params/", {"metadatas": [{**META[0], "end_idx": 10**300}]}, "metadatas[0].end_idx"),
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


TRANSFER_OPEN = ("POST", "/init_weight_transfer_engine", {"init_info": {
    "master_address": "127.0.0.1", "master_port": 29501, "rank_offset": 1, "world_size": 2, "transport": "tcp"}})
LISTED = {"update_info": {"names": ["a", "b"], "dtype_names": ["float32", "float16"], "shapes": [[2], [1]]}}


def test_vllms_routes_open_the_trainers_group_hold_generations_for_the_update_and_name_the_version():
    backend = Recording()
    replies = session(backend, [
        TRANSFER_OPEN, ("POST", "/start_weight_update", {}), ("POST", "/update_weights", LISTED),
        ("POST", "/finish_weight_update", {"weight_version": "step-7"}), INFER, ("GET", "/weight_info", None),
        ("POST", "/reset_prefix_cache", None), ("POST", "/shutdown_weight_transfer_engine", None)])
    assert [r.status_code for r in replies] == [200] * 8, [r.text for r in replies]
    assert replies[5].json() == {"weight_version": "step-7"}
    assert backend.calls == ["open 127.0.0.1:29501 2 tcp trainer-first", "load 2 tensors", "finish", "generate",
                             "reset prefix", "close"]


@pytest.mark.parametrize(("route", "body", "field"), [
    ("/init_weight_transfer_engine", {"init_info": {**TRANSFER_OPEN[2]["init_info"], "rank_offset": 2}},
     "init_info.rank_offset"),
    ("/init_weight_transfer_engine", {"init_info": {**TRANSFER_OPEN[2]["init_info"], "master_address": "8.8.8.8"}},
     "init_info.master_address"),
    ("/init_weight_transfer_engine", {"init_info": {**TRANSFER_OPEN[2]["init_info"], "packed": True}},
     "init_info.packed"),
    ("/init_weight_transfer_engine", {"init_info": {**TRANSFER_OPEN[2]["init_info"], "nccl_unique_id_b64": "AA=="}},
     "init_info.nccl_unique_id_b64"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent"}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/tmp", "abort_all_requests": True}, "abort_all_requests"),
])
def test_vllms_routes_refuse_a_malformed_call_by_field_before_any_backend_call(route, body, field):
    backend = Recording()
    reply = session(backend, [("POST", route, body)])[0]
    assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text
    assert backend.calls == []


def test_an_update_before_the_group_is_open_is_a_conflict_and_a_listed_update_checks_its_lists():
    backend = Recording()
    early, opened, uneven = session(backend, [
        ("POST", "/update_weights", LISTED), TRANSFER_OPEN,
        ("POST", "/update_weights", {"update_info": {**LISTED["update_info"], "shapes": [[2]]}})])
    assert early.status_code == 409 and "init_weight_transfer_engine" in early.text
    assert opened.status_code == 200
    assert uneven.status_code == 400 and uneven.json()["error"]["param"] == "update_info.shapes"
    assert backend.calls == ["open 127.0.0.1:29501 2 tcp trainer-first"]


def test_a_reset_with_no_weights_loaded_since_drops_nothing_and_a_disk_reload_makes_every_cache_stale(tmp_path):
    """Resets posted back to back drained every row in flight (hostile round 3): a cache is reset once per load."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    backend = Recording()
    replies = session(backend, [
        ("POST", "/reset_prefix_cache/", None), ("POST", "/update_weights_from_disk", {"model_path": str(tmp_path)}),
        ("POST", "/reset_prefix_cache/", None), ("POST", "/reset_encoder_cache/", None),
        ("POST", "/reset_encoder_cache/", None)])
    assert [r.status_code for r in replies] == [200] * 5, [r.text for r in replies]
    assert "kept" in replies[0].json()["message"] and "kept" in replies[2].json()["message"]
    assert replies[1].json() == {"success": True, "message": f"loaded 2 tensors from {tmp_path}",
                                 "num_paused_requests": 0}
    assert backend.calls == [f"checkpoint {tmp_path}", "reset prefix", "reset encoder"]


def test_a_session_that_outlives_its_bound_is_ended_by_the_next_generation():
    """A learner that keeps a session open (pushes, no finish) holds generations at most
    ``serve.weight_sync_session_max_s``; then the generation ends it and runs."""
    import time

    backend = Recording()
    start = time.monotonic()
    replies = session(backend, [
        TRANSFER_OPEN, ("POST", "/start_weight_update", {}), ("POST", "/update_weights", LISTED), INFER],
        serve={"weight_sync_session_timeout_s": 30, "weight_sync_session_max_s": 0.5})
    assert [r.status_code for r in replies] == [200] * 4
    assert backend.calls[-2:] == ["finish", "generate"], backend.calls
    assert time.monotonic() - start < 20


def test_every_weight_route_is_counted_in_metrics_by_status_and_not_timed_as_a_generation():
    """swift's and vLLM's weight routes answer through the one control path: each answer is a ``weights`` sample of
    ``engine_requests_total`` by status (a refusal included), and none enters the generation latency histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    backend = Recording()
    replies = session(backend, [OPEN, ("POST", "/init_communicator/", {**OPEN[2], "port": 0}),
                                ("GET", "/weight_info", None), ("GET", "/metrics", None)])
    assert [r.status_code for r in replies] == [200, 400, 200, 200]
    samples = [s for f in text_string_to_metric_families(replies[-1].text) for s in f.samples]
    counted = {s.labels["status"]: s.value for s in samples
               if s.name == "engine_requests_total" and s.labels.get("endpoint") == "weights"}
    assert counted == {"200": 2, "400": 1}, counted
    timed = [s.value for s in samples if s.name == "engine_request_latency_seconds_count"]
    assert timed == [0], timed


def test_the_opening_call_hands_out_the_groups_secret_and_the_backend_gets_the_same():
    """On ``tcp`` the group's store carries only values sealed with a secret drawn per group: the keyed opening call
    answers it (``group_secret``) and the backend joins with it; a second group gets another."""
    backend = Recording()
    first, second, _closed = session(backend, [OPEN, OPEN, ("POST", "/close_communicator/", None)])
    assert first.status_code == 200 and second.status_code == 200
    secrets_ = first.json()["group_secret"], second.json()["group_secret"]
    assert len(secrets_[0]) == 64 and secrets_[0] != secrets_[1] and backend.secret == secrets_[1]


@pytest.mark.parametrize("key", [None, "k"], ids=["keyless", "keyed"])
def test_a_wildcard_store_needs_the_api_key(key):
    """A server on ``0.0.0.0`` would open the group's store on every interface: refused without an API key."""
    backend = Recording()
    app = create_app(ServedEngine(Engine(backend, {"host": "0.0.0.0"}), Activation(None, "test"), api_key=key),
                     close_engine=False)
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine.test",
                                     headers=headers) as client:
            reply = await client.post("/init_communicator/", json={**OPEN[2], "host": "0.0.0.0"})
            await client.post("/close_communicator/")  # waits for the background join's start
            return reply

    reply = asyncio.run(run())
    if key is None:
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "host", reply.text
        assert "API key" in reply.json()["error"]["message"]
    else:
        assert reply.status_code == 200 and "0.0.0.0:29500" in backend.calls[0], reply.text


def test_starts_without_a_push_cannot_restart_the_session_bound(monkeypatch, caplog):
    """Hostile round 4: ``/start_weight_update`` every 15 s on a group nobody joins held an ordinary request 100 s
    with a 40 s bound (each start ended the old session and aged the new one from zero). Sessions that never got a
    tensor are aged from the first of them: here the bound is 6 s and three starts at 0, 3 and 6 s, so at 7 s the
    session is over (aged from the last start it would have 5 s left) and the next generation ends it at once.

    The weight module's clock is the test's (wall time beside CI's quick tier is not the server's to promise: a
    generation that should run at once waited 3.5 s there), so the check is the rule's, not the machine's speed."""
    from engine.serve.rollout import weights

    now = [0.0]
    monkeypatch.setattr(weights, "time", SimpleNamespace(monotonic=lambda: now[0]))
    backend = Recording()
    served = ServedEngine(Engine(backend, {"weight_sync_session_max_s": 6}), Activation(None, "test"))
    app = create_app(served, close_engine=False)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine.test") as client:
            assert (await client.post(TRANSFER_OPEN[1], json=TRANSFER_OPEN[2])).status_code == 200
            for at in (0.0, 3.0, 6.0):
                now[0] = at
                assert (await client.post("/start_weight_update")).status_code == 200
            now[0] = 5.9
            early = served.weight_calls.session_over()
            assert early is None, f"the session ended ({early}) before its bound"
            now[0] = 7.0
            late = served.weight_calls.session_over()
            assert late == "open for 6 s in all", f"aged from a later start: at 7 s the session is {late!r}"
            # bounded, so a gate that waits anyway fails rather than hanging the run (this clock stands still)
            return await asyncio.wait_for(client.post(INFER[1], json=INFER[2]), timeout=60)

    reply = asyncio.run(run())
    assert reply.status_code == 200, reply.text
    assert "a weight session open for 6 s in all: ending it before generating" in caplog.text


def test_the_weight_version_is_the_groups_to_set_and_is_printable():
    backend = Recording()
    keyless, = session(backend, [("POST", "/finish_weight_update", {"weight_version": "evil"})])
    assert keyless.status_code == 409 and "init_weight_transfer_engine" in keyless.text, keyless.text
    _opened, poisoned, fine, info = session(backend, [
        TRANSFER_OPEN, ("POST", "/finish_weight_update", {"weight_version": "a\nforged: line"}),
        ("POST", "/finish_weight_update", {"weight_version": "step-3"}), ("GET", "/weight_info", None)])
    assert poisoned.status_code == 400 and poisoned.json()["error"]["param"] == "weight_version", poisoned.text
    assert fine.status_code == 200 and info.json() == {"weight_version": "step-3"}


PEFT = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize(("path", "body", "status", "says"), [
    ("/update_adapter_flattened_param/", {"peft_config": PEFT, "metadatas": META}, 400, "without LoRA adapters"),
    ("/update_adapter_param/", {"peft_config": PEFT, "lora_tensors_metadata": []}, 400, "lora_tensors_metadata"),
    ("/update_adapter_param/", {"peft_config": PEFT, "lora_tensors_metadata": [{"name": "a", "shape": [2],
                                                                               "dtype": "torch.int8"}]},
     400, "lora_tensors_metadata[0].dtype"),
    ("/update_adapter_flattened_param/", {"peft_config": PEFT, "metadatas": []}, 400, "metadatas"),
    ("/update_adapter_flattened_param/", {"metadatas": META}, 400, "peft_config"),
])
def test_an_adapter_push_is_refused_by_field_before_anything_joins(path, body, status, says):
    backend = Recording()
    (reply,) = session(backend, [("POST", path, body)])
    assert reply.status_code == status and says in reply.text, reply.text
    assert not [c for c in backend.calls if c.startswith("load")]
