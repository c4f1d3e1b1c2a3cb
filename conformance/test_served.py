"""The served engine (``python -m engine.serve``) on both backends, driven by clients nobody here wrote (ms-swift's
rollout client, curl) and by ours: the envelope, activation checks, bad input, load, disconnects, kills, drain.

Servers bind 127.0.0.1 only; every request loop is bounded in count and time.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conformance.compare import assert_served_equal
from conformance.subjects.looper import LOOPER_SERVE
from conformance.subjects.looper import NAME as LOOPER
from conformance.subjects.plan import engines, kept, processes, uses
from conformance.subjects.served import scrape
from conformance.test_repeat import BUDGET, LOOP_GUARD, MIXED
from engine.config import RepeatTerminateConfig
from engine_fixtures import fixture_path

SUBJECTS = uses(
    engines("tiny-looper"),
    kept(LOOPER, why="the looper's server per backend, its guard from the environment; test_weight_sync.py's too",
         via="looper_servers"),
    processes("engine.serve server", why="those servers, and HF's of its own with an API key (SIGTERM drains it)"),
)

pytestmark = [pytest.mark.slow, pytest.mark.runner_dependent]
NS = LOOPER_SERVE["namespace"]
GREEDY = {"max_tokens": BUDGET["max_new_tokens"], "temperature": 0, "return_details": True}


@pytest.fixture(scope="session")
def looper_path() -> str:
    return str(fixture_path("tiny-looper"))


@pytest.fixture(scope="session")
def served_config(pool, looper_path):
    def make(backend: str) -> dict:
        return {**pool.config(backend, looper_path), "serve": {"port": 0, "namespace": NS}}
    return make


@pytest.fixture
def server(looper_servers, backend):
    """The looper's server of this backend (``conformance/subjects/looper.py``), its guard ``LOOP_GUARD`` activated
    from the environment at startup."""
    from conformance.kit.availability import unavailable_reason

    if unavailable_reason(backend):
        pytest.skip(unavailable_reason(backend))
    return looper_servers.checkout(backend)


KEY = "conformance-key-7"


@pytest.fixture(scope="module")
def keyed_hf_server(served_config):
    """HF's looper server started with an API key (``launch_server(api_key=...)`` sets ``ENGINE_API_KEY``), a callable
    that gives it running: the key check asks it, then the graceful-shutdown check drains it with SIGTERM and kills
    the next one (destructive, so they run after the key check; one found dead is started again). One HF start fewer
    than a server per check."""
    from engine.client import launch_server

    started = []

    def running():
        if not started or started[-1].process.poll() is not None:
            started.append(launch_server(served_config("hf"), repeat_terminate=LOOP_GUARD, api_key=KEY))
        return started[-1]

    yield running
    for handle in started:
        handle.stop()


@pytest.fixture(scope="session")
def reference(pool, backend, looper_path):
    """The in-process engine with the same config: what every served answer must equal."""
    return pool.engine(backend, looper_path, repeat_terminate=LOOP_GUARD)


def post(url: str, body, timeout: float = 120.0):
    import httpx

    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{url}/infer/", content=content, headers={"content-type": "application/json"},
                      timeout=timeout)


def generated_sequences(url: str) -> int:
    return int(scrape(url, "engine_sequences_total"))


def test_health_reports_the_startup_activation(server, backend):
    import httpx

    health = httpx.get(f"{server.url}/health", timeout=10).json()
    expected = RepeatTerminateConfig(**LOOP_GUARD)
    assert health["status"] == "ok" and health["backend"] == backend
    assert health["repeat_terminate_active"] == 1
    assert health["repeat_terminate"] == expected.as_dict()
    assert health["repeat_terminate_hash"] == expected.fingerprint()
    assert health["repeat_terminate_source"] == "env:ENGINE_REPEAT_TERMINATE_JSON"
    if backend == "vllm":
        assert health["runner"] in ("v1", "v2") and health["engine_core"] == "child process"
    assert httpx.get(f"{server.url}/get_world_size/", timeout=10).json() == {"world_size": 1}
    assert httpx.post(f"{server.url}/get_engine_type/", timeout=10).json()["engine_type"] == "AsyncLLMEngine"


def test_swift_client_drives_infer_and_parses_every_item(server, reference):
    """ms-swift's own VLLMInferClient: its health check, its /infer/ body (every RequestConfig field), its parser."""
    from swift.infer_engine import RequestConfig
    from swift.infer_engine.protocol import RolloutInferRequest, RolloutOutput
    from swift.rlhf_trainers.vllm_client import VLLMInferClient

    client = VLLMInferClient(base_urls=[server.url], connection_timeout=30)
    outputs = client.infer([RolloutInferRequest(messages=m) for m in MIXED],
                           RequestConfig(max_tokens=BUDGET["max_new_tokens"], temperature=0, return_details=True))
    local = reference.generate(MIXED, options=BUDGET)
    assert len(outputs) == len(local)
    for i, (out, ref) in enumerate(zip(outputs, local, strict=True)):
        assert isinstance(out, RolloutOutput), f"item {i} parsed as {type(out).__name__}, not swift's RolloutOutput"
        choice = out.response.choices[0]
        assert choice.message.content == ref.text and tuple(choice.token_ids) == ref.token_ids, f"item {i}"
        assert choice.finish_reason == ref.finish_reason
        assert tuple(out.response.prompt_token_ids) == ref.prompt_token_ids
        assert out.response.usage.completion_tokens == len(ref.token_ids)
    assert {r.meta["repeat_terminate_triggered"] for r in local} == {0, 1}, "MIXED must hold looping and clean rows"


def test_envelope_flags_equal_the_in_process_meta(server, reference):
    from engine.serve.rollout.infer import result_from_item
    from engine.serve.shared.writers import shown_logprob

    body = {"infer_requests": [{"messages": m} for m in MIXED], "request_config": {**GREEDY, "logprobs": True,
                                                                                   "top_logprobs": 2}}
    r = post(server.url, body)
    assert r.status_code == 200, r.text
    items = r.json()
    served = [result_from_item(item, NS) for item in items]
    local = reference.generate(MIXED, options={**BUDGET, "logprobs": 2})
    assert_served_equal(served, local, what="served vs in-process")
    for item, ref in zip(items, local, strict=True):
        assert set(item) == {"response", NS}
        assert item[NS]["repeat_terminate_triggered"] == ref.meta["repeat_terminate_triggered"]
        content = item["response"]["choices"][0]["logprobs"]["content"]
        chosen = [shown_logprob(ref.logprobs[k][t]) for k, t in enumerate(ref.token_ids)]
        # Within float32 rounding, as test_chat's logprob check: vLLM's CPU kernels gave a 1-ulp difference once (CI at
        # a5c587f, token 30 of a row, -7.54736328125 vs -7.547363758087158) on otherwise equal answers.
        assert [c["logprob"] for c in content] == pytest.approx(chosen, abs=1e-5)
        assert all(len(c["top_logprobs"]) == 2 for c in content)


def test_metrics_count_the_answers_labelled_by_the_model(server, backend, reference, looper_path):
    """``/metrics`` read with ``prometheus_client``'s parser: every series of ours names the served model, the token
    and trigger counters grow by what the rows answered (the guard's own flags), and on vLLM its own metrics follow
    under the same model name, counting the same generated tokens."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    name = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    assert name.startswith(Path(looper_path).name)  # the folder's name (llama.cpp serves the GGUF twin's folder)
    counters = ("engine_generation_tokens_total", "engine_repeat_terminate_triggered_total",
                "vllm:generation_tokens_total")
    before = {c: scrape(server.url, c) for c in counters}
    r = post(server.url, {"infer_requests": [{"messages": m} for m in MIXED], "request_config": GREEDY})
    assert r.status_code == 200, r.text
    local = reference.generate(MIXED, options=BUDGET)
    generated = sum(len(x.token_ids) for x in local)
    deadline = time.monotonic() + 10  # vLLM records its stats as its output loop runs: allow it a moment
    while True:
        grown = {c: scrape(server.url, c) - before[c] for c in counters}
        if backend != "vllm" or grown["vllm:generation_tokens_total"] >= generated or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert grown["engine_generation_tokens_total"] == generated
    assert grown["engine_repeat_terminate_triggered_total"] == sum(x.meta["repeat_terminate_triggered"] for x in local)
    families = list(text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text))
    ours = [s for f in families if f.name.startswith("engine_") for s in f.samples]
    theirs = [s for f in families if f.name.startswith("vllm:") for s in f.samples]
    assert ours and {s.labels["model_name"] for s in ours} == {name}
    if backend == "vllm":
        assert grown["vllm:generation_tokens_total"] == generated
        assert {s.labels["model_name"] for s in theirs if "model_name" in s.labels} == {name}
    else:
        assert theirs == []


def test_curl_sees_the_raw_wire_format(server):
    curl = shutil.which("curl")
    if curl is None:
        pytest.fail("curl is not installed; the wire-format check needs it (apt-get install curl)")
    body = json.dumps({"infer_requests": [{"messages": MIXED[0]}], "request_config": {"max_tokens": 8,
                                                                                     "temperature": 0}})
    out = subprocess.run([curl, "-sS", "--max-time", "60", "-X", "POST", f"{server.url}/infer/", "-H",
                          "Content-Type: application/json", "-d", body], capture_output=True, text=True, check=True)
    [item] = json.loads(out.stdout)
    response = item["response"]
    assert set(response) == {"model", "choices", "usage", "id", "object", "created", "prompt_token_ids",
                             "prompt_logprobs", "images_size"}
    assert response["object"] == "chat.completion" and response["id"].startswith("chatcmpl-")
    assert response["prompt_token_ids"] is None and response["choices"][0]["token_ids"] is None  # no details
    assert item[NS]["repeat_terminate_triggered"] in (0, 1)
    bad = subprocess.run([curl, "-sS", "--max-time", "30", "-w", "\n%{http_code}", "-X", "POST",
                          f"{server.url}/infer/", "-H", "Content-Type: application/json", "-d", "{oops"],
                         capture_output=True, text=True, check=True)
    text, code = bad.stdout.rsplit("\n", 1)
    assert code == "400" and json.loads(text)["error"]["param"] == "body"


def test_an_api_key_guards_every_route_but_health(pool, keyed_hf_server, looper_path):
    """A server started with a key (``launch_server(api_key=...)`` sets ``ENGINE_API_KEY``): our client and the
    official openai client get answers with it and a 401 without or with another; curl sees the probe open but no
    path in it. The key is the HTTP layer's, so one backend (HF, the quickest to start) carries the check."""
    import httpx
    import openai

    from engine.client import RolloutClient, RolloutServerError

    key, handle = KEY, keyed_hf_server()
    with RolloutClient(handle.url, repeat_terminate=LOOP_GUARD, api_key=key, health_timeout=30) as client:
        [got] = client.infer([MIXED[0]], GREEDY)
    reference = pool.reference("hf", looper_path, repeat_terminate=LOOP_GUARD)
    expected = reference.generate([MIXED[0]], options={"max_new_tokens": GREEDY["max_tokens"], "temperature": 0})
    assert got.token_ids == expected[0].token_ids
    with RolloutClient(handle.url, repeat_terminate=LOOP_GUARD, api_key="wrong", health_timeout=30) as client, \
            pytest.raises(RolloutServerError, match="401"):
        client.infer([MIXED[0]], GREEDY)
    model = httpx.get(f"{handle.url}/health", timeout=10).json()["model"]
    chat = {"model": model, "messages": MIXED[0], "max_tokens": 8, "temperature": 0}
    answer = openai.OpenAI(base_url=f"{handle.url}/v1", api_key=key).chat.completions.create(**chat)
    assert answer.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{handle.url}/v1", api_key="wrong", max_retries=0).chat.completions.create(**chat)
    curl = shutil.which("curl")
    if curl is None:
        pytest.fail("curl is not installed; the check needs it (apt-get install curl)")
    probe = subprocess.run([curl, "-sS", "--max-time", "10", f"{handle.url}/health"], capture_output=True,
                           text=True, check=True)
    assert json.loads(probe.stdout)["status"] == "ok" and "model_path" not in probe.stdout
    assert str(fixture_path("tiny-looper")) not in probe.stdout
    metrics = subprocess.run([curl, "-sS", "--max-time", "10", "-o", "/dev/null", "-w", "%{http_code}",
                              f"{handle.url}/metrics"], capture_output=True, text=True, check=True)
    assert metrics.stdout == "401"
    keyed = subprocess.run([curl, "-sS", "--max-time", "10", "-H", f"Authorization: Bearer {key}",
                            f"{handle.url}/health"], capture_output=True, text=True, check=True)
    assert json.loads(keyed.stdout)["model_path"] == str(fixture_path("tiny-looper"))


def test_envelope_is_additive(pool, looper_path):
    """The wrapped item's ``response`` equals what the same app returns with no envelope (namespace null)."""
    import asyncio

    import httpx

    from engine.config import ServeConfig
    from engine.serve.activation import Activation
    from engine.serve.app import create_app
    from engine.serve.service import ServedEngine

    local = pool.engine("hf", looper_path, repeat_terminate=LOOP_GUARD)
    body = {"infer_requests": [{"messages": m} for m in MIXED], "request_config": {**GREEDY, "logprobs": True}}

    async def ask(namespace):
        app = create_app(ServedEngine(local, Activation(LOOP_GUARD, "test"), ServeConfig(namespace=namespace)),
                         close_engine=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.post("/infer/", json=body, timeout=120)).json()

    wrapped, bare = asyncio.run(ask(NS)), asyncio.run(ask(None))
    strip = lambda d: {k: v for k, v in d.items() if k not in ("id", "created")}  # noqa: E731
    assert [strip(w["response"]) for w in wrapped] == [strip(b) for b in bare]
    assert all(set(b) == set(w["response"]) for w, b in zip(wrapped, bare, strict=True))


BAD_BODIES = [
    (b"{not json", "body"),
    ({"infer_requests": [{"messages": MIXED[0]}], "request_config": {"n": 2}}, "request_config.n"),
    ({"infer_requests": [{"messages": MIXED[0]}], "request_config": {"beam_width": 2}}, "request_config.beam_width"),
    ({"infer_requests": [{"messages": MIXED[0]}], "request_config": {"num_beams": 4}}, "request_config.num_beams"),
    ({"infer_requests": [{"messages": MIXED[0]}], "request_config": {"stream": True}}, "request_config.stream"),
    ({"infer_requests": [{"messages": MIXED[0]}], "request_config": {"top_p": 1.5, "temperature": 1}},
     "request_config.top_p"),
    ({"infer_requests": [{"messages": MIXED[0], "images": ["x.png"]}]}, "infer_requests[0].images"),
    ({"infer_requests": [{"messages": []}]}, "infer_requests[0].messages"),
    ({"infer_requests": [{"messages": MIXED[0]}, {"messages": [{"role": "robot", "content": "x"}]}]},
     "infer_requests[1].messages[0].role"),
    ({"infer_requests": [{"messages": MIXED[0]}], "extra": 1}, "extra"),
    ({"infer_requests": [{"messages": MIXED[0]}], "engine": {"options": {"min_new_tokens": -1}}},
     "engine.options.min_new_tokens"),
    ({"infer_requests": [{"messages": MIXED[0]}], "engine": {"plugins": [{"name": "nope"}]}}, "engine.plugins[0].name"),
    ({"infer_requests": [{"messages": MIXED[0]}],
      "engine": {"repeat_terminate": {"ngram_size": 1, "ngram_repeats": 2}}}, "engine.repeat_terminate.ngram_size"),
    ({"infer_requests": [{"messages": MIXED[0]}], "engine": {"repeat_terminate": {"ngram_sise": 3}}},
     "engine.repeat_terminate.ngram_sise"),
]


def test_bad_requests_are_refused_naming_the_field_and_generate_nothing(server):
    before = generated_sequences(server.url)
    long_prompt = [{"role": "user", "content": "word " * 2100}]  # beyond the looper's 2048-token context
    cases = [*BAD_BODIES, ({"infer_requests": [{"messages": long_prompt}]}, "infer_requests[0].messages")]
    for body, field in cases:
        r = post(server.url, body)
        assert r.status_code == 400, (field, r.status_code, r.text)
        error = r.json()["error"]
        assert error["param"] == field and field in error["message"], (field, error)
        assert "Fix:" in error["message"] or "did you mean" in error["message"], error
    assert generated_sequences(server.url) == before, "a refused request generated something"
    good = post(server.url, {"infer_requests": [{"messages": MIXED[0]}], "request_config": GREEDY})
    assert good.status_code == 200  # refusals did not poison the server


def test_a_request_lays_its_own_guard_over_the_servers(server, pool, backend, looper_path, reference):
    """``engine.repeat_terminate`` sets one request's guard over the server's start-up one, field by field (the vLLM
    plugin's rule): ``enabled: false`` gives the unguarded engine's rows, a stricter threshold the rows of an engine
    configured with it; the next request without the field gets the server's guard again."""
    from engine.client import RolloutClient

    free = pool.reference(backend, looper_path).generate(MIXED, options=BUDGET)
    stricter = {**LOOP_GUARD, "min_new_tokens": 12}
    gated = pool.reference(backend, looper_path, repeat_terminate=stricter).generate(MIXED, options=BUDGET)
    assert [r.token_ids for r in gated] != [r.token_ids for r in free], "the stricter guard must fire on MIXED"
    with RolloutClient(server.url, repeat_terminate=LOOP_GUARD, namespace=NS, health_timeout=30) as client:
        off = client.infer(MIXED, engine={"options": BUDGET, "repeat_terminate": {"enabled": False}})
        later = client.infer(MIXED, engine={"options": BUDGET, "repeat_terminate": {"min_new_tokens": 12}})
        again = client.infer(MIXED, engine={"options": BUDGET})
    assert_served_equal(off, free, what=f"{backend}: enabled false over the server's guard vs unguarded")
    assert_served_equal(later, gated, what=f"{backend}: min_new_tokens 12 over the server's guard vs configured")
    assert_served_equal(again, reference.generate(MIXED, options=BUDGET), what=f"{backend}: the server's guard")


def test_client_refuses_a_server_whose_guard_differs(server):
    from engine.client import RolloutClient, RolloutServerError

    other = {**LOOP_GUARD, "ngram_repeats": 5}
    with RolloutClient(server.url, repeat_terminate=other, health_timeout=10) as client, \
            pytest.raises(RolloutServerError, match=r"differs from the server's") as info:
        client.wait_ready()
    assert RepeatTerminateConfig(**other).fingerprint()[:12] in str(info.value)
    assert RepeatTerminateConfig(**LOOP_GUARD).fingerprint()[:12] in str(info.value)
    with RolloutClient(server.url, repeat_terminate=LOOP_GUARD, namespace="other", health_timeout=10) as client, \
            pytest.raises(RolloutServerError, match="namespace"):
        client.wait_ready()


def test_64_concurrent_clients_get_their_own_answers(server, reference):
    """64 clients x 10 requests: nothing lost, nothing cross-wired (each answer equals its own prompt's)."""
    from engine.client import RolloutClient

    prompts = MIXED
    local = reference.generate(prompts, options=BUDGET)
    results: dict[tuple[int, int], object] = {}

    def client_loop(c: int) -> None:
        with RolloutClient(server.url, repeat_terminate=LOOP_GUARD, timeout=300, health_timeout=30) as client:
            for k in range(10):
                i = (c + k) % len(prompts)
                [results[(c, k)]] = client.infer([prompts[i]], {"max_tokens": BUDGET["max_new_tokens"],
                                                                "temperature": 0})

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=64) as pool_:
        list(pool_.map(client_loop, range(64)))
    elapsed = time.perf_counter() - start
    assert len(results) == 640, f"lost {640 - len(results)} answers"
    for (c, k), got in results.items():
        ref = local[(c + k) % len(prompts)]
        assert got.token_ids == ref.token_ids and got.text == ref.text, f"client {c} request {k} got another answer"
        assert got.meta["repeat_terminate_triggered"] == ref.meta["repeat_terminate_triggered"]
    print(f"640 requests from 64 clients in {elapsed:.1f}s ({640 / elapsed:.1f} req/s)")


def test_concurrent_seeded_calls_each_get_their_in_process_samples(server, reference):
    """Seeded sampling calls sent at once (HF's batcher merges them, each row keeping its own seed) each get exactly
    what the same call gives in-process, row by row."""
    from engine.client import RolloutClient

    calls = [([MIXED[i % len(MIXED)], MIXED[(i + 3) % len(MIXED)]], 100 + i) for i in range(6)]
    sampled = {"max_new_tokens": BUDGET["max_new_tokens"], "temperature": 1.0}
    want = [reference.generate(rows, options={**sampled, "seed": seed}) for rows, seed in calls]

    def one(call):
        rows, seed = call
        with RolloutClient(server.url, repeat_terminate=LOOP_GUARD, timeout=300, health_timeout=30) as client:
            return client.infer(rows, {"max_tokens": sampled["max_new_tokens"], "temperature": 1.0, "seed": seed})

    with ThreadPoolExecutor(max_workers=len(calls)) as pool_:
        got = list(pool_.map(one, calls))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert [r.token_ids for r in g] == [r.token_ids for r in w], f"call {i} (seed {calls[i][1]})"


def test_client_disconnect_cancels_only_its_request(server):

    # min_new_tokens holds EOS and the guard back: the rows surely still run when the client goes away.
    body = json.dumps({"infer_requests": [{"messages": MIXED[0]}] * 8, "request_config": {"max_tokens": 600},
                       "engine": {"options": {"min_new_tokens": 599}}}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /infer/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.5)
    deadline = time.monotonic() + 30
    while scrape(server.url, "engine_requests_cancelled_total") < 1:
        assert time.monotonic() < deadline, "the server never noticed the disconnect"
        time.sleep(0.25)
    r = post(server.url, {"infer_requests": [{"messages": MIXED[0]}], "request_config": GREEDY})
    assert r.status_code == 200


def test_graceful_shutdown_drains_then_a_killed_server_fails_the_client_fast(keyed_hf_server):
    """SIGTERM: the in-flight request still gets its answer. SIGKILL mid-batch: the client raises within 5 s."""
    from engine.client import RolloutClient, RolloutServerError

    slow = {"max_tokens": 400, "temperature": 0}
    held = {"options": {"min_new_tokens": 399}}  # rows surely still run at the signal
    handle = keyed_hf_server()
    with RolloutClient(handle.url, repeat_terminate=LOOP_GUARD, api_key=KEY, timeout=120, health_timeout=30) as client:
        box: dict[str, object] = {}
        t = threading.Thread(target=lambda: box.update(r=client.infer([MIXED[0]] * 4, slow, engine=held)))
        t.start()
        time.sleep(1.0)
        handle.process.send_signal(signal.SIGTERM)
        t.join(120)
        assert handle.process.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    assert len(box.get("r", [])) == 4, "SIGTERM dropped an in-flight request instead of draining it"

    handle = keyed_hf_server()  # the drained one exited: another
    with RolloutClient(handle.url, repeat_terminate=LOOP_GUARD, api_key=KEY, timeout=120, health_timeout=30) as client:
        box = {}

        def run() -> None:
            try:
                client.infer([MIXED[0]] * 8, slow, engine=held)
            except RolloutServerError as err:
                box["error"], box["at"] = err, time.monotonic()

        t = threading.Thread(target=run)
        t.start()
        time.sleep(1.0)
        killed = time.monotonic()
        handle.process.kill()
        t.join(30)
        assert "error" in box, "the client did not raise after the server was killed"
        assert box["at"] - killed < 5, f"the client raised {box['at'] - killed:.1f}s after the kill"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.gate_only(reason=(
    "a server process started to watch it refuse (12 s on CI); CI keeps the same refusal in-process, "
    "before vLLM starts (test_repeat.py::test_refuses_to_start_when_the_guard_cannot_be_activated), and "
    "the served start-up activation (test_served.py::test_health_reports_the_startup_activation)"))
def test_guard_that_cannot_run_exits_before_binding(pool, served_config, tmp_path):
    """vLLM without its runner's logits-processor interface: exit 3 with the reason; the port never listens (it is
    bound before the model loads, so that a port in use fails first, but nothing is accepted there)."""
    from conformance.kit.availability import unavailable_reason

    if unavailable_reason("vllm"):
        pytest.skip(unavailable_reason("vllm"))
    import yaml

    path = tmp_path / "served.yaml"
    path.write_text(yaml.safe_dump({**served_config("vllm"), "repeat_terminate": LOOP_GUARD}))
    port = free_port()
    code = ("import sys; from engine.backends.vllm import rules as vllm_rules; "  # this vLLM 'lacks' both interfaces
            "vllm_rules.INTERFACES.update(v1='engine_absent.v1', v2='engine_absent.v2'); "
            "from engine.serve.launch import main; sys.exit(main(sys.argv[1:]))")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, "--config", str(path), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    bound = False
    while proc.poll() is None and time.perf_counter() - start < 120:
        with socket.socket() as s:
            bound = bound or s.connect_ex(("127.0.0.1", port)) == 0
        time.sleep(0.1)
    _out, err = proc.communicate(timeout=60)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 3, (proc.returncode, err[-2000:])
    assert "cannot start" in err and "repeat_terminate.enabled is true, but the guard cannot be activated" in err
    assert not bound, "the port accepted a connection although the guard could not run"
    print(f"guard refusal: exit 3 after {elapsed:.1f}s, port never listened")
