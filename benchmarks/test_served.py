"""Served vs in-process: the same requests through ``python -m engine.serve`` and through ``generate``.

For each backend and concurrency ``c`` (``Size.served_concurrency``), one round answers
``max(c, Size.served_requests)`` chat requests of fixed length (EOS held back, so both variants generate the same
number of tokens; asserted):

* ``served`` (subject): ``c`` client threads, each posting one request at a time to ``/infer/`` with the learner's
  ``RolloutClient`` until the round's requests are answered; each request's latency is timed (issue to answer).
  The server batches what arrives together (vLLM: ``AsyncLLM``'s continuous batching; HF: the async batcher,
  up to the largest concurrency per batch).
* ``in-process`` (reference): ``engine.generate`` on batches of ``c`` requests, one after another: what the learner
  would do without a server. A request's latency is its batch call's wall time.

Recorded: ``served_over_inprocess`` (in-process median wall / served median wall; above 1 the server is faster),
requests/s and p50/p99 request latency of both variants per round (``reports/README.md``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from benchmarks.conftest import SESSION_KEY
from benchmarks.harness import Answered, Variant, closed_loop
from benchmarks.workload import batch_messages, fixed_length

NEW_TOKENS = 16


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "served_case" not in metafunc.fixturenames:
        return
    bench = metafunc.config.stash.get(SESSION_KEY, None)
    # Not opted in: one placeholder case, skipped by the conftest.
    cases = [(b, c) for b in bench.backends for c in bench.size.served_concurrency] if bench else [("hf", 1)]
    metafunc.parametrize("served_case", cases, ids=[f"{b}-c{c}" for b, c in cases])


def in_process(engine: Any, messages: list[Any], concurrency: int) -> Variant:
    options = fixed_length(NEW_TOKENS)

    def run() -> Answered:
        tokens, latencies = 0, []
        for start in range(0, len(messages), concurrency):
            batch = messages[start : start + concurrency]
            began = time.perf_counter()
            tokens += sum(len(r.token_ids) for r in engine.generate(batch, options=options))
            latencies += [time.perf_counter() - began] * len(batch)
        return Answered(tokens, tuple(latencies))

    return Variant("in-process", "reference", run)


def served(client: Any, messages: list[Any], concurrency: int) -> Variant:
    request_config = {"max_tokens": NEW_TOKENS}
    extension = {"options": {"min_new_tokens": NEW_TOKENS}}

    def one(i: int) -> tuple[int, float, None]:
        began = time.perf_counter()
        [result] = client.infer([messages[i]], request_config, engine=extension)
        return len(result.token_ids), time.perf_counter() - began, None

    return Variant("served", "subject", lambda: closed_loop(len(messages), concurrency, one))


def test_served_vs_in_process(bench, benchmark, served_case: tuple[str, int]) -> None:
    from engine.client import RolloutClient

    backend, concurrency = served_case
    n = max(concurrency, bench.size.served_requests)
    messages = batch_messages(n, "short")
    engine = bench.engine(backend)
    server = bench.server(backend)
    label = f"served[{backend}-c{concurrency}-n{n}-o{NEW_TOKENS}]"
    with RolloutClient(server.url, repeat_terminate=engine.config.repeat_terminate, timeout=600) as client:
        client.wait_ready()
        reference, subject = in_process(engine, messages, concurrency), served(client, messages, concurrency)
        rounds = bench.measure(benchmark, label, [reference, subject], gated=False)
    for variant in (reference, subject):  # fixed length: a variant that stopped early would flatter the ratio
        assert rounds.tokens(variant.name) == {n * NEW_TOKENS}, (variant.name, rounds.tokens(variant.name))
    rendered, _ = engine.prepare(messages, options=fixed_length(NEW_TOKENS))
    ratio = rounds.speed_ratio(subject.name, reference.name)
    bench.record({"benchmark": label, "group": "served", "backend": backend, "batch": concurrency,
                  "prompt_len": "short", "prompt_tokens": sum(len(r.token_ids) for r in rendered),
                  "new_tokens": NEW_TOKENS, "fixed_length": True, "guard_set": "none"},
                 rounds, {"served_over_inprocess": ratio}, benchmark)
    p50 = {v.name: _median_of(rounds, v.name, "p50_latency_ms") for v in (reference, subject)}
    p99 = {v.name: _median_of(rounds, v.name, "p99_latency_ms") for v in (reference, subject)}
    bench.progress(f"{label}: {n / rounds.median_wall(subject.name):.1f} req/s served vs "
                   f"{n / rounds.median_wall(reference.name):.1f} in-process; p50 {p50['served']:.0f} vs "
                   f"{p50['in-process']:.0f} ms, p99 {p99['served']:.0f} vs {p99['in-process']:.0f} ms")


def _median_of(rounds: Any, name: str, column: str) -> float:
    import statistics

    return statistics.median(r[column] for r in rounds.rows() if r["variant"] == name)
