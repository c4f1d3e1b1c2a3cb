"""The per-run conformance report, collected while the suite runs: one result per check run
(``conformance/kit/record.py`` holds the schema), written at the end as ``conformance-report.json``, the HTML matrix
and the Markdown summary (``conformance/kit/matrix.py``), with the checks' notes and the time by module."""

from __future__ import annotations

import datetime as dt
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conformance.subjects.target import DIFFERS


def check_of(nodeid: str) -> str:
    module = nodeid.split("::")[0].rsplit("/", 1)[-1]
    return module.removeprefix("test_").removesuffix(".py")


class SummaryCollector:
    """A pytest plugin: one :class:`~conformance.kit.record.Result` per check run, the checks' notes and the time by
    module; at session end the report, the matrix and the summary (the plugin registers it).

    ``describe()`` gives the run's model, dtype, backends, workload and engine context, read at the end."""

    def __init__(self, out_dir: Path, describe: Callable[[], dict[str, Any]] | None = None,
                 stem: str = "conformance-summary", checks: set[str] | None = None,
                 census: Path | None = None) -> None:
        self.out_dir = out_dir
        self.census = census
        """The run watcher's census file (``conformance/kit/census.py``): the processes the run started, counted at
        its end; None: not counted (a run outside the suite's plugin start)."""
        self.checks = checks
        """Node ids it counts (filled at collection by the plugin: the suite's own checks); None: every test."""
        self.stem = stem
        self.describe = describe or dict
        self.started = dt.datetime.now(dt.UTC)
        self.results: dict[str, dict[str, Any]] = {}
        """result id (``record.result_id``) -> what its reports said so far (verdict, seconds, message, failure)."""
        self.notes: list[tuple[str, str]] = []
        """(result id, text): measured facts checks report (e.g. how many prompts matched exactly)."""
        self.seconds: Counter[str] = Counter()
        """Wall seconds per check module, setup (the engines and servers it first needed) and teardown included."""
        self.ran: Counter[str] = Counter()
        self.memory_start = peak_gib()
        """This process's peak resident memory when the run's checks began (imports and collection included: set
        again at the collection's end)."""
        self.memory_rise: Counter[str] = Counter()
        """GiB the process's peak resident memory rose by while each check module ran: which modules set the peak
        the 12 GB budget is measured against (docs/conformance.md)."""
        self.windows: list[tuple[float, str]] = []
        """(seconds since boot, module file) as each check starts: which module a process the census noted started
        in (``census.by_module``)."""

    def note(self, check: str, text: str) -> None:
        self.notes.append((check, text))

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.memory_start = peak_gib()

    def pytest_runtest_logstart(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        import time

        if self.checks is None or nodeid in self.checks:
            self.windows.append((time.clock_gettime(time.CLOCK_BOOTTIME), location[0].rsplit("/", 1)[-1]))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        from conformance.kit.record import result_id

        if self.checks is not None and report.nodeid not in self.checks:
            return
        key = result_id(report.location)
        self.seconds[check_of(key)] += report.duration
        peak = peak_gib()
        self.memory_rise[check_of(key)] += peak - self.memory_start - sum(self.memory_rise.values())
        self.ran[check_of(key)] += report.when == "call"
        entry = self.results.setdefault(key, {"verdict": "", "seconds": 0.0, "message": "", "failure": ""})
        entry["seconds"] += report.duration
        verdict = verdict_of(report)
        if verdict is None or (entry["verdict"] in ("failed", "error") and report.when == "teardown"):
            return
        entry["verdict"] = verdict
        if verdict == "differs":
            entry["message"] = str(report.wasxfail).removeprefix(DIFFERS)
        elif report.skipped and isinstance(report.longrepr, tuple):
            entry["message"] = str(report.longrepr[2]).removeprefix("Skipped: ")
        elif report.failed:
            entry["failure"] = report.longreprtext[-FAILURE_CHARS:]
            entry["message"] = first_error_line(report.longreprtext)

    def report(self) -> dict[str, Any]:
        """This run's report (``conformance.kit.record``'s schema)."""
        from conformance.kit.record import Result, check_name, new_report, run_info, subject_of
        from conformance.subjects.target import TARGET

        described = self.describe()
        backends = tuple(described.get("backends", ()))
        divergences = {check: m.group(1) for check, text in self.notes
                       if (m := re.search(r"first divergence: ([^;]+)", text)) and m.group(1).strip() != "none"}
        results = []
        for nodeid, entry in self.results.items():
            subject, params = subject_of(nodeid, (*backends, TARGET))
            results.append(Result(id=nodeid, check=check_name(nodeid), subject=subject, params=params,
                                  verdict=entry["verdict"] or "error", duration_s=round(entry["seconds"], 3),
                                  message=entry["message"], first_divergence=divergences.get(nodeid, ""),
                                  failure=entry["failure"]))
        run = run_info(model=described.get("model", ""), dtype=described.get("dtype", ""), backends=backends,
                       workload=described.get("workload", ""), context=described.get("context", {}),
                       started=self.started, shards=described.get("shards", []),
                       target=described.get("target"))
        return new_report(run, results)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.results:
            return
        written = self.write()
        writer = session.config.get_terminal_writer()
        writer.line(f"conformance report: {', '.join(map(str, written))}")
        writer.line("run context: " + ", ".join(f"{k}={v}" for k, v in self.describe().get("context", {}).items()))
        for check, text in self.notes:
            writer.line(f"note ({check}): {text}")
        for line in (*self.time_table(), *self.slowest_lines()):
            writer.line(line)
        for line in self.memory_lines():
            writer.line(line)
        for line in self.census_lines():
            writer.line(line)
        for line in self.describe().get("plan", []):
            writer.line(line)

    def census_lines(self) -> list[str]:
        """The census line, then the processes by the module whose check was running when each started."""
        from conformance.kit import census

        if self.census is None:
            return []
        import os

        from conformance.kit.reaper import command_line

        entries, run = census.read(self.census), command_line(os.getpid())
        modules = census.by_module(entries, self.windows, run=run)
        by_module = census.module_lines(modules)
        undeclared = census.undeclared_lines(modules, self.describe().get("declared_processes", {}))
        return [census.line(census.count(entries, run)),
                *(["started while each module ran:", *by_module] if by_module else []),
                *(["started without a declaration (processes(...) in the module's SUBJECTS):", *undeclared]
                  if undeclared else [])]

    def time_table(self) -> list[str]:
        """Seconds per check module, slowest first, with its share of the run: where the suite's time goes.

        >>> c = SummaryCollector(Path("."))
        >>> c.seconds.update({"stop": 30.0, "repeat": 90.0}); c.ran.update({"stop": 4, "repeat": 6})
        >>> print("\\n".join(c.time_table()))
        time by module (setup and teardown included): 120 s in 10 checks
           90.0 s  75%    6 checks  repeat
           30.0 s  25%    4 checks  stop
        """
        total = sum(self.seconds.values())
        if not total:
            return []
        lines = [f"time by module (setup and teardown included): {total:.0f} s in {sum(self.ran.values())} checks"]
        for module, seconds in self.seconds.most_common():
            lines.append(f"{seconds:7.1f} s {100 * seconds / total:3.0f}% {self.ran[module]:4d} checks  {module}")
        return lines

    def slowest_lines(self, count: int = 12) -> list[str]:
        """The ``count`` slowest check runs (setup and teardown included: a first user pays its engines' and servers'
        starts), each with its module's share: what the time table's rows are made of.

        >>> c = SummaryCollector(Path("."))
        >>> c.results.update({"test_stop.py::a[hf]": {"seconds": 12.0}, "test_stop.py::b[vllm]": {"seconds": 3.0},
        ...                   "test_repeat.py::c": {"seconds": 40.0}})
        >>> c.seconds.update({"stop": 15.0, "repeat": 40.0})
        >>> print("\\n".join(c.slowest_lines(2)))
        slowest checks (setup and teardown included):
           40.0 s  100% of repeat  test_repeat.py::c
           12.0 s   80% of stop  test_stop.py::a[hf]
        """
        ranked = sorted(self.results.items(), key=lambda kv: kv[1]["seconds"], reverse=True)[:count]
        if not ranked or not ranked[0][1]["seconds"]:
            return []
        lines = ["slowest checks (setup and teardown included):"]
        for nodeid, entry in ranked:
            module = check_of(nodeid)
            share = 100 * entry["seconds"] / self.seconds[module] if self.seconds[module] else 0
            lines.append(f"{entry['seconds']:7.1f} s {share:4.0f}% of {module}  {nodeid}")
        return lines

    def memory_lines(self) -> list[str]:
        """The process's peak resident memory and the modules that raised it, most first (rises under 0.05 GiB left
        out): what to look at when the run nears its memory budget.

        >>> c = SummaryCollector(Path("."))
        >>> c.memory_start = 0.5
        >>> c.memory_rise.update({"stop": 0.02, "adapters": 2.5, "chat": 1.0})
        >>> print("\\n".join(c.memory_lines()))
        peak resident memory 4.0 GiB (0.5 GiB before the first check); it rose in: adapters +2.5, chat +1.0
        """
        rises = [(m, gib) for m, gib in self.memory_rise.most_common() if gib >= 0.05]
        if not self.memory_rise:
            return []
        peak = self.memory_start + sum(self.memory_rise.values())
        listed = ", ".join(f"{m} +{gib:.1f}" for m, gib in rises) or "no module by 0.05 GiB or more"
        return [f"peak resident memory {peak:.1f} GiB ({self.memory_start:.1f} GiB before the first check); "
                f"it rose in: {listed}"]

    def write(self) -> list[Path]:
        """The report (``<report>.json``), the HTML matrix and the Markdown summary (with the notes and the time by
        module); the stem's suffix (``-bfloat16``) is kept on each."""
        from conformance.kit.matrix import markdown, page
        from conformance.kit.record import write

        report = self.report()
        suffix = self.stem.removeprefix("conformance-summary")
        json_path = write(report, self.out_dir / f"conformance-report{suffix}.json")
        html_path = self.out_dir / f"conformance-matrix{suffix}.html"
        html_path.write_text(page(report))
        lines = [markdown(report)]
        if self.notes:
            lines += ["## Notes", ""] + [f"- `{check}`: {text}" for check, text in self.notes] + [""]
        if self.time_table():
            lines += ["## Time by module", "", "```", *self.time_table(), *self.slowest_lines(), *self.memory_lines(),
                      "```", ""]
        processes, plan = self.census_lines(), self.describe().get("plan", [])
        if processes:
            lines += ["## Processes", "", "```", *processes, "```", ""]
        if plan:
            lines += ["## Subjects", "", "```", *plan, "```", ""]
        md = self.out_dir / f"{self.stem}.md"
        md.write_text("\n".join(lines))
        return [json_path, html_path, md]


FAILURE_CHARS = 20_000


def peak_gib() -> float:
    """This process's peak resident memory so far, in GiB (``ru_maxrss``: KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def verdict_of(report: pytest.TestReport) -> str | None:
    """A phase report's verdict for its result (None: the phase decides nothing, e.g. a passed setup)."""
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            if report.skipped and str(report.wasxfail).startswith(DIFFERS):
                return "differs"  # conformance/subjects/target.py: an external server's finding
            return "xfailed" if report.skipped else "xpassed"
        return report.outcome
    if report.failed:
        return "error"
    if report.skipped:
        return "skipped"
    return None


def first_error_line(text: str) -> str:
    """The first ``E `` line of a failure (pytest's assertion message), or its last line.

    >>> first_error_line("def test():\\n>  assert x\\nE   AssertionError: 3 != 4\\nE   more")
    'AssertionError: 3 != 4'
    """
    for line in text.splitlines():
        if line.startswith("E "):
            return line[1:].strip()[:500]
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:500] if lines else ""
