"""Benchmark plumbing: the ``--benchmark`` opt-in, sizes, shared engines, progress lines, the Parquet report.

Options (under "engine benchmarks" in ``pytest --help``): ``--benchmark`` (without it every benchmark is
skipped), ``--benchmark-size smoke|full``, ``--benchmark-backends``, ``--benchmark-model``,
``--benchmark-dtype``, ``--benchmark-reports``. One report per run:
``reports/benchmark-<run_id>.parquet`` (copied to ``reports/benchmark-latest.parquet``), schema in
``engine/report/schema.py`` and ``reports/README.md``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from benchmarks.harness import Rounds, Variant
from benchmarks.workload import SIZES, Size
from conformance.kit import reaper
from engine.report.schema import RATIO_COLUMNS

SESSION_KEY = pytest.StashKey["BenchSession"]()
BACKENDS = ("hf", "vllm")
"""The backends benchmarked by default; the ``backends`` group adds llama.cpp itself (``SPECS`` lists every one)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("engine benchmarks")
    group.addoption("--benchmark", action="store_true", default=False,
                    help="run the benchmarks in benchmarks/ (default: off, they are skipped)")
    group.addoption("--benchmark-size", choices=sorted(SIZES), default=os.environ.get("ENGINE_BENCHMARK_SIZE"),
                    help="smoke (CPU CI, minutes) or full (GPU runners); default: $ENGINE_BENCHMARK_SIZE, "
                         "else full with CUDA and smoke without")
    group.addoption("--benchmark-backends", default=",".join(BACKENDS), help="comma-separated (default: hf,vllm)")
    group.addoption("--benchmark-model", default="smollm2-135m-instruct",
                    help="a fixture name (python -m engine_fixtures list) or a model folder "
                         "(default: smollm2-135m-instruct)")
    group.addoption("--benchmark-dtype", default=None,
                    help="model dtype (default: float32 on CPU, bfloat16 with CUDA)")
    group.addoption("--benchmark-reports", default=None, help="report folder (default: <rootdir>/reports)")


def _cuda() -> bool:
    from engine.backends.host import has_cuda

    return has_cuda()


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("--benchmark"):
        return
    reaper.start()  # every server and engine core this run starts dies with it, however it ends
    size = config.getoption("--benchmark-size") or ("full" if _cuda() else "smoke")
    if size not in SIZES:
        raise pytest.UsageError(f"--benchmark-size / ENGINE_BENCHMARK_SIZE: {size!r} is not one of {sorted(SIZES)}")
    backends = tuple(b.strip() for b in config.getoption("--benchmark-backends").split(",") if b.strip())
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        raise pytest.UsageError(f"--benchmark-backends: unknown {unknown or backends}; available: hf,vllm")
    reports = Path(config.getoption("--benchmark-reports") or Path(config.rootpath) / "reports")
    config.stash[SESSION_KEY] = BenchSession(config, size, backends, reports)


def pytest_report_header(config: pytest.Config) -> list[str]:
    bench = config.stash.get(SESSION_KEY, None)
    if bench is None:
        return []
    run = bench.writer.run
    return [f"engine benchmarks: size {bench.size_name}, backends {','.join(bench.backends)}, model "
            f"{bench.model_arg} ({bench.dtype}) on {run['device']}",
            f"engine benchmarks: report {bench.reports}/benchmark-{run['run_id']}.parquet"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SESSION_KEY not in config.stash:
        skip = pytest.mark.skip(reason="benchmarks run only with --benchmark (nox -s benchmark)")
        for item in items:
            item.add_marker(skip)
        return
    config.stash[SESSION_KEY].total = len(items)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if SESSION_KEY in item.config.stash:
        item.config.stash[SESSION_KEY].started += 1
        item.config.stash[SESSION_KEY].item = item


def pytest_sessionfinish(session: pytest.Session) -> None:
    bench = session.config.stash.get(SESSION_KEY, None)
    if bench is not None and bench.writer.rows:
        path = bench.writer.write(bench.reports)
        session.config.get_terminal_writer().line()
        session.config.get_terminal_writer().line(f"benchmark report: {path} (and {path.parent}/"
                                                  "benchmark-latest.parquet); python -m engine.report show it")


@pytest.fixture(scope="session")
def bench(pytestconfig: pytest.Config) -> Iterator[BenchSession]:
    session = pytestconfig.stash[SESSION_KEY]
    yield session
    session.close()


class BenchSession:
    """Engines shared by all benchmarks of a run, the report being written, and the progress lines."""

    def __init__(self, config: pytest.Config, size: str, backends: tuple[str, ...], reports: Path) -> None:
        from engine.report.metadata import run_metadata
        from engine.report.writer import ReportWriter

        self.config = config
        self.size_name = size
        self.size: Size = SIZES[size]
        self.backends = backends
        self.reports = reports
        self.model_arg = config.getoption("--benchmark-model")
        self.dtype = config.getoption("--benchmark-dtype") or ("bfloat16" if _cuda() else "float32")
        self.writer = ReportWriter(run_metadata(size, root=Path(config.rootpath)))
        self.total = 0
        self.started = 0
        self.item: pytest.Item | None = None
        """The benchmark running now (a gated one must carry the ``gated`` marker, which the quick tier selects)."""
        self._pool: Any = None
        if not self.size.vllm_compiled:  # before any engine or server starts: they inherit it
            from engine.backends.host import turn_torch_compile_off

            turn_torch_compile_off()

    # -- engines (one per kind for the whole run; vLLM ones are never closed early, see EnginePool.keep) --

    @property
    def model_path(self) -> str:
        from engine_fixtures import FIXTURES, ensure

        if self.model_arg in FIXTURES:
            return str(ensure(self.model_arg))
        if not Path(self.model_arg).is_dir():
            raise pytest.UsageError(f"--benchmark-model {self.model_arg!r}: neither a fixture "
                                    f"({', '.join(FIXTURES)}) nor a folder")
        return self.model_arg

    @property
    def model_name(self) -> str:
        return Path(self.model_arg).name

    @property
    def pool(self) -> Any:
        """The suite's engine pool with the benchmarks' sizing (``benchmarks/pool.py``), made on first need."""
        if self._pool is None:
            from benchmarks.pool import VLLM_ENGINES_AT_ONCE, BenchPool
            from conformance.subjects.bill import Bill
            from conformance.subjects.pool import PoolOptions
            from engine_fixtures import GGUF_TWINS, ensure

            twin = GGUF_TWINS.get(self.model_arg)
            options = PoolOptions(backends=self.backends, model=self.model_path, vlm_model="", dtype=self.dtype,
                                  device="cuda" if _cuda() else "cpu", gpu_vllm_engines=VLLM_ENGINES_AT_ONCE)
            self._pool = BenchPool(options, bill=Bill(announce=self.progress), size=self.size,
                                   gguf_twin=None if twin is None else lambda: str(ensure(twin)))
        return self._pool

    def engine(self, backend: str, *, guarded: bool = False) -> Any:
        """The backend's engine; ``guarded``: the same loaded engine with the repeat guard on (derived, so guard on
        vs off compares one model instance with itself)."""
        from benchmarks.workload import REPEAT_GUARD

        if guarded:
            return self.pool.loaded(backend, self.model_path, repeat_terminate=REPEAT_GUARD)
        return self.pool.loaded(backend, self.model_path)

    def engine_in(self, backend: str, dtype: str, logprobs_mode: str = "raw_logprobs") -> Any:
        """``backend``'s engine with the model in ``dtype`` and ``logprobs_mode``: the run's own engine when those are
        its own, else one more engine, kept for the run (derived where the backend reads the mode per call; vLLM's
        count in ``VLLM_ENGINES_AT_ONCE``)."""
        if dtype == self.dtype and logprobs_mode == "raw_logprobs":
            return self.engine(backend)
        if dtype == self.dtype:
            return self.pool.loaded(backend, self.model_path, model={"logprobs_mode": logprobs_mode})
        return self.pool.loaded(backend, self.model_path, model={"dtype": dtype, "logprobs_mode": logprobs_mode})

    def raw_vllm(self, *, plugin: bool = False) -> Any:
        """A bare ``vllm.LLM`` with the engine's own arguments, minus what the engine adds; ``plugin``: the same with
        the guard's vLLM plugin loaded (``engine.vllm_plugin``), as a user adds it to the vLLM they run."""

        def build() -> Any:
            import vllm

            from engine.backends.vllm.backend import llm_kwargs
            from engine.vllm_plugin import PROCESSOR

            plain = self.engine("vllm")  # prepares the environment the same way
            more = {"logits_processors": [PROCESSOR]} if plugin else {}
            return vllm.LLM(**llm_kwargs(plain.config.model, plain.config.vllm), **more)

        return self.pool.keep(("raw", "vllm", *(["plugin"] if plugin else [])), build)

    def server(self, backend: str) -> Any:
        """``python -m engine.serve`` on the plain engine's config (a free port on 127.0.0.1), from the pool's
        servers; the HF batcher may merge as many requests as the largest served concurrency, as the in-process
        variant batches them; Pattern C ``/chat`` is greedy (its other defaults kept)."""
        return self.pool.servers.server(*self._served(backend))

    def server_config(self, backend: str) -> dict[str, Any]:
        """The config ``server(backend)`` runs."""
        return self._served(backend)[1]

    def _served(self, backend: str) -> tuple[tuple[str, str], dict[str, Any]]:
        from engine.config.serve import ServeConfig

        # Pattern C greedy: every round then generates the same tokens (sampled, one row looping on emoji until
        # max_new_tokens -- characters grow slowly there -- held a whole HF batch for 85 s in one round). The
        # server's own timeouts, not the suite's short ones (those are for the hostile checks). The uniproc
        # executor, as the suite's servers run it (the pool's servers do): a multiprocess worker (the served
        # default) spins while idle and would take a core from every later benchmark. test_vs_vllm_serve runs
        # the default.
        defaults = ServeConfig()
        serve = {"max_batch_size": max(self.size.served_concurrency), "chat": {"temperature": 0, "top_p": 1.0},
                 "idle_connection_timeout_s": defaults.idle_connection_timeout_s,
                 "body_timeout_s": defaults.body_timeout_s}
        return self.pool.servers.served_config(backend, self.model_path, serve=serve)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # -- measuring and recording ----------------------------------------------------------------------

    def progress(self, line: str) -> None:
        """A line on the terminal now, even while pytest captures output."""
        if self.config.pluginmanager.get_plugin("terminalreporter") is None:  # e.g. -p no:terminal
            print(line, file=sys.stderr, flush=True)
            return
        writer = self.config.get_terminal_writer()
        capture = self.config.pluginmanager.get_plugin("capturemanager")
        prefix = f"[bench {self.started}/{self.total}] " if self.total else "[bench] "
        if capture is not None:
            with capture.global_and_fixture_disabled():
                writer.line(prefix + line)
                writer.flush()  # shown now, also when stdout is a pipe or a CI log
        else:
            writer.line(prefix + line)
            writer.flush()

    def measure(self, benchmark: Any, label: str, variants: Sequence[Variant], *, gated: bool = True,
                gates: Mapping[str, tuple[str, str]] | None = None, rounds_compared: bool = False) -> Rounds:
        """Run the variants interleaved through pytest-benchmark's pedantic mode (warm-up rounds dropped);
        ``gated`` False: a case whose ratios are reported only gets the size's ``ungated_rounds`` after its
        ``ungated_warmup``, and at least two calls in all when ``rounds_compared`` (its assertion compares rounds).

        ``gates``: the case's ratios the release gate checks, ``{ratio: (subject, reference)}``. When one is below
        its minimum (``engine.report.gate.minimums_for("full")``) after the size's rounds, the case measures the size's
        ``confirm_rounds`` more, and every ratio of the case is then a median over all its rounds: on a shared
        machine one slow round (a ratio of 0.897 where this machine measured 0.966 and 1.065 for the same code)
        cannot fail a release, while a real regression misses in every round and still fails the gate."""
        from engine.report.gate import minimums_for

        marked = self.item is None or any(self.item.get_closest_marker(m) for m in ("gated", "gated_full"))
        if gated and not marked:
            pytest.fail(f"{label} is gated (its ratios are read by the release gate) but {self.item.nodeid} has no "
                        "'gated' marker, so ENGINE_TIER=quick (CI) would leave it out; fix: pytestmark = "
                        "pytest.mark.gated in its module ('gated_full': only the full tier's run, for a ratio of "
                        "engine.report.gate.FULL_TIER_MINIMUMS), or measure(..., gated=False)")
        total = self.size.rounds if gated else self.size.ungated_rounds
        warmup = self.size.warmup if gated else self.size.ungated_warmup
        if rounds_compared:
            warmup = max(warmup, 2 - total)
        rounds = Rounds(variants, warmup=warmup, total=total, progress=self.progress, label=label)
        benchmark.pedantic(rounds, rounds=total, warmup_rounds=warmup, iterations=1)
        if rounds.calls != warmup + total:
            pytest.fail(f"{label}: pytest-benchmark ran {rounds.calls} rounds, expected {warmup} warm-up + "
                        f"{total} measured; drop --benchmark-disable (the report needs every round)")
        missed = rounds.missed(gates or {}, minimums_for("full")) if gated else []
        if missed:
            self.progress(f"{label}: {', '.join(missed)} after {total} rounds; confirming with "
                          f"{self.size.confirm_rounds} more")
            rounds.more(self.size.confirm_rounds)
        return rounds

    def record(self, case: Mapping[str, Any], rounds: Rounds, ratios: Mapping[str, float],
               benchmark: Any) -> None:
        row = {"model": self.model_name, "dtype": self.dtype, **case, "confirm_rounds": rounds.added}
        self.writer.add_case(row, rounds.rows(), ratios)
        benchmark.extra_info.update({**case, **ratios})
        shown = ", ".join(f"{k} {v:.3f}" if k in RATIO_COLUMNS else f"{k} {v:.3g}" for k, v in ratios.items())
        self.progress(f"{case['benchmark']}: {shown}")
