"""A backend from another package joins the suite with no change to it, and a sharded run equals the run in one piece.

The example backend (``conformance/subjects/example_backend``: a distribution whose ``xbackend_engine.backends`` entry
point names its spec, and a transformers class that generates one row at a time) is put on ``PYTHONPATH`` and named in
``--engine-backends``, as a user names their own. Every run here is a child pytest from an empty folder (the plugin
found by its entry point, the checks by ``--pyargs``), HF and the example required: the whole suite collects an
``example`` variant of every per-backend check that has an ``hf`` one; a selection (:data:`SELECTION`) passes on it,
the example compared with HF in float32; and the same selection as two shards (``--engine-shard 1/2``, ``2/2``: one
backend each) gives the same check ids and verdicts once merged.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.kit import matrix, record
from conformance.subjects.plan import processes, uses

SUBJECTS = uses(processes("child pytest", why="the kit run in a user's folder with a backend from another package"))

EXAMPLE = Path(__file__).resolve().parent / "subjects" / "example_backend"
SELECTION = ["--pyargs", "conformance.test_contract", "conformance.test_parity", "-m", "not served", "-k",
             "length_finish or min_new_tokens or empty_batch or logprobs_agree"]
"""Per-backend checks on both backends and a cross-backend one comparing them, each a few short requests."""


def start_child(folder: Path, *args: str) -> subprocess.Popen[str]:
    """A child pytest from ``folder`` with the example backend on ``PYTHONPATH``; read it with :func:`finish`."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(EXAMPLE), os.environ.get("PYTHONPATH")) if p)}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--engine-backends=hf,example",
               "--engine-require=hf,example", f"--engine-reports={folder / 'reports'}", *args]
    return subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(child: subprocess.Popen[str], timeout: float = 600) -> str:
    """The child's stdout once it passed (its output in the failure otherwise)."""
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
    assert child.returncode == 0, out[-5000:] + err[-3000:]
    return out


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[str]]:
    """The selection's report, and the ids of the whole suite collected (the two children run at once)."""
    folder, listing = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("listing")
    run, listed = start_child(folder, *SELECTION), start_child(listing, "--pyargs", "conformance", "--collect-only")
    ids = [line for line in finish(listed, timeout=300).splitlines() if "::" in line]
    finish(run)
    return record.read(folder / "reports" / "conformance-report.json"), ids


def test_an_entry_point_backend_joins_every_check_and_passes(whole):
    report, ids = whole

    def variants(backend: str) -> set[str]:  # each per-backend check with the backend taken out of its id
        return {re.sub(rf"(?<=[\[-]){backend}(?=[\]-])", "*", i) for i in ids if re.search(rf"[\[-]{backend}[\]-]", i)}

    assert variants("hf"), "no per-backend check collected"
    missing = variants("hf") - variants("example")
    assert not missing, f"checks without an example variant: {sorted(missing)}"

    on_example = [r for r in report["results"] if r["subject"] == "example"]
    assert on_example and {r["verdict"] for r in on_example} == {"passed"}, on_example
    assert report["run"]["backends"] == ["hf", "example"]
    assert {r["verdict"] for r in report["results"]} == {"passed"}
    compared = [r for r in report["results"] if r["subject"] == record.CROSS]
    assert compared and all(r["check"] == "test_parity.py::test_logprobs_agree_in_fp32" for r in compared)


@pytest.mark.gate_only(reason=(
    "two more child runs of the selection (56 s on CI); CI keeps "
    "test_an_entry_point_backend_joins_every_check_and_passes (the suite as a child run with the "
    "example backend) and the shard rule and the merge of shard reports (tests/test_shards.py, "
    "tests/test_conformance_report.py)"))
def test_two_shards_give_the_ids_and_verdicts_of_one_run(tmp_path, whole):
    one_run, _ = whole
    # Both shards at once, as two CI runners would run them (and half the wall time here).
    children = [start_child(tmp_path / f"shard-{k}", *SELECTION, f"--engine-shard={k}/2") for k in (1, 2)]
    for child in children:
        finish(child)
    paths = [tmp_path / f"shard-{k}" / "reports" / "conformance-report.json" for k in (1, 2)]
    shards = [record.read(p) for p in paths]
    assert [s["run"]["shards"] for s in shards] == [["1/2"], ["2/2"]]
    assert all(s["results"] for s in shards), "a shard ran nothing"
    subjects = [{r["subject"] for r in s["results"]} - {record.CROSS} for s in shards]
    assert not subjects[0] & subjects[1], f"a backend's checks ran on both shards: {subjects}"
    merged_path = tmp_path / "merged.json"
    assert matrix.main([*map(str, paths), "--merged", str(merged_path), "--html", str(tmp_path / "m.html"),
                        "--markdown", str(tmp_path / "m.md")]) == 0
    merged = record.read(merged_path)
    verdicts = lambda report: sorted((r["id"], r["verdict"]) for r in report["results"])  # noqa: E731
    assert verdicts(merged) == verdicts(one_run)
    assert merged["run"]["shards"] == ["1/2", "2/2"]
