"""The benchmarks' engines and servers: the suite's engine pool (``conformance/subjects/pool.py``) sized for
measuring.

What differs from the conformance sizing is only the config each engine gets (:meth:`BenchPool.config`): vLLM sized
for the run's largest batch, compiled at full size, an equal share of the card for each of ``VLLM_ENGINES_AT_ONCE``;
no generation defaults of the suite's. Loading, deriving (the repeat guard's twin, a logprobs mode read per call),
keeping raw ``vllm.LLM`` objects and starting servers are the pool's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.workload import Size
from conformance.subjects.pool import EnginePool
from engine.backends.registry import SPECS
from engine.backends.vllm.memory import engine_share

VLLM_ENGINES_AT_ONCE = 5
"""vLLM engines a benchmark run holds on one card at once: the engine, the raw ``LLM`` (and its twin with the guard's
plugin loaded), the served engine (one server process, shared by the served and chat benchmarks) and the
``rollout_vs_trainer`` group's engine in the other dtype; at ``engine_share(5)`` each they take 0.8 of it, the
rest is left to the HF models and the processes' CUDA contexts."""


@dataclass
class BenchPool(EnginePool):
    """The engine pool with the benchmarks' sizing; ``gguf_twin`` gives the folder of the F32 GGUF twin llama.cpp
    loads, built on first need (None: the model has none, and a llama.cpp benchmark is skipped with the reason).

    Example (the benchmarks' conftest builds one per run)::

        pool = BenchPool(PoolOptions(backends=("hf",), model=path, vlm_model="", dtype="float32", device="cpu",
                                     gpu_vllm_engines=VLLM_ENGINES_AT_ONCE), size=SIZES["smoke"])
        engine = pool.loaded("hf", path)
    """

    size: Size | None = None
    gguf_twin: Callable[[], str] | None = None

    def config(self, backend: str, model: str, /, **sections: Any) -> dict[str, Any]:
        import pytest

        assert self.size is not None, "BenchPool needs its size"
        model_cfg: dict[str, Any] = {"path": model, "dtype": self.options.dtype}
        if SPECS[backend].model_format == "gguf":
            if self.gguf_twin is None:
                pytest.skip(f"{backend}: the benchmarked model {model} has no GGUF twin fixture")
            model_cfg["path"] = self.gguf_twin()
        model_cfg.update(sections.pop("model", {}))
        if SPECS[backend].model_format == "gguf" and model_cfg.get("adapters"):  # each adapter's GGUF twin
            model_cfg["adapters"] = {name: self.twins.get(path, path) for name, path in model_cfg["adapters"].items()}
        vllm = {"max_num_seqs": max(self.size.batches),
                "gpu_memory_utilization": engine_share(self.options.gpu_vllm_engines),
                "enforce_eager": not self.size.vllm_compiled, **sections.pop("vllm", {})}
        return {"backend": backend, "model": model_cfg, "vllm": vllm, **sections}
