"""``EnginePool.drop``: an engine only one check uses is closed after it, with the engines derived from it, where
closing it cannot break the others (HF, llama.cpp, a vLLM engine whose core runs in a child process); an in-process
vLLM engine is refused. A stand-in for ``GenerationEngine`` records closes; the real engines run in the suite
(``conformance/test_adapters.py`` drops its merged HF engine after its one check)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conformance.subjects.pool import EnginePool, PoolOptions
from engine.config import RepeatTerminateConfig

CLOSED: list[str] = []


class Engine:
    def __init__(self, config, base=None):
        self.name = config["backend"] if config else f"derived from {base.name}"
        vllm = (config or {}).get("vllm", {})
        self.config = SimpleNamespace(vllm=SimpleNamespace(multiprocessing=vllm.get("multiprocessing", False)),
                                      repeat_terminate=RepeatTerminateConfig())
        self.backend = SimpleNamespace(load_decisions={})

    def derive(self, **sections):
        return Engine(None, self)

    def close(self):
        CLOSED.append(self.name)


@pytest.fixture
def pool(monkeypatch):
    import engine

    monkeypatch.setattr(engine, "GenerationEngine", Engine)
    CLOSED.clear()
    return EnginePool(PoolOptions(backends=("hf", "vllm"), model="/m/text", vlm_model="/m/vlm", dtype="float32",
                                  device="cpu"))


GUARD = {"enabled": True, "max_consecutive_token_repeats": 4}


def test_a_dropped_engine_is_closed_with_what_was_derived_from_it_and_loads_again_on_the_next_ask(pool):
    merged = pool.engine("hf", "/m/text", hf={"merge_adapters": True})
    pool.engine("hf", "/m/text", hf={"merge_adapters": True}, repeat_terminate=GUARD)  # derived: no second load
    plain = pool.engine("hf", "/m/text")
    assert pool.drop("hf", "/m/text", hf={"merge_adapters": True}, repeat_terminate=GUARD)  # by a derived key too
    assert CLOSED == ["hf"] and pool.engine("hf", "/m/text") is plain  # the plain engine is untouched
    assert [kind for kind, _, _ in pool.starts].count("closed") == 1
    again = pool.engine("hf", "/m/text", hf={"merge_adapters": True})
    assert again is not merged and [kind for kind, _, _ in pool.starts].count("engine") == 3
    assert not pool.drop("hf", "/m/text", model={"dtype": "bfloat16"})  # never loaded: nothing to close


def test_an_in_process_vllm_engine_is_refused_and_a_child_process_one_is_dropped(pool):
    pool.engine("vllm", "/m/text")
    with pytest.raises(RuntimeError, match=r"vllm\.multiprocessing true"):
        pool.drop("vllm", "/m/text")
    assert CLOSED == []
    child = {"max_num_seqs": 16, "multiprocessing": True}
    pool.engine("vllm", "/m/text", vllm=child)
    assert pool.drop("vllm", "/m/text", vllm=child) and CLOSED == ["vllm"]
