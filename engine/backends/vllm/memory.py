"""How vLLM engines held side by side share one CUDA card.

vLLM 0.32 refuses to start an engine when the card's free memory is below ``gpu_memory_utilization`` × its total
(the start-up check ``vllm/v1/worker/utils.py::request_memory``), and a started engine then takes that whole share
(its KV cache fills what the weights leave). A process that holds several engines at once (the conformance pool,
the benchmarks' raw and engine pairs) must give each a share such that all of them, plus what else lives on the
card (HF models, each process's CUDA context), stay below the card; and it must stop engines it no longer needs
before it starts more.

>>> engine_share(4)
0.2
>>> leases = EngineLeases(capacity=2)
>>> leases.admit("a"), leases.admit("b"), leases.admit("a"), leases.admit("c")
([], [], [], ['b'])
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

RESERVE = 0.2
"""The card's share left outside vLLM engines: HF models on the same card, the CUDA context of every process
(about 0.5 GiB each), allocator fragmentation."""


def engine_share(engines: int, *, reserve: float = RESERVE) -> float:
    """The ``gpu_memory_utilization`` of each of ``engines`` vLLM engines held at once, rounded down to 0.01, so
    that together they take at most ``1 - reserve`` of the card.

    >>> engine_share(6), round(6 * engine_share(6), 2)
    (0.13, 0.78)
    >>> engine_share(100)
    Traceback (most recent call last):
    ...
    ValueError: engines: 100 vLLM engines cannot share one card (under 1 % each); fix: hold fewer at once
    """
    if engines < 1:
        raise ValueError(f"engines: {engines}; fix: at least 1")
    share = math.floor((1 - reserve) / engines * 100) / 100
    if share < 0.01:
        raise ValueError(f"engines: {engines} vLLM engines cannot share one card (under 1 % each); "
                         "fix: hold fewer at once")
    return share


@dataclass
class EngineLeases:
    """The engines alive on the card, least recently used first. ``admit(key)`` marks ``key`` used and returns the
    keys to stop before it starts (none when it is already alive or there is room), so that at most ``capacity``
    engines hold a share at any time.

    >>> leases = EngineLeases(capacity=1)
    >>> leases.admit("guarded"), leases.admit("unguarded"), leases.alive
    ([], ['guarded'], ['unguarded'])
    """

    capacity: int
    _alive: dict[Hashable, None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity: {self.capacity}; fix: at least 1 engine")

    @property
    def alive(self) -> list[Hashable]:
        return list(self._alive)

    def admit(self, key: Hashable) -> list[Hashable]:
        if key in self._alive:
            self._alive[key] = self._alive.pop(key)  # most recently used last
            return []
        released = []
        while len(self._alive) >= self.capacity:
            oldest = next(iter(self._alive))
            del self._alive[oldest]
            released.append(oldest)
        self._alive[key] = None
        return released
