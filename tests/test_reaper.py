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


CENSUS_RUN = """
import subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from conformance.kit import reaper
reaper.start(census=sys.argv[2])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-m", "engine.serve"])
time.sleep(1.5)  # three looks: the child is noted
child.kill()
print("noted", flush=True)
time.sleep(30)
"""


def test_the_census_counts_what_the_run_started(tmp_path):
    """The watcher writes each process it notes; the census counts it by its command line, and a process written
    twice (renamed) counts once, as what it became."""
    from conformance.kit import census

    path = tmp_path / "census.tsv"
    root = str(Path(reaper.__file__).resolve().parents[2])
    run = subprocess.Popen([sys.executable, "-c", CENSUS_RUN, root, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout is not None and run.stdout.readline().strip() == "noted"
    finally:
        run.kill()
        run.wait()
    counts = census.count(census.read(path))
    assert counts["engine.serve server"] == 1, path.read_text()
    with path.open("a") as out:
        out.write("999999\t1\tpython -c from multiprocessing.spawn import spawn_main\n999999\t1\tVLLM::EngineCore\n")
    counts = census.count(census.read(path))
    assert counts["vLLM engine core"] == 1 and counts["multiprocessing helper"] == 0, counts
