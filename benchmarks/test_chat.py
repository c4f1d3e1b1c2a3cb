"""The chat service through the official ``openai`` client: streamed vs non-streamed, and Pattern C vs plain chat.

Both run against the benchmark session's server per backend (``python -m engine.serve``, the served cases' one;
Pattern C at its defaults, min_len 120 and max_len 240, but greedy so that every round generates the same tokens).
``c`` client threads each send one request at a time until the round's ``max(c, Size.chat_requests)`` requests
are answered.

* ``chat_stream[backend-cN]``: the same fixed-length requests (``NEW_TOKENS`` tokens, EOS held back through the
  engine extension; asserted) non-streamed (reference) and streamed over SSE (subject). Recorded per round:
  p50 time to first token (streamed: issue to the first content delta; non-streamed: issue to the answer),
  request latencies and tokens/s; ratio ``streamed_over_plain``.
* ``pattern_c[backend-cN]`` (the largest chat concurrency only): the same prompts to ``/v1/chat/completions``
  greedy with ``PLAIN_BUDGET`` tokens (reference) and to ``/chat`` (subject). Answers differ in length by design,
  so the ratio ``pattern_c_over_chat`` is one of token rates; per-request latency is in the latency columns.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from benchmarks.conftest import SESSION_KEY
from benchmarks.harness import Variant, closed_loop
from benchmarks.workload import batch_messages

NEW_TOKENS = 16
PLAIN_BUDGET = 96
"""Token budget of the plain chat requests Pattern C is compared with (sampled SmolLM2 answers may ramble on; a
240-character Pattern C answer takes about 60 tokens)."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    bench = metafunc.config.stash.get(SESSION_KEY, None)
    for name, every in (("chat_case", True), ("pattern_c_case", False)):
        if name not in metafunc.fixturenames:
            continue
        levels = (bench.size.chat_concurrency if every else bench.size.chat_concurrency[-1:]) if bench else (1,)
        cases = [(b, c) for b in (bench.backends if bench else ("hf",)) for c in levels]
        metafunc.parametrize(name, cases, ids=[f"{b}-c{c}" for b, c in cases])


def openai_client(server: Any) -> Any:
    import httpx
    import openai

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600,
                         http_client=httpx.Client(limits=limits, timeout=600))


def plain(client: Any, model: str, messages: list[Any], concurrency: int, **fields: Any) -> Variant:
    def one(i: int) -> tuple[int, float, float]:
        began = time.perf_counter()
        answer = client.chat.completions.create(model=model, messages=messages[i], **fields)
        latency = time.perf_counter() - began
        return answer.usage.completion_tokens, latency, latency

    return Variant("non-streamed", "reference", lambda: closed_loop(len(messages), concurrency, one))


def streamed(client: Any, model: str, messages: list[Any], concurrency: int, **fields: Any) -> Variant:
    def one(i: int) -> tuple[int, float, float]:
        began = time.perf_counter()
        first, tokens = None, 0
        for chunk in client.chat.completions.create(model=model, messages=messages[i], stream=True,
                                                    stream_options={"include_usage": True}, **fields):
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - began
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        latency = time.perf_counter() - began
        return tokens, latency, latency if first is None else first

    return Variant("streamed", "subject", lambda: closed_loop(len(messages), concurrency, one))


def pattern_c(server: Any, messages: list[Any], concurrency: int) -> Variant:
    import httpx

    http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=256))

    def one(i: int) -> tuple[int, float, float]:
        began = time.perf_counter()
        reply = http.post(f"{server.url}/chat", json={"messages": messages[i]})
        reply.raise_for_status()
        latency = time.perf_counter() - began
        return reply.json()["meta"]["usage"]["completion_tokens"], latency, latency

    return Variant("pattern_c", "subject", lambda: closed_loop(len(messages), concurrency, one))


def _p50(rounds: Any, name: str, column: str) -> float:
    import statistics

    return statistics.median(r[column] for r in rounds.rows() if r["variant"] == name)


def test_streamed_vs_non_streamed(bench, benchmark, chat_case: tuple[str, int]) -> None:
    backend, concurrency = chat_case
    n = max(concurrency, bench.size.chat_requests)
    messages = batch_messages(n, "short")
    server = bench.server(backend)
    fields = {"max_tokens": NEW_TOKENS, "temperature": 0, "extra_body": {"engine": {"options": {
        "min_new_tokens": NEW_TOKENS}}}}
    label = f"chat_stream[{backend}-c{concurrency}-n{n}-o{NEW_TOKENS}]"
    with openai_client(server) as client:
        model = client.models.list().data[0].id
        reference = plain(client, model, messages, concurrency, **fields)
        subject = streamed(client, model, messages, concurrency, **fields)
        rounds = bench.measure(benchmark, label, [reference, subject], gated=False)
    for variant in (reference, subject):
        assert rounds.tokens(variant.name) == {n * NEW_TOKENS}, (variant.name, rounds.tokens(variant.name))
    ratio = rounds.speed_ratio(subject.name, reference.name)
    bench.record({"benchmark": label, "group": "chat_stream", "backend": backend, "batch": concurrency,
                  "prompt_len": "short", "prompt_tokens": _prompt_tokens(bench, backend, messages),
                  "new_tokens": NEW_TOKENS, "fixed_length": True, "guard_set": "none"},
                 rounds, {"streamed_over_plain": ratio}, benchmark)
    ttft = {v.name: _p50(rounds, v.name, "p50_ttft_ms") for v in (reference, subject)}
    rate = {v.name: n * NEW_TOKENS / rounds.median_wall(v.name) for v in (reference, subject)}
    bench.progress(f"{label}: TTFT p50 streamed {ttft['streamed']:.0f} ms vs non-streamed {ttft['non-streamed']:.0f}"
                   f" ms; {rate['streamed']:.1f} vs {rate['non-streamed']:.1f} tokens/s")


def test_pattern_c_vs_plain_chat(bench, benchmark, pattern_c_case: tuple[str, int]) -> None:
    backend, concurrency = pattern_c_case
    n = max(concurrency, bench.size.chat_requests)
    messages = batch_messages(n, "short")
    server = bench.server(backend)
    label = f"pattern_c[{backend}-c{concurrency}-n{n}]"
    from engine.config.serve import PatternCConfig

    defaults = PatternCConfig(**bench.server_config(backend)["serve"]["chat"])
    with openai_client(server) as client:
        model = client.models.list().data[0].id
        reference = plain(client, model, messages, concurrency, temperature=defaults.temperature,
                          max_tokens=PLAIN_BUDGET, **({} if defaults.temperature == 0 else {"top_p": defaults.top_p}))
        reference = Variant("chat", "reference", reference.run)
        subject = pattern_c(server, messages, concurrency)
        rounds = bench.measure(benchmark, label, [reference, subject], gated=False)
    for variant in (reference, subject):  # greedy: the same answers every round
        assert len(rounds.tokens(variant.name)) == 1, (variant.name, rounds.tokens(variant.name))
    ratio = rounds.token_rate_ratio(subject.name, reference.name)
    bench.record({"benchmark": label, "group": "pattern_c", "backend": backend, "batch": concurrency,
                  "prompt_len": "short", "prompt_tokens": _prompt_tokens(bench, backend, messages),
                  "new_tokens": PLAIN_BUDGET, "fixed_length": False, "guard_set": "min_length"},
                 rounds, {"pattern_c_over_chat": ratio}, benchmark)
    latency = {v.name: _p50(rounds, v.name, "p50_latency_ms") for v in (reference, subject)}
    tokens = {v.name: sorted(rounds.tokens(v.name)) for v in (reference, subject)}
    bench.progress(f"{label}: token rate ratio {ratio:.3f}; p50 latency pattern_c {latency['pattern_c']:.0f} ms "
                   f"vs chat {latency['chat']:.0f} ms; tokens per round {tokens}")


def _prompt_tokens(bench: Any, backend: str, messages: list[Any]) -> int:
    rendered, _ = bench.engine(backend).prepare(messages)
    return sum(len(r.token_ids) for r in rendered)
