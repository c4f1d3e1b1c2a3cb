"""``--engine-shard K/N``: the suite split over N runners (a CI matrix), each loading only the engines of its checks.

Checks are grouped by what they load: a per-backend check by its backend, a cross-backend check by its module (it
loads every backend's engine). A backend's checks go whole to one shard, each cross-backend module too, the largest
first to the shard with the fewest checks so far (ties: the lowest), so a shard starts only its own backends'
servers. The split depends only on the collected ids, so every runner computes the same one; merge the shards'
reports with ``python -m conformance.kit.matrix shard-1.json shard-2.json --merged all.json``.

>>> ids = ["a.py::t[hf]", "a.py::t[vllm]", "b.py::u[hf]", "b.py::u[vllm]", "c.py::cross"]
>>> split(ids, ("hf", "vllm"), 2)
[['a.py::t[hf]', 'b.py::u[hf]', 'c.py::cross'], ['a.py::t[vllm]', 'b.py::u[vllm]']]
>>> parse("2/3"), parse("3/2")
Traceback (most recent call last):
...
ValueError: --engine-shard must be K/N with 1 <= K <= N, got '3/2'
"""

from __future__ import annotations

from collections.abc import Sequence

from conformance.kit.record import CROSS, subject_of


def parse(text: str) -> tuple[int, int]:
    """``K/N`` as (K, N), 1-based; anything else is a ValueError naming the option and the value."""
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        k = n = 0
    if not 1 <= k <= n:
        raise ValueError(f"--engine-shard must be K/N with 1 <= K <= N, got {text!r}")
    return k, n


def group_of(nodeid: str, backends: tuple[str, ...]) -> str:
    """What a check loads: its backend and module, or ``cross-backend`` and its module."""
    subject, _ = subject_of(nodeid, backends)
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return f"{subject}|{module}" if subject != CROSS else f"{CROSS}|{module}"


def split(nodeids: Sequence[str], backends: tuple[str, ...], shards: int) -> list[list[str]]:
    """The ids of each shard (in their collected order); together exactly ``nodeids``, each once.

    The units placed are a backend's per-backend checks together (one shard starts that backend's servers) and each
    cross-backend module alone; where they are fewer than the shards, every group is a unit of its own."""
    groups: dict[str, list[str]] = {}
    for nodeid in nodeids:
        groups.setdefault(group_of(nodeid, backends), []).append(nodeid)
    units: dict[str, list[str]] = {}
    for key in groups:
        subject = key.split("|", 1)[0]
        units.setdefault(key if subject == CROSS else subject, []).append(key)
    if len(units) < shards:
        units = {key: [key] for key in groups}
    load = [0] * shards
    owner: dict[str, int] = {}
    for name in sorted(units, key=lambda u: (-sum(len(groups[k]) for k in units[u]), u)):
        target = load.index(min(load))
        for key in units[name]:
            owner[key] = target
        load[target] += sum(len(groups[k]) for k in units[name])
    chosen: list[list[str]] = [[] for _ in range(shards)]
    for nodeid in nodeids:
        chosen[owner[group_of(nodeid, backends)]].append(nodeid)
    return chosen
