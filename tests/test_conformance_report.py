"""The conformance report: what the collector records from a real pytest run, the versioned JSON, older versions read,
shards merged, the HTML matrix's links and the Markdown summary."""

from __future__ import annotations

import doctest
import json
import re
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from conformance.kit import census, matrix, plugin, record
from conformance.kit import report as collector_module
from conformance.kit.report import SummaryCollector
from conformance.subjects import bill, looper, plan, pool, served, stock, target

ROOT = Path(__file__).resolve().parents[1]
CHECKS = '''
import pytest

@pytest.fixture(params=["hf", "vllm"])
def backend(request):
    return request.param

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown broke")

def test_passes(backend):
    pass

def test_fails_on_vllm(backend):
    assert backend == "hf", "3 != 4 on " + backend

def test_skips(backend):
    pytest.skip("llamacpp: llama_cpp not installed")

@pytest.mark.xfail(reason="known", strict=True)
def test_known():
    assert False

def test_compares_all(request):
    [summary] = [p for p in request.config.pluginmanager.get_plugins() if hasattr(p, "note")]
    from conformance.kit.record import result_id
    summary.note(result_id(request.node.location),
        "greedy parity hf vs vllm: 5/6 token-identical; first divergence: chat-3@12")
    assert False, "prompt chat-3 differs"

def test_teardown_breaks(broken_teardown):
    pass

def test_server_differs(backend):
    from conformance.subjects.target import Findings
    findings = Findings(strict=backend == "vllm")  # an external target's finding on hf; strict on vllm
    findings.differ("stop_token_ids ignored")
    findings.settle()
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("suite")
    (folder / "test_checks.py").write_text(textwrap.dedent(CHECKS))
    out = folder / "reports"
    describe = lambda: {"model": "m", "dtype": "float32", "backends": ("hf", "vllm"), "workload": "quick",  # noqa: E731
                        "context": {"vllm_runner": "v1"}}
    collector = SummaryCollector(out, describe)
    code = pytest.main([str(folder), "-q", "-p", "no:cacheprovider", "-p", "no:xbackend_engine_conformance"],
                       plugins=[collector])
    assert code == 1
    return out, json.loads((out / "conformance-report.json").read_text())


def by_id(report: dict, part: str) -> list[dict]:
    return [r for r in report["results"] if part in r["id"]]


def test_each_check_run_is_one_result_with_its_verdict_subject_and_text(run):
    _, report = run
    assert report["schema"] == record.SCHEMA and report["schema_version"] == record.SCHEMA_VERSION
    assert {r["verdict"] for r in by_id(report, "test_passes")} == {"passed"}
    [hf, vllm] = by_id(report, "test_fails_on_vllm")
    assert (hf["subject"], hf["verdict"], vllm["subject"], vllm["verdict"]) == ("hf", "passed", "vllm", "failed")
    assert vllm["message"] == "AssertionError: 3 != 4 on vllm" and "def test_fails_on_vllm" in vllm["failure"]
    assert {r["message"] for r in by_id(report, "test_skips")} == {"llamacpp: llama_cpp not installed"}
    assert by_id(report, "test_known")[0]["verdict"] == "xfailed"
    [cross] = by_id(report, "test_compares_all")
    assert cross["subject"] == "cross-backend" and cross["first_divergence"] == "chat-3@12"
    [teardown] = by_id(report, "test_teardown_breaks")
    assert teardown["verdict"] == "error" and "teardown broke" in teardown["failure"]
    assert report["run"]["model"] == "m" and report["run"]["versions"]["pytest"] and report["run"]["host"]
    assert all(r["check"].startswith("test_checks.py::") for r in report["results"])
    [differs, strict] = by_id(report, "test_server_differs")
    assert (differs["verdict"], differs["message"]) == ("differs", "stop_token_ids ignored")
    assert strict["verdict"] == "failed" and "stop_token_ids ignored" in strict["message"]


def test_a_finding_about_a_target_is_coloured_and_listed_but_fails_nothing(run):
    out, report = run
    page = (out / "conformance-matrix.html").read_text()
    row = re.search(r"<tr><th class=\"check\">test_checks.py::test_server_differs</th>(.*?)</tr>", page).group(1)
    assert re.findall(r"<td class=\"(\w+)\"", row) == ["differs", "failed", "none"]
    summary = (out / "conformance-summary.md").read_text()
    assert "## Where the target differs from the reference" in summary and "stop_token_ids ignored" in summary
    only_differs = {**report, "results": [r for r in report["results"] if r["verdict"] in ("passed", "differs")]}
    path = record.write(only_differs, out / "differs-only.json")
    assert matrix.main([str(path), "--html", str(out / "d.html"), "--markdown", str(out / "d.md")]) == 0


def test_the_matrix_links_every_cell_to_its_results_and_colours_it(run):
    out, _ = run
    page = (out / "conformance-matrix.html").read_text()
    links = set(re.findall(r'href="#([^"]+)"', page))
    anchors = set(re.findall(r'<section id="([^"]+)"', page))
    assert links and links == anchors
    row = re.search(r"<tr><th class=\"check\">test_checks.py::test_fails_on_vllm</th>(.*?)</tr>", page).group(1)
    assert re.findall(r"<td class=\"(\w+)\"", row) == ["passed", "failed", "none"]  # no cross-backend variant
    assert "3 != 4 on vllm" in page and "first divergence: <code>chat-3@12</code>" in page
    summary = (out / "conformance-summary.md").read_text()
    assert summary.startswith("# Conformance") and "| vllm | " in summary
    assert "- `" in summary and "first divergence chat-3@12" in summary
    assert matrix.main([str(out / "conformance-report.json"), "--html", str(out / "again.html"),
                        "--markdown", str(out / "again.md")]) == 1  # a report with failures exits 1
    assert (out / "again.html").read_text() == page


def test_shards_merge_into_the_one_run_and_overlap_is_refused(run):
    _, report = run
    first = {**report, "results": report["results"][:5], "run": {**report["run"], "shards": ["1/2"]}}
    second = {**report, "results": report["results"][5:], "run": {**report["run"], "shards": ["2/2"]}}
    merged = record.merge([first, second])
    assert [r["id"] for r in merged["results"]] == [r["id"] for r in report["results"]]
    assert merged["run"]["shards"] == ["1/2", "2/2"]
    with pytest.raises(record.ReportError, match="is in shard 1 and shard 2"):
        record.merge([first, first])


def test_older_and_foreign_reports(tmp_path, run):
    out, report = run
    again = record.read(out / "conformance-report.json")
    assert again["results"] == report["results"] and again["read_from_version"] == record.SCHEMA_VERSION
    v1 = tmp_path / "v1.json"  # before the verdict differs and the run's target
    v1.write_text(json.dumps({**report, "schema_version": 1, "run": {k: v for k, v in report["run"].items()
                                                                     if k != "target"},
                              "results": [r for r in report["results"] if r["verdict"] != "differs"]}))
    older = record.read(v1)
    assert older["read_from_version"] == 1 and older["schema_version"] == record.SCHEMA_VERSION
    assert "read from a version-1 report" in matrix.run_line(older)
    old = tmp_path / "conformance-summary.parquet"  # what the suite wrote before the versioned report
    pd.DataFrame([{"backend": "hf", "check": "stop", "passed": 4, "failed": 0, "skipped": 1, "skip_reason": "",
                   "workload": "quick"},
                  {"backend": "vllm", "check": "stop", "passed": 3, "failed": 2, "skipped": 0, "skip_reason": "",
                   "workload": "quick"}]).to_parquet(old, index=False)
    v0 = record.read(old)
    assert v0["read_from_version"] == 0 and [r["verdict"] for r in v0["results"]] == ["passed", "failed"]
    assert "version-0 report" in matrix.run_line(v0) and "vllm" in matrix.page(v0)
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({**report, "schema_version": record.SCHEMA_VERSION + 1}))
    with pytest.raises(record.ReportError, match="newer than this tool's"):
        record.read(newer)
    foreign = tmp_path / "other.json"
    foreign.write_text(json.dumps({"schema": "something else"}))
    with pytest.raises(record.ReportError, match="not a conformance report"):
        record.read(foreign)


def test_the_summary_names_the_module_each_process_started_in_and_each_subjects_users(tmp_path):
    import os

    tick = os.sysconf("SC_CLK_TCK")
    noted = tmp_path / "census.tsv"
    noted.write_text(f"11\t{5 * tick}\tpython -m engine.serve --config /tmp/a.json\n"
                     f"12\t{9 * tick}\tpython -m vllm.entrypoints.openai.api_server /m\n"
                     f"13\t{1 * tick}\tps -o pid\n")
    plan = ["subjects and their users (1 subjects, 1 starts):", "  server hf smol: 1 starts, 2 modules: a.py b.py"]
    declared = {"test_a.py": [], "test_b.py": []}  # test_b.py starts stock vllm serve without declaring it
    collector = SummaryCollector(tmp_path, lambda: {"plan": plan, "declared_processes": declared}, census=noted)
    collector.windows = [(4.0, "test_a.py"), (8.0, "test_b.py")]  # seconds since boot as each check started
    collector.results = {"conformance/test_a.py::test_x": {"verdict": "passed", "seconds": 1.0, "message": "",
                                                           "failure": ""}}
    assert collector.census_lines()[1:] == ["started while each module ran:", "  (before the checks): other: ps 1",
                                            "  test_a.py: engine.serve server 1", "  test_b.py: stock vllm serve 1",
                                            "started without a declaration (processes(...) in the module's SUBJECTS):",
                                            "  test_b.py: stock vllm serve 1"]
    declared["test_b.py"] = ["stock vllm serve"]
    assert "started without a declaration" not in "\n".join(collector.census_lines())
    summary = (tmp_path / "conformance-summary.md")
    collector.write()
    text = summary.read_text()
    assert "## Processes" in text and "  test_b.py: stock vllm serve 1" in text
    assert "## Subjects" in text and plan[1] in text


def test_the_memory_line_names_the_modules_that_raised_the_peak(tmp_path, monkeypatch):
    """Each phase's rise of the process's peak goes to the module whose check ran it; the summary carries the line."""
    peaks = iter([0.1, 1.0, 1.0, 3.5, 3.5, 4.0])  # GiB: made, collected (imports), then after each phase below
    monkeypatch.setattr(collector_module, "peak_gib", lambda: next(peaks))
    collector = SummaryCollector(tmp_path)
    collector.pytest_collection_finish(None)
    for nodeid, when in [("test_stop.py::test_a", "setup"), ("test_adapters.py::test_b", "setup"),
                         ("test_adapters.py::test_b", "call"), ("test_chat.py::test_c", "call")]:
        collector.pytest_runtest_logreport(pytest.TestReport(nodeid, (nodeid.split("::")[0], 1, nodeid), {},
                                                             "passed", None, when, duration=0.1))
    [line] = collector.memory_lines()
    assert line == "peak resident memory 4.0 GiB (1.0 GiB before the first check); it rose in: adapters +2.5, chat +0.5"
    collector.write()
    assert line in (tmp_path / "conformance-summary.md").read_text()


def test_the_slowest_checks_sum_each_checks_phases_and_reach_the_summary(tmp_path):
    """A check's setup, call and teardown add up to its one line (a first user's engine starts are its setup); the
    summary carries the lines under the time by module."""
    collector = SummaryCollector(tmp_path)
    phases = [("test_stop.py::test_a[hf]", "setup", 20.0), ("test_stop.py::test_a[hf]", "call", 5.0),
              ("test_stop.py::test_b[hf]", "call", 1.0), ("test_chat.py::test_c", "call", 9.0),
              ("test_stop.py::test_a[hf]", "teardown", 0.5)]
    for nodeid, when, seconds in phases:
        collector.pytest_runtest_logreport(pytest.TestReport(nodeid, (nodeid.split("::")[0], 1, nodeid.split("::")[1]),
                                                             {}, "passed", None, when, duration=seconds))
    head, first, second, third = collector.slowest_lines()
    assert head.startswith("slowest checks")
    assert first.split() == ["25.5", "s", "96%", "of", "stop", "test_stop.py::test_a[hf]"]
    assert second.split()[0] == "9.0" and third.split()[-1] == "test_stop.py::test_b[hf]"
    collector.write()
    assert first in (tmp_path / "conformance-summary.md").read_text()


def test_reports_readme_documents_every_field():
    readme = (ROOT / "reports" / "README.md").read_text()
    assert f"Conformance report schema version: {record.SCHEMA_VERSION}" in readme
    for name in (*record.RESULT_FIELDS, *record.RUN_FIELDS):
        assert f"| `{name}` |" in readme, name


@pytest.mark.parametrize("module", [record, matrix, collector_module, target, stock, pool, census, plugin, served,
                                    bill, plan, looper])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0
