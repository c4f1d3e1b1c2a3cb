"""Where a row the guard ended is recorded, since vLLM's answer has no field for it: the log, and an audit file.

vLLM answers a row the guard ended with ``finish_reason "stop"`` and ``stop_reason null``, as for the model's own EOS.
The processor runs in vLLM's engine core, a process apart from the API server, so what it knows cannot reach the
response; it goes to:

- the engine core's log (``engine.vllm_plugin.audit``, INFO), one line per ended row;
- ``ENGINE_GUARD_AUDIT_LOG=<file>``: one JSON object per ended row appended (``time``, ``pid``, the rule's events:
  ``repeat_terminate: [reason, index]``, ``min_length_capped``...), for a trainer or an operator to count;
- :attr:`AuditLog.counts`: ended rows by reason, in the engine core's process.

What a trainer reads per row is :func:`engine.vllm_plugin.replay.guard_report`: the rule replayed on the ids vLLM
returned (exact: the rule is a pure function of those ids).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

VARIABLE = "ENGINE_GUARD_AUDIT_LOG"
log = logging.getLogger(__name__)


class AuditLog:
    """Ended rows, counted by reason and written one JSON line each to ``path`` (None: counted and logged only).

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "audit.jsonl"
    >>> audit = AuditLog(str(path))
    >>> audit.record({"repeat_terminate": ("ngram_repeats", 12)})
    >>> json.loads(path.read_text())["repeat_terminate"], dict(audit.counts)
    (['ngram_repeats', 12], {'ngram_repeats': 1})
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.counts: Counter[str] = Counter()

    def record(self, events: Mapping[str, Any]) -> None:
        reason = reason_of(events)
        self.counts[reason] += 1
        log.info("engine guard ended a row: %s", dict(events))
        if self.path:
            line = json.dumps({"time": time.time(), "pid": os.getpid(), "reason": reason, **events}, default=list)
            with open(self.path, "a", encoding="utf-8") as out:
                out.write(line + "\n")


def reason_of(events: Mapping[str, Any]) -> str:
    """The name of what ended the row: the repeat rule's reason, or the min-length cap."""
    fired = events.get("repeat_terminate")
    if fired:
        return str(fired[0])
    return "min_length_capped" if events.get("min_length_capped") else "other"


AUDIT = AuditLog(os.environ.get(VARIABLE) or None)
"""This process's audit (the engine core's, where the processor runs)."""
