"""The run's reaper (``conformance/kit/reaper.py``) kills what a noted process started after the watcher's last
look: a server that spawned its engine core while the run was being killed (``conformance/test_run_cleanup.py`` kills
a whole suite run; this is the one case it cannot time)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from conformance.kit import reaper

RUN = """
import subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from conformance.kit import reaper
reaper.start()
subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[3]])  # the 'server': noted by the watcher
time.sleep(2.0)  # several looks: the server is noted
print("noted", flush=True)
time.sleep(60)
"""
SERVER = """
import os, subprocess, sys, time
run = os.getppid()
while os.getppid() == run:  # until the run is gone: the watcher takes no look after that
    time.sleep(0.05)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(60)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_child_started_after_the_last_look_dies_with_the_run(tmp_path):
    pid_file = tmp_path / "child.pid"
    root = str(Path(reaper.__file__).resolve().parents[2])
    run = subprocess.Popen([sys.executable, "-c", RUN, root, SERVER, str(pid_file)], stdout=subprocess.PIPE,
                           text=True)
    assert run.stdout is not None and run.stdout.readline().strip() == "noted"
    run.kill()
    run.wait()
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the server never started its child"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + reaper.GRACE_S + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    still = alive(child)
    if still:
        os.kill(child, 9)
    assert not still, "a process started by a noted process after the watcher's last look outlived the run"
