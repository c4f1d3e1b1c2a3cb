"""Weight sync on a served engine (issue 28): a learner pushes perturbed weights over swift's routes, and the server's
answers then equal, token for token, an in-process engine loaded from the perturbed checkpoint.

The learner is this test process with :class:`engine.weights.sync.WeightSyncClient` over the ``tcp`` transport (a CPU
host has no NCCL, which swift's own ``VLLMClient`` needs for its broadcasts); ms-swift's real code still builds the
flattened bucket (``FlattenedTensorBucket``) and calls the routes it can call on a CPU host (``VLLMClient``'s
``get_model_state_keys`` and the three cache resets its trainer calls). The prompts are answered once before the
push, so on vLLM their prefixes sit in the prefix cache, computed with the old weights: equal answers after the
push need the reset.
The checks whose server needs no settings of its own share the looper's server per backend with test_served.py
(``conformance/subjects/looper.py``), asking with its start-up guard off, the original checkpoint reloaded after a
check pushed; the under-load check, which kills vLLM's engine core, runs last.
GPU-only, not run here: the ``nccl`` transport with swift's ``VLLMClient.init_communicator`` and its broadcasts.
"""

from __future__ import annotations

import shutil
import time

import pytest

from conformance.subjects.looper import LOOPER_SERVE
from conformance.subjects.looper import NAME as LOOPER
from conformance.subjects.plan import BUILT, engines, kept, processes, uses
from conformance.test_repeat import MIXED
from engine_fixtures import fixture_path

SUBJECTS = uses(
    engines(BUILT),
    kept(LOOPER, why="the looper's server per backend, test_served.py's, whose weights the checks change",
         via="looper_servers"),
    processes("engine.serve server", why="those, and servers of its own: session bounds, an API key"),
)

pytestmark = pytest.mark.slow
PREAMBLE = " ".join(f"Note {i}: the shelf holds {i * 7} jars." for i in range(40))
PROMPTS = [[{"role": "user", "content": f"{PREAMBLE}\n\n{m[-1]['content']}"}] for m in MIXED[:3]]
"""Prompts of about 600 tokens: several full KV blocks each (vLLM's CPU blocks hold 128 tokens), which the first
answers leave in the prefix cache."""
GREEDY = {"max_tokens": 16, "temperature": 0, "return_details": True}
NAMED = "model.layers.0.self_attn.q_proj.weight"
"""Pushed alone (``/update_named_param/``); vLLM fuses it into ``qkv_proj`` when loading."""
BUCKET = ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
          "model.layers.1.mlp.down_proj.weight", "model.norm.weight")
"""Pushed as one swift bucket (``/update_flattened_params/``)."""


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory) -> tuple[str, dict]:
    """The looper fixture with five tensors perturbed (seeded): its folder, and the perturbed tensors."""
    import torch
    from safetensors.torch import load_file, save_file

    source = fixture_path("tiny-looper")
    out = tmp_path_factory.mktemp("weights") / "tiny-looper-perturbed"
    shutil.copytree(source, out)
    tensors = load_file(str(source / "model.safetensors"))
    generator = torch.Generator().manual_seed(28)
    changed = {}
    for name in (NAMED, *BUCKET):
        base = tensors[name]
        changed[name] = base + 0.5 * base.std() * torch.randn(base.shape, generator=generator)
    save_file({**tensors, **changed}, str(out / "model.safetensors"))
    return str(out), changed


UNGUARDED = {"repeat_terminate": {"enabled": False}}
"""The engine extension of every weight check's request: the shared server's start-up guard (test_served's) off, as
the in-process engines they are compared with run unguarded."""


@pytest.fixture
def weight_server(looper_servers, backend):
    """``weight_server()``: this backend's looper server (``conformance/subjects/looper.py``, shared with
    test_served.py), once the check has passed its own skips (so a check that skips starts nothing). A check that
    pushed leaves its weights behind: the next checkout reloads the looper's checkpoint (which resets vLLM's prefix
    cache too); a server a check killed (the under-load check kills vLLM's engine core to see ``/health`` say so; it
    runs last in this file) is started again for the next one."""
    return lambda: looper_servers.checkout(backend, changes_weights=backend != "llamacpp")


def needs_weight_loading(backend: str) -> None:
    """Skip, with the reason, a backend that cannot run here or loads no learner's weights (llama.cpp: refused by
    name, which test_pushed_weights_answer_like_the_perturbed_checkpoint checks)."""
    from conformance.kit.availability import unavailable_reason

    if unavailable_reason(backend):
        pytest.skip(unavailable_reason(backend))
    if backend == "llamacpp":
        pytest.skip("llamacpp loads no learner's weights (refused by name: "
                    "test_pushed_weights_answer_like_the_perturbed_checkpoint)")


def originals(changed: dict) -> dict:
    """The looper's own values of the tensors ``changed`` perturbs: what a round trip pushes back."""
    from safetensors.torch import load_file

    return {name: t for name, t in load_file(str(fixture_path("tiny-looper") / "model.safetensors")).items()
            if name in changed}


def test_pushed_weights_answer_like_the_perturbed_checkpoint(pool, backend, perturbed, weight_server):
    import httpx
    from swift.rlhf_trainers.utils import FlattenedTensorBucket
    from swift.rlhf_trainers.vllm_client import VLLMClient

    from conformance.kit.availability import unavailable_reason
    from engine.client import RolloutClient
    from engine.weights.sync import WeightSyncClient

    if unavailable_reason(backend):
        pytest.skip(unavailable_reason(backend))
    path, changed = perturbed
    handle = weight_server()
    if backend == "llamacpp":  # no weight loading there: refused by name, nothing joins a group
        reply = httpx.post(f"{handle.url}/init_communicator/", json={"host": "127.0.0.1", "port": 29999,
                                                                     "world_size": 2}, timeout=30)
        assert reply.status_code == 400 and "cannot load a learner's weights" in reply.text
        return
    with RolloutClient(handle.url, health_timeout=30) as client:
        before = client.infer(PROMPTS, GREEDY, engine=UNGUARDED)
        with WeightSyncClient(handle.url, transport="tcp") as sync:
            sync.update_named_param(NAMED, changed[NAMED])
            bucket = FlattenedTensorBucket(named_tensors=[(name, changed[name]) for name in BUCKET])
            sync.update_flattened_params(bucket.get_metadata(), bucket.get_flattened_tensor())
            swift = VLLMClient(base_urls=[handle.url], connection_timeout=30)
            keys = swift.get_model_state_keys()
            swift.reset_prefix_cache()
            swift.reset_encoder_cache()  # what swift's trainer calls after every update, with the mm reset
            swift.reset_mm_cache()
        after = client.infer(PROMPTS, GREEDY, engine=UNGUARDED)
    assert any(name.startswith("model.layers.0.") for name in keys) and "model.norm.weight" in keys
    expected = pool.engine(backend, path).generate(PROMPTS, options={"max_new_tokens": GREEDY["max_tokens"]})
    assert [r.token_ids for r in after] == [r.token_ids for r in expected], "served answers after the push"
    assert [r.token_ids for r in before] != [r.token_ids for r in after], "the push changed no answer"


def test_vllm_routes_and_disk_reload_round_trip_exactly(pool, backend, perturbed, weight_server):
    """Issue 61: the weight updates RL clients of vLLM's API send. Through vLLM's four routes (the trainer is rank 0
    of the group, tensors listed in one ``/update_weights``), answers equal the perturbed checkpoint's, and the
    original weights pushed back give the first answers bit for bit (tokens and float32 logprobs); the same through a
    checkpoint reload from disk (``/update_weights_from_disk``, SGLang's and AReaL's name). ``/server_info`` names the
    transport TRL's client checks for, ``/weight_info`` the version the finish named; bad calls are refused by name
    before anything moves; llama.cpp refuses both families by name and reports no weight-transfer engine."""
    import httpx

    from conformance.kit.availability import unavailable_reason
    from engine.client import RolloutClient
    from engine.weights.transfer import WeightTransferClient

    if unavailable_reason(backend):
        pytest.skip(unavailable_reason(backend))
    path, changed = perturbed
    looper = str(fixture_path("tiny-looper"))
    original = originals(changed)
    scored = {**GREEDY, "logprobs": True, "top_logprobs": 2}
    handle = weight_server()
    info = httpx.get(f"{handle.url}/server_info?config_format=json", timeout=30).json()
    transfer = info["vllm_config"]["weight_transfer_config"]
    if backend == "llamacpp":
        refused = [httpx.post(f"{handle.url}{route}", json=body, timeout=30) for route, body in (
            ("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1", "master_port": 29999,
                                                            "rank_offset": 1, "world_size": 2}}),
            ("/update_weights_from_disk", {"model_path": path}))]
        assert transfer is None
        assert all(r.status_code == 400 and "cannot load a learner's weights" in r.text for r in refused)
        return
    assert transfer == {"backend": "tcp"}, info
    bad = {
        "init_info.master_address": ("/init_weight_transfer_engine", {"init_info": {
            "master_address": "203.0.113.9", "master_port": 29557, "rank_offset": 1, "world_size": 2}}),
        "init_info.world_size": ("/init_weight_transfer_engine", {"init_info": {
            "master_address": "127.0.0.1", "master_port": 29557, "rank_offset": 1, "world_size": 5}}),
        "init_info.packed": ("/init_weight_transfer_engine", {"init_info": {
            "master_address": "127.0.0.1", "master_port": 29557, "rank_offset": 1, "world_size": 2,
            "transport": "tcp", "packed": True}}),
        "model_path": ("/update_weights_from_disk", {"model_path": "/nonexistent/checkpoint"}),
        "load_format": ("/update_weights_from_disk", {"model_path": path, "load_format": "gguf"}),
    }
    for param, (route, body) in bad.items():
        reply = httpx.post(f"{handle.url}{route}", json=body, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, (param, reply.text)
    early = httpx.post(f"{handle.url}/update_weights", timeout=30, json={"update_info": {
        "names": [NAMED], "dtype_names": ["float32"], "shapes": [list(changed[NAMED].shape)]}})
    assert early.status_code == 409 and "init_weight_transfer_engine" in early.text, early.text
    with RolloutClient(handle.url, health_timeout=30) as client:
        def answers():  # one prompt at a time: bit-exact needs the same batches (vLLM is not batch invariant)
            return [(r.token_ids, r.logprobs) for p in PROMPTS
                    for r in client.infer([p], scored, engine=UNGUARDED)]

        def update(sync, tensors, version):
            with sync.weight_update():
                sync.update_named_params([(n, "float32", list(t.shape)) for n, t in tensors.items()],
                                         iter(tensors.items()))
            httpx.post(f"{handle.url}/finish_weight_update", json={"weight_version": version}, timeout=30)
            sync.reset_prefix_cache()

        before = answers()
        with WeightTransferClient(handle.url, transport="tcp") as sync:
            listed = httpx.post(f"{handle.url}/update_weights", timeout=30, json={"update_info": {
                "names": [NAMED], "dtype_names": ["float32", "float32"], "shapes": [[1]]}})
            assert listed.status_code == 400 and listed.json()["error"]["param"] == "update_info.dtype_names"
            update(sync, changed, "step-1")
            pushed = answers()
            version = httpx.get(f"{handle.url}/weight_info", timeout=30).json()
            update(sync, original, "step-2")
            back = answers()
        from_disk = httpx.post(f"{handle.url}/update_weights_from_disk", json={"model_path": path,
                                                                               "weight_version": "disk-1"},
                               timeout=120)
        assert from_disk.status_code == 200 and from_disk.json()["success"] is True, from_disk.text
        disk_answers = answers()
        restored = httpx.post(f"{handle.url}/update_weights_from_disk", json={"model_path": looper}, timeout=120)
        assert restored.status_code == 200, restored.text
        disk_back = answers()
    expected = pool.engine(backend, path).generate(PROMPTS, options={"max_new_tokens": GREEDY["max_tokens"]})
    assert [ids for ids, _ in pushed] == [r.token_ids for r in expected], "answers after vLLM's routes' update"
    assert pushed != before, "the update changed no answer: the check has no teeth"
    assert version == {"weight_version": "step-1"}
    assert back == before, "vLLM's routes: the original weights pushed back do not answer as before"
    assert disk_answers == pushed, "a reload of the perturbed checkpoint answers unlike the same weights pushed"
    assert disk_back == before, "the original checkpoint reloaded from disk does not answer as before"


@pytest.mark.quick_on("hf", reason=(
    "the session bounds are the server's weight-sync layer, one code for HF and vLLM (engine/serve/rollout/), and this "
    "check's own server starts in 6 s on HF against 25 s on vLLM"))
def test_a_learner_holds_rollouts_no_longer_than_the_session_bounds(pool, backend):
    """Hostile round 3 (issue 61), on a keyless server: (1) a group nobody joins plus one announced push held every
    generation for 75 s (the join timeout, not the session's 30 s): now the push's deadline is the session timeout and
    the failure is the learner's next weight call's (500), not the rollouts'; (2) cache resets posted with no weights
    loaded since drained every row in flight (a reset storm cut throughput by 40%): now they drop nothing and drain
    nothing; (3) a joined learner pushing without end, never ending its session, held rollouts for as long as it
    pushed: now ``serve.weight_sync_session_max_s`` ends the session and the rollouts run."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from engine.client import launch_server
    from engine.weights.sync import WeightSyncClient

    needs_weight_loading(backend)
    looper = str(fixture_path("tiny-looper"))
    bounds = {"weight_sync_join_timeout_s": 60, "weight_sync_session_timeout_s": 3, "weight_sync_session_max_s": 4}
    handle = launch_server({**pool.config(backend, looper), "serve": {"port": 0, **bounds}})
    short = {"infer_requests": [{"messages": PROMPTS[0]}], "request_config": {"max_tokens": 4, "temperature": 0}}
    from safetensors.torch import load_file

    norm = load_file(str(fixture_path("tiny-looper") / "model.safetensors"))["model.norm.weight"]
    named = {"name": "model.norm.weight", "dtype": "torch.float32", "shape": list(norm.shape)}

    def timed_infer(body):
        start = time.monotonic()
        reply = httpx.post(f"{handle.url}/infer/", json=body, timeout=120)
        return reply.status_code, time.monotonic() - start

    try:
        # (1) nobody joins; one push announced
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        opened = httpx.post(f"{handle.url}/init_communicator/", timeout=30,
                            json={"host": "127.0.0.1", "port": port, "world_size": 2, "transport": "tcp"})
        assert opened.status_code == 200, opened.text
        if backend == "hf":  # shapes are checked against the model on HF; vLLM reads checkpoint names as they come
            assert httpx.post(f"{handle.url}/update_named_param/", json={**named, "shape": [3]},
                              timeout=30).status_code == 400
        announced = httpx.post(f"{handle.url}/update_named_param/", json=named, timeout=30)
        status, held = timed_infer(short)
        heard = httpx.post(f"{handle.url}/close_communicator/", timeout=120)
        # (2) resets with nothing loaded since the last one: no drain (the first drops what the push above staled)
        first_reset = httpx.post(f"{handle.url}/reset_prefix_cache/", timeout=120)
        with ThreadPoolExecutor(1) as pool_:
            # 640 tokens a row: on vLLM the looper's 12 rows of 160 could end within the half second and the resets
            # (the gate at c6d48d9 read that as a drain), so the check first sees them still in flight
            long = pool_.submit(timed_infer, {"infer_requests": [{"messages": p} for p in PROMPTS * 4],
                                              "request_config": {"max_tokens": 640, "temperature": 0}})
            time.sleep(0.5)
            in_flight = not long.done()
            resets = [httpx.post(f"{handle.url}/reset_prefix_cache/", timeout=120) for _ in range(5)]
            drained = long.done()
            long_status, _ = long.result()
        # (3) a joined learner pushing every 0.5 s for 12 s, never ending its session
        with WeightSyncClient(handle.url, transport="tcp") as sync:
            stop = threading.Event()

            def keep_pushing():
                deadline = time.monotonic() + 12
                while not stop.is_set() and time.monotonic() < deadline:
                    sync.update_named_param("model.norm.weight", norm)  # a layer of one tensor (not fused)
                    time.sleep(0.5)

            pusher = threading.Thread(target=keep_pushing, daemon=True)
            pusher.start()
            time.sleep(1.0)
            during_status, during = timed_infer(short)
            stop.set()
            pusher.join(60)
    finally:
        handle.stop()
    assert announced.status_code == 200, announced.text
    assert status == 200 and held < 20, f"a push nobody sends held a generation {held:.1f} s (session timeout 3 s)"
    assert heard.status_code == 500 and "has not joined" in heard.text, heard.text
    assert first_reset.status_code == 200 and first_reset.json()["message"] == "prefix cache reset", first_reset.text
    assert all(r.status_code == 200 and "kept" in r.json()["message"] for r in resets), [r.text for r in resets]
    assert in_flight, "the long request ended before the resets were sent: the check would prove nothing"
    assert not drained and long_status == 200, "a reset with nothing loaded waited for the rows in flight"
    assert during_status == 200 and during < 10, \
        f"a learner pushing without end held a generation {during:.1f} s (session max 4 s)"


STRANGER = '''
import os, pickle, sys, time
from datetime import timedelta
from torch.distributed import TCPStore

class Payload:  # what hostile round 4 wrote: unpickling it runs a command in the reader
    def __reduce__(self):
        return (os.system, (f"touch {sys.argv[2]}",))

store = TCPStore("127.0.0.1", int(sys.argv[1]), None, False, timedelta(seconds=10))
evil = pickle.dumps(Payload())
for src in (0, 1):
    for n in range(4):  # every key vLLM's StatelessProcessGroup reads in a learner's first pushes
        for key in (f"broadcast_from/{src}/{n}", f"send_to/0/{n}", f"send_to/1/{n}"):
            store.set(key, evil)
print("written", store.num_keys(), flush=True)
'''
"""A local process with no key: it reaches the group's store (any process on the machine can) and writes a pickle
that runs ``touch <marker>`` when read, under every key the old transport's reader took values from."""


@pytest.mark.quick_on("hf", reason=(
    "the group's store and what the server reads from it are the engine's own channel (engine/weights/channel.py), "
    "one code for HF and vLLM, and this check's keyed server starts in 6 s on HF against 25 s on vLLM"))
def test_a_stranger_in_the_group_store_runs_nothing(pool, backend, perturbed, tmp_path):
    """Hostile round 4's attack, with ``ENGINE_API_KEY`` set: while a learner's group is open and the server waits
    for a pushed tensor, a keyless local process writes pickles into the group's store. The server reads only keys
    named from the group's secret (handed out by the keyed ``/init_communicator/``) and unpickles nothing: no
    command runs, the learner's push lands as sent, and the round trip back to the original weights is bit-exact."""
    import subprocess
    import sys

    from swift.rlhf_trainers.utils import FlattenedTensorBucket

    from engine.client import RolloutClient, launch_server
    from engine.weights.sync import WeightSyncClient

    needs_weight_loading(backend)
    _, changed = perturbed
    looper = str(fixture_path("tiny-looper"))
    original = originals(changed)
    marker = tmp_path / "ran-inside-the-server"
    key = "k3y-of-the-test"
    handle = launch_server({**pool.config(backend, looper), "serve": {"port": 0}}, api_key=key)
    try:
        with RolloutClient(handle.url, health_timeout=30, api_key=key) as client:
            before = client.infer(PROMPTS[:1], GREEDY)
            with WeightSyncClient(handle.url, api_key=key, transport="tcp") as sync:
                # Announce, so the server waits on the store for the tensor; the stranger writes meanwhile.
                sync._call("POST", "/update_named_param/", json={"name": NAMED, "dtype": str(changed[NAMED].dtype),
                                                                 "shape": list(changed[NAMED].shape)})
                wrote = subprocess.run([sys.executable, "-c", STRANGER, str(sync.port), str(marker)],
                                       capture_output=True, text=True, timeout=60)
                assert wrote.returncode == 0 and "written" in wrote.stdout, wrote.stderr[-2000:]
                time.sleep(1.0)  # time for a reader of those keys to take them
                sync._send(changed[NAMED])
                bucket = FlattenedTensorBucket(named_tensors=[(name, changed[name]) for name in BUCKET])
                sync.update_flattened_params(bucket.get_metadata(), bucket.get_flattened_tensor())
                sync.reset_prefix_cache()  # the session (q with k and v: vLLM fuses them) ends here
                moved = client.infer(PROMPTS[:1], GREEDY)
                push(sync, original)
            after = client.infer(PROMPTS[:1], GREEDY)
    finally:
        handle.stop()
    assert not marker.exists(), "the stranger's pickle ran inside the server"
    assert [r.token_ids for r in after] == [r.token_ids for r in before], "the round trip is not exact"
    assert [r.token_ids for r in moved] != [r.token_ids for r in before], "the learner's push did not land"


def refused_folders(root, changed: dict) -> dict:
    """Checkpoint folders a reload must refuse (id: (folder, the parameter named, a phrase, backends)); each is what a
    trainer or a hostile client sends by mistake or on purpose (hostile round 4: on vLLM the first three killed the
    engine core or answered garbage ever after)."""
    import os

    import torch
    from safetensors.torch import load_file, save_file

    source = fixture_path("tiny-looper")
    tensors = load_file(str(source / "model.safetensors"))

    def folder(name: str, content: dict | None = None) -> str:
        out = root / name
        shutil.copytree(source, out)
        if content is not None:
            save_file(content, str(out / "model.safetensors"))
        return str(out)

    fifo = folder("fifo")
    os.remove(f"{fifo}/model.safetensors")
    os.mkfifo(f"{fifo}/model.safetensors")
    corrupt = folder("corrupt")
    with open(f"{corrupt}/model.safetensors", "wb") as out:
        out.write((64).to_bytes(8, "little") + b"{not json" + b" " * 55)
    nan = tensors[NAMED].clone()
    nan[0, 0] = float("nan")
    both = ("hf", "vllm")
    return {
        "value-head": (folder("value-head", {**tensors, "v_head.weight": torch.zeros(1, 64)}), "v_head.weight",
                       "is not a parameter of the served model", both),
        "wrong-shape": (folder("wrong-shape", {**tensors, NAMED: tensors[NAMED][:-1].clone()}), NAMED,
                        "has shape", both),
        "half-a-fused-layer": (folder("half", {NAMED: tensors[NAMED]}), NAMED, "brings part of a fused layer",
                               ("vllm",)),
        "nan": (folder("nan", {**tensors, NAMED: nan}), NAMED, "holds NaN", both),
        "fifo": (fifo, None, "is not a regular file", both),
        "corrupt-header": (corrupt, None, "corrupt safetensors header", both),
        "100k-character-path": ("x" * 100_000, None, "at most 4096 characters", both),
    }


@pytest.mark.quick_on("vllm", reason=(
    "vLLM is where these folders killed the engine core or answered garbage ever after (hostile round 4); it shares "
    "the module's vLLM server"))
def test_a_refused_reload_leaves_the_old_weights_serving(pool, backend, perturbed, weight_server, tmp_path):
    """``/update_weights_from_disk`` checks a folder by its safetensors headers (names, shapes, whole fused layers,
    floating dtypes, regular files) and its values (finite) before anything is written: each bad folder is a 400
    naming the parameter, answered at once (a FIFO does not hold the server), and after all of them the server
    answers every prompt as before, bit for bit; the original folder then reloads with 200 (the engine is alive)."""
    import httpx

    from engine.client import RolloutClient

    needs_weight_loading(backend)
    _, changed = perturbed
    looper = str(fixture_path("tiny-looper"))
    cases = refused_folders(tmp_path, changed)
    handle = weight_server()
    with RolloutClient(handle.url, health_timeout=30) as client:
        before = [r.token_ids for r in client.infer(PROMPTS, GREEDY, engine=UNGUARDED)]
        for case, (path, param, phrase, backends) in cases.items():
            began = time.monotonic()
            reply = httpx.post(f"{handle.url}/update_weights_from_disk", json={"model_path": path}, timeout=60)
            took = time.monotonic() - began
            if backend not in backends:  # HF loads projections one by one: a lone q_proj is a whole push there
                assert reply.status_code == 200, f"{case}: {reply.text[:400]}"
                continue
            assert reply.status_code == 400, f"{case}: {reply.status_code} {reply.text[:400]}"
            message = reply.json()["error"]["message"]
            assert phrase in message and (param is None or param in message), f"{case}: {message}"
            assert took < 10, f"{case}: answered after {took:.1f} s"
            again_one = client.infer(PROMPTS[:1], GREEDY, engine=UNGUARDED)
            assert [r.token_ids for r in again_one] == before[:1], f"after {case}"
        after = [r.token_ids for r in client.infer(PROMPTS, GREEDY, engine=UNGUARDED)]
        reload = httpx.post(f"{handle.url}/update_weights_from_disk", json={"model_path": looper}, timeout=120)
        again = [r.token_ids for r in client.infer(PROMPTS, GREEDY, engine=UNGUARDED)]
        health = httpx.get(f"{handle.url}/health", timeout=30)
    assert after == before, "a refused reload changed the served answers"
    assert reload.status_code == 200 and again == before, reload.text[:400]
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text


def push(sync, tensors: dict) -> None:
    """One training step's push as the test's learner sends it: the named tensor, then one swift bucket."""
    from swift.rlhf_trainers.utils import FlattenedTensorBucket

    sync.update_named_param(NAMED, tensors[NAMED])
    bucket = FlattenedTensorBucket(named_tensors=[(name, tensors[name]) for name in BUCKET])
    sync.update_flattened_params(bucket.get_metadata(), bucket.get_flattened_tensor())
    sync.reset_prefix_cache()  # what swift's trainer calls after every update; the session ends here


@pytest.mark.quick_on("vllm", reason=(
    "vLLM is where a push under a generating batch killed the engine core, and only there /health must say dead; it "
    "shares the module's vLLM server, last"))
def test_pushes_under_load_round_trip_exactly(pool, backend, perturbed, weight_server):
    """The GRPO loop as trainers run it: rollouts in flight while the learner pushes (this killed vLLM's engine
    core: its layerwise reload ran under a generating batch), three cycles of perturbed weights and the original ones
    back. Every in-flight row runs on one set of weights (old or new, never a mix); after each round trip the
    answers and logprobs equal the ones before, bit for bit in float32; pushing the same weights again changes
    nothing; ``/health`` still answers ok (and would say ``dead`` otherwise)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from engine.client import RolloutClient
    from engine.weights.sync import WeightSyncClient

    needs_weight_loading(backend)
    _, changed = perturbed
    original = originals(changed)
    scored = {**GREEDY, "logprobs": True, "top_logprobs": 2}
    long = {**GREEDY, "max_tokens": 48}
    handle = weight_server()
    with RolloutClient(handle.url, health_timeout=30) as client:
        # A learner that opens a group and never joins: generation goes on (it used to wait up to 300 s for the
        # join, on HF's batcher thread or in vLLM's engine core), and no address but loopback or the server's own
        # is bound.
        stranger = httpx.post(f"{handle.url}/init_communicator/", timeout=30,
                              json={"host": "203.0.113.9", "port": 29555, "world_size": 2, "transport": "tcp"})
        assert stranger.status_code == 400 and stranger.json()["error"]["param"] == "host", stranger.text
        opened = httpx.post(f"{handle.url}/init_communicator/", timeout=30,
                            json={"host": "0.0.0.0", "port": 29556, "world_size": 2, "transport": "tcp"})
        assert opened.status_code == 200, opened.text
        join_s = LOOPER_SERVE["weight_sync_join_timeout_s"]
        began = time.monotonic()
        waiting = httpx.post(f"{handle.url}/infer/", timeout=join_s + 5, json={
            "infer_requests": [{"messages": PROMPTS[0]}], "request_config": {"max_tokens": 4}})
        waited = time.monotonic() - began
        assert waiting.status_code == 200, waiting.text
        # the bound is the join timeout this server was given: a generation that waited for the join would reach it
        assert waited < join_s / 2, f"a generation waited {waited:.1f} s on a group nobody joined (join {join_s} s)"
        httpx.post(f"{handle.url}/close_communicator/", timeout=30)

        def answers():  # one prompt at a time: bit-exact needs the same batches (vLLM is not batch invariant)
            return [(r.token_ids, r.logprobs) for p in PROMPTS
                    for r in client.infer([p], scored, engine=UNGUARDED)]

        def rows(during):
            return [r.token_ids for r in during]

        before = answers()
        old_long = rows(client.infer(PROMPTS, long, engine=UNGUARDED))
        with WeightSyncClient(handle.url, transport="tcp") as sync:
            push(sync, changed)
            new_long = rows(client.infer(PROMPTS, long, engine=UNGUARDED))
            push(sync, original)
            assert answers() == before, "answers after pushing the original weights back"
            for cycle in range(3):
                with ThreadPoolExecutor(len(PROMPTS)) as threads:
                    flying = [threads.submit(client.infer, [p], long, engine=UNGUARDED) for p in PROMPTS]
                    push(sync, changed)
                    landed = [f.result()[0].token_ids for f in flying]
                for i, got in enumerate(landed):
                    assert got in (old_long[i], new_long[i]), f"cycle {cycle} row {i}: a mix of two weight sets"
                landed_after = rows(client.infer(PROMPTS, long, engine=UNGUARDED))
                assert landed_after == new_long, f"cycle {cycle}: the push did not land"
                push(sync, original)
                assert answers() == before, f"cycle {cycle}: the round trip is not exact"
            push(sync, original)
            assert answers() == before, "pushing the weights already loaded changed an answer"
        health = httpx.get(f"{handle.url}/health", timeout=30)
        if backend == "vllm":  # an engine core that died: /health must say so (it answered 200 before)
            import psutil

            for child in psutil.Process(handle.process.pid).children(recursive=True):
                child.kill()
            dead = httpx.get(f"{handle.url}/health", timeout=30)
            for _ in range(100):
                if dead.status_code != 200:
                    break
                time.sleep(0.1)
                dead = httpx.get(f"{handle.url}/health", timeout=30)
            assert dead.status_code == 503 and dead.json()["status"] == "dead", dead.text
    assert old_long != new_long, "the perturbed weights changed no answer: the check has no teeth"
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
