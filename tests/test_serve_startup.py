"""Startup of ``python -m engine.serve``: the guard's subtree from config, environment or the learner's YAML,
validated before torch or vLLM is imported; bad input exits non-zero before any heavy import or model load.

No check here times the subprocess: what makes a bad start cheap is what it does not import or load, and that is
asserted directly (``HEAVY=`` empty, no load attempted). A wall-clock bound failed CI once under load (14.2 s beside
the quick tier) while the start itself was right."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from engine.errors import ConfigError
from engine.serve.activation import ENV_FILE, ENV_JSON, SEED_ENABLE, SEED_FILE, SEED_JSON, resolve

BASE = {"backend": "hf", "model": {"path": "/models/none", "dtype": "float32"}}
GUARD = {"enabled": True, "ngram_size": 3, "ngram_repeats": 3}
PROBE = ("import sys; from engine.serve.launch import main; code = main(sys.argv[1:]); "
         "heavy = sorted(m for m in ('torch', 'vllm', 'transformers', 'fastapi', 'uvicorn') if m in sys.modules); "
         "print('HEAVY=' + ','.join(heavy)); sys.exit(code)")


def serve(tmp_path, config: dict, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    path = tmp_path / "served.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    clean = {k: v for k, v in os.environ.items() if k not in (ENV_JSON, ENV_FILE, SEED_ENABLE, SEED_JSON, SEED_FILE)}
    proc = subprocess.run([sys.executable, "-c", PROBE, "--config", str(path), *args], capture_output=True,
                          text=True, env={**clean, **(env or {})}, timeout=60)
    return proc


@pytest.mark.parametrize(("subtree", "message"), [
    ({"enabled": True}, "repeat_terminate.enabled has no threshold set"),
    ({"enabled": True, "ngram_size": 3}, "repeat_terminate.ngram_repeats must be set together"),
    ({"enabled": "yes", "max_consecutive_token_repeats": 4}, "repeat_terminate.enabled must be true or false"),
    ({"enabled": True, "max_consecutive_token_repeat": 4}, "did you mean 'max_consecutive_token_repeats'"),
])
@pytest.mark.parametrize("source", ["config", "env-json", "env-file", "learner-yaml"])
def test_bad_subtree_exits_2_before_heavy_imports(tmp_path, subtree, message, source):
    config, args, env = dict(BASE), [], {}
    if source == "config":
        config["repeat_terminate"] = subtree
    elif source == "env-json":
        env[ENV_JSON] = json.dumps(subtree)
    elif source == "env-file":
        (tmp_path / "rt.json").write_text(json.dumps(subtree))
        env[ENV_FILE] = str(tmp_path / "rt.json")
    else:
        (tmp_path / "train.yaml").write_text(json.dumps({"custom": {"extra": {"rollout": {"rt": subtree}}}}))
        args = ["--repeat-terminate-from", f"{tmp_path / 'train.yaml'}:custom.extra.rollout.rt"]
    proc = serve(tmp_path, config, *args, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "engine.serve: config error:" in proc.stderr and message in proc.stderr
    assert "HEAVY=\n" in proc.stdout, f"imported before validating: {proc.stdout}"


def test_check_reports_the_source_and_hash_without_loading(tmp_path):
    from engine.config import RepeatTerminateConfig

    (tmp_path / "train.yaml").write_text("custom:\n  extra:\n    rt: {enabled: true, ngram_size: 3, ngram_repeats: 3}")
    spec = f"{tmp_path / 'train.yaml'}:custom.extra.rt"
    proc = serve(tmp_path, BASE, "--check", "--repeat-terminate-from", spec)
    assert proc.returncode == 0, proc.stderr
    assert "source=--repeat-terminate-from" in proc.stdout
    assert RepeatTerminateConfig(**GUARD).fingerprint()[:12] in proc.stdout


def test_missing_dotted_path_names_the_key_and_what_is_there(tmp_path):
    (tmp_path / "train.yaml").write_text("custom:\n  extra: {rollout_matching: {}}\n")
    proc = serve(tmp_path, BASE, "--check", "--repeat-terminate-from",
                    f"{tmp_path / 'train.yaml'}:custom.extra.rollout.repeat_terminate")
    assert proc.returncode == 2
    assert "has no key 'rollout' under custom.extra" in proc.stderr and "rollout_matching" in proc.stderr


def test_precedence_flag_then_env_json_then_env_file_then_config(tmp_path):
    (tmp_path / "train.yaml").write_text(json.dumps({"rt": {"enabled": False}}))
    (tmp_path / "rt.json").write_text(json.dumps({"enabled": True, "max_consecutive_token_repeats": 5}))
    config = {**BASE, "repeat_terminate": GUARD}
    assert resolve(config, environ={})[1].source == "served config"
    file_env = {ENV_FILE: str(tmp_path / "rt.json")}
    assert resolve(config, environ=file_env)[0]["repeat_terminate"]["max_consecutive_token_repeats"] == 5
    assert resolve(config, environ={ENV_JSON: '{"enabled": false}'})[0]["repeat_terminate"] == {"enabled": False}
    got, act = resolve(config, from_yaml=f"{tmp_path / 'train.yaml'}:rt", environ={})
    assert got["repeat_terminate"] == {"enabled": False} and act.source.startswith("--repeat-terminate-from")


@pytest.mark.parametrize(("environ", "flag", "message"), [
    ({ENV_JSON: "{}", ENV_FILE: "/x.json"}, None, "are alternatives"),
    ({ENV_JSON: "{}"}, "t.yaml:a", "conflicts with ENGINE_REPEAT_TERMINATE_JSON"),
    ({ENV_JSON: "{enabled: true"}, None, "is not valid JSON"),
    ({ENV_FILE: "/nonexistent/rt.json"}, None, "cannot be read"),
    ({}, "no-colon", "must be FILE.yaml:dotted.path"),
])
def test_ambiguous_or_unreadable_sources_are_errors(environ, flag, message):
    with pytest.raises(ConfigError, match=message):
        resolve(BASE, from_yaml=flag, environ=environ)


def test_the_seeds_variables_are_aliases_of_ours(tmp_path):
    """The seed documents' server-side variables give the same subtree ours do, named as the source."""
    (tmp_path / "rt.json").write_text(json.dumps(GUARD))
    ours = resolve(BASE, environ={ENV_JSON: json.dumps(GUARD)})[0]
    by_json, act = resolve(BASE, environ={SEED_ENABLE: "1", SEED_JSON: json.dumps(GUARD)})
    assert by_json == ours and act.source == f"env:{SEED_JSON}"
    by_file, act = resolve(BASE, environ={SEED_ENABLE: "1", SEED_FILE: str(tmp_path / "rt.json")})
    assert by_file == ours and act.source == f"env:{SEED_FILE}={tmp_path / 'rt.json'}"
    off, act = resolve({**BASE, "repeat_terminate": GUARD}, environ={SEED_ENABLE: "0"})
    assert off["repeat_terminate"] == {"enabled": False} and act.source == f"env:{SEED_ENABLE}=0"


@pytest.mark.parametrize(("environ", "flag", "message"), [
    ({SEED_ENABLE: "1", SEED_JSON: "{}", ENV_FILE: "/x.json"}, None, "two ways to give one subtree"),
    ({SEED_ENABLE: "1"}, None, "neither COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON nor"),
    ({SEED_ENABLE: "0", SEED_JSON: "{}"}, None, "turns the guard off, but"),
    ({SEED_ENABLE: "yes", SEED_JSON: "{}"}, None, "must be 1 .use the subtree. or 0"),
    ({SEED_JSON: "{}"}, None, "must be 1 .use the subtree. or 0"),
    ({SEED_ENABLE: "1", SEED_JSON: "{}", SEED_FILE: "/x.json"}, None, "are alternatives"),
    ({SEED_ENABLE: "1", SEED_JSON: "{}"}, "t.yaml:a", "conflicts with COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON"),
])
def test_the_seeds_variables_refuse_what_is_ambiguous(environ, flag, message):
    with pytest.raises(ConfigError, match=message):
        resolve(BASE, from_yaml=flag, environ=environ)


def test_the_launcher_takes_the_seeds_variables(tmp_path):
    proc = serve(tmp_path, BASE, "--check", env={SEED_ENABLE: "1", SEED_JSON: json.dumps(GUARD)})
    assert proc.returncode == 0, proc.stderr
    assert f"source=env:{SEED_JSON}" in proc.stdout and "enabled=True" in proc.stdout
    proc = serve(tmp_path, BASE, "--check", env={SEED_ENABLE: "1", SEED_JSON: "{}", ENV_JSON: "{}"})
    assert proc.returncode == 2 and "two ways to give one subtree" in proc.stderr


def test_namespace_must_not_shadow_the_response(tmp_path):
    proc = serve(tmp_path, {**BASE, "serve": {"namespace": "response"}}, "--check")
    assert proc.returncode == 2 and "serve.namespace must not be 'response'" in proc.stderr


@pytest.mark.parametrize(("text", "message"), [
    ("backend: hf\nmodel: /models/none\nserve:\n  host: 127.0.0.1\n  port: 0\n  host: 0.0.0.0\n",
     "--config line 6 has the key 'host' twice in one mapping (first on line 4"),
    ("backend: hf\nmodel: /models/none\nserve: [port, 8000]\n", "serve must be a mapping of settings"),
    ("backend: hf\nmodel: /models/none\nserve: {chat: 5}\n", "serve.chat must be a mapping of settings"),
    ("backend: hf\nmodel: /models/none\nserve: {port: 80\n", "is not valid YAML"),
], ids=["duplicate-key", "serve-list", "chat-number", "broken-yaml"])
def test_launch_faults_in_the_config_file_exit_2_with_a_message(tmp_path, text, message):
    """Each used to exit 1 with a traceback, or (a second ``host:``) to bind whatever the last one said."""
    path = tmp_path / "served.yaml"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-c", PROBE, "--config", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "engine.serve: config error:" in proc.stderr and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "HEAVY=\n" in proc.stdout


def test_a_port_in_use_exits_2_before_the_model_loads(tmp_path):
    """The port is taken before the model: the missing model (exit 3 after a load attempt) is never reached."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = serve(tmp_path, BASE, "--port", str(port))
    assert proc.returncode == 2, proc.stderr
    assert f"serve.port cannot be bound (Address already in use), got '127.0.0.1:{port}'" in proc.stderr
    assert "cannot start" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("seconds", [0, 0.5, 30])
def test_the_drain_timeout_reaches_uvicorn_as_given(seconds):
    """``drain_timeout_s: 0.5`` used to become ``int(0.5) or None``: wait forever on SIGTERM."""
    from engine.config import ServeConfig
    from engine.serve.launch import uvicorn_config

    assert uvicorn_config(object(), ServeConfig(drain_timeout_s=seconds), log_level="warning"
                          ).timeout_graceful_shutdown == seconds


def test_a_positional_model_and_several_served_names_as_vllm_serve_takes_them():
    """``python -m engine.serve MODEL --served-model-name A B``: the model's path, A reported, B accepted too; a
    positional model and a different --model are refused by name."""
    from engine.serve.launch import parser, served_config

    config, _ = served_config(parser().parse_args(["/models/m", "--backend", "hf", "--served-model-name", "a", "b"]),
                              environ={})
    assert (config.model.path, config.serve.model_name, config.serve.model_aliases) == ("/models/m", "a", ("b",))
    with pytest.raises(ConfigError, match="differs from the positional model"):
        served_config(parser().parse_args(["/models/m", "--model", "/models/n", "--backend", "hf"]), environ={})


def test_a_stopped_server_leaves_no_files_and_keeps_its_log(tmp_path):
    """``ServerProcess.stop()`` removes the server's folder (config, ready file, log, vLLM's IPC sockets) and keeps
    the log's text for ``log()``: the gate left one folder per server start in the temp folder before."""
    from engine.client import ServerProcess

    work = tmp_path / "engine-serve-x"
    work.mkdir()
    (work / "socket-like").write_text("")
    log_path = work / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-c", "import time; print('serving', flush=True); time.sleep(60)"],
                                   stdout=log, stderr=subprocess.STDOUT)
    server = ServerProcess(process, "http://127.0.0.1:1", log_path, work)
    deadline = time.monotonic() + 30
    while "serving" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stop(timeout=10) != 0 and not work.exists()
    assert server.log() == "serving\n" and server.stop() == process.returncode  # a second stop: nothing left to do


def test_a_server_that_exits_before_serving_leaves_no_folder(tmp_path, monkeypatch):
    """``launch_server`` of a config the server refuses at once: the error carries the server's message, and its
    folder (with vLLM's socket path pointed into it) is gone."""
    import tempfile

    from engine.client import launch_server
    from engine.serve.rollout.client import RolloutServerError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for name in (ENV_JSON, ENV_FILE, SEED_ENABLE, SEED_JSON, SEED_FILE):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RolloutServerError, match=r"repeat_terminate[.]enabled has no threshold set"):
        launch_server({**BASE, "repeat_terminate": {"enabled": True}}, timeout=60)
    assert not list(tmp_path.glob("engine-serve-*"))
