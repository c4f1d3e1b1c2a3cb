"""What a LoRA adapter costs: one engine with the ``smollm2-lora`` adapters loaded, rows with adapter ``r16`` (rank 16
on every projection) against the same rows on the base model, per backend, at the size's batches (1, 8 and 64 in the
full size).

Three variants generate the same greedy requests to a fixed length (EOS held back), interleaved in one run: rows
with the adapter and base rows on the one engine with adapters loaded, and the same rows on the run's plain engine
(no LoRA at all). The case records ``adapter_over_base`` (the adapter's arithmetic on one loaded model),
``adapter_over_plain`` (what serving a LoRA policy costs against serving the plain model: LoRA's kernels on every row
of a LoRA-enabled engine, the adapter's on its own) and ``added_us_per_token`` ((adapter median - base median) /
(batch x new_tokens), in microseconds). Measured with the release gate's round count (``gated_full``: the full tier
runs it) but held to no minimum: what an adapter costs is the backend's (vLLM's punica kernels, PyTorch ops on CPU;
PEFT's extra matmuls; llama.cpp's adapter graph). On CPU hosts the engine's vLLM base rows run with a zero adapter
(``engine.backends.vllm.lora``), so there base rows pay the LoRA arithmetic too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.conftest import SESSION_KEY
from benchmarks.harness import generating, record_per_token_cost
from benchmarks.test_throughput import Case  # the same case shape and id: adapter_cost[hf-b8-short-o16-none]
from benchmarks.workload import batch_messages, fixed_length

pytestmark = pytest.mark.gated_full  # the full tier's run, its round count; no minimum reads its ratios

ADAPTER = "r16"
ADAPTER_FIXTURE = "smollm2-lora"
BASE_FIXTURE = "smollm2-135m-instruct"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "adapter_case" not in metafunc.fixturenames:
        return
    bench = metafunc.config.stash.get(SESSION_KEY, None)
    if bench is None:  # not opted in: one placeholder case, skipped by the conftest
        cases = [Case("hf", 1, "short", 16, "none")]
    else:
        backends = dict.fromkeys((*bench.backends, "llamacpp"))
        cases = [Case(b, n, "short", o, "none") for b in backends for n in bench.size.batches
                 for o in bench.size.new_tokens]
    metafunc.parametrize("adapter_case", cases, ids=[c.id for c in cases])


def adapter_engine(bench, backend: str) -> object:
    """The run's model with both fixture adapters loaded (llama.cpp: their GGUF twins), kept for the run."""
    from engine_fixtures import ensure
    from engine_fixtures.build import ADAPTER_TWINS

    if bench.model_arg != BASE_FIXTURE:
        pytest.skip(f"the adapter fixtures ({ADAPTER_FIXTURE}) are {BASE_FIXTURE}'s; --benchmark-model is "
                    f"{bench.model_arg}")
    hf_root = Path(ensure(ADAPTER_FIXTURE))
    adapters = {name: str(hf_root / name) for name in ("r8", "r16")}
    if backend == "llamacpp":  # the pool loads each adapter's GGUF twin there, as it loads the model's
        gguf_root = Path(ensure(ADAPTER_TWINS[ADAPTER_FIXTURE]))
        bench.pool.twins.update({path: str(gguf_root / name) for name, path in adapters.items()})
    return bench.pool.loaded(backend, bench.model_path, model={"adapters": adapters})


def test_adapter_cost(bench, benchmark, adapter_case: Case) -> None:
    case = adapter_case
    if case.backend == "llamacpp":
        pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install "
                            "'xbackend-engine[llamacpp]'; nox installs it)")
    engine = adapter_engine(bench, case.backend)
    messages = batch_messages(case.batch, "short")
    options = fixed_length(case.new_tokens)
    base = generating("base", "reference", engine, messages, options)
    adapted = generating("adapter", "subject", engine, messages, options, adapter=ADAPTER)
    plain = generating("plain", "reference", bench.engine(case.backend), messages, options)
    rounds = bench.measure(benchmark, f"adapter_cost[{case.id}]", [base, adapted, plain], gates={})
    added = record_per_token_cost(bench, benchmark, "adapter_cost", case, engine, messages, options, rounds,
                                  {"adapter_over_base": rounds.speed_ratio("adapter", "base"),
                                   "adapter_over_plain": rounds.speed_ratio("adapter", "plain")}, "adapter", "base")
    bench.progress(f"adapter_cost[{case.id}]: adapter {ADAPTER} adds {added:.1f} us per token per row")
