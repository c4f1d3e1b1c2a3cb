"""The guard under TRL 1.16's own rollout server and client: ``trl vllm-serve --logits-processors
engine.vllm_plugin:EngineGuard`` (TRL passes extra arguments through to the stock ``vllm serve`` it execs) on
``--engine-model``, driven by TRL's ``VLLMClient.generate`` with the guard's settings in ``generation_kwargs``
(``vllm_xargs``). The in-process HF engine with the same guard is the reference.

TRL 1.16 needs vLLM <= 0.31 and a ``trl`` of its own (the stack venv holds ms-swift's TRL 0.29), so this module runs
in the vLLM 0.31 venv of ``nox -s vllm-versions``; elsewhere it is skipped with that reason. On a CPU host TRL's
server starts as it is (its NCCL weight-transfer configuration is only used when a trainer calls
``init_communicator``, which TRL's client refuses off CUDA); vLLM's CPU build needs the project's
``engine/compat/site`` on ``PYTHONPATH`` for the ``vllm serve`` command to find its own version
(:mod:`engine.compat.vllm_cpu_name`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from conformance.subjects.plan import engines, processes, uses
from conformance.test_repeat import REAL_LOOP_GUARD
from conformance.test_vllm_plugin import MIN_CHARS, chat_rows, xargs
from engine.vllm_plugin import PROCESSOR
from engine.vllm_plugin.replay import guard_report
from engine_fixtures import load_prompts

SUBJECTS = uses(engines("text"), processes("trl vllm-serve", why="TRL 1.16's own server with the guard"))

pytestmark = pytest.mark.slow
TRL_VERSION = "1.16"


def trl_version() -> str | None:
    """The installed TRL's version, read from its metadata: importing TRL at collection would import transformers'
    vision modules before the suite's torchvision stand-in is in place (the VLM checks then fail)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return None


needs_trl = pytest.mark.skipif(not (trl_version() or "").startswith(TRL_VERSION),
                               reason=f"TRL {TRL_VERSION} is installed only in the vLLM 0.31 venv of nox -s "
                                      f"vllm-versions (here: TRL {trl_version()}, whose vllm-serve is another server)")


@pytest.fixture(scope="module")
def trl_server(pool: Any, backend_names: tuple[str, ...]) -> Any:
    """``trl vllm-serve`` on ``--engine-model`` with the plugin, bound to 127.0.0.1, stopped after the module."""
    if "vllm" not in backend_names:
        pytest.skip(f"trl vllm-serve runs vLLM; backends here: {backend_names}")
    import engine
    from conformance.subjects.stock import free_port, started

    _, config = pool.servers.served_config("vllm", pool.options.model)
    port = free_port()
    trl = Path(sys.executable).parent / "trl"
    cmd = [str(trl), "vllm-serve", "--model", config["model"]["path"], "--host", "127.0.0.1", "--port", str(port),
           "--dtype", config["model"].get("dtype", "float32"), "--enforce_eager", "true", "--max_model_len", "2048",
           # passed through to vllm serve:
           "--logits-processors", PROCESSOR, "--seed", "0", "--generation-config", "vllm", "--max-num-seqs", "16",
           "--kv-cache-memory-bytes", str(int(config["vllm"]["cpu_kv_cache_space_gib"] * 2**30))]
    site = Path(engine.__file__).parent / "compat" / "site"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    server = started("trl vllm-serve", cmd, port, env=env, ready="/health", timeout=600)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(trl_server: Any) -> Any:
    from trl.generation.vllm_client import VLLMClient

    return VLLMClient(base_url=trl_server.url, connection_timeout=60)


@needs_trl
def test_trl_server_is_what_trl_configures(client):
    """TRL's server as TRL starts it: processed logprobs and NCCL weight transfer configured (read by TRL's client)."""
    info = client.get_server_info()
    assert info.get("weight_transfer_config") == {"backend": "nccl"}, info.get("weight_transfer_config")


@needs_trl
def test_trl_client_gets_the_real_loop_ended_where_the_engine_does(pool, client):
    by_id = {p["id"]: p["messages"] for p in load_prompts("json")}
    want = chat_rows(pool, [by_id["json-30-fruits"]], 160, repeat_terminate=REAL_LOOP_GUARD)[0]
    assert want.meta["repeat_terminate_triggered"] == 1
    got = client.generate([list(want.prompt_token_ids)], temperature=0.0, max_tokens=160,
                          generation_kwargs={"vllm_xargs": xargs(REAL_LOOP_GUARD)})
    ids = got["completion_ids"][0]
    assert tuple(ids) == tuple(want.token_ids)
    eos = pool.reference("hf", pool.options.model).tokenizer.eos_token_id
    assert guard_report(ids, xargs(REAL_LOOP_GUARD), eos_id=eos)["forced_index"] == want.meta["repeat_terminate_index"]


@needs_trl
def test_trl_client_sampled_groups_hold_the_rule_row_by_row(pool, client):
    """A GRPO-style group (``n = 4``, temperature 1): vLLM fans the request out, each sample gets its own rule state;
    every row either never meets the rule or ends with EOS exactly where the rule fires on its own ids."""
    by_id = {p["id"]: p["messages"] for p in load_prompts("json")}
    prompt = chat_rows(pool, [by_id["json-30-fruits"]], 1)[0].prompt_token_ids
    guard = {"max_consecutive_token_repeats": 3, "ngram_size": 2, "ngram_repeats": 3}
    got = client.generate([list(prompt)], n=4, temperature=1.0, max_tokens=96,
                          generation_kwargs={"vllm_xargs": xargs(guard), "seed": 7})
    eos = pool.reference("hf", pool.options.model).tokenizer.eos_token_id
    for i, ids in enumerate(got["completion_ids"]):
        report = guard_report(ids, xargs(guard), eos_id=eos)
        body = ids[:-1] if report["forced_index"] is not None else ids
        assert guard_report(body, xargs(guard), eos_id=eos)["forced_index"] is None, f"sample {i}"
        if report["forced_index"] is not None:
            assert report["forced_index"] == len(ids) - 1, f"sample {i}: the rule fired before the row ended"


@needs_trl
def test_trl_client_healthy_rows_and_min_length(pool, client):
    healthy = [p["messages"] for p in load_prompts("chat")][:2]
    free = chat_rows(pool, healthy, 48)
    got = client.generate([list(r.prompt_token_ids) for r in free], temperature=0.0, max_tokens=48,
                          generation_kwargs={"vllm_xargs": xargs(REAL_LOOP_GUARD)})
    assert [tuple(i) for i in got["completion_ids"]] == [tuple(r.token_ids) for r in free]
    question = [[{"role": "user", "content": "What is 2+2? Answer with one number."}]]
    want = pool.engine("hf", pool.options.model).generate(question, options={"max_new_tokens": 96},
                                                          plugins=[{"name": "min_length", "min_chars": MIN_CHARS}])[0]
    got = client.generate([list(want.prompt_token_ids)], temperature=0.0, max_tokens=96,
                          generation_kwargs={"vllm_xargs": {"min_length.min_chars": MIN_CHARS}})
    assert tuple(got["completion_ids"][0]) == tuple(want.token_ids)


@needs_trl
def test_trl_client_bad_settings_are_refused_by_name(client):
    with pytest.raises(Exception, match=r"400.*repeat_terminate[.]ngram_size.*Fix:"):
        client.generate([[1, 2, 3]], max_tokens=4, generation_kwargs={"vllm_xargs": {"repeat_terminate.ngram_size": 1}})
