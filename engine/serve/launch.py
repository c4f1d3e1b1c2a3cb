"""``python -m engine.serve``: validate, activate, load, then bind -- and fail fast at each step.

1. The config (YAML, overrides, the ``repeat_terminate`` subtree from :mod:`engine.serve.activation`) is
   validated before torch or vLLM is imported: a bad value (a duplicate YAML key, a section that is not a
   mapping, a value out of range) exits with code 2 and the ``ConfigError`` text.
2. The port is bound, not yet listening: a port in use exits with code 2 before any model work.
3. The engine loads; an enabled guard that cannot run (e.g. no logits-processor interface for vLLM's runner)
   refuses before the model loads: exit code 3 with the reason. Nothing has listened on the port.
4. Only then the socket listens and the ready line is printed (and written to ``--ready-file``).

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

from engine.backends.registry import SPECS
from engine.config.serve import PatternCConfig
from engine.errors import ConfigError, EngineError
from engine.serve.activation import FLAG, Activation, resolve
from engine.serve.shared.auth import ENV_API_KEY, LOOPBACK, api_key_from

EXIT_CONFIG = 2
EXIT_START = 3


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="model.path, as vllm serve takes it (the same as "
                   "--model)")
    p.add_argument("--config", help="engine config YAML (backend, model, generation, serve, ...)")
    p.add_argument("--backend", help=f"override: backend ({', '.join(SPECS)})")
    p.add_argument("--model", help="override: model.path")
    p.add_argument("--dtype", help="override: model.dtype")
    p.add_argument("--logprobs-mode", help="override: model.logprobs_mode (vLLM's names: raw_logprobs, "
                   "processed_logprobs, raw_logits, processed_logits); reported by /health and /v1/models")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME", help="override: serve.model_name (the first "
                   "name, the one answers report) and serve.model_aliases (the others), as vllm serve takes them; "
                   "requests may name any of them or the model's path")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", help="LoRA adapters loaded at start, as vllm "
                   "serve takes them: adds each to model.adapters")
    p.add_argument("--max-lora-rank", type=int, help="override: model.max_lora_rank (LoRA on, for adapters loaded "
                   "later)")
    p.add_argument("--enable-lora", action="store_true", help="LoRA on with vllm serve's default rank limit (16) "
                   "unless --max-lora-rank or the config says otherwise")
    p.add_argument("--max-loras", type=int, help="override: vllm.max_loras (adapters vLLM computes with in one step)")
    p.add_argument("--allow-adapter-loading", action="store_true", help="serve.adapter_loading: serve "
                   "/v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    p.add_argument("--host", help="override: serve.host (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="override: serve.port (0: any free port)")
    p.add_argument("--namespace", help="override: serve.namespace ('none' for bare responses)")
    p.add_argument(FLAG, dest="repeat_terminate_from", metavar="FILE.yaml:dotted.path",
                   help="take the repeat_terminate subtree from the learner's YAML (see engine.serve.activation)")
    p.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on every route but /health (or set "
                   f"{ENV_API_KEY}; prefer the variable: a flag shows in the process list)")
    p.add_argument("--ready-file", help="write {url, pid, port} here once the port is bound")
    p.add_argument("--check", action="store_true", help="validate the config and exit (nothing loaded)")
    p.add_argument("--log-level", default="info", help="log level of uvicorn and the engine's loggers, the access "
                   "log (engine.serve.access) at info (default: info, as vllm serve)")
    return p


def served_config(args: argparse.Namespace, environ: Any = None) -> tuple[Any, Activation]:
    """The validated ``EngineConfig`` and the guard's activation, from the arguments and the environment."""
    from engine.backends.registry import SPECS
    from engine.config import EngineConfig
    from engine.config.yaml_file import load_yaml
    from engine.plugins import create_plugins

    data: dict[str, Any] = {}
    if args.config:
        data = load_yaml(args.config, field="--config") or {}
        if not isinstance(data, dict):
            raise ConfigError("--config", args.config, "must hold a YAML mapping", fix="start with 'backend:'")
    if args.backend:
        data["backend"] = args.backend
    tag = getattr(args, "model_tag", None)
    if tag and args.model and tag != args.model:
        raise ConfigError("--model", args.model, f"differs from the positional model {tag!r}",
                          fix="give the model once")
    args.model = args.model or tag
    lora = lora_settings(args)
    if args.model or args.dtype or args.logprobs_mode or lora or getattr(args, "enable_lora", False):
        model = data.get("model") or {}
        model = {"path": model} if isinstance(model, str) else section(model, "model")
        if args.model:
            model["path"] = args.model
        if args.dtype:
            model["dtype"] = args.dtype
        if args.logprobs_mode:
            model["logprobs_mode"] = args.logprobs_mode
        adapters = {**(model.get("adapters") or {}), **lora.pop("adapters", {})}
        model.update({**lora, **({"adapters": adapters} if adapters else {})})
        if "max_lora_rank" not in model and getattr(args, "enable_lora", False):
            model["max_lora_rank"] = 16  # vllm serve's default limit
        data["model"] = model
    serve = section(data.get("serve"), "serve")
    for key in ("host", "port"):
        if getattr(args, key) is not None:
            serve[key] = getattr(args, key)
    names = getattr(args, "served_model_name", None)
    if names:
        serve["model_name"], serve["model_aliases"] = names[0], list(names[1:])
    if args.namespace is not None:
        serve["namespace"] = None if args.namespace.lower() == "none" else args.namespace
    if getattr(args, "allow_adapter_loading", False):
        serve["adapter_loading"] = True
    chat = section(serve.get("chat"), "serve.chat")
    serve["chat"] = chat_environment(chat, os.environ if environ is None else environ)
    data["serve"] = serve
    if getattr(args, "max_loras", None) is not None:
        data["vllm"] = {**section(data.get("vllm"), "vllm"), "max_loras": args.max_loras}
    served = SPECS.get(data.get("backend"))  # type: ignore[arg-type]
    if served is not None and served.served_settings:  # vLLM: concurrent requests share continuous batching
        data[served.name] = {**section(data.get(served.name), served.name), **served.served_settings}
    data, activation = resolve(data, from_yaml=args.repeat_terminate_from, environ=environ)
    config = EngineConfig.from_dict(data)
    create_plugins(config.plugins)  # unknown names and bad parameters fail before binding (nothing is loaded)
    return config, activation


def lora_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The model settings of ``--lora-modules`` (``adapters``), ``--max-lora-rank`` and ``--enable-lora``.

    >>> lora_settings(argparse.Namespace(lora_modules=["math=/a/math"], max_lora_rank=None, enable_lora=False))
    {'adapters': {'math': '/a/math'}}
    >>> lora_settings(argparse.Namespace(lora_modules=["math"], max_lora_rank=None, enable_lora=False))
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: --lora-modules must be NAME=PATH, got 'math'. Fix: write each adapter as name=folder.
    """
    out: dict[str, Any] = {}
    for item in getattr(args, "lora_modules", None) or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError("--lora-modules", item, "must be NAME=PATH", fix="write each adapter as name=folder")
        out.setdefault("adapters", {})[name] = path
    if getattr(args, "max_lora_rank", None) is not None:
        out["max_lora_rank"] = args.max_lora_rank
    return out


def section(value: Any, name: str) -> dict[str, Any]:
    """A copy of the config section ``name`` (absent: empty), refused by name when it is not a mapping.

    >>> section(None, "serve"), section({"port": 1}, "serve")
    ({}, {'port': 1})
    >>> section(["port", 1], "serve.chat")
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: serve.chat must be a mapping of settings, got ['port', 1]. Fix: write it as \
'serve.chat:' followed by indented 'key: value' lines.
    """
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(name, value, "must be a mapping of settings",
                          fix=f"write it as '{name}:' followed by indented 'key: value' lines")
    return dict(value)


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
        api_key = api_key_from(args.api_key, os.environ)
    except ConfigError as err:
        return fail(EXIT_CONFIG, "config error", err)
    if api_key is None and config.serve.host not in LOOPBACK:
        print(f"engine.serve: warning: listening on {config.serve.host} without an API key: anyone who reaches the "
              f"port can run generation. Set {ENV_API_KEY} (or --api-key), or serve.host: 127.0.0.1",
              file=sys.stderr, flush=True)
    guard = config.repeat_terminate
    summary = (f"backend={config.backend} model={config.model.path} repeat_terminate: enabled={guard.enabled} "
               f"source={activation.source} hash={guard.fingerprint()[:12]} api_key={'set' if api_key else 'none'}")
    if args.check:
        print(f"engine.serve: config ok: {summary}", flush=True)
        return 0
    import uvicorn

    from engine.engine import GenerationEngine
    from engine.serve.app import create_app
    from engine.serve.service import ServedEngine
    from engine.serve.shared.access import configure_logging

    configure_logging(args.log_level)
    # The port is taken before the model loads (a port in use fails in a second, not after the load), but it
    # listens only once uvicorn starts: until the ready line, connecting is refused.
    sock = socket.socket(socket.AF_INET6 if ":" in config.serve.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.serve.host, config.serve.port))
    except OSError as err:
        sock.close()
        return fail(EXIT_CONFIG, "cannot bind", ConfigError(
            "serve.port", f"{config.serve.host}:{config.serve.port}", f"cannot be bound ({err.strerror})",
            fix="pick a free port (--port), or 0 for any free one"))
    try:
        engine = GenerationEngine(config)
    except EngineError as err:
        sock.close()
        return fail(EXIT_START, "cannot start", err)
    served = ServedEngine(engine, activation, api_key=api_key)
    sock.listen(2048)  # from the ready line on, connections queue until uvicorn accepts them
    port = sock.getsockname()[1]
    url = f"http://{config.serve.host}:{port}"
    print(f"engine.serve: ready on {url} ({summary})", flush=True)
    if args.ready_file:
        tmp = Path(f"{args.ready_file}.tmp")
        tmp.write_text(json.dumps({"url": url, "port": port, "pid": os.getpid()}))
        tmp.replace(args.ready_file)  # readers never see a half-written file
    server = uvicorn.Server(uvicorn_config(create_app(served), config.serve, log_level=args.log_level))
    server.run(sockets=[sock])
    return 0


def uvicorn_config(app: Any, serve: Any, *, log_level: str) -> Any:
    """uvicorn's settings for ``app``: on SIGTERM, in-flight requests get ``serve.drain_timeout_s`` seconds as
    given (0: none; a fraction of a second stays one, it never turns into "wait forever")."""
    import uvicorn

    from engine.serve.shared.connections import guarded_protocol

    # The engine's own access log (engine.serve.access: request ids, durations) replaces uvicorn's.
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=serve.drain_timeout_s, access_log=False,
                          http=guarded_protocol(serve))


def cli() -> None:
    """The ``engine-serve`` console script."""
    sys.exit(main())
