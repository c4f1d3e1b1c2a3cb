"""Our served vLLM with a LoRA adapter vs stock ``vllm serve`` with the same adapter: the ``smollm2-lora`` fixture's
r16 (rank 16 on every projection) loaded at start on both (``model.adapters``; ``--enable-lora --lora-modules
r16=<folder> --max-lora-rank 16 --max-loras 2``, the slots our engine gives vLLM on a CPU host: the adapter and the
zero adapter base rows run with), every request naming it by the OpenAI ``model`` field, through the official
``openai`` client, side by side in one run (``test_vs_vllm_serve.py``'s servers, layout and rounds).

For each concurrency ``c`` (1, 8, 64), ``max(c, Size.served_requests)`` greedy chat requests of fixed length; both
servers answer them alike first (texts and prompt tokens asserted). Recorded: ``adapter_ours_over_stock`` (stock's
median wall / ours: above 1 ours serves the adapter faster), gated at 0.97 in the full tier's run like
``ours_over_stock`` (``gated_full``: CI's quick tier leaves the module out: two more vLLM servers).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.conftest import SESSION_KEY
from benchmarks.test_adapter_cost import ADAPTER, ADAPTER_FIXTURE, BASE_FIXTURE
from benchmarks.test_vs_vllm_serve import compare_with_stock, side_by_side

pytestmark = pytest.mark.gated_full  # the full tier's gate reads adapter_ours_over_stock; CI's quick tier leaves it out

CONCURRENCY = (1, 8, 64)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "adapter_concurrency" in metafunc.fixturenames:
        on = metafunc.config.stash.get(SESSION_KEY, None) is not None
        metafunc.parametrize("adapter_concurrency", CONCURRENCY if on else CONCURRENCY[:1])  # not opted in: skipped


@pytest.fixture(scope="module")
def adapter_servers(bench: Any) -> Iterator[dict[str, Any]]:
    """Both servers with adapter r16 loaded at start, stopped when the module ends."""
    from engine_fixtures import ensure

    if bench.model_arg != BASE_FIXTURE:
        pytest.skip(f"the adapter fixtures ({ADAPTER_FIXTURE}) are {BASE_FIXTURE}'s; --benchmark-model is "
                    f"{bench.model_arg}")
    folder = str(Path(ensure(ADAPTER_FIXTURE)) / ADAPTER)
    yield from side_by_side(bench, model={"adapters": {ADAPTER: folder}},
                            stock_flags=["--enable-lora", "--lora-modules", f"{ADAPTER}={folder}", "--max-lora-rank",
                                         "16", "--max-loras", "2"])


def test_adapter_ours_vs_vllm_serve(bench, benchmark, adapter_servers, adapter_concurrency: int) -> None:
    compare_with_stock(bench, benchmark, adapter_servers, adapter_concurrency, group="adapter_vs_vllm_serve",
                       ratio="adapter_ours_over_stock", model=ADAPTER)
