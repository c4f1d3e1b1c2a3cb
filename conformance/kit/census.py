"""The run's census: every process a conformance run started, counted by kind (our servers, stock ``vllm serve``,
llama.cpp's server, vLLM engine cores, swift, the lm_eval CLI, TRL, child pytest runs), from what the run's watcher
noted (``conformance/kit/reaper.py``, :class:`~conformance.kit.reaper.Census`). Printed at the run's end beside the
engine pool's bill and kept in the summary: what a run costs in processes, the figure a session plan (issue 76) has
to bring down.

>>> entries = {(1, 5): "python -m engine.serve --config /tmp/a.json", (2, 6): "VLLM::EngineCore",
...            (3, 7): "python -m engine.serve --config /tmp/b.json", (4, 8): "ps -o pid"}
>>> print(line(count(entries)))
processes this run started (4): engine.serve server 2, vLLM engine core 1, other: ps 1
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

KINDS: tuple[tuple[str, str], ...] = (
    ("engine.serve server", r"-m engine\.serve\b|engine/serve/__main__"),
    ("stock vllm serve", r"vllm\.entrypoints\.openai\.api_server|\bvllm serve\b|/vllm serve"),
    ("vLLM engine core", r"^VLLM::EngineCore"),
    ("vLLM API server", r"^VLLM::APIServer"),
    ("llama.cpp server", r"llama-server|llama_cpp\.server"),
    ("swift rollout", r"\bswift\b.*\brollout\b"),
    ("trl vllm-serve", r"\btrl\b.*vllm-serve"),
    ("lm_eval CLI", r"\blm_eval\b|\blm-eval\b"),
    ("child pytest", r"-m pytest\b|(?:^|/)pytest(?:\s|$)"),  # the program, not a path under /tmp/pytest-of-...
    ("multiprocessing helper", r"multiprocessing\.(resource_tracker|spawn|forkserver)"),
)
"""(kind, pattern of its command line), first match wins; anything else is ``other``."""


def kind_of(command: str) -> str:
    """The kind of a noted process by its command line.

    >>> kind_of("/v/bin/python -m vllm.entrypoints.openai.api_server /m --served-model-name m")
    'stock vllm serve'
    >>> kind_of("/v/bin/python -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)")
    'multiprocessing helper'
    >>> kind_of("/v/bin/pytest conformance -q"), kind_of("/usr/bin/sh -c ls /tmp/pytest-of-root/pytest-6/x")
    ('child pytest', 'other')
    """
    for kind, pattern in KINDS:
        if re.search(pattern, command):
            return kind
    return "other"


def read(path: Path) -> dict[tuple[int, int], str]:
    """(pid, start) -> the last command line the watcher wrote for it (a renamed process counts once, as what it
    became)."""
    entries: dict[tuple[int, int], str] = {}
    if not path.is_file():
        return entries
    for row in path.read_text(errors="replace").splitlines():
        parts = row.split("\t", 2)
        if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
            entries[(int(parts[0]), int(parts[1]))] = parts[2]
    return entries


def program_of(command: str) -> str:
    """What a command line runs, in a word: the program's name, or for Python the module or script it runs.

    >>> program_of("/v/bin/python -m uvicorn app:x"), program_of("/usr/bin/curl -s http://127.0.0.1:1/health")
    ('uvicorn', 'curl')
    """
    words = command.split()
    if not words:
        return "?"
    name = words[0].rsplit("/", 1)[-1]
    if name.startswith("python") and len(words) > 1:
        if words[1] == "-m" and len(words) > 2:
            return words[2]
        return "python -c" if words[1] == "-c" else words[1].rsplit("/", 1)[-1]
    return name


FORK = "fork of the run"
"""A process with the run's own command line: forked by it (a multiprocessing or tokenizer worker), not started."""


def labelled(command: str, run: str = "") -> str:
    """A noted process's kind in a count: :data:`FORK` for the run's own command line, ``other: <program>`` for a
    process of no kind.

    >>> labelled("/v/bin/python /v/bin/pytest conformance -q", run="/v/bin/python /v/bin/pytest conformance -q")
    'fork of the run'
    >>> labelled("/usr/bin/curl -s x")
    'other: curl'
    """
    if run and command == run:
        return FORK
    kind = kind_of(command)
    return kind if kind != "other" else f"other: {program_of(command)}"


def count(entries: Mapping[tuple[int, int], str], run: str = "") -> Counter[str]:
    """Processes by kind (:func:`labelled`; ``run``: the run's own command line)."""
    return Counter(labelled(command, run) for command in entries.values())


def line(counts: Counter[str]) -> str:
    """One line of the counts, in :data:`KINDS`' order, then the others by program."""
    order = [kind for kind, _ in KINDS] + [FORK] + sorted(k for k in counts if k.startswith("other: "))
    parts = [f"{k} {counts[k]}" for k in order if counts[k]]
    return f"processes this run started ({sum(counts.values())}): " + (", ".join(parts) if parts else "none")


def by_module(entries: Mapping[tuple[int, int], str], windows: Sequence[tuple[float, str]],
              ticks_per_s: float | None = None, run: str = "") -> dict[str, Counter[str]]:
    """The processes by the module whose check was running when each started: ``windows`` holds (seconds since boot,
    module) as each check started, in order; a process's start is in clock ticks since boot (``/proc/PID/stat``).
    Processes started before the first check (collection, the watcher) count as ``(before the checks)``. A start is
    whole clock ticks, rounded down: a process started in the tick a check started in is that check's (a module's
    first check that starts a child at once, in its fixture's setup, had it counted for the module before).

    >>> entries = {(1, 150): "python -m engine.serve --config a", (2, 450): "vllm serve /m", (3, 50): "ps"}
    >>> {m: dict(c) for m, c in by_module(entries, [(1.0, "a.py"), (4.0, "b.py")], ticks_per_s=100).items()}
    {'(before the checks)': {'other: ps': 1}, 'a.py': {'engine.serve server': 1}, 'b.py': {'stock vllm serve': 1}}
    >>> dict(by_module({(4, 413): "pytest -q"}, [(1.0, "a.py"), (4.132, "b.py")], ticks_per_s=100))
    {'b.py': Counter({'child pytest': 1})}
    """
    import bisect
    import os

    tick = ticks_per_s or os.sysconf("SC_CLK_TCK")
    starts = [at for at, _ in windows]
    out: dict[str, Counter[str]] = {}
    for (_, start), command in sorted(entries.items(), key=lambda e: e[0][1]):
        index = bisect.bisect_right(starts, (start + 1) / tick) - 1  # somewhere in [start, start + 1) ticks
        module = windows[index][1] if index >= 0 else "(before the checks)"
        out.setdefault(module, Counter())[labelled(command, run)] += 1
    return out


def module_lines(modules: Mapping[str, Counter[str]]) -> list[str]:
    """One line per module, most processes first (multiprocessing helpers and forks of the run left out).

    >>> module_lines({"a.py": Counter({"engine.serve server": 2, "multiprocessing helper": 1})})
    ['  a.py: engine.serve server 2']
    """
    lines = []
    for module, counts in sorted(modules.items(), key=lambda m: -sum(m[1].values())):
        shown = {k: n for k, n in counts.items() if k not in ("multiprocessing helper", FORK)}
        if shown:
            lines.append(f"  {module}: " + ", ".join(f"{k} {n}" for k, n in sorted(shown.items(), key=lambda x: -x[1])))
    return lines


FOREIGN = ("stock vllm serve", "llama.cpp server", "swift rollout", "trl vllm-serve", "lm_eval CLI", "child pytest")
"""Kinds only a check starts (the pool starts servers, engines and their helpers): a module that starts one declares
it (``processes(kind, why=...)``, ``conformance/subjects/plan.py``)."""


def undeclared_lines(modules: Mapping[str, Counter[str]], declared: Mapping[str, Sequence[str]]) -> list[str]:
    """The foreign processes a module started without declaring their kind, one line per module.

    >>> undeclared_lines({"a.py": Counter({"stock vllm serve": 2, "child pytest": 1}), "b.py": Counter({"ps": 1})},
    ...                  {"a.py": ["child pytest"]})
    ['  a.py: stock vllm serve 2']
    """
    lines = []
    for module, counts in modules.items():
        missing = {k: n for k, n in counts.items() if k in FOREIGN and k not in declared.get(module, ())}
        if missing:
            lines.append(f"  {module}: " + ", ".join(f"{k} {n}" for k, n in missing.items()))
    return lines
