"""``python -m engine.serve``: validate, activate, load, then bind -- and fail fast at each step.

1. The config (YAML, overrides, the ``repeat_terminate`` subtree from :mod:`engine.serve.activation`) is
   validated before torch or vLLM is imported: a bad value exits with code 2 and the ``ConfigError`` text.
2. The engine loads; an enabled guard that cannot run (e.g. no logits-processor interface for vLLM's runner)
   refuses before the model loads: exit code 3 with the reason. The port has not been bound yet.
3. Only then the socket is bound and the ready line printed (and written to ``--ready-file``).

SIGTERM/SIGINT stop accepting connections, let in-flight requests finish (``serve.drain_timeout_s``), then close
the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from engine.config.serve import PatternCConfig
from engine.errors import ConfigError, EngineError
from engine.serve.activation import FLAG, Activation, resolve

EXIT_CONFIG = 2
EXIT_START = 3


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="engine config YAML (backend, model, generation, serve, ...)")
    p.add_argument("--backend", help="override: backend (hf or vllm)")
    p.add_argument("--model", help="override: model.path")
    p.add_argument("--dtype", help="override: model.dtype")
    p.add_argument("--host", help="override: serve.host (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="override: serve.port (0: any free port)")
    p.add_argument("--namespace", help="override: serve.namespace ('none' for bare responses)")
    p.add_argument(FLAG, dest="repeat_terminate_from", metavar="FILE.yaml:dotted.path",
                   help="take the repeat_terminate subtree from the learner's YAML (see engine.serve.activation)")
    p.add_argument("--ready-file", help="write {url, pid, port} here once the port is bound")
    p.add_argument("--check", action="store_true", help="validate the config and exit (nothing loaded)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default: warning)")
    return p


def served_config(args: argparse.Namespace, environ: Any = None) -> tuple[Any, Activation]:
    """The validated ``EngineConfig`` and the guard's activation, from the arguments and the environment."""
    import yaml

    from engine.config import EngineConfig

    data: dict[str, Any] = {}
    if args.config:
        try:
            data = yaml.safe_load(Path(args.config).read_text(encoding="utf-8")) or {}
        except OSError as err:
            raise ConfigError("--config", args.config, f"cannot be read ({err.strerror})",
                              fix="give an existing YAML file") from err
        if not isinstance(data, dict):
            raise ConfigError("--config", args.config, "must hold a YAML mapping", fix="start with 'backend:'")
    if args.backend:
        data["backend"] = args.backend
    if args.model or args.dtype:
        model = data.get("model") or {}
        model = {"path": model} if isinstance(model, str) else dict(model)
        if args.model:
            model["path"] = args.model
        if args.dtype:
            model["dtype"] = args.dtype
        data["model"] = model
    serve = dict(data.get("serve") or {})
    for key in ("host", "port"):
        if getattr(args, key) is not None:
            serve[key] = getattr(args, key)
    if args.namespace is not None:
        serve["namespace"] = None if args.namespace.lower() == "none" else args.namespace
    serve["chat"] = chat_environment(dict(serve.get("chat") or {}), os.environ if environ is None else environ)
    data["serve"] = serve
    if data.get("backend") == "vllm":  # concurrent requests share vLLM's continuous batching
        data["vllm"] = {**(data.get("vllm") or {}), "async_engine": True}
    data, activation = resolve(data, from_yaml=args.repeat_terminate_from, environ=environ)
    return EngineConfig.from_dict(data), activation


CHAT_ENVIRONMENT = {"MIN_LEN": "min_len", "MAX_LEN": "max_len"}


def chat_environment(chat: dict[str, Any], environ: Any) -> dict[str, Any]:
    """``serve.chat`` with ``MIN_LEN``/``MAX_LEN`` from the environment applied (they win over the config file,
    as in the Pattern C deployments that set them).

    >>> chat_environment({"min_len": 50}, {"MAX_LEN": "400"})
    {'min_len': 50, 'max_len': 400}
    >>> chat_environment({}, {"MIN_LEN": "ten"})
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: MIN_LEN (environment) must be an integer, got 'ten'. Fix: e.g. MIN_LEN=120.
    """
    for var, key in CHAT_ENVIRONMENT.items():
        raw = environ.get(var)
        if raw is None or raw == "":
            continue
        try:
            chat[key] = int(raw)
        except ValueError:
            raise ConfigError(f"{var} (environment)", raw, "must be an integer",
                              fix=f"e.g. {var}={getattr(PatternCConfig, key)}") from None
    return chat


def fail(code: int, stage: str, err: BaseException) -> int:
    print(f"engine.serve: {stage}: {err}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config, activation = served_config(args)
    except ConfigError as err:
        return fail(EXIT_CONFIG, "config error", err)
    guard = config.repeat_terminate
    summary = (f"backend={config.backend} model={config.model.path} repeat_terminate: enabled={guard.enabled} "
               f"source={activation.source} hash={guard.fingerprint()[:12]}")
    if args.check:
        print(f"engine.serve: config ok: {summary}", flush=True)
        return 0
    import uvicorn

    from engine.engine import GenerationEngine
    from engine.serve.app import create_app
    from engine.serve.service import ServedEngine

    try:
        engine = GenerationEngine(config)
    except EngineError as err:
        return fail(EXIT_START, "cannot start", err)
    served = ServedEngine(engine, activation)
    sock = socket.socket(socket.AF_INET6 if ":" in config.serve.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.serve.host, config.serve.port))
    except OSError as err:
        engine.close()
        return fail(EXIT_START, "cannot bind", f"{config.serve.host}:{config.serve.port}: {err.strerror}")
    port = sock.getsockname()[1]
    url = f"http://{config.serve.host}:{port}"
    print(f"engine.serve: ready on {url} ({summary})", flush=True)
    if args.ready_file:
        tmp = Path(f"{args.ready_file}.tmp")
        tmp.write_text(json.dumps({"url": url, "port": port, "pid": os.getpid()}))
        tmp.replace(args.ready_file)  # readers never see a half-written file
    server = uvicorn.Server(uvicorn.Config(create_app(served), log_level=args.log_level,
                                           timeout_graceful_shutdown=int(config.serve.drain_timeout_s) or None))
    server.run(sockets=[sock])
    return 0


def cli() -> None:
    """The ``engine-serve`` console script."""
    sys.exit(main())
