"""Measure where a served vLLM engine's start-up goes, and what the cheaper starts would save (issue 44, point 4).

A ``python -m engine.serve`` vLLM server is two processes that each import torch and vLLM: the API process, then
the engine core ``AsyncLLM`` spawns (vLLM forces ``spawn`` on CPU hosts). This script starts the suite's vLLM server
(the conformance pool's CPU settings: eager, torch.compile off, the fixture SmolLM2) ``--rounds`` times per way and
prints the medians of:

- ``import``: a bare ``python -c "import vllm.v1.engine.async_llm"`` (torch and vLLM's engine: what each of the two
  processes pays before any model work);
- ``start``: ``launch_server`` until ``/health`` answers, the way the suite starts its servers;
- when the engine core's process appears (the API process has imported and configured vLLM), and how it started
  (spawned: a fresh interpreter that imports everything again; forked: a copy of the API process).

Ways: ``spawn`` (the default) and ``fork`` (``VLLM_WORKER_MULTIPROC_METHOD=fork``: the engine core forks from the
API process after its imports, the "fork after import" the issue asks about); every start's greedy answer must
be the same::

    python -m benchmarks.server_start --rounds 3       # after python -m engine_fixtures build, in the stack venv
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WAYS = {"spawn": {}, "fork": {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}}


def config() -> dict[str, Any]:
    from conformance.subjects.pool import CPU_VLLM
    from conformance.subjects.servers import SERVED_CHAT
    from engine.backends.host import turn_torch_compile_off

    turn_torch_compile_off()  # as the suite: its servers inherit the environment
    model = str(ROOT / ".fixtures" / "smollm2-135m-instruct")
    return {"backend": "vllm", "model": {"path": model, "dtype": "float32"}, "generation": {"max_new_tokens": 16},
            "vllm": {"max_num_seqs": 16, **CPU_VLLM}, "serve": {"chat": dict(SERVED_CHAT), "port": 0}}


def time_import() -> float:
    began = time.monotonic()
    subprocess.run([sys.executable, "-c", "import vllm.v1.engine.async_llm"], check=True, capture_output=True)
    return time.monotonic() - began


def start_once(cfg: dict[str, Any], env: dict[str, str]) -> tuple[dict[str, float], str]:
    """One start: seconds from launch to each milestone, and the server's greedy answer. Milestones: ``core`` (the
    engine core's process appears: the API process has imported and configured), ``healthy`` (``/health`` answers:
    the core has imported, loaded and warmed up), and ``spawned`` (1.0: a fresh interpreter; 0.0: a fork)."""
    import threading

    import httpx
    import psutil

    from engine.client import launch_server

    marks: dict[str, float] = {}
    began = time.monotonic()
    done = threading.Event()

    def watch() -> None:  # the engine core: the API process's first python child that is not multiprocessing's
        while not done.is_set() and "core" not in marks:  # resource tracker (started just before a spawned core)
            for proc in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    lines = [" ".join(c.cmdline()) for c in proc.children() if "python" in c.name()]
                    cores = [line for line in lines if "resource_tracker" not in line]
                    if cores and "core" not in marks:
                        marks["core"] = time.monotonic() - began
                        marks["spawned"] = float(any("spawn_main" in line for line in cores))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    server = launch_server(cfg, env=env)
    marks["healthy"] = time.monotonic() - began
    done.set()
    try:
        body = {"model": httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"], "max_tokens": 16,
                "temperature": 0, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
        return marks, answer["choices"][0]["message"]["content"]
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--rounds", type=int, default=3)
    args.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    opts = args.parse_args(argv)
    cfg = config()
    imports = [time_import() for _ in range(opts.rounds)]
    listed = [round(t, 1) for t in imports]
    print(f"import vllm.v1.engine.async_llm (one process): median {statistics.median(imports):.1f} s of {listed}")
    answers: dict[str, set[str]] = {}
    seen: dict[str, dict[str, list[float]]] = {}
    for _ in range(opts.rounds):  # interleaved rounds: the machine's drift falls on every way alike
        for way in opts.ways.split(","):
            try:
                marks, answer = start_once(cfg, {**os.environ, **WAYS[way]})
            except Exception as err:  # a way vLLM does not allow here: say so, measure the others
                print(f"{way}: did not start ({type(err).__name__}: {str(err)[-600:]})", flush=True)
                continue
            answers.setdefault(way, set()).add(answer)
            for name, value in marks.items():
                seen.setdefault(way, {}).setdefault(name, []).append(value)
            how = "spawned" if marks.get("spawned") else "forked"
            print(f"{way}: core process at {marks.get('core', float('nan')):.1f} s ({how}), healthy at "
                  f"{marks['healthy']:.1f} s, answered {answer!r}", flush=True)
    for way, values in seen.items():
        core, healthy = (statistics.median(values.get(k, [float("nan")])) for k in ("core", "healthy"))
        print(f"{way}: medians over {len(values['healthy'])} starts: API process imports and configures "
              f"{core:.1f} s, the engine core imports, loads and warms up {healthy - core:.1f} s, healthy at "
              f"{healthy:.1f} s")
    distinct = {a for way in answers.values() for a in way}
    print("every start answered alike" if len(distinct) == 1 else f"ANSWERS DIFFER: {answers}")
    return 0 if len(distinct) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
