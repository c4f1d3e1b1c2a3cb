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

import pytest

from conformance.test_repeat import MIXED
from fixtures import fixture_path

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

    from conformance.conftest import unavailable_reason
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
