"""The conformance report drawn for people: a static HTML matrix (checks x subjects, coloured, each cell linking to its
results' failure text) and a Markdown summary a CI step can publish.

``python -m conformance.kit.matrix REPORT [REPORT ...] [--html OUT] [--markdown OUT] [--merged OUT]`` reads reports of
any version (``conformance.kit.record.read``), merges several (the shards of one run) into one, and writes what is asked
(default: ``conformance-matrix.html`` and ``conformance-summary.md`` beside the first report). The suite writes all
three at the end of each run.

>>> from conformance.kit.record import Result, new_report
>>> report = new_report({"model": "m", "dtype": "float32"}, [
...     Result("a.py::t[hf]", "a.py::t", "hf", "", "passed", 1.0),
...     Result("a.py::t[vllm]", "a.py::t", "vllm", "", "failed", 1.0, message="AssertionError: 3 != 4")])
>>> print(markdown(report).splitlines()[2])
**1 passed, 1 failed of 2 results (1 checks x 2 subjects)**
"""

from __future__ import annotations

import argparse
import html
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conformance.kit.record import BAD, CROSS, HELD, VERDICTS, merge, read, write

COLOURS = {"passed": "#2e7d32", "failed": "#c62828", "differs": "#6a1b9a", "mixed": "#ef6c00", "skipped": "#9e9e9e",
           "none": "#ffffff"}
"""Cell colours: every result passed; one failed (or errored, or passed when marked to fail); an external target
server differs from the reference (a finding about that server, no failure); some passed and some skipped; all
skipped; no result (the check has no variant for that subject)."""

PAGE_STYLE = """body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #212121; }
table { border-collapse: collapse; }
th, td { border: 1px solid #bdbdbd; padding: 3px 8px; }
th.check { text-align: left; font-weight: normal; font-family: monospace; }
td { text-align: center; min-width: 4.5em; }
td a { color: #fff; text-decoration: none; font-weight: bold; }
td.none { background: #fff; }
.key { display: inline-block; width: 1em; height: 1em; border: 1px solid #757575; margin: 0 .3em 0 1em;
        vertical-align: middle; }
pre { background: #f5f5f5; padding: .5em; overflow-x: auto; max-height: 30em; }
section { border-top: 1px solid #e0e0e0; margin-top: 1em; }
"""
"""The pages' style (the matrix, and the release comparison of ``conformance/kit/history.py``)."""


def subjects(report: dict[str, Any]) -> list[str]:
    """The report's subjects: its backends in their selected order, then any other, then ``cross-backend``."""
    seen = list(dict.fromkeys(r["subject"] for r in report["results"]))
    order = [b for b in report.get("run", {}).get("backends", []) if b in seen]
    return order + [s for s in seen if s not in order and s != CROSS] + ([CROSS] if CROSS in seen else [])


def cells(report: dict[str, Any]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """check -> subject -> its results, checks sorted by module and function (a module's rows together)."""
    grid: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in sorted(report["results"], key=lambda r: r["check"]):
        grid[r["check"]][r["subject"]].append(r)
    return grid


def state(results: Sequence[dict[str, Any]]) -> str:
    """A cell's colour key (see :data:`COLOURS`).

    >>> state([{"verdict": "passed"}, {"verdict": "skipped"}]), state([]), state([{"verdict": "error"}])
    ('mixed', 'none', 'failed')
    """
    verdicts = {r["verdict"] for r in results}
    if not verdicts:
        return "none"
    if verdicts & set(BAD):
        return "failed"
    if "differs" in verdicts:
        return "differs"
    if verdicts <= {"skipped"}:
        return "skipped"
    return "passed" if not verdicts & {"skipped"} else "mixed"


def anchor(check: str, subject: str) -> str:
    return "r-" + re.sub(r"[^A-Za-z0-9]+", "-", f"{check}-{subject}").strip("-")


def totals(report: dict[str, Any]) -> Counter[str]:
    return Counter(r["verdict"] for r in report["results"])


def headline(report: dict[str, Any]) -> str:
    count = totals(report)
    parts = ", ".join(f"{count[v]} {v}" for v in VERDICTS if count[v])
    return (f"{parts} of {sum(count.values())} results ({len(cells(report))} checks x "
            f"{len(subjects(report))} subjects)")


def run_line(report: dict[str, Any]) -> str:
    run = report.get("run", {})
    versions = ", ".join(f"{k} {v}" for k, v in (run.get("versions") or {}).items() if v)
    items = [f"model {run.get('model', '?')}", f"dtype {run.get('dtype', '?')}", f"workload {run.get('workload', '?')}",
             f"host {run.get('host', '?')} ({run.get('cpu', '?')})", f"started {run.get('started', '?')}"]
    if run.get("shards"):
        items.append(f"shards {', '.join(run['shards'])}")
    if run.get("target"):
        items.append(f"target {run['target'].get('url', '?')} (model {run['target'].get('model', '?')}, owned by "
                     f"{run['target'].get('owned_by', '?')})")
    if report.get("read_from_version", report.get("schema_version")) != report.get("schema_version"):
        items.append(f"read from a version-{report.get('read_from_version')} report")
    return "; ".join(items) + (f"; {versions}" if versions else "")


def markdown(report: dict[str, Any]) -> str:
    """The summary a CI step publishes: the headline, per-subject counts, every failure's first line."""
    lines = ["# Conformance", "", f"**{headline(report)}**", "", run_line(report), ""]
    names = subjects(report)
    lines += ["| subject | passed | failed | differs | skipped |", "|---|---|---|---|---|"]
    for name in names:
        count = Counter(r["verdict"] for r in report["results"] if r["subject"] == name)
        lines.append(f"| {name} | {sum(count[v] for v in HELD)} | "
                     f"{sum(count[v] for v in BAD)} | {count['differs']} | {count['skipped']} |")
    failed = [r for r in report["results"] if r["verdict"] in BAD]
    if failed:
        lines += ["", "## Failures", ""]
        for r in failed:
            where = f"first divergence {r['first_divergence']}; " if r["first_divergence"] else ""
            lines.append(f"- `{r['id']}`: {where}{r['message'][:300]}")
    differs = [r for r in report["results"] if r["verdict"] == "differs"]
    if differs:
        lines += ["", "## Where the target differs from the reference", ""]
        lines += [f"- `{r['id']}`: {r['message'][:600]}" for r in differs]
    return "\n".join(lines) + "\n"


def page(report: dict[str, Any]) -> str:
    """The HTML matrix: one row per check, one column per subject; a cell shows passed/total and links to the
    results below it (every one that did not pass, with its message and failure text)."""
    names = subjects(report)
    grid = cells(report)
    esc = html.escape
    head = "".join(f"<th>{esc(n)}</th>" for n in names)
    rows, details = [], []
    for check, by_subject in grid.items():
        row = [f'<th class="check">{esc(check)}</th>']
        for name in names:
            results = by_subject.get(name, [])
            key = state(results)
            if not results:
                row.append(f'<td class="none" title="no variant for {esc(name)}"></td>')
                continue
            passed = sum(r["verdict"] in HELD for r in results)
            label = f"{passed}/{len(results)}"
            row.append(f'<td class="{key}" style="background:{COLOURS[key]}"><a href="#{anchor(check, name)}" '
                       f'title="{esc(key)}">{label}</a></td>')
            shown = [r for r in results if r["verdict"] not in HELD] or results
            items = "".join(
                f"<li><code>{esc(r['id'])}</code> <b>{esc(r['verdict'])}</b> ({r['duration_s']:.1f} s)"
                + (f"<br>first divergence: <code>{esc(r['first_divergence'])}</code>" if r["first_divergence"] else "")
                + (f"<br>{esc(r['message'])}" if r["message"] else "")
                + (f"<pre>{esc(r['failure'])}</pre>" if r["failure"] else "") + "</li>" for r in shown)
            details.append(f'<section id="{anchor(check, name)}"><h3>{esc(check)} on {esc(name)}: {label} passed'
                           f"</h3><ul>{items}</ul></section>")
        rows.append("<tr>" + "".join(row) + "</tr>")
    legend = " ".join(f'<span class="key" style="background:{c}"></span>{esc(k)}' for k, c in COLOURS.items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Conformance: {esc(headline(report))}</title>
<style>
{PAGE_STYLE}</style></head><body>
<h1>Conformance</h1>
<p><b>{esc(headline(report))}</b></p>
<p>{esc(run_line(report))}</p>
<p>{legend}</p>
<table><thead><tr><th>check</th>{head}</tr></thead><tbody>
{chr(10).join(rows)}
</tbody></table>
<h2>Results by cell</h2>
{chr(10).join(details)}
</body></html>
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.kit.matrix", description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="conformance-report.json files (a run's shards), "
                        "or a version-0 conformance-summary.parquet")
    parser.add_argument("--html", type=Path, help="where to write the HTML matrix")
    parser.add_argument("--markdown", type=Path, help="where to write the Markdown summary")
    parser.add_argument("--merged", type=Path, help="where to write the merged report (several reports)")
    args = parser.parse_args(argv)
    reports = [read(p) for p in args.reports]
    report = merge(reports) if len(reports) > 1 else reports[0]
    folder = args.reports[0].parent
    if args.merged:
        write(report, args.merged)
    (args.html or folder / "conformance-matrix.html").write_text(page(report))
    (args.markdown or folder / "conformance-summary.md").write_text(markdown(report))
    print(headline(report))
    return 1 if any(r["verdict"] in BAD for r in report["results"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
