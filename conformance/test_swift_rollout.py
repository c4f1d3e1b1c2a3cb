"""ms-swift's own ``swift rollout`` with the engine's guard (issue 28): rows end where the engine ends them.

Each case starts the real ``swift rollout`` command on the looper fixture, the guard given by the seeds' variables
(``COORDEXP_ENABLE_VLLM_REPEAT_TERMINATE_INJECTION=1`` and ``..._CONFIG_JSON``), once per way in and engine kind:
``--external_plugins`` with swift's synchronous vLLM engine (its default), and the ``sitecustomize`` fallback on
``PYTHONPATH`` with its async engine (``--vllm_use_async_engine true``). Swift's own ``VLLMInferClient`` sends the
rows; every answer must equal, token for token, the engine's own guarded vLLM answer, with the same trigger report.

On a CPU host ``swift rollout`` refuses to start for want of a device; ``conformance/swift_cpu_devices.py`` (a second
plugin, test-only) answers that one check. GPU-only, not run here: swift's NCCL weight sync through the combined
worker extension (its methods are reached here, through ``/get_model_state_keys/``), and Model Runner V2 (the
processor class of that runner is registered instead, by vLLM's own decision; see docs/serving.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from conformance.subjects.plan import engines, processes, uses
from conformance.test_repeat import BUDGET, LOOP_GUARD, MIXED
from engine_fixtures import fixture_path

SUBJECTS = uses(engines("tiny-looper"), processes("swift rollout", why="ms-swift's own rollout server with the plugin"))

pytestmark = pytest.mark.slow
SEEDS_ON = {"COORDEXP_ENABLE_VLLM_REPEAT_TERMINATE_INJECTION": "1",
            "COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON": json.dumps(LOOP_GUARD)}
CPU_DEVICES = Path(__file__).with_name("swift_cpu_devices.py")
START_TIMEOUT = 300.0


def swift_command(port: int, *, plugins: list[str], async_engine: bool) -> list[str]:
    """``swift rollout`` on the looper: its chat template through swift's jinja backend (the tokenizer's, as the
    engine renders it), float32 as the fixture is saved."""
    swift = Path(sys.executable).with_name("swift")
    return [str(swift), "rollout", "--model", str(fixture_path("tiny-looper")), "--model_type", "llama",
            "--template", "chatml", "--template_backend", "jinja", "--vllm_max_model_len", "1024",
            "--vllm_enforce_eager", "true", "--vllm_use_async_engine", str(async_engine).lower(),
            "--host", "127.0.0.1", "--port", str(port), *(["--external_plugins", *plugins] if plugins else [])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def swift_rollout(tmp_path: Path, env: dict[str, str], *, plugins: list[str], async_engine: bool) -> Iterator[str]:
    """A running ``swift rollout`` (its own process group, stopped with everything it started); yields its URL."""
    import httpx

    port = free_port()
    log_path = tmp_path / "swift-rollout.log"
    child_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1", **env}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(swift_command(port, plugins=plugins, async_engine=async_engine), env=child_env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"swift rollout did not serve (exit {process.poll()}):\n"
                                     f"{log_path.read_text(errors='replace')[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        stop_group(process)


def stop_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            process.wait(60)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # swift's workers and vLLM's engine cores, whatever is left
    process.wait()


@pytest.fixture(scope="module")
def guarded_engine(pool):
    from conformance.kit.availability import unavailable_reason

    if "vllm" not in pool.options.backends or unavailable_reason("vllm"):
        pytest.skip(unavailable_reason("vllm") or "swift rollout runs vLLM, which --engine-backends leaves out")
    return pool.engine("vllm", str(fixture_path("tiny-looper")), repeat_terminate=LOOP_GUARD)


WAYS = {
    "external-plugins-sync-engine": ({}, True, False),
    "sitecustomize-async-engine": ({"PYTHONPATH": "<site>"}, False, True),
}


@pytest.mark.parametrize("way", list(WAYS))
def test_swift_rollout_ends_rows_where_the_engine_does(guarded_engine, tmp_path, way):
    import httpx
    from swift.infer_engine import RequestConfig
    from swift.infer_engine.protocol import RolloutInferRequest
    from swift.rlhf_trainers.vllm_client import VLLMInferClient

    from engine.swift_rollout import NAMESPACE, PLUGIN_FILE, SITE_DIR

    extra_env, through_plugin, async_engine = WAYS[way]
    env = dict(SEEDS_ON)
    if "PYTHONPATH" in extra_env:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), os.environ.get("PYTHONPATH")) if p)
    plugins = [str(CPU_DEVICES), *([str(PLUGIN_FILE)] if through_plugin else [])]
    local = guarded_engine.generate(MIXED, options=BUDGET)
    config = RequestConfig(max_tokens=BUDGET["max_new_tokens"], temperature=0, return_details=True)
    with swift_rollout(tmp_path, env, plugins=plugins, async_engine=async_engine) as url:
        outputs = VLLMInferClient(base_urls=[url], connection_timeout=30).infer(
            [RolloutInferRequest(messages=m) for m in MIXED], config)
        wire = httpx.post(f"{url}/infer/", json={"infer_requests": [{"messages": MIXED[1]}],
                                                 "request_config": dataclasses.asdict(config)}, timeout=120).json()
        keys = httpx.get(f"{url}/get_model_state_keys/", timeout=60).json()
    assert len(outputs) == len(local)
    for i, (out, ref) in enumerate(zip(outputs, local, strict=True)):
        choice = out.response.choices[0]
        assert tuple(out.response.prompt_token_ids) == ref.prompt_token_ids, f"row {i}: another prompt rendering"
        assert tuple(choice.token_ids) == ref.token_ids, f"row {i}: swift rollout vs the engine"
        report = out.rollout_infos[NAMESPACE]
        assert report == {k: ref.meta[k] for k in report}, f"row {i}"
        assert set(report) == {"repeat_terminate_triggered", "repeat_terminate_index", "repeat_terminate_reason"}
    assert {r.meta["repeat_terminate_triggered"] for r in local} == {0, 1}, "MIXED must hold looping and clean rows"
    (item,) = wire
    assert set(item) >= {"response", NAMESPACE} and item[NAMESPACE]["repeat_terminate_triggered"] == 1, item
    assert item["response"]["choices"][0]["token_ids"] == list(local[1].token_ids)
    assert "model.norm.weight" in keys["keys"], "swift's worker extension is no longer reached"


@pytest.mark.gate_only(reason=(
    "a second swift rollout started to watch it refuse (19 s on CI); CI keeps swift rollout with the "
    "plugin (test_swift_rollout_ends_rows_where_the_engine_does) and the bad environment refused by "
    "name (tests/test_swift_rollout_plugin.py::test_a_bad_environment_is_refused_naming_the_field)"))
def test_a_bad_subtree_stops_swift_rollout_before_it_serves(guarded_engine, tmp_path):
    """The plugin is imported while swift parses its arguments: a threshold out of range ends the command there,
    with the field, the value and the fix, before any port is bound or model loaded."""
    from engine.swift_rollout import PLUGIN_FILE

    env = {**SEEDS_ON, "COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON": json.dumps({"enabled": True, "ngram_size": 1,
                                                                                 "ngram_repeats": 3})}
    port = free_port()
    log_path = tmp_path / "bad.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(swift_command(port, plugins=[str(CPU_DEVICES), str(PLUGIN_FILE)],
                                                 async_engine=False),
                                   env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        code = process.wait(START_TIMEOUT)
    finally:
        stop_group(process)
    text = log_path.read_text(errors="replace")
    assert code != 0
    assert "repeat_terminate.ngram_size must be in [2, 1024], got 1" in text and "Fix:" in text, text[-3000:]
    assert "Uvicorn running" not in text and "Loading safetensors" not in text


def test_the_envelope_survives_swifts_pipe_and_parser_and_says_0_with_the_guard_off():
    """What the workers send through swift's pipe (pickle) and FastAPI writes (JSON), parsed back by swift's own
    ``RolloutOutput``: the envelope at the top of the wire item and in ``rollout_infos``. With the guard off
    (``..._INJECTION=0``, no rows) every item says 0."""
    import pickle

    from fastapi.encoders import jsonable_encoder
    from swift.infer_engine.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
        RolloutOutput,
        UsageInfo,
    )

    from engine.swift_rollout import NAMESPACE
    from engine.swift_rollout.attach import OFF, envelope_outputs
    from engine.swift_rollout.output import GuardedRolloutOutput

    choice = ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content="hi"),
                                          finish_reason="stop", logprobs=None, token_ids=[5, 2])
    swift_out = RolloutOutput(response=ChatCompletionResponse(model="m", choices=[choice], usage=UsageInfo(3, 2, 5),
                                                              id="7"), rollout_infos={"num_turns": 1})
    (out,) = envelope_outputs(None, [swift_out])
    assert isinstance(out, GuardedRolloutOutput) and out.coordexp == OFF
    wire = jsonable_encoder(pickle.loads(pickle.dumps(out)))
    assert wire[NAMESPACE] == OFF and wire["rollout_infos"] == {"num_turns": 1, NAMESPACE: OFF}
    assert wire["response"]["choices"][0]["token_ids"] == [5, 2]
    parsed = RolloutOutput.model_validate(wire)
    assert parsed.rollout_infos[NAMESPACE] == OFF and parsed.response.choices[0].token_ids == [5, 2]
