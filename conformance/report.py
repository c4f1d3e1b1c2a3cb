"""The per-run conformance summary: one row per backend x check, as markdown and (with pandas) Parquet."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from engine.config import BACKENDS

OUTCOMES = ("passed", "failed", "skipped")


def backend_of(nodeid: str) -> str:
    """The backend a check ran on (its parameter), or "cross-backend".

    >>> backend_of("conformance/test_stop.py::test_x[llamacpp-2]"), backend_of("conformance/test_parity.py::test_y")
    ('llamacpp', 'cross-backend')
    """
    names = "|".join(BACKENDS)
    match = re.search(rf"\[(?:[^\]]*-)?({names})(?:-[^\]]*)?\]", nodeid)
    return match.group(1) if match else "cross-backend"


def check_of(nodeid: str) -> str:
    module = nodeid.split("::")[0].rsplit("/", 1)[-1]
    return module.removeprefix("test_").removesuffix(".py")


class SummaryCollector:
    """A pytest plugin: counts outcomes per (backend, check) and writes the summary at session end."""

    def __init__(self, out_dir: Path, context: Any = None, stem: str = "conformance-summary") -> None:
        self.out_dir = out_dir
        self.stem = stem
        self.context = context or dict
        """Run-wide facts recorded in every row (e.g. the vLLM model runner), read at session end."""
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self.skip_reasons: dict[tuple[str, str], str] = {}
        self.notes: list[tuple[str, str]] = []
        """(check node id, text): measured facts checks report (e.g. how many prompts matched exactly)."""
        self.seconds: Counter[str] = Counter()
        """Wall seconds per check module, setup (the engines and servers it first needed) and teardown included."""
        self.ran: Counter[str] = Counter()

    def note(self, check: str, text: str) -> None:
        self.notes.append((check, text))

    @property
    def rows(self) -> list[dict[str, Any]]:
        keys = sorted({(b, c) for b, c, _ in self.counts})
        context = self.context()
        return [{"backend": b, "check": c, **{o: self.counts[(b, c, o)] for o in OUTCOMES},
                 "skip_reason": self.skip_reasons.get((b, c), ""), **context} for b, c in keys]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[check_of(report.nodeid)] += report.duration
        self.ran[check_of(report.nodeid)] += report.when == "call"
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            outcome = "failed" if report.outcome == "failed" else report.outcome
            key = (backend_of(report.nodeid), check_of(report.nodeid))
            self.counts[(*key, outcome)] += 1
            if outcome == "skipped" and isinstance(report.longrepr, tuple):
                self.skip_reasons[key] = str(report.longrepr[2])

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.rows:
            return
        written = self.write()
        writer = session.config.get_terminal_writer()
        writer.line(f"conformance summary: {', '.join(map(str, written))}")
        writer.line("run context: " + ", ".join(f"{k}={v}" for k, v in self.context().items()))
        for check, text in self.notes:
            writer.line(f"note ({check}): {text}")
        for line in self.time_table():
            writer.line(line)

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

    def write(self) -> list[Path]:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        rows = self.rows
        lines = [", ".join(f"{k}: {v}" for k, v in self.context().items()), ""] if self.context() else []
        lines += ["| backend | check | passed | failed | skipped | skip reason |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['backend']} | {r['check']} | {r['passed']} | {r['failed']} | {r['skipped']} | "
                  f"{r['skip_reason']} |" for r in rows]
        if self.notes:
            lines += ["", "## Notes", ""] + [f"- `{check}`: {text}" for check, text in self.notes]
        if self.time_table():
            lines += ["", "## Time by module", "", "```", *self.time_table(), "```"]
        md = self.out_dir / f"{self.stem}.md"
        md.write_text("\n".join(lines) + "\n")
        written = [md]
        try:
            import pandas as pd

            pq = self.out_dir / f"{self.stem}.parquet"
            pd.DataFrame(rows).to_parquet(pq, index=False)
            written.append(pq)
        except ImportError:
            pass
        return written
