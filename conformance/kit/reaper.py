"""The run's reaper: every process a test run starts dies with the run, however the run ends (SIGKILL and the
kernel's OOM killer included, which leave no Python code a chance to clean up).

A small watcher process of its own session (a signal to the run's process group does not reach it) follows the run's
process tree: every half second it notes each descendant of the run (pid and start time: our servers, stock ``vllm
serve``, their engine cores, in-process vLLM's engine cores, lm-eval and swift children). When the run's process is
gone, or its pipe to the watcher closes, it kills every noted process still alive with the same start time (a reused
pid is never touched), and every process those left behind, then exits. On a run that ends well there is nothing left
to kill; a leak is killed all the same.

The suite's plugin starts it for a run of the suite (``conformance/kit/plugin.py``), the benchmarks' conftest for a
benchmark run; ``python conformance/kit/reaper.py --parent PID`` is the watcher itself (standard library only, run
isolated: it starts in tens of milliseconds whatever the run's environment). :func:`start` returns only once the
watcher has taken its first look (the run's identity noted): a watcher that started slowly under load, after the run
it was to watch had been killed, once watched nothing and let an HF server outlive its run.

>>> tree = {1: (0, 5), 10: (1, 7), 11: (10, 8), 12: (11, 9), 20: (1, 3)}
>>> sorted(descendants(10, tree))
[11, 12]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

GRACE_S = 5.0
"""How long the run's processes get to end by themselves once the run is gone (multiprocessing's resource tracker
cleans up and exits when its parent is gone: killed at once, it would leave its semaphores behind)."""
PERIOD_S = 0.5
"""How often the watcher notes the run's tree: a process started and orphaned within one period can escape."""
_started: subprocess.Popen[bytes] | None = None


def process_table() -> dict[int, tuple[int, int]]:
    """Every process now: pid -> (parent pid, start time in clock ticks since boot), from ``/proc``."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_bytes().decode("latin-1")  # a name may hold any bytes
            fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
            table[int(entry.name)] = (int(fields[1]), int(fields[19]))
        except (OSError, ValueError, IndexError):  # gone meanwhile, or caught half-written as it exits
            continue
    return table


def descendants(root: int, table: Mapping[int, tuple[int, int]]) -> set[int]:
    """The pids below ``root`` in ``table`` (pid -> (parent, start))."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def command_line(pid: int) -> str:
    """``pid``'s command line (its first 120 characters), or an empty string once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120].strip()
    except OSError:
        return ""


def reap(noted: Mapping[int, int]) -> dict[int, str]:
    """Kill every noted process (pid -> start time) still alive as itself, and every process below them now; returns
    the processes killed (pid -> command line, read before the kill: what leaked is named)."""
    table = process_table()
    alive = {pid for pid, start in noted.items() if table.get(pid, (0, -1))[1] == start}
    for pid in list(alive):
        alive |= descendants(pid, table)
    killed = {pid: command_line(pid) for pid in sorted(alive)}
    for pid in alive:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return killed


class Census:
    """What the watcher noted, as lines ``pid<TAB>start<TAB>command line`` appended to ``path``: each process when
    first seen, and again when its command line changes (vLLM's engine core renames itself ``VLLM::EngineCore`` after
    its spawn). ``conformance/kit/census.py`` reads and counts them; a process that lived less than one look is not
    in it."""

    def __init__(self, path: str) -> None:
        self.out = open(path, "a", buffering=1)  # noqa: SIM115 (held for the watcher's life, line by line)
        self.said: dict[tuple[int, int], str] = {}

    def look(self, noted: Mapping[int, int], table: Mapping[int, tuple[int, int]]) -> None:
        for pid, start in noted.items():
            if table.get(pid, (0, -1))[1] != start:
                continue  # gone (or its pid reused): what it was is written already
            command = command_line(pid)
            if command and self.said.get((pid, start)) != command:
                self.said[(pid, start)] = command
                self.out.write(f"{pid}\t{start}\t{command}\n")


def watch(parent: int, pipe: int | None, ready: Any = None, census: Census | None = None) -> None:
    """Note ``parent``'s tree until it is gone (or ``pipe`` reads end-of-file), then :func:`reap` it; ``ready`` (a
    file) is told once the first look is taken; ``census`` is handed every look."""
    start = process_table().get(parent, (0, None))[1]
    noted: dict[int, int] = {}
    me = os.getpid()
    told = ready is None
    while True:
        try:
            table = process_table()
            if table.get(parent, (0, None))[1] != start:
                break
            noted.update({pid: table[pid][1] for pid in descendants(parent, table) if pid != me})
            if census is not None:
                census.look(noted, table)
            if not told:
                ready.write(f"watching {parent}\n")
                ready.close()
                told = True
        except Exception:  # never die of a bad look at /proc: the run's processes would outlive it
            traceback.print_exc()
            time.sleep(PERIOD_S)
            continue
        if pipe is None:
            time.sleep(PERIOD_S)
            continue
        ready, _, _ = select.select([pipe], [], [], PERIOD_S)
        if ready and not os.read(pipe, 4096):  # end-of-file: the run's end of the pipe is closed
            break
    deadline = time.monotonic() + GRACE_S  # what ends by itself (a resource tracker cleaning up) is left to end
    while time.monotonic() < deadline:
        table = process_table()
        if not any(table.get(pid, (0, -1))[1] == start_time for pid, start_time in noted.items()):
            break
        time.sleep(0.2)
    killed = reap(noted)
    if killed:
        print(f"conformance.kit.reaper: the run (pid {parent}) ended; killed {len(killed)} process(es) it had left: "
              + "; ".join(f"{pid} {cmd!r}" for pid, cmd in killed.items()), file=sys.stderr)


def start(wait_s: float = 60.0, census: str | None = None) -> subprocess.Popen[bytes]:
    """Start the watcher for this process (once per process) and wait until it has taken its first look; returns it.
    Its stdin is a pipe whose writing end only this process holds (closed when this process ends, however it ends);
    its stdout says when it watches. ``census``: a file the watcher appends each noted process to (:class:`Census`)."""
    global _started
    if _started is None or _started.poll() is not None:
        command = [sys.executable, "-I", "-S", __file__, "--parent", str(os.getpid())]
        _started = subprocess.Popen(command + (["--census", census] if census else []),
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                                    close_fds=True)
        assert _started.stdout is not None
        ready, _, _ = select.select([_started.stdout], [], [], wait_s)
        said = _started.stdout.readline() if ready else b""
        if not said.startswith(b"watching"):
            print(f"conformance.kit.reaper: the watcher did not start within {wait_s:.0f} s (exit {_started.poll()}): "
                  "processes this run starts may outlive it if it is killed", file=sys.stderr)
        _started.stdout.close()
    return _started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python conformance/kit/reaper.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parent", type=int, required=True, help="the run's pid, whose tree dies with it")
    parser.add_argument("--census", default=None, help="a file to append every noted process to (its command line)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the run, not its reaper
    watch(args.parent, sys.stdin.fileno() if not sys.stdin.isatty() else None, ready=sys.stdout,
          census=Census(args.census) if args.census else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
