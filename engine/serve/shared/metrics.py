"""``GET /metrics``: the served engine's counters through ``prometheus_client``, one registry per app, every series
labelled ``model_name`` (as vLLM labels its own); on the vLLM backend, vLLM's own ``vllm:*`` metrics follow ours.

A registry per app (never the library's global one for our metrics) keeps several apps in one process (the test
suite, a host serving two models) from sharing or clashing over metric state. vLLM's ``AsyncLLM`` registers its
metrics (queue, KV cache, time to first token, tokens, ...) in ``prometheus_client``'s global registry of the server
process; :class:`VllmMetrics` hands those families to the app's registry when it is scraped.
"""

from __future__ import annotations

from typing import Any

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class VllmMetrics:
    """A collector yielding the ``vllm:*`` families of ``prometheus_client``'s global registry (vLLM's own), their
    ``model_name`` label set to the served name (vLLM labels them with the model path it was given)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def describe(self) -> list[Any]:
        return []  # nothing to check at registration: vLLM's names never clash with ``engine_*``

    def collect(self) -> Any:
        from prometheus_client import REGISTRY

        for family in REGISTRY.collect():  # fresh family objects on every collect: relabelling them is safe
            if family.name.startswith("vllm:"):
                family.samples = [s._replace(labels={**s.labels, "model_name": self.model_name})
                                  if "model_name" in s.labels else s for s in family.samples]
                yield family


class ServeMetrics:
    """The counters of one served engine, in a registry of its own.

    >>> m = ServeMetrics("smol")
    >>> m.observe(endpoint="infer", status=200, seconds=0.2, sequences=2, prompt_tokens=10, generated_tokens=7,
    ...           triggered=1)
    >>> [l for l in m.render(active=1, in_flight=0).splitlines() if l.startswith("engine_repeat_terminate_triggered_t")]
    ['engine_repeat_terminate_triggered_total{model_name="smol"} 1.0']
    """

    def __init__(self, model_name: str, *, include_vllm: bool = False) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]

        def counter(name: str, text: str, labels: tuple[str, ...] = ()) -> Any:
            return Counter(name, text, [*label, *labels], registry=self.registry)

        self.requests = counter("engine_requests", "HTTP requests answered, by endpoint and status.",
                                ("endpoint", "status"))
        self.sequences = counter("engine_sequences", "Sequences generated.").labels(model_name)
        self.prompt_tokens = counter("engine_prompt_tokens", "Prompt tokens of generated sequences.").labels(model_name)
        self.generated = counter("engine_generation_tokens", "Tokens generated.").labels(model_name)
        self.triggered = counter("engine_repeat_terminate_triggered",
                                 "Sequences the repeat guard ended (its own per-sequence flag).").labels(model_name)
        self.cancelled = counter("engine_requests_cancelled",
                                 "Requests whose client went away before the answer.").labels(model_name)
        self.active = Gauge("engine_repeat_terminate_active", "Whether the repeat guard is active (0/1).", label,
                            registry=self.registry).labels(model_name)
        self.in_flight = Gauge("engine_requests_in_flight", "Requests being generated now.", label,
                               registry=self.registry).labels(model_name)
        self.latency = Histogram("engine_request_latency_seconds", "Latency of successful generation requests.",
                                 label, buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        if include_vllm:
            self.registry.register(VllmMetrics(model_name))

    def observe(self, *, endpoint: str, status: int, seconds: float, sequences: int = 0, prompt_tokens: int = 0,
                generated_tokens: int = 0, triggered: int = 0, cancelled: bool = False,
                generation: bool = True) -> None:
        """Count one answered request; ``generation`` False (a weight route): counted by status, not timed."""
        self.requests.labels(self.model_name, endpoint, str(status)).inc()
        self.sequences.inc(sequences)
        self.prompt_tokens.inc(prompt_tokens)
        self.generated.inc(generated_tokens)
        self.triggered.inc(triggered)
        self.cancelled.inc(int(cancelled))
        if status == 200 and generation:
            self.latency.observe(seconds)

    def render(self, *, active: int, in_flight: int) -> str:
        """The exposition text (Prometheus text format 0.0.4), gauges read now."""
        from prometheus_client import generate_latest

        self.active.set(active)
        self.in_flight.set(in_flight)
        return generate_latest(self.registry).decode()
