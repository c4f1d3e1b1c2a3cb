"""On a CUDA host the vLLM engines held at once share the card: each asks vLLM for an equal share of it, and the
conformance pool stops the least recently used engine before one more would exceed it (vLLM refuses to start an
engine when free memory is below its ``gpu_memory_utilization`` share of the card).

The pool runs here with the CUDA host forced and a stand-in for ``GenerationEngine`` that records what vLLM would
be asked for; the real engines start in the conformance suite."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import ClassVar

import pytest

from conformance.subjects.pool import EnginePool, PoolOptions
from engine.backends.vllm.memory import RESERVE, EngineLeases, engine_share


@pytest.mark.parametrize("engines", range(1, 81))
def test_equal_shares_never_exceed_the_card_minus_the_reserve(engines):
    share = engine_share(engines)
    assert share >= 0.01 and engines * share <= 1 - RESERVE + 1e-9


def test_leases_release_the_least_recently_used_first():
    leases = EngineLeases(capacity=2)
    assert leases.admit("a") == [] and leases.admit("b") == []
    assert leases.admit("a") == []  # a is now the most recent
    assert leases.admit("c") == ["b"]
    assert leases.alive == ["a", "c"]
    with pytest.raises(ValueError, match="capacity: 0"):
        EngineLeases(capacity=0)


class FakeBackend:
    load_decisions: ClassVar[dict[str, str]] = {}  # the backend protocol's (what vLLM decided at load)

    def __init__(self, card, share):
        self.card, self.share, self.open = card, share, True
        card.append(self)

    def close(self):
        self.open = False
        self.card.remove(self)


class FakeEngine:
    """What the pool does with an engine: build it from a config, derive request-level variants, close it."""

    card: ClassVar[list[FakeBackend]] = []

    def __init__(self, config):
        share = config["vllm"]["gpu_memory_utilization"] if config["backend"] == "vllm" else 0.0
        vllm = config["backend"] == "vllm"
        self.backend = FakeBackend(self.card, share) if vllm else SimpleNamespace(load_decisions={})
        self.owner = True

    def derive(self, **sections):
        twin = object.__new__(FakeEngine)
        twin.backend, twin.owner = self.backend, False
        return twin

    def close(self):
        if self.owner and isinstance(self.backend, FakeBackend):
            self.backend.close()


@pytest.fixture
def cuda_pool(monkeypatch):
    import engine
    import engine.backends.host as host

    monkeypatch.setattr(host, "has_cuda", lambda: True)
    monkeypatch.setattr(engine, "GenerationEngine", FakeEngine)
    FakeEngine.card = []
    options = PoolOptions(backends=("hf", "vllm"), model="/models/text", vlm_model="/models/vlm", dtype="bfloat16",
                          device="cuda", vllm_multiprocessing=True)
    return EnginePool(options)


def suite_like_requests(pool):
    """30 distinct loaded vLLM engines (the CPU suite starts 26 engines of all backends), each asked for again
    later and with request-level variants derived from it, interleaved with HF engines. A vLLM section is sized as
    the suite's checks size one, over the pool's own (its card share kept)."""

    def seqs(n: int) -> dict:
        return {**pool.config("vllm", "/models/text")["vllm"], "max_num_seqs": n}

    for i in range(30):
        yield "vllm", {"model": {"checkpoint_eos": bool(i % 2)}, "vllm": seqs(i + 1)}
        yield "vllm", {"model": {"checkpoint_eos": bool(i % 2)}, "vllm": seqs(i + 1),
                       "generation": {"max_new_tokens": 8}}  # derived: no second model
        yield "vllm", {"model": {"checkpoint_eos": bool(i % 2)}, "vllm": seqs(i + 1),
                       "hf": {"max_batch_size": 3}}  # HF's section: not read by vLLM, the same engine
        yield "hf", {"hf": {"max_batch_size": i + 1}}
        if i >= 3:
            yield "vllm", {"model": {"checkpoint_eos": bool((i - 3) % 2)}, "vllm": seqs(i - 2)}


def test_the_pool_keeps_the_card_within_budget_for_a_whole_session(cuda_pool):
    budget = 1 - RESERVE
    servers = cuda_pool.options.servers_per_backend  # a vLLM server holds a share in its own process
    share = engine_share(cuda_pool.options.gpu_vllm_engines)
    peak = 0.0
    for backend, sections in suite_like_requests(cuda_pool):
        cuda_pool._local(cuda_pool._key(backend, "/models/text", True, sections), backend, "/models/text", True,
                         sections)
        held = sum(b.share for b in FakeEngine.card) + servers * share
        peak = max(peak, held)
        assert held <= budget + 1e-9, f"the card would hold {held:.2f} of itself"
        alive = {id(e.backend) for e in cuda_pool._engines.values() if isinstance(e.backend, FakeBackend)}
        assert alive == {id(b) for b in FakeEngine.card}, "an engine of a stopped backend is still handed out"
    assert all(b.share == share for b in FakeEngine.card)
    assert cuda_pool.released > 0 and peak == pytest.approx(cuda_pool.options.gpu_vllm_engines * share)


def test_in_process_engines_are_never_stopped_behind_the_suites_back(cuda_pool):
    from dataclasses import replace

    cuda_pool.options = replace(cuda_pool.options, vllm_multiprocessing=False, gpu_vllm_engines=2)
    cuda_pool._local(cuda_pool._key("vllm", "/m", True, {}), "vllm", "/m", True, {})
    with pytest.raises(RuntimeError, match="--engine-vllm-multiprocessing"):
        sections = {"vllm": {**cuda_pool.config("vllm", "/m")["vllm"], "max_num_seqs": 1}}
        cuda_pool._local(cuda_pool._key("vllm", "/m", True, sections), "vllm", "/m", True, sections)


def test_another_backends_settings_section_loads_nothing_more(cuda_pool):
    """``read_by``: a vLLM engine asked for with HF's section is the one already loaded (no second model on the
    card), and HF's own section still keys a second HF engine."""
    sizes = {"hf": {"max_batch_size": 2}}
    first = cuda_pool._local(cuda_pool._key("vllm", "/m", True, {}), "vllm", "/m", True, {})
    again = cuda_pool._local(cuda_pool._key("vllm", "/m", True, sizes), "vllm", "/m", True, sizes)
    assert again is first and len(FakeEngine.card) == 1
    plain = cuda_pool._local(cuda_pool._key("hf", "/m", True, {}), "hf", "/m", True, {})
    assert cuda_pool._local(cuda_pool._key("hf", "/m", True, sizes), "hf", "/m", True, sizes) is not plain


def test_a_kept_text_server_outlives_the_servers_that_take_turns(cuda_pool, monkeypatch):
    """``KEPT_TEXT_SERVERS``: a second and a third HF config stop each other, never HF's text server; vLLM's text
    server still takes its turn."""
    import engine.client

    stopped = []

    class FakeServer:
        def __init__(self, config, **_):
            self.name = json.dumps(config, sort_keys=True)

        def stop(self):
            stopped.append(self.name)

    monkeypatch.setattr(engine.client, "launch_server", FakeServer)
    servers = cuda_pool.servers
    text = servers.server(*servers.served_config("hf", "/models/text"))
    guarded = servers.server(*servers.served_config("hf", "/models/text", repeat_terminate={"enabled": True}))
    servers.server(*servers.served_config("hf", "/models/text", generation={"max_new_tokens": 4}))
    assert stopped == [guarded.name] and text.name not in stopped
    vllm_text = servers.server(*servers.served_config("vllm", "/models/text"))
    servers.server(*servers.served_config("vllm", "/models/text", repeat_terminate={"enabled": True}))
    assert stopped[-1] == vllm_text.name
