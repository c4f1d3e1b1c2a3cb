"""``GET /metrics``: the served engine's counters in the Prometheus text format (version 0.0.4).

Written here (a few counters, one gauge family, one histogram) rather than through a client library's global
registry, so several apps in one process never share or clash over metric state.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServeMetrics:
    """Thread-safe counters of one served engine.

    >>> m = ServeMetrics()
    >>> m.observe(endpoint="infer", status=200, seconds=0.2, sequences=2, prompt_tokens=10, generated_tokens=7,
    ...           triggered=1)
    >>> print([l for l in m.render(active=1, in_flight=0).splitlines() if l.startswith("engine_repeat")][0])
    engine_repeat_terminate_triggered_total 1
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.totals: Counter[str] = Counter()
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        self.latency_count = 0

    def observe(self, *, endpoint: str, status: int, seconds: float, sequences: int = 0, prompt_tokens: int = 0,
                generated_tokens: int = 0, triggered: int = 0, cancelled: bool = False) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1
            self.totals["sequences"] += sequences
            self.totals["prompt_tokens"] += prompt_tokens
            self.totals["generated_tokens"] += generated_tokens
            self.totals["triggered"] += triggered
            self.totals["cancelled"] += int(cancelled)
            if status == 200:
                self.buckets[bisect_left(LATENCY_BUCKETS, seconds)] += 1
                self.latency_sum += seconds
                self.latency_count += 1

    def render(self, *, active: int, in_flight: int) -> str:
        with self._lock:
            lines = ["# HELP engine_requests_total HTTP requests answered, by endpoint and status.",
                     "# TYPE engine_requests_total counter"]
            for (endpoint, status), n in sorted(self.requests.items()):
                lines.append(f'engine_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
            for name, key, text in (
                ("engine_sequences_total", "sequences", "Sequences generated."),
                ("engine_prompt_tokens_total", "prompt_tokens", "Prompt tokens of generated sequences."),
                ("engine_generation_tokens_total", "generated_tokens", "Tokens generated."),
                ("engine_repeat_terminate_triggered_total", "triggered",
                 "Sequences the repeat guard ended (its own per-sequence flag)."),
                ("engine_requests_cancelled_total", "cancelled", "Requests whose client went away before the answer."),
            ):
                lines += [f"# HELP {name} {text}", f"# TYPE {name} counter", f"{name} {self.totals[key]}"]
            lines += ["# HELP engine_repeat_terminate_active Whether the repeat guard is active (0/1).",
                      "# TYPE engine_repeat_terminate_active gauge", f"engine_repeat_terminate_active {active}",
                      "# HELP engine_requests_in_flight Requests being generated now.",
                      "# TYPE engine_requests_in_flight gauge", f"engine_requests_in_flight {in_flight}",
                      "# HELP engine_request_latency_seconds Latency of successful generation requests.",
                      "# TYPE engine_request_latency_seconds histogram"]
            cumulative = 0
            for bound, n in zip((*map(str, LATENCY_BUCKETS), "+Inf"), self.buckets, strict=True):
                cumulative += n
                lines.append(f'engine_request_latency_seconds_bucket{{le="{bound}"}} {cumulative}')
            lines += [f"engine_request_latency_seconds_sum {self.latency_sum}",
                      f"engine_request_latency_seconds_count {self.latency_count}"]
        return "\n".join(lines) + "\n"
