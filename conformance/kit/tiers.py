"""The suite's two tiers: ``-m quick`` runs every check function once, the full gate every parametrization.

The quick tier is chosen by one rule at collection, so a new check joins it without a list to keep: every check
function runs once, with its first in-process parametrization, and every module meets every backend.

- A cross-backend check (no ``backend`` parameter) runs once, with every backend it compares.
- A per-backend check runs on one backend: the module's backends take turns, weighed by what a check costs on each
  (:data:`TURN_COST`): the module's first per-backend functions go to its backends in order, one each, and every
  next one to the backend whose turns cost least so far (HF, 2.6 times the others per token, then takes its second
  turn at a module's twelfth function and about one in six after, instead of one in three); a backend the turns
  leave out of a module gets that module's first per-backend function too. So CI meets each backend in every
  module and each function once, and the full gate runs each function on each backend. A function whose claim
  holds only where a backend can do something (scoring) names that backend (``quick_on``, below).
- A function may name its own representatives, by marking parametrizations ``quick`` (``pytest.param(...,
  marks=pytest.mark.quick)``: the hostile requests mark one of each kind): each marked variant runs once, on the
  module's next backend in turn.
- Served twins join the quick tier only where marked: every twin reaches its servers through ``/infer/``, so the
  cross-backend parity and stop checks carry ``@pytest.mark.quick`` and their twins reach every backend's server
  (the other surfaces, ``/v1/chat/completions``, ``/v1/completions``, Pattern C ``/chat``, have check functions of
  their own).

- A per-backend function whose cost on CI's clock depends on its backend may say where the quick tier runs it
  (``@pytest.mark.quick_on("hf", reason=...)``): a check that starts a server of its own pays that backend's start
  (vLLM's about 25 s on CI, HF's 6 s, llama.cpp's 3 s), and the reason says why that backend carries what the
  function proves on CI's clock. It takes no turn: the module's other functions still meet every backend (the turns
  and the rule below see to it). A mark without a reason fails collection.
- A function marked ``gate_only`` (``@pytest.mark.gate_only(reason=...)``) is left to the full gate whole: the
  reason names the quick check that already carries what it proves on CI's clock (each a foreign process started
  only to watch it refuse, or a second transport for the same answers; ``docs/tiers.md`` lists them). A mark
  without a reason fails collection.

Everything else (the other backends of a per-backend check, more guard settings, prompts, served twins and configs,
hostile cases) stays in the full gate, ``nox -s conformance``, which runs before an issue is resolved.

A run that selects the quick tier only (``-m quick``, or ``-m`` with more marks) also runs the quick *workload*: the
heaviest checks name a smaller one with :class:`Workload` (fewer prompts or documents), each still able to fail the
way its full form does. Any other run, a single check picked by its id included, runs the full workload.

>>> items = [Check(f"m::{f}", {"backend": b, "x": x}) for f in "fgh" for x in (1, 2) for b in ("hf", "vllm")]
>>> [(c.function, c.params["backend"], c.params["x"]) for c in quick_checks(items)]
[('m::f', 'hf', 1), ('m::g', 'vllm', 1), ('m::h', 'vllm', 1)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

MARK = "quick"
GATE_ONLY = "gate_only"
"""The mark of a check function the quick tier leaves to the full gate, with its reason."""
QUICK_ON = "quick_on"
"""The mark of a per-backend check function that names the backend the quick tier runs it on, with its reason."""
SPREAD = ("backend",)
"""The parameters the quick tier covers every value of, per check function (a target check's ``target``, the
server it asks, counts as its backend: :func:`check_of`)."""
SERVED = "served"
"""The ``reach`` of a served twin: never picked by the rule, only by a mark."""
TURN_COST = {"hf": 2.6}
"""What a quick-tier turn costs on a backend, against 1 for the others: HF took 12.4 ms per token at the suite's
average call of 5.3 rows x 20 tokens on CI's machine, 2.6 times vLLM and llama.cpp (issue 76's probe of the quick
tier); the turns after a module's first round go to the backend whose turns cost least so far."""


@dataclass(frozen=True)
class Check:
    """One collected parametrization: its function (``module::name``), its parameters, and whether it carries an
    explicit ``quick`` mark."""

    function: str
    params: dict[str, Any] = field(default_factory=dict)
    marked: bool = False
    gate_only: bool = False
    quick_on: str = ""
    """The backend the quick tier runs this function on (``@pytest.mark.quick_on``), or empty: the turns choose."""

    def spread(self) -> tuple[str, ...]:
        return tuple(str(self.params.get(name, "")) for name in SPREAD)


def quick_checks(checks: Sequence[Check]) -> list[Check]:
    """The quick tier of ``checks``, in their order (see the module's rule).

    >>> [c.function for c in quick_checks([Check("m::f"), Check("m::g", gate_only=True)])]
    ['m::f']
    """
    checks = [c for c in checks if not c.gate_only]
    by_function: dict[str, list[Check]] = {}
    for check in checks:
        by_function.setdefault(check.function, []).append(check)
    backends_of: dict[str, list[str]] = {}  # module -> its backends, in collected order
    for check in checks:
        if check.spread() != ("",):
            order = backends_of.setdefault(module_of(check.function), [])
            order.extend(b for b in check.spread() if b not in order)
    spent: dict[str, dict[str, float]] = {}  # module -> backend -> the cost of the turns it took
    met: dict[str, set[tuple[str, ...]]] = {}
    chosen: set[int] = set()
    for function, group in by_function.items():
        module = module_of(function)
        marked = [c for c in group if c.marked]
        if not any(c.spread() != ("",) for c in group):  # cross-backend: marked ones, else the first in-process
            first = [c for c in group if c.params.get("reach") != SERVED][:1]
            chosen.update(id(c) for c in (marked or first))
            continue
        variants: dict[str, list[Check]] = {}  # the parameters other than the backend -> that variant's checks
        for c in marked or [c for c in group if c.params.get("reach") != SERVED]:
            variants.setdefault(rest_of(c), []).append(c)
        named = group[0].quick_on
        pinned = [c for c in next(iter(variants.values()), []) if c.spread() == (named,)] if named else []
        if pinned:  # the function names its backend: no turn taken
            chosen.add(id(pinned[0]))
            met.setdefault(module, set()).add(pinned[0].spread())
            continue
        for key in (list(variants) if marked else list(variants)[:1]):
            pick = _next_backend(variants[key], backends_of[module], spent.setdefault(module, {}))
            chosen.add(id(pick))
            met.setdefault(module, set()).add(pick.spread())
    for module, order in backends_of.items():  # a backend the turns left out of a module: its first check there
        for backend in order:
            if (backend,) not in met.get(module, set()):
                first = next((c for c in checks if module_of(c.function) == module and c.spread() == (backend,)
                              and c.params.get("reach") != SERVED), None)
                if first is not None:
                    chosen.add(id(first))
    return [c for c in checks if id(c) in chosen]


def _next_backend(variant: list[Check], order: list[str], spent: dict[str, float]) -> Check:
    """The check of ``variant`` on the module's next backend in turn that has it: the first, in the module's order,
    that took no turn yet; once every backend took one, the one whose turns cost least so far with this one
    (:data:`TURN_COST`; the module's order breaks ties). ``spent`` (backend -> cost) is the module's, updated.

    >>> spent = {}
    >>> [_next_backend([Check("m::f", {"backend": b}) for b in ("hf", "vllm", "llamacpp")], ["hf", "vllm", "llamacpp"],
    ...                spent).params["backend"] for _ in range(9)]
    ['hf', 'vllm', 'llamacpp', 'vllm', 'llamacpp', 'vllm', 'llamacpp', 'vllm', 'llamacpp']
    """
    have = [(order.index(c.spread()[0]), c) for c in variant if c.spread()[0] in order]
    if not have:
        return variant[0]
    fresh = [(i, c) for i, c in have if c.spread()[0] not in spent]
    if fresh:
        _, pick = min(fresh, key=lambda ic: ic[0])
    else:
        _, pick = min(have, key=lambda ic: (spent[ic[1].spread()[0]] + TURN_COST.get(ic[1].spread()[0], 1.0), ic[0]))
    backend = pick.spread()[0]
    spent[backend] = spent.get(backend, 0.0) + TURN_COST.get(backend, 1.0)
    return pick


def module_of(function: str) -> str:
    return function.split("::", 1)[0]


def rest_of(check: Check) -> str:
    """The check's parameters other than the spread ones, as one comparable key."""
    return repr(sorted((k, repr(v)) for k, v in check.params.items() if k not in SPREAD))


def missing_from_quick(full: Sequence[tuple[str, tuple[str, ...]]],
                       quick: Sequence[tuple[str, tuple[str, ...]]], gate_only: Sequence[str] = ()) -> list[str]:
    """What the quick tier promises and ``quick`` lacks, given the full gate's (function, spread) pairs: a check
    function that never runs, or a (module, backend) that never meets (empty when the rule holds; the unit test over
    the collected ids and the conformance session's own check assert it). Functions in ``gate_only`` are the full
    gate's alone.

    >>> full = [("m::f", ("hf",)), ("m::f", ("vllm",)), ("m::g", ("",))]
    >>> missing_from_quick(full, [("m::f", ("hf",))])
    ['function m::g', 'module m on vllm']
    >>> missing_from_quick(full, [("m::f", ("hf",)), ("m::f", ("vllm",))], gate_only=["m::g"])
    []
    """
    full = [(f, s) for f, s in full if f not in set(gate_only)]
    ran_functions = {f for f, _ in quick}
    ran_modules = {(module_of(f), s) for f, s in quick}
    missing = [f"function {f}" for f in dict.fromkeys(f for f, _ in full) if f not in ran_functions]
    missing += [f"module {m} on {', '.join(s)}" for m, s in dict.fromkeys((module_of(f), s) for f, s in full)
                if s != ("",) and (m, s) not in ran_modules]
    return missing


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
    """The pytest plugin that marks the quick tier at collection (the conformance plugin registers it), and
    keeps what it saw: every collected check and the quick ones, before ``-m`` deselects anything. It marks the
    items ``is_check`` accepts (the suite's own), never a user's other tests in the same session."""

    def __init__(self, is_check: Callable[[pytest.Item], bool] = lambda item: True) -> None:
        self.is_check = is_check
        self.checks: list[Check] = []
        self.quick: list[Check] = []
        self.gate_only: dict[str, str] = {}
        """Check functions left to the full gate, with their reasons."""
        self.quick_on: dict[str, tuple[str, str]] = {}
        """Check functions that name their quick backend: (backend, reason)."""
        self.workload = Workload()

    @pytest.hookimpl(tryfirst=True)  # before pytest's own -m deselects anything
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        mine = [item for item in items if self.is_check(item)]
        self.checks = [check_of(item) for item in mine]
        self.gate_only = gate_only_reasons(mine)
        self.quick_on = quick_on_reasons(mine)
        self.quick = quick_checks(self.checks)
        chosen = {id(c) for c in self.quick}
        for item, check in zip(mine, self.checks, strict=True):
            if id(check) in chosen and not check.marked:
                item.add_marker(MARK)
            elif id(check) not in chosen and check.marked:
                # A parametrization marked ``quick`` carries the mark on every backend's item; the rule runs it on
                # one (the module's next in turn), so ``-m quick`` must not select the others (before 6dd62a4 it did:
                # each hostile kind ran on all three backends, 28 checks more than the rule's).
                item.own_markers[:] = [m for m in item.own_markers if m.name != MARK]

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """The quick workload runs where ``-m`` left quick checks only (see the module's rule)."""
        mine = [i for i in session.items if self.is_check(i)]
        selected = bool(session.config.getoption("markexpr", "")) and bool(mine)
        self.workload = Workload(quick=selected and all(i.get_closest_marker(MARK) for i in mine))


def check_of(item: pytest.Item) -> Check:
    """The tier rule's view of a collected item."""
    spec = getattr(item, "callspec", None)
    params = dict(spec.params) if spec else {}
    if "target" in params:  # conformance/test_target.py: the server it asks is its backend here
        params["backend"] = params.pop("target")
    function = item.nodeid.split("[", 1)[0]
    if function.startswith("::"):  # --pyargs names no module in node ids
        function = item.path.name + function
    gate_only = item.get_closest_marker(GATE_ONLY)
    if gate_only is not None and not gate_only.kwargs.get("reason"):
        raise pytest.UsageError(f"{function}: @pytest.mark.gate_only needs reason=... (which quick check carries what "
                                "it proves on CI's clock)")
    quick_on = item.get_closest_marker(QUICK_ON)
    if quick_on is not None and (len(quick_on.args) != 1 or not quick_on.kwargs.get("reason")):
        raise pytest.UsageError(f"{function}: @pytest.mark.quick_on needs one backend and reason=... (why that backend "
                                "carries what the function proves on CI's clock), e.g. quick_on(\"hf\", reason=...)")
    return Check(function, params, item.get_closest_marker(MARK) is not None, gate_only is not None,
                 quick_on.args[0] if quick_on is not None else "")


def gate_only_reasons(items: Sequence[pytest.Item]) -> dict[str, str]:
    """Check function -> the reason it is the full gate's alone (``docs/tiers.md`` lists them)."""
    reasons: dict[str, str] = {}
    for item in items:
        marker = item.get_closest_marker(GATE_ONLY)
        if marker is not None:
            reasons.setdefault(check_of(item).function, marker.kwargs["reason"])
    return reasons


def quick_on_reasons(items: Sequence[pytest.Item]) -> dict[str, tuple[str, str]]:
    """Check function -> (the backend the quick tier runs it on, why) (``docs/tiers.md`` lists them)."""
    named: dict[str, tuple[str, str]] = {}
    for item in items:
        marker = item.get_closest_marker(QUICK_ON)
        if marker is not None:
            named.setdefault(check_of(item).function, (marker.args[0], marker.kwargs["reason"]))
    return named


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
    rows += [f"| `{f}` | {q} | {n} | "
             f"{', '.join(sorted(backends.get(f, ()))) or ('full gate only' if q == 0 else 'cross-backend')} |"
             for f, (q, n) in sorted(counts.items())]
    return rows


def main(argv: Sequence[str] = ()) -> int:
    """``python -m conformance.kit.tiers [pytest args]``: collect the suite (nothing runs) and print :func:`table`."""
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
    if probe.tier.gate_only:
        print("\nLeft to the full gate (`gate_only`), and what carries it on CI's clock:\n")
        print("\n".join(f"- `{f}`: {reason}" for f, reason in sorted(probe.tier.gate_only.items())))
    if probe.tier.quick_on:
        print("\nRun in the quick tier on a backend of their own choosing (`quick_on`), and why:\n")
        print("\n".join(f"- `{f}` on {backend}: {reason}"
                         for f, (backend, reason) in sorted(probe.tier.quick_on.items())))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
