"""What the portable sampler costs: the engine sampling with ``generation.sampler: portable`` against the same engine
with the backend's own sampler, per backend, at batch 1, 8 and 64.

Both variants generate the same seeded requests at temperature 1.0 to a fixed length (EOS held back), interleaved in
one run; the case records ``portable_over_native`` (speed ratio, gated) and ``added_us_per_token``: what the portable
draw adds per generated token per row, (portable median - native median) / (batch x new_tokens), in microseconds.
The draw hashes only the tokens that can still win (``engine.rules.portable_sampler``), in numpy on the host.
"""

from __future__ import annotations

import pytest

from benchmarks.conftest import SESSION_KEY
from benchmarks.harness import generating, record_per_token_cost
from benchmarks.test_throughput import Case  # the same case shape and id: sampler_cost[hf-b8-short-o16-none]
from benchmarks.workload import batch_messages, fixed_length

pytestmark = pytest.mark.gated_full  # the full tier's gate reads portable_over_native (FULL_TIER_MINIMUMS); not CI

SAMPLED = {"temperature": 1.0, "seed": 5}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "sampler_case" not in metafunc.fixturenames:
        return
    bench = metafunc.config.stash.get(SESSION_KEY, None)
    if bench is None:  # not opted in: one placeholder case, skipped by the conftest
        cases = [Case("hf", 1, "short", 16, "none")]
    else:
        backends = dict.fromkeys((*bench.backends, "llamacpp"))  # llama.cpp's own sampler too (its chain's draw)
        cases = [Case(b, n, "short", o, "none") for b in backends for n in bench.size.batches
                 for o in bench.size.new_tokens]
    metafunc.parametrize("sampler_case", cases, ids=[c.id for c in cases])


def test_sampler_cost(bench, benchmark, sampler_case: Case) -> None:
    case = sampler_case
    if case.backend == "llamacpp":
        pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install "
                            "'xbackend-engine[llamacpp]'; nox installs it)")
    engine = bench.engine(case.backend)
    messages = batch_messages(case.batch, "short")
    options = {**fixed_length(case.new_tokens), **SAMPLED}
    native = generating("native", "reference", engine, messages, {**options, "sampler": "native"})
    portable = generating("portable", "subject", engine, messages, {**options, "sampler": "portable"})
    rounds = bench.measure(benchmark, f"sampler_cost[{case.id}]", [native, portable],
                           gates={"portable_over_native": ("portable", "native")})
    added = record_per_token_cost(bench, benchmark, "sampler_cost", case, engine, messages, options, rounds,
                                  {"portable_over_native": rounds.speed_ratio("portable", "native")},
                                  "portable", "native")
    bench.progress(f"sampler_cost[{case.id}]: the portable draw adds {added:.1f} us per token per row")
