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
from collections.abc import Mapping
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
    ("child pytest", r"-m pytest\b|/pytest\b"),
    ("multiprocessing helper", r"multiprocessing\.(resource_tracker|spawn|forkserver)"),
)
"""(kind, pattern of its command line), first match wins; anything else is ``other``."""


def kind_of(command: str) -> str:
    """The kind of a noted process by its command line.

    >>> kind_of("/v/bin/python -m vllm.entrypoints.openai.api_server /m --served-model-name m")
    'stock vllm serve'
    >>> kind_of("/v/bin/python -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)")
    'multiprocessing helper'
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


def count(entries: Mapping[tuple[int, int], str]) -> Counter[str]:
    """Processes by kind; those of no kind as ``other: <program>`` (:func:`program_of`)."""
    return Counter(kind if (kind := kind_of(command)) != "other" else f"other: {program_of(command)}"
                   for command in entries.values())


def line(counts: Counter[str]) -> str:
    """One line of the counts, in :data:`KINDS`' order, then the others by program."""
    order = [kind for kind, _ in KINDS] + sorted(k for k in counts if k.startswith("other: "))
    parts = [f"{k} {counts[k]}" for k in order if counts[k]]
    return f"processes this run started ({sum(counts.values())}): " + (", ".join(parts) if parts else "none")
