"""Weight sync on a served engine (issue 28): a learner pushes perturbed weights over swift's routes, and the server's
answers then equal, token for token, an in-process engine loaded from the perturbed checkpoint.

The learner is this test process with :class:`engine.weight_sync.WeightSyncClient` over the ``tcp`` transport (a CPU
host has no NCCL, which swift's own ``VLLMClient`` needs for its broadcasts); ms-swift's real code still builds the
flattened bucket (``FlattenedTensorBucket``) and calls the routes it can call on a CPU host (``VLLMClient``'s
``get_model_state_keys`` and the three cache resets its trainer calls). The prompts are answered once before the
push, so on vLLM their prefixes sit in the prefix cache, computed with the old weights: equal answers after the
push need the reset.
GPU-only, not run here: the ``nccl`` transport with swift's ``VLLMClient.init_communicator`` and its broadcasts.
"""

from __future__ import annotations

import shutil
import time

import pytest

from conformance.test_repeat import MIXED
from engine_fixtures import fixture_path

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


def test_pushed_weights_answer_like_the_perturbed_checkpoint(pool, backend, perturbed):
    import httpx
    from swift.rlhf_trainers.utils import FlattenedTensorBucket
    from swift.rlhf_trainers.vllm_client import VLLMClient

    from conformance.availability import unavailable_reason
    from engine.client import RolloutClient, launch_server
    from engine.weight_sync import WeightSyncClient

    if unavailable_reason(backend):
        pytest.skip(unavailable_reason(backend))
    path, changed = perturbed
    looper = str(fixture_path("tiny-looper"))
    handle = launch_server({**pool.config(backend, looper), "serve": {"port": 0}})
    try:
        if backend == "llamacpp":  # no weight loading there: refused by name, nothing joins a group
            reply = httpx.post(f"{handle.url}/init_communicator/", json={"host": "127.0.0.1", "port": 29999,
                                                                         "world_size": 2}, timeout=30)
            assert reply.status_code == 400 and "cannot load a learner's weights" in reply.text
            return
        with RolloutClient(handle.url, health_timeout=30) as client:
            before = client.infer(PROMPTS, GREEDY)
            with WeightSyncClient(handle.url, transport="tcp") as sync:
                sync.update_named_param(NAMED, changed[NAMED])
                bucket = FlattenedTensorBucket(named_tensors=[(name, changed[name]) for name in BUCKET])
                sync.update_flattened_params(bucket.get_metadata(), bucket.get_flattened_tensor())
                swift = VLLMClient(base_urls=[handle.url], connection_timeout=30)
                keys = swift.get_model_state_keys()
                swift.reset_prefix_cache()
                swift.reset_encoder_cache()  # what swift's trainer calls after every update, with the mm reset
                swift.reset_mm_cache()
            after = client.infer(PROMPTS, GREEDY)
    finally:
        handle.stop()
    assert any(name.startswith("model.layers.0.") for name in keys) and "model.norm.weight" in keys
    expected = pool.engine(backend, path).generate(PROMPTS, options={"max_new_tokens": GREEDY["max_tokens"]})
    assert [r.token_ids for r in after] == [r.token_ids for r in expected], "served answers after the push"
    assert [r.token_ids for r in before] != [r.token_ids for r in after], "the push changed no answer"


def push(sync, tensors: dict) -> None:
    """One training step's push as the test's learner sends it: the named tensor, then one swift bucket."""
    from swift.rlhf_trainers.utils import FlattenedTensorBucket

    sync.update_named_param(NAMED, tensors[NAMED])
    bucket = FlattenedTensorBucket(named_tensors=[(name, tensors[name]) for name in BUCKET])
    sync.update_flattened_params(bucket.get_metadata(), bucket.get_flattened_tensor())
    sync.reset_prefix_cache()  # what swift's trainer calls after every update; the session ends here


def test_pushes_under_load_round_trip_exactly(pool, backend, perturbed):
    """The GRPO loop as trainers run it: rollouts in flight while the learner pushes (this killed vLLM's engine
    core: its layerwise reload ran under a generating batch), three cycles of perturbed weights and the original ones
    back. Every in-flight row runs on one set of weights (old or new, never a mix); after each round trip the
    answers and logprobs equal the ones before, bit for bit in float32; pushing the same weights again changes
    nothing; ``/health`` still answers ok (and would say ``dead`` otherwise)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from safetensors.torch import load_file

    from conformance.availability import unavailable_reason
    from engine.client import RolloutClient, launch_server
    from engine.weight_sync import WeightSyncClient

    if unavailable_reason(backend):
        pytest.skip(unavailable_reason(backend))
    if backend == "llamacpp":
        pytest.skip("llamacpp loads no learner's weights (refused by name: "
                    "test_pushed_weights_answer_like_the_perturbed_checkpoint)")
    _, changed = perturbed
    looper = str(fixture_path("tiny-looper"))
    original = {name: t for name, t in load_file(str(fixture_path("tiny-looper") / "model.safetensors")).items()
                if name in changed}
    scored = {**GREEDY, "logprobs": True, "top_logprobs": 2}
    long = {**GREEDY, "max_tokens": 48}
    handle = launch_server({**pool.config(backend, looper), "serve": {"port": 0, "weight_sync_join_timeout_s": 5}})
    try:
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
            waiting = httpx.post(f"{handle.url}/infer/", timeout=15, json={
                "infer_requests": [{"messages": PROMPTS[0]}], "request_config": {"max_tokens": 4}})
            assert waiting.status_code == 200, waiting.text
            httpx.post(f"{handle.url}/close_communicator/", timeout=30)

            def answers():  # one prompt at a time: bit-exact needs the same batches (vLLM is not batch invariant)
                return [(r.token_ids, r.logprobs) for p in PROMPTS for r in client.infer([p], scored)]

            def rows(during):
                return [r.token_ids for r in during]

            before = answers()
            old_long = rows(client.infer(PROMPTS, long))
            with WeightSyncClient(handle.url, transport="tcp") as sync:
                push(sync, changed)
                new_long = rows(client.infer(PROMPTS, long))
                push(sync, original)
                assert answers() == before, "answers after pushing the original weights back"
                for cycle in range(3):
                    with ThreadPoolExecutor(len(PROMPTS)) as threads:
                        flying = [threads.submit(client.infer, [p], long) for p in PROMPTS]
                        push(sync, changed)
                        landed = [f.result()[0].token_ids for f in flying]
                    for i, got in enumerate(landed):
                        assert got in (old_long[i], new_long[i]), f"cycle {cycle} row {i}: a mix of two weight sets"
                    assert rows(client.infer(PROMPTS, long)) == new_long, f"cycle {cycle}: the push did not land"
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
    finally:
        handle.stop()
    assert old_long != new_long, "the perturbed weights changed no answer: the check has no teeth"
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
