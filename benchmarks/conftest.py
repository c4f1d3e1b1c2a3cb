"""Benchmarks are opted in with ``pytest --benchmark`` (a flag this project registers); otherwise skipped."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("engine benchmarks")
    group.addoption("--benchmark", action="store_true", default=False,
                    help="run the benchmarks in benchmarks/ (default: off, they are skipped)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--benchmark"):
        return
    skip = pytest.mark.skip(reason="benchmarks run only with --benchmark (nox -s benchmark)")
    for item in items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def hf_engine():
    from engine import GenerationEngine
    from fixtures import ensure

    path = ensure("smollm2-135m-instruct")
    eng = GenerationEngine({"backend": "hf", "model": {"path": str(path), "dtype": "float32", "device": "cpu"}})
    yield eng
    eng.close()
