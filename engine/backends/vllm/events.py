"""The worker side of rule events: a vLLM ``worker_extension_cls`` whose one method hands the engine the events
that the row-rule processor recorded in this worker's process.

``VllmBackend`` starts vLLM with ``worker_extension_cls="engine.backends.vllm.events.RuleEventsWorker"`` and,
after a batch, calls ``llm.collective_rpc("engine_rule_events", args=(keys,))``. The call reaches the worker
wherever it runs (the calling process, an engine-core child process, every tensor-parallel rank), so the
trigger meta is reported by the guard itself in every deployment, never inferred from finish reasons.
"""

from __future__ import annotations

from typing import Any


class RuleEventsWorker:
    """Mixed into vLLM's worker class; no state of its own (the store is process-wide)."""

    def engine_rule_events(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        """The events of each finished request key known in this process, removed from the store."""
        from engine.backends.vllm.rules import EVENTS

        return EVENTS.collect(keys)
