"""A test run that dies leaves nothing running (issue 61): a run of the suite killed with SIGKILL mid-way, as the
kernel's OOM killer kills (no Python code of the run gets to clean up), leaves none of the processes it had started
(here the HF server its check started). ``conformance/kit/reaper.py`` is what kills them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conformance.kit.reaper import command_line, descendants, process_table
from conformance.subjects.plan import processes, uses

SUBJECTS = uses(
    processes("child pytest", why="a run of the suite killed with SIGKILL once its check started the HF server"),
)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_a_run_killed_mid_way_leaves_no_process_running(tmp_path):
    """A child run of the suite (a chat check on HF, which starts the HF server) is killed with SIGKILL once its
    server process exists; within 30 s every process the run had started is gone."""
    log = tmp_path / "run.log"  # the run's output, and its reaper's (what it killed, or why it could not)
    run = subprocess.Popen([sys.executable, "-m", "pytest", "conformance/test_chat.py", "-k", "curl", "-p",
                            "no:cacheprovider", "--engine-backends=hf", "--engine-require=hf",
                            f"--engine-reports={tmp_path}"], cwd=ROOT, stdout=log.open("w"),
                           stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    seen: dict[int, int] = {}  # pid -> start time: every process of the run's tree while it ran
    server = None
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and run.poll() is None:
            table = process_table()
            seen.update({pid: table[pid][1] for pid in descendants(run.pid, table)})
            if server is None:
                server = next((pid for pid in seen if "engine.serve" in command_line(pid)), None)
                found_at = time.monotonic()
            elif time.monotonic() - found_at > 2:  # noted by the run's reaper too (it looks every 0.5 s)
                break
            time.sleep(0.1)
        assert run.poll() is None, f"the run ended (exit {run.returncode}) before it could be killed mid-way"
        assert server is not None, "the run started no server within 240 s: nothing to prove"
        reapers = [pid for pid in seen if "conformance/kit/reaper.py" in command_line(pid)]
        assert reapers, f"the run started no reaper; its processes: {[command_line(p)[:80] for p in seen]}"
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
        left = {}
        for _ in range(300):
            table = process_table()
            left = {pid: command_line(pid) for pid, start in seen.items() if table.get(pid, (0, -1))[1] == start}
            if not left:
                break
            time.sleep(0.1)
        assert not left, f"left running after the run was killed: {left}; the run's log ends:\n" \
                         f"{log.read_text(errors='replace')[-2000:]}"
    finally:
        if run.poll() is None:
            run.kill()
        for pid, start in seen.items():  # never leave them to the next check, whatever failed above
            if process_table().get(pid, (0, -1))[1] == start:
                os.kill(pid, signal.SIGKILL)
