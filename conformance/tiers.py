"""The suite's two tiers: ``-m quick`` runs every check function at least once, the full gate every parametrization.

The quick tier is chosen by one rule at collection, so a new check joins it without a list to keep: for every check
function, its first in-process parametrization on each backend it has, i.e. a cross-backend check once with all its
backends, a per-backend check once on each backend. A function may name its own representatives instead, by marking
parametrizations ``quick`` (``pytest.param(..., marks=pytest.mark.quick)``: the hostile requests mark one of each
kind); the rule still adds the first in-process parametrization of any backend its marks leave uncovered. Served
twins join the quick tier only where marked: every twin reaches its servers through ``/infer/``, so the cross-backend
parity and stop checks carry ``@pytest.mark.quick`` and their twins reach every backend's server (the other surfaces,
``/v1/chat/completions``, ``/v1/completions``, Pattern C ``/chat``, have check functions of their own). Everything else
(more guard settings, prompts, served twins and configs, hostile cases) stays in the full gate, ``nox -s conformance``.

A run that selects the quick tier only (``-m quick``, or ``-m`` with more marks) also runs the quick *workload*: the
heaviest checks name a smaller one with :class:`Workload` (fewer prompts or documents), each still able to fail the
way its full form does. Any other run, a single check picked by its id
included, runs the full workload.

>>> items = [Check("m::f", {"backend": b, "x": x}) for x in (1, 2) for b in ("hf", "vllm")]
>>> [(c.params["backend"], c.params["x"]) for c in quick_checks(items)]
[('hf', 1), ('vllm', 1)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

MARK = "quick"
SPREAD = ("backend",)
"""The parameters the quick tier covers every value of, per check function."""
SERVED = "served"
"""The ``reach`` of a served twin: never picked by the rule, only by a mark."""


@dataclass(frozen=True)
class Check:
    """One collected parametrization: its function (``module::name``), its parameters, and whether it carries an
    explicit ``quick`` mark."""

    function: str
    params: dict[str, Any] = field(default_factory=dict)
    marked: bool = False

    def spread(self) -> tuple[str, ...]:
        return tuple(str(self.params.get(name, "")) for name in SPREAD)


def quick_checks(checks: Sequence[Check]) -> list[Check]:
    """The quick tier of ``checks``, in their order (see the module's rule)."""
    by_function: dict[str, list[Check]] = {}
    for check in checks:
        by_function.setdefault(check.function, []).append(check)
    chosen: set[int] = set()
    for group in by_function.values():
        marked = [c for c in group if c.marked]
        covered = {c.spread() for c in marked}
        chosen.update(id(c) for c in marked)
        for check in group:
            if check.spread() not in covered and check.params.get("reach") != SERVED:
                covered.add(check.spread())
                chosen.add(id(check))
    return [c for c in checks if id(c) in chosen]


def missing_from_quick(full: Sequence[tuple[str, tuple[str, ...]]],
                       quick: Sequence[tuple[str, tuple[str, ...]]]) -> list[tuple[str, tuple[str, ...]]]:
    """(function, spread) pairs of the full gate that the quick tier never runs: what the tier rule promises is
    empty (the unit test over the collected ids asserts it).

    >>> missing_from_quick([("m::f", ("hf",)), ("m::f", ("vllm",))], [("m::f", ("hf",))])
    [('m::f', ('vllm',))]
    """
    ran = set(quick)
    return sorted({pair for pair in full if pair not in ran})


@dataclass(frozen=True)
class Workload:
    """How much a check runs: the full gate's prompt sets and documents, or the quick tier's smaller ones. Checks
    get it as the ``workload`` fixture and name both sizes where they differ, so the difference reads in one line.

    >>> Workload(quick=True).pick(full=["a", "b", "c"], quick=["a"])
    ['a']
    >>> Workload().pick(full=None, quick=4) is None
    True
    """

    quick: bool = False

    def pick(self, full: Any, quick: Any) -> Any:
        return quick if self.quick else full

    @property
    def name(self) -> str:
        return "quick" if self.quick else "full"


class QuickTier:
    """The pytest plugin that marks the quick tier at collection (the conformance conftest registers it), and
    keeps what it saw: every collected check and the quick ones, before ``-m`` deselects anything."""

    def __init__(self) -> None:
        self.checks: list[Check] = []
        self.quick: list[Check] = []
        self.workload = Workload()

    @pytest.hookimpl(tryfirst=True)  # before pytest's own -m deselects anything
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.checks = [check_of(item) for item in items]
        self.quick = quick_checks(self.checks)
        chosen = {id(c) for c in self.quick}
        for item, check in zip(items, self.checks, strict=True):
            if id(check) in chosen and not check.marked:
                item.add_marker(MARK)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """The quick workload runs where ``-m`` left quick checks only (see the module's rule)."""
        selected = bool(session.config.getoption("markexpr", "")) and bool(session.items)
        self.workload = Workload(quick=selected and all(i.get_closest_marker(MARK) for i in session.items))


def check_of(item: pytest.Item) -> Check:
    """The tier rule's view of a collected item."""
    spec = getattr(item, "callspec", None)
    return Check(item.nodeid.split("[", 1)[0], dict(spec.params) if spec else {},
                 item.get_closest_marker(MARK) is not None)


def table(checks: Sequence[Check], quick: Sequence[Check]) -> list[str]:
    """A markdown table: every check function, its parametrizations in the quick tier and in the full gate.

    >>> full = [Check("m::f", {"backend": "hf"}), Check("m::f", {"backend": "hf", "x": 2})]
    >>> print("\\n".join(table(full, full[:1])[2:]))
    | `m::f` | 1 | 2 | hf |
    """
    counts: dict[str, list[int]] = {}
    backends: dict[str, set[str]] = {}
    for c in checks:
        counts.setdefault(c.function, [0, 0])[1] += 1
    for c in quick:
        counts[c.function][0] += 1
        backends.setdefault(c.function, set()).update(b for b in c.spread() if b)
    rows = ["| check function | quick | full | quick backends |", "|---|---|---|---|"]
    rows += [f"| `{f}` | {q} | {n} | {', '.join(sorted(backends.get(f, ()))) or 'cross-backend'} |"
             for f, (q, n) in sorted(counts.items())]
    return rows


def main(argv: Sequence[str] = ()) -> int:
    """``python -m conformance.tiers [pytest args]``: collect the suite (nothing runs) and print :func:`table`."""
    import contextlib
    import io

    class Probe:
        tier: QuickTier | None = None

        def pytest_collection_finish(self, session: pytest.Session) -> None:
            self.tier = session.config.pluginmanager.get_plugin("engine-quick-tier")

    probe = Probe()
    with contextlib.redirect_stdout(io.StringIO()):
        code = pytest.main(["conformance", "--collect-only", "-q", "-p", "no:cacheprovider", *argv], plugins=[probe])
    if code != 0 or probe.tier is None:
        print(f"collection failed (pytest exit {code})")
        return int(code) or 1
    print("\n".join(table(probe.tier.checks, probe.tier.quick)))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
