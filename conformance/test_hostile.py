"""One hostile request against the real server (``python -m engine.serve`` on 127.0.0.1, the pool's text server of
each backend: HF, vLLM, llama.cpp): each is refused with a typed JSON error naming the field, before any
tokenization or model work, and a normal request is answered right after; the server's resident memory (with its
engine-core children) stays bounded throughout. Limits and their settings: ``engine.serve.shared.limits``; the
"Limits" table in ``docs/serving.md``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
HI = [{"role": "user", "content": "Hi"}]
NORMAL = {"infer_requests": [{"messages": HI}], "request_config": {"max_tokens": 4, "temperature": 0}}
MEMORY_BOUND_GB = 6.0
"""What the server process tree may hold while refusing: the tiny fixture model's server idles near 1-4 GB."""


def infer(messages=HI, **config):
    return {"infer_requests": [{"messages": messages}], "request_config": {"max_tokens": 4, **config}}


def nested(depth: int) -> bytes:
    return b'{"infer_requests": ' + b"[" * depth + b"]" * depth + b"}"


HOSTILE = {  # id: (path, raw body, status, the field the error names, a phrase of its message)
    "body-17MiB": ("/infer/", json.dumps(infer([{"role": "user", "content": "x" * (17 * 2**20)}])), 413, "body",
                   "larger than serve.max_body_bytes"),
    "message-3MB": ("/infer/", json.dumps(infer([{"role": "user", "content": "x" * (3 * 2**20)}])), 400,
                    "infer_requests[0].messages", "refused before tokenizing"),
    "100k-prompts": ("/infer/", json.dumps({"infer_requests": [{"messages": HI}] * 100_000}), 400, "infer_requests",
                     "more than serve.max_prompts_per_call"),
    "1000-stops": ("/infer/", json.dumps({**infer(), "engine": {"stop": {"strings": [f"s{i}" for i in range(1000)]}}}),
                   400, "engine.stop.strings", "more than serve.max_stop_strings"),
    "1MB-stop": ("/infer/", json.dumps({**infer(), "engine": {"stop": {"strings": ["y" * 2**20]}}}), 400,
                 "engine.stop.strings", "longer than serve.max_stop_string_chars"),
    "max-tokens-1e9": ("/infer/", json.dumps(infer(max_tokens=10**9)), 400, "request_config.max_tokens",
                       "more than the model's context length"),
    "plugin-name-list": ("/infer/", json.dumps({**infer(), "engine": {"plugins": [{"name": ["cleanup"]}]}}), 400,
                         "engine.plugins[0].name", "must be a plugin name"),
    "plugin-name-mapping": ("/infer/", json.dumps({**infer(), "engine": {"plugins": [{"name": {"a": 1}}]}}), 400,
                            "engine.plugins[0].name", "must be a plugin name"),
    "plugins-5": ("/infer/", json.dumps({**infer(), "engine": {"plugins": 5}}), 400, "engine.plugins",
                  "must be an array"),
    "nested-1e5": ("/infer/", nested(100_000), 400, "body", "nests arrays or objects too deeply"),
    "int-5000-digits": ("/infer/", b'{"infer_requests": [], "request_config": {"seed": ' + b"9" * 5000 + b"}}", 400,
                        "body", "is not valid JSON"),
    "lone-surrogate": ("/v1/chat/completions",
                       '{"model": "MODEL", "messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
                       "messages[0].content", "lone surrogate"),
    "temperature-1e-300": ("/infer/", json.dumps(infer(temperature=1e-300)), 400, "request_config.temperature",
                           "must be 0 (greedy) or at least 0.01"),
    "temperature-2.5": ("/v1/chat/completions",
                        '{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "temperature": 2.5}', 400,
                        "temperature", "must be in [0, 2]"),
    "repetition-penalty-1e-300": ("/infer/", json.dumps(infer(repetition_penalty=1e-300)), 400,
                                  "request_config.repetition_penalty", "must be in [0.01, inf)"),
    "stop-id-1e30": ("/infer/", json.dumps({**infer(), "engine": {"stop": {"token_ids": [10**30]}}}), 400,
                     "engine.stop.token_ids[0]", "is not a token id of this model"),
    "message-name": ("/v1/chat/completions",
                     json.dumps({"model": "MODEL", "messages": [{"role": "user", "content": "Hi", "name": "ann"}]}),
                     400, "messages[0].name", "is not read by the engine"),
    "unknown-1MB-field": ("/infer/", json.dumps({**infer(), "junk": "z" * 2**20}), 400, "junk", "is not a known field"),
}


KINDS = {  # one representative of each kind of hostile request runs in the quick tier (-m quick); all in the full gate
    "body-17MiB": "a body past the transport limit (413)",
    "100k-prompts": "a count past a serve limit",
    "nested-1e5": "JSON the parser must refuse",
    "lone-surrogate": "text that cannot be encoded",
    "plugin-name-list": "a value of the wrong type",
    "temperature-2.5": "a number out of its range",
    "stop-id-1e30": "a value the model cannot have",
    "unknown-1MB-field": "a field no surface reads",
}


@pytest.fixture
def server(pool, backend):
    return pool.text_server(backend)


def resident_gb(pid: int) -> float:
    """Resident memory of ``pid`` and every process below it (the vLLM engine core), from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    tree, frontier = {pid}, [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier and p not in tree]
        tree.update(children)
        frontier = children
    total = 0
    for p in tree:
        try:
            rss = next(line for line in Path(f"/proc/{p}/status").read_text().splitlines() if line.startswith("VmRSS"))
            total += int(rss.split()[1]) * 1024
        except (OSError, StopIteration):
            continue
    return total / 2**30


@pytest.mark.parametrize("case", [pytest.param(c, id=c, marks=[pytest.mark.quick] if c in KINDS else [])
                                  for c in HOSTILE])
def test_a_hostile_request_is_refused_by_name_and_the_next_one_answered(server, backend, case, summary_note):
    import httpx

    path, body, status, field, phrase = HOSTILE[case]
    if isinstance(body, str):
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        body = body.replace('"MODEL"', json.dumps(model)).encode("utf-8", "surrogatepass")
    before = resident_gb(server.process.pid)
    reply = httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"},
                       timeout=120)
    after = resident_gb(server.process.pid)
    assert reply.status_code == status, f"{case}: {reply.status_code} {reply.text[:400]}"
    error = reply.json()["error"]
    assert error["param"] == field and phrase in error["message"], f"{case}: {error}"
    assert len(error["message"]) < 1000, f"{case}: the error echoes {len(error['message'])} characters back"
    assert after < MEMORY_BOUND_GB, f"{case}: the server holds {after:.1f} GB"
    normal = httpx.post(f"{server.url}/infer/", json=NORMAL, timeout=120)
    assert normal.status_code == 200 and normal.json()[0]["response"]["choices"][0]["message"]["content"], normal.text
    summary_note(f"{case} on {backend}: {reply.status_code} {field}; server {before:.2f} -> {after:.2f} GB")


def test_a_client_that_leaves_a_long_unstreamed_request_frees_the_server(server, backend, summary_note):
    """A non-streamed call that would generate to the end of the context (``min_new_tokens`` holds EOS back) and
    whose client leaves after 2 s: its rows end at their next token, so the next caller is answered at once
    instead of after the whole context (minutes on this CPU)."""
    import httpx

    limit = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    budget = limit - 64
    long = {"infer_requests": [{"messages": HI}], "request_config": {"max_tokens": budget, "temperature": 0},
            "engine": {"options": {"min_new_tokens": budget}}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/infer/", json=long, timeout=httpx.Timeout(60.0, read=2.0))
    start = time.perf_counter()
    normal = httpx.post(f"{server.url}/infer/", json=NORMAL, timeout=120)
    waited = time.perf_counter() - start
    assert normal.status_code == 200, normal.text
    assert waited < 60, f"the next caller waited {waited:.0f} s: the abandoned rows kept generating"
    summary_note(f"client left a {budget}-token unstreamed call on {backend}: the next call answered in {waited:.1f} s")
