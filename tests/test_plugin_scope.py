"""The conformance plugin (entry point ``pytest11``) in a user's own test session: its options and markers are there,
and nothing else reaches the user's tests (no quick mark, no reordering, no fixture of ours replacing theirs, no
engine pool, no torch import, no report)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

USER_TESTS = '''
import sys

import pytest

@pytest.fixture
def client():
    return "the user's client"

def test_second_defined_first_run(client):
    assert client == "the user's client"

def test_nothing_heavy_was_imported():
    assert "torch" not in sys.modules and "vllm" not in sys.modules

@pytest.mark.quick  # the plugin registers the marker: --strict-markers accepts it
def test_marked_by_the_user():
    pass
'''


def pytest_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--strict-markers", *args],
                          cwd=folder, capture_output=True, text=True, timeout=120)


def test_a_users_own_tests_see_only_the_options_and_markers(tmp_path):
    (tmp_path / "test_user.py").write_text(textwrap.dedent(USER_TESTS))
    done = pytest_in(tmp_path, "-v")
    assert done.returncode == 0, done.stdout + done.stderr
    order = [line.split("::")[1].split()[0] for line in done.stdout.splitlines() if "::test_" in line]
    assert order == ["test_second_defined_first_run", "test_nothing_heavy_was_imported", "test_marked_by_the_user"]
    assert not (tmp_path / "reports").exists()  # no conformance report for a run without conformance checks
    quick = pytest_in(tmp_path, "-m", "quick", "-q")  # only the user's own mark selects: the tier marks nothing
    assert quick.returncode == 0 and "1 passed, 2 deselected" in quick.stdout, quick.stdout
    helped = pytest_in(tmp_path, "--help")
    assert "engine conformance" in helped.stdout and "--engine-shard=K/N" in helped.stdout


def test_the_plugin_can_be_turned_off(tmp_path):
    (tmp_path / "test_user.py").write_text("def test_x():\n    pass\n")
    off = pytest_in(tmp_path, "-p", "no:xbackend_engine_conformance", "--engine-backends=hf")
    assert off.returncode == 4 and "unrecognized arguments: --engine-backends=hf" in off.stderr


def test_every_mark_the_suite_uses_is_registered_by_the_plugin():
    """A user's ``--strict-markers`` (the kit's user repository sets it) accepts every check module of the suite."""
    import re

    from conformance.kit.plugin import MARKERS

    root = Path(__file__).resolve().parents[1] / "conformance"
    used = {m for path in root.glob("*.py") for m in re.findall(r"pytest\.mark\.(\w+)", path.read_text())}
    builtin = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"}
    assert used - builtin <= set(MARKERS), used - builtin - set(MARKERS)
