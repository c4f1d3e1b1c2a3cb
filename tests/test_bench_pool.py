"""The benchmarks draw their engines from the suite's pool (``benchmarks/pool.py``): only the config differs."""

from __future__ import annotations

import pytest

from benchmarks.pool import VLLM_ENGINES_AT_ONCE, BenchPool
from benchmarks.workload import SIZES
from conformance.subjects.bill import Bill
from conformance.subjects.pool import EnginePool, PoolOptions


def pool(twin=None, announce=None):
    options = PoolOptions(backends=("hf", "vllm"), model="/m", vlm_model="", dtype="float32", device="cpu",
                          gpu_vllm_engines=VLLM_ENGINES_AT_ONCE)
    return BenchPool(options, bill=Bill(announce=announce), size=SIZES["smoke"], gguf_twin=twin)


def test_the_benchmarks_sizing_not_the_suites():
    config = pool().config("vllm", "/m")
    suite = EnginePool(pool().options).config("vllm", "/m")
    assert config["vllm"]["max_num_seqs"] == max(SIZES["smoke"].batches) != suite["vllm"]["max_num_seqs"]
    assert config["vllm"]["enforce_eager"] is (not SIZES["smoke"].vllm_compiled)
    assert "generation" not in config and "generation" in suite  # no generation defaults of the suite's
    assert config["model"] == {"path": "/m", "dtype": "float32"}


def test_sections_reach_the_config_and_the_served_config_keeps_the_benchmarks_serve():
    bench = pool()
    config = bench.config("hf", "/m", model={"logprobs_mode": "processed_logprobs"}, repeat_terminate={"x": 1})
    assert config["model"]["logprobs_mode"] == "processed_logprobs" and config["repeat_terminate"] == {"x": 1}
    _, served = bench.servers.served_config("hf", "/m", serve={"max_batch_size": 64, "body_timeout_s": 30.0})
    assert served["serve"]["max_batch_size"] == 64 and served["serve"]["body_timeout_s"] == 30.0
    assert served["serve"]["port"] == 0 and served["vllm"]["multiprocessing"] is False


def test_llamacpp_loads_the_gguf_twin_or_is_skipped_with_the_reason():
    assert pool(twin=lambda: "/m-gguf").config("llamacpp", "/m")["model"]["path"] == "/m-gguf"
    with pytest.raises(pytest.skip.Exception, match="no GGUF twin"):
        pool().config("llamacpp", "/m")


def test_each_start_is_announced_before_it_begins():
    lines = []
    bill = Bill(announce=lines.append)
    with bill.timed("engine", ("hf", "smol")):
        assert lines == ["starting engine hf smol ..."]
    assert [kind for kind, _, _ in bill.starts] == ["engine"]
