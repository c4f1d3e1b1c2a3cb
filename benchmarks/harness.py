"""Measuring: variants of one case run interleaved, round by round, the device synchronized around each call.

Each round runs every variant once (the order alternates between rounds), so machine noise hits all of
them alike and their ratio is meaningful even on a busy machine. Warm-up rounds run but are not kept.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Answered:
    """What a round of a variant that times each request returns: the tokens over all its requests, and each
    request's latency (issue to answer) in seconds."""

    tokens: int
    latencies_s: tuple[float, ...]
    ttft_s: tuple[float, ...] = ()
    """Each request's time to its first token (streamed: the first content delta), where measured."""


@dataclass(frozen=True)
class Variant:
    """One way to serve the case's requests. ``run`` returns the tokens it generated over the whole batch, or an
    :class:`Answered` when it times each request too."""

    name: str
    role: str  # "reference" or "subject"
    run: Callable[[], int | Answered]


def closed_loop(n: int, concurrency: int, one: Callable[[int], tuple[int, float, float | None]]) -> Answered:
    """Answer requests ``0..n-1`` with ``concurrency`` client threads, each sending its next request when the last
    one is answered. ``one(i)`` sends request ``i`` and returns (tokens, latency s, time to first token s or None).
    The first error stops every thread and is raised."""
    queue = list(range(n))
    lock = threading.Lock()
    answers: list[tuple[int, float, float | None]] = [(0, 0.0, None)] * n
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                if not queue or errors:
                    return
                i = queue.pop()
            try:
                answers[i] = one(i)
            except BaseException as err:  # surfaced below, after every thread has stopped
                with lock:
                    errors.append(err)
                return

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    ttft = tuple(a[2] for a in answers if a[2] is not None)
    return Answered(sum(a[0] for a in answers), tuple(a[1] for a in answers), ttft if len(ttft) == n else ())


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between closest ranks, as numpy's default.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([5.0], 99), percentile(list(range(101)), 99)
    (2.5, 5.0, 99.0)
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def sync() -> None:
    """Wait for queued device work, so a round's wall time covers it (a no-op without CUDA)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@dataclass
class Rounds:
    """Callable for ``benchmark.pedantic``: each call is one round of every variant."""

    variants: Sequence[Variant]
    warmup: int
    total: int
    progress: Callable[[str], None]
    label: str
    calls: int = 0
    added: int = 0
    """Measured rounds added after the first ``total`` (see :meth:`more`)."""
    samples: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    latencies: dict[str, list[tuple[float, ...]]] = field(default_factory=dict)
    """Per measured round, each request's latency (variants that return :class:`Answered` only)."""
    ttfts: dict[str, list[tuple[float, ...]]] = field(default_factory=dict)
    """Per measured round, each request's time to first token (variants that measure it)."""

    def __call__(self) -> None:
        kept = self.calls >= self.warmup
        order = self.variants if self.calls % 2 == 0 else list(reversed(self.variants))
        done = []
        for v in order:
            sync()
            start = time.perf_counter()
            out = v.run()
            sync()
            wall = time.perf_counter() - start
            tokens = out.tokens if isinstance(out, Answered) else out
            done.append(f"{v.name} {wall:.3f}s/{tokens}tok")
            if kept:
                self.samples.setdefault(v.name, []).append((wall, tokens))
                if isinstance(out, Answered):
                    self.latencies.setdefault(v.name, []).append(out.latencies_s)
                    if out.ttft_s:
                        self.ttfts.setdefault(v.name, []).append(out.ttft_s)
        step = "warm-up" if not kept else f"round {self.calls - self.warmup + 1}/{self.total}"
        self.progress(f"{self.label} {step}: {', '.join(done)}")
        self.calls += 1

    def more(self, n: int) -> None:
        """Measure ``n`` more rounds of every variant, kept beside the first ones (same interleaving)."""
        self.total += n
        self.added += n
        for _ in range(n):
            self()

    def median_wall(self, name: str) -> float:
        return statistics.median(w for w, _ in self.samples[name])

    def speed_ratio(self, subject: str, reference: str) -> float:
        """Median wall time of ``reference`` / of ``subject``: how fast the subject serves the same requests
        relative to the reference (= the token-throughput ratio when both generate the same tokens)."""
        return self.median_wall(reference) / self.median_wall(subject)

    def token_rate_ratio(self, subject: str, reference: str) -> float:
        """Median tokens/s of ``subject`` / of ``reference`` (for variants that generate different lengths)."""
        rate = {n: statistics.median(t / w for w, t in self.samples[n]) for n in (subject, reference)}
        return rate[subject] / rate[reference]

    def missed(self, gates: Mapping[str, tuple[str, str]], minimums: Mapping[str, float]) -> list[str]:
        """The gated ratios (``{ratio: (subject, reference)}``) below their minimums, as ``"ratio value < min"``."""
        return [f"{ratio} {self.speed_ratio(*pair):.3f} < {minimums[ratio]}" for ratio, pair in gates.items()
                if ratio in minimums and self.speed_ratio(*pair) < minimums[ratio]]

    def tokens(self, name: str) -> set[int]:
        return {t for _, t in self.samples[name]}

    def rows(self) -> list[dict[str, Any]]:
        roles = {v.name: v.role for v in self.variants}
        out = []
        for name, samples in self.samples.items():
            for i, (wall, tokens) in enumerate(samples):
                row = {"variant": name, "role": roles[name], "round": i, "wall_s": wall, "output_tokens": tokens}
                if name in self.latencies:
                    lat = self.latencies[name][i]
                    row.update(requests=len(lat), p50_latency_ms=percentile(lat, 50) * 1e3,
                               p99_latency_ms=percentile(lat, 99) * 1e3)
                if name in self.ttfts:
                    row["p50_ttft_ms"] = percentile(self.ttfts[name][i], 50) * 1e3
                out.append(row)
        return out


def generating(name: str, role: str, engine: Any, messages: list, options: dict, **call: Any) -> Variant:
    """A variant that runs ``engine.generate(messages, options=options, **call)`` and counts the generated tokens."""

    def run() -> int:
        return sum(len(r.token_ids) for r in engine.generate(messages, options=options, **call))

    return Variant(name, role, run)


def record_per_token_cost(bench: Any, benchmark: Any, group: str, case: Any, engine: Any, messages: list,
                          options: dict, rounds: Any, ratios: Mapping[str, float], subject: str,
                          reference: str) -> float:
    """Record a fixed-length cost case of ``group`` (every variant generated ``batch x new_tokens`` tokens, asserted:
    one that stopped early would flatter its ratio) with its ``ratios`` and ``added_us_per_token`` ((``subject``
    median - ``reference`` median) / tokens, in microseconds), which it returns."""
    expected = case.batch * case.new_tokens
    for name in (v.name for v in rounds.variants):
        assert rounds.tokens(name) == {expected}, (name, rounds.tokens(name), expected)
    added = (rounds.median_wall(subject) - rounds.median_wall(reference)) / expected * 1e6
    rendered, _ = engine.prepare(messages, options=options)
    bench.record({"benchmark": f"{group}[{case.id}]", "group": group, "backend": case.backend, "batch": case.batch,
                  "prompt_len": "short", "prompt_tokens": sum(len(r.token_ids) for r in rendered),
                  "new_tokens": case.new_tokens, "fixed_length": True, "guard_set": "none"},
                 rounds, {**ratios, "added_us_per_token": added}, benchmark)
    return added
