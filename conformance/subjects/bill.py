"""What the conformance session's pools started and what it cost: every engine, server and kept object, in order,
with its seconds (printed at the session's end with the time by module, ``conformance/kit/report.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Bill:
    """(kind, key, seconds) of every start, shared by the engine pool and the server pool.

    >>> bill = Bill()
    >>> with bill.timed("engine", ("hf", "smol")):
    ...     pass
    >>> [(kind, key) for kind, key, _ in bill.starts]
    [('engine', 'hf smol')]
    """

    starts: list[tuple[str, str, float]] = field(default_factory=list)
    announce: Callable[[str], None] | None = None
    """Told ``starting <kind> <key> ...`` as each start begins (the benchmarks' progress lines)."""

    @contextmanager
    def timed(self, kind: str, key: tuple[str, ...]) -> Iterator[None]:
        named = " ".join(k for k in key if k and k != "[]")
        if self.announce is not None:
            self.announce(f"starting {kind} {named} ...")
        began = time.monotonic()
        yield
        self.starts.append((kind, named, time.monotonic() - began))
