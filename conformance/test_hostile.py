"""One hostile request against the real server (``python -m engine.serve`` on 127.0.0.1, the pool's text server of
each backend: HF, vLLM, llama.cpp): each is refused with a typed JSON error naming the field, before any
tokenization or model work, and a normal request is answered right after; the server's resident memory (with its
engine-core children) stays bounded throughout. Limits and their settings: ``engine.serve.shared.limits``; the
"Limits" table in ``docs/serving.md``.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from conformance.subjects.plan import engines, servers, uses

SUBJECTS = uses(engines("text"), servers("text"))

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
    # Hostile round 3: a lone surrogate outside message content was a 500 (each names where it is now).
    "lone-surrogate-json-key": ("/v1/chat/completions", '{"model": "MODEL", "messages": [{"role": "user", '
                                '"content": "Hi"}], "\\ud800": 1}', 400, "body (a key)", "lone surrogate"),
    "lone-surrogate-completions-prompt": ("/v1/completions", '{"model": "MODEL", "prompt": "a\\ud800", '
                                          '"max_tokens": 2}', 400, "prompt", "lone surrogate"),
    "lone-surrogate-tokenize": ("/tokenize", '{"model": "MODEL", "prompt": "a\\udc00b"}', 400, "prompt",
                                "lone surrogate"),
    "lone-surrogate-infer-option-key": ("/infer/", '{"infer_requests": [{"messages": [{"role": "user", "content": '
                                        '"Hi"}]}], "engine": {"options": {"\\ud800": 1}}}', 400,
                                        "engine.options (a key)", "lone surrogate"),
    "lone-surrogate-stop-key": ("/infer/", '{"infer_requests": [{"messages": [{"role": "user", "content": "Hi"}]}], '
                                '"engine": {"stop": {"\\ud800": ["x"]}}}', 400, "engine.stop (a key)",
                                "lone surrogate"),
    # Hostile round 4: a lone surrogate that arrives another way than a lower-case JSON escape was a 500 (TypeError,
    # UnicodeEncodeError) on all three servers.
    "lone-surrogate-raw-utf8-prompt": ("/v1/completions", '{"model": "MODEL", "prompt": "a\ud800", "max_tokens": 2}',
                                       400, "prompt", "lone surrogate"),
    "lone-surrogate-raw-utf8-tokenize": ("/tokenize", '{"model": "MODEL", "prompt": "\udc00b"}', 400, "prompt",
                                         "lone surrogate"),
    "lone-surrogate-upper-hex": ("/v1/chat/completions", '{"model": "MODEL", "messages": [{"role": "user", '
                                 '"content": "a\\uDBFFb"}]}', 400, "messages[0].content", "lone surrogate"),
    "lone-surrogate-reversed-pair": ("/tokenize", '{"prompt": "\\udc00\\ud800"}', 400, "prompt", "lone surrogate"),
    "lone-surrogate-utf16-body": ("/tokenize", '{"prompt": "a\\ud800"}'.encode("utf-16-le"), 400, "prompt",
                                  "lone surrogate"),
    "structured-string-nested-1e5": ("/v1/completions", json.dumps({
        "model": "MODEL", "prompt": "hi", "max_tokens": 2,
        "structured_outputs": {"json": "[" * 100_000 + "]" * 100_000}}), 400, "structured_outputs.json",
        "nests arrays or objects too deeply"),
    "schema-nested-200": ("/v1/chat/completions", json.dumps({
        "model": "MODEL", "messages": HI, "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": json.loads('{"items": ' * 200 + '{}' + '}' * 200)}}}), 400,
        "response_format.json_schema.schema", "levels deep"),
    "n-4096-x-512-tokens": ("/v1/chat/completions", json.dumps({"model": "MODEL", "messages": HI, "n": 4096,
                                                                "max_tokens": 512, "ignore_eos": True}), 400,
                            "max_tokens", "more than serve.max_tokens_per_call"),
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
    # Issue 47's round: each froze the event loop for seconds, grew the server by a gigabyte, or answered a 500.
    "1M-unknown-keys": ("/infer/", json.dumps({**infer(), **{f"k{i}": 0 for i in range(10**6)}}), 400, "k0",
                        "is not a known field"),
    "request-config-1M-keys": ("/infer/", json.dumps({"infer_requests": [{"messages": HI}],
                                                      "request_config": {f"k{i}": 0 for i in range(10**6)}}), 400,
                               "request_config.k0", "is not a known field"),
    "tokenize-15MB-prompt": ("/tokenize", json.dumps({"prompt": "hello " * 2_500_000, "return_token_strs": True}), 400,
                             "prompt", "refused before tokenizing"),
    "completion-2.5M-words": ("/v1/completions", json.dumps({"model": "MODEL", "prompt": "hello " * 2_500_000,
                                                             "max_tokens": 1}), 400, "prompt",
                              "refused before tokenizing"),
    "1M-stop-ids": ("/infer/", json.dumps({**infer(), "engine": {"stop": {"token_ids": [1] * 10**6}}}), 400,
                    "engine.stop.token_ids", "more items than any field of this server takes"),
    "tokenize-200k-messages": ("/tokenize", json.dumps({"messages": [{"role": "user", "content": ""}] * 200_000}),
                               400, "messages", "more items than any field of this server takes"),
    "detokenize-1.35M-ids": ("/detokenize", json.dumps({"tokens": [1] * 1_350_000}), 400, "tokens",
                             "more items than any field of this server takes"),
    "100k-text-prompts": ("/v1/completions", json.dumps({"model": "MODEL", "prompt": ["hi"] * 100_000}), 400,
                          "prompt", "more than serve.max_prompts_per_call"),
    "echo-8x4000-ids": ("/v1/completions", json.dumps({"model": "MODEL", "prompt": [[100] * 4000] * 8, "echo": True,
                                                       "logprobs": 20, "max_tokens": 0}), 400, "prompt",
                        "more than serve.max_scored_tokens"),
    "tokenize-null-content": ("/tokenize", json.dumps({"messages": [{"role": "user", "content": None}]}), 400,
                              "messages[0].content", "must be a string"),
    "tokenize-no-content": ("/tokenize", json.dumps({"messages": [{"role": "user"}]}), 400, "messages[0].content",
                            "is required"),
    "tokenize-bogus-role": ("/tokenize", json.dumps({"messages": [{"role": "bogus", "content": "hi"}]}), 400,
                            "messages[0].role", "must be one of"),
    "flattened-end-idx-string": ("/update_flattened_params/", json.dumps({"metadatas": [
        {"name": "w", "shape": [2], "dtype": "torch.float32", "start_idx": 0, "end_idx": "8"}]}), 400,
        "metadatas[0].end_idx", "must be an integer"),
    **{f"schema-{name}": ("/v1/chat/completions", json.dumps({
        "model": "MODEL", "messages": HI, "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}), 400,
        "response_format.json_schema.schema", phrase)
       for name, schema, phrase in [
           ("type-5", {"type": 5}, "cannot be built into a grammar"),
           ("type-banana", {"type": "banana"}, "cannot be built into a grammar"),
           ("bad-pattern", {"type": "string", "pattern": "(("}, "cannot be built into a grammar"),
           ("dangling-ref", {"$ref": "#/$defs/nowhere"}, "cannot be built into a grammar"),
           ("minimum-over-maximum", {"type": "integer", "minimum": 5, "maximum": 1}, "cannot be built into a grammar"),
           ("pattern-a20000", {"type": "string", "pattern": "^a{20000}$"}, "more than 1000"),
           # Hostile round 3: converted by xgrammar but not compilable for the model's vocabulary (HF: 500, vLLM: an
           # empty row); nested counts; an 8 MB enum (round 3: 8,000 x 1,000 characters) that never answered.
           ("pattern-a999", {"type": "string", "pattern": "a{999}"}, "cannot be built into a grammar"),
           ("pattern-anchored-a999", {"type": "string", "pattern": "^a{999}$"}, "cannot be built into a grammar"),
           ("pattern-nested-999x999", {"type": "string", "pattern": "(a{999}){999}"}, "more than 1000"),
           ("enum-4000x2000", {"enum": [f"{i:04d}" + "x" * 1996 for i in range(4000)]}, "characters long")]},
}
UNCONSTRAINED = (None, "cannot constrain output to a JSON Schema")
"""A backend without structured outputs (llama.cpp) refuses every schema by capability first."""
LOOP_BOUND_S = 1.5
"""How much longer than parsing the body (:func:`parse_s`) ``/health`` may wait while the server reads, checks and
refuses a hostile request: the checks run off the event loop (before issue 47 they held it 1.5-9 s here, 5-17 s in
the probe). What remains holds the interpreter in the worker thread too: validating a 100k-item list (up to 0.9 s)
and JSON parsing (``json.loads`` is one C call, the same wait in a thread as on the loop): about 1 s for a 14 MB body
of a million keys on one machine, 1.3 s on one 1.7 times slower, where ``/health`` waited 1.6 s and failed the 1.5 s
bound this was. So the parse is measured on the machine that runs the check and added to the bound: a refusal that
holds the loop 1.5 s beyond it fails anywhere. (Moving this parse back onto the loop is not caught: the wait is
about the same, 1.3-1.8 s on that machine.)"""


def parse_s(body: bytes) -> float:
    """The fastest of three ``json.loads`` of ``body`` in this process (0 for a body that is not JSON): the part of a
    refusal's wait that no server can hand back to its event loop, measured on the machine the check runs on."""
    times = []
    for _ in range(3):
        began = time.perf_counter()
        try:
            json.loads(body)
        except (ValueError, RecursionError):  # a body the parser must refuse
            return 0.0
        times.append(time.perf_counter() - began)
    return min(times)


KINDS = {  # one representative of each kind of hostile request runs in the quick tier (-m quick); all in the full gate
    "1M-unknown-keys": "a body whose refusal itself was the cost",
    "tokenize-15MB-prompt": "text that cannot fit, refused before tokenizing",
    "tokenize-null-content": "a secondary route's message",
    "schema-type-banana": "a JSON Schema no grammar can be built from",
    "body-17MiB": "a body past the transport limit (413)",
    "100k-prompts": "a count past a serve limit",
    "nested-1e5": "JSON the parser must refuse",
    "lone-surrogate": "text that cannot be encoded",
    "lone-surrogate-raw-utf8-prompt": "text that cannot be encoded, as raw bytes",
    "n-4096-x-512-tokens": "rows times tokens past what the server generates in one call",
    "plugin-name-list": "a value of the wrong type",
    "temperature-2.5": "a number out of its range",
    "stop-id-1e30": "a value the model cannot have",
    "unknown-1MB-field": "a field no surface reads",
}


class HealthWatch:
    """Polls ``/health`` in a thread while a hostile request is in flight; ``longest``: the slowest answer (or the
    time a still-pending one has waited when the watch ends)."""

    def __init__(self, url: str) -> None:
        import threading

        self.url, self.longest, self._done = url, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        import httpx

        with httpx.Client(timeout=60) as client:
            while not self._done.is_set():
                began = time.perf_counter()
                client.get(f"{self.url}/health")
                self.longest = max(self.longest, time.perf_counter() - began)
                self._done.wait(0.05)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(60)


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
    if case.startswith("schema-") and backend == "llamacpp":
        field, phrase = UNCONSTRAINED
    if isinstance(body, str):
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        body = body.replace('"MODEL"', json.dumps(model)).encode("utf-8", "surrogatepass")
    bound = LOOP_BOUND_S + parse_s(body)
    before = resident_gb(server.process.pid)
    with HealthWatch(server.url) as watch:
        reply = httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"},
                           timeout=120)
    after = resident_gb(server.process.pid)
    assert reply.status_code == status, f"{case}: {reply.status_code} {reply.text[:400]}"
    error = reply.json()["error"]
    assert error["param"] == field and phrase in error["message"], f"{case}: {error}"
    assert watch.longest < bound, (f"{case}: /health waited {watch.longest:.1f} s, parsing the body takes "
                                   f"{bound - LOOP_BOUND_S:.1f} s here: the event loop froze")
    assert len(error["message"]) < 1000, f"{case}: the error echoes {len(error['message'])} characters back"
    assert after < MEMORY_BOUND_GB, f"{case}: the server holds {after:.1f} GB"
    normal = httpx.post(f"{server.url}/infer/", json=NORMAL, timeout=120)
    assert normal.status_code == 200 and normal.json()[0]["response"]["choices"][0]["message"]["content"], normal.text
    summary_note(f"{case} on {backend}: {reply.status_code} {field}; server {before:.2f} -> {after:.2f} GB, "
                 f"/health at most {watch.longest:.2f} s meanwhile")


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


class PeakMemory:
    """Samples the server's resident memory (with its children) in a thread while a request runs: ``peak``."""

    def __init__(self, pid: int) -> None:
        import threading

        self.pid, self.peak, self._done = pid, resident_gb(pid), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, resident_gb(self.pid))
            self._done.wait(0.05)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(30)


ECHO_GROWTH_GB = {"hf": 1.25, "vllm": 2.5}
"""What scoring one 4000-token echoed prompt may add to the server at its peak. HF: full fp32 logits of the row and
their log-softmax were +1.46 GB here before issue 47 (+1.85 GB in the probe); the head now runs on 512 positions at a
time: +0.93 GB measured, the 4000-token forward pass itself. vLLM computes a
prompt's logprobs per prefill chunk of its own (``max_num_batched_tokens``), the chunk's full logits at once: +1.6 GB
measured here, bounded by that chunk whatever the prompt (``serve.max_scored_tokens`` bounds the tokens per call)."""


@pytest.mark.quick_on("hf", reason=(
    "the memory bound is a scoring server's: llama.cpp's variant only sees the refusal (it cannot score), and HF's "
    "text server scores 4000 echoed tokens within the context its SmolLM2 holds"))
def test_echo_scoring_of_a_long_prompt_stays_within_bounded_memory(server, backend, summary_note):
    """``/v1/completions`` with ``echo``, ``logprobs: 20`` and ``max_tokens: 0`` on a 4000-token prompt (lm-eval's
    scoring of a long document): answered on the backends that score, with every prompt token's logprob, while the
    server grows by less than :data:`ECHO_GROWTH_GB` (HF makes the logits a slice of positions at a time); refused
    by name where the backend cannot score (llama.cpp)."""
    import httpx

    model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": [100 + i % 5000 for i in range(4000)], "echo": True, "logprobs": 20,
            "max_tokens": 0}
    with PeakMemory(server.process.pid) as memory, HealthWatch(server.url) as watch:
        base = memory.peak
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    if backend == "llamacpp":
        assert reply.status_code == 400 and "cannot score" in reply.json()["error"]["message"], reply.text[:300]
        return
    assert reply.status_code == 200, reply.text[:400]
    logprobs = reply.json()["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == 4000 and logprobs["token_logprobs"][0] is None
    assert all(isinstance(x, float) for x in logprobs["token_logprobs"][1:])
    growth = memory.peak - base
    assert growth < ECHO_GROWTH_GB[backend], f"{backend}: scoring 4000 echoed tokens grew the server by {growth:.2f} GB"
    summary_note(f"echo scoring of 4000 ids on {backend}: peak +{growth:.2f} GB, /health at most "
                 f"{watch.longest:.2f} s meanwhile")


def test_distinct_schemas_stay_a_bounded_cache(pool, backend):
    """A client that sends a new JSON Schema every call does not grow the server without bound: HF keeps at most
    ``KEPT`` compiled grammars (vLLM bounds its own xgrammar cache; llama.cpp refuses every schema)."""
    from engine.backends.hf.structured import KEPT
    from engine.errors import UnsupportedCapabilityError

    engine = pool.text_engine(backend).local
    schemas = [{"type": "object", "properties": {f"field{i}": {"type": "integer"}}, "required": [f"field{i}"]}
               for i in range(KEPT + 8)]
    if not engine.backend.capabilities.structured_outputs:
        with pytest.raises(UnsupportedCapabilityError):
            engine.prepare([HI], json_schema=schemas[0])
        return
    for schema in schemas:
        engine.prepare([HI], json_schema=schema)
    held = getattr(engine.backend, "_schemas", None)
    if backend == "hf":
        assert held is not None and len(held._compiled) == KEPT, "every distinct schema stayed compiled"
    else:  # vLLM compiles in its engine core, in its own bounded cache (VLLM_XGRAMMAR_CACHE_MB)
        assert held is None


def test_silent_and_lying_connections_are_closed_by_the_server(server, backend, summary_note):
    """A socket that never sends a byte is closed after ``serve.idle_connection_timeout_s``; a POST declaring
    ``Content-Length: 10**12`` that sends ten bytes gets its 413 within seconds; a chunked body (no
    ``Content-Length``) over ``serve.max_body_bytes`` is a 413 too; and a keyless server's ``/v1/models`` shows no
    filesystem path."""
    import socket

    import httpx

    from conformance.subjects.servers import SERVED_TIMEOUTS

    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    silent = [socket.create_connection((host, int(port)), timeout=30) for _ in range(20)]
    began = time.perf_counter()
    try:
        closed = [sock.recv(1) == b"" for sock in silent]  # the server closes: recv returns at once with nothing
    finally:
        for sock in silent:
            sock.close()
    waited = time.perf_counter() - began
    assert all(closed) and waited < SERVED_TIMEOUTS["idle_connection_timeout_s"] + 10, waited

    with socket.create_connection((host, int(port)), timeout=30) as lying:
        lying.sendall(b"POST /infer/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000000000000\r\n\r\n{\"infer_re")
        began = time.perf_counter()
        head = lying.recv(200)
    assert head.startswith(b"HTTP/1.1 413"), head
    assert time.perf_counter() - began < 15

    def chunks():
        for _ in range(17):
            yield b" " * 2**20

    reply = httpx.post(f"{server.url}/infer/", content=chunks(), headers={"Content-Type": "application/json"},
                       timeout=60)
    assert reply.status_code == 413 and reply.json()["error"]["param"] == "body", reply.text[:300]
    models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    assert all("/" not in m["root"] for m in models), models
    summary_note(f"silent sockets on {backend}: 20 closed after {waited:.1f} s; a 10**12 Content-Length: 413")


def test_trickled_heads_bodies_and_a_full_connection_table_cannot_keep_clients_out(server, backend, summary_note):
    """Hostile round 3: a request head trickled a byte a second is closed within ``serve.idle_connection_timeout_s``
    (a head deadline, not a first-byte one); a body trickled a byte a second gets its 408 within
    ``serve.body_timeout_s`` (a total deadline, not a pause between parts); with the connection table full of
    stalled sockets (a whole head and one byte of its body: round 4's way to count as running), ``/health`` still
    answers at once: the oldest connections that run no request make room, in order."""
    import socket

    import httpx

    from conformance.subjects.servers import SERVED_TIMEOUTS
    from engine.config import ServeConfig

    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    head_s, body_s = SERVED_TIMEOUTS["idle_connection_timeout_s"], SERVED_TIMEOUTS["body_timeout_s"]

    def trickle(opening: bytes, drip: bytes, limit_s: float) -> tuple[bytes, float]:
        """Send ``opening``, then ``drip`` a byte a second until the server answers or closes (its first bytes,
        and when), for at most ``limit_s``."""
        with socket.create_connection((host, int(port)), timeout=1) as sock:
            sock.sendall(opening)
            began = time.perf_counter()
            while time.perf_counter() - began < limit_s:
                try:
                    got = sock.recv(64)
                    return got, time.perf_counter() - began
                except TimeoutError:
                    pass
                except ConnectionResetError:  # closed with a dripped byte unread: the kernel sends a reset, not a FIN
                    return b"", time.perf_counter() - began
                try:
                    sock.sendall(drip)
                except OSError:  # closed by the server
                    return b"", time.perf_counter() - began
            return b"still open", time.perf_counter() - began

    got, head_took = trickle(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"a", head_s + 10)
    assert got == b"" and head_took < head_s + 3, f"a trickled head: {got!r} after {head_took:.1f} s"
    got, body_took = trickle(b"POST /infer/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000\r\n\r\n{", b" ", body_s + 10)
    assert got.startswith(b"HTTP/1.1 408") and body_took < body_s + 3, f"a trickled body: {got!r} after " \
                                                                        f"{body_took:.1f} s"
    count = ServeConfig().max_connections + 32  # the suite's servers keep the default cap
    stalled = []
    try:
        opened = time.perf_counter()
        for _ in range(count):  # a whole head and one byte of the body: round 4's way to count as running
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.sendall(b"POST /infer/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{")
            stalled.append(sock)
        began = time.perf_counter()
        health = httpx.get(f"{server.url}/health", timeout=head_s)  # before the head deadline frees any
        answered = time.perf_counter() - began
        closed = closed_without_answer(stalled)
        probed = time.perf_counter() - opened
    finally:
        for sock in stalled:
            sock.close()
    assert health.status_code == 200 and answered < head_s, f"/health beside {count} stalled sockets: " \
                                                            f"{health.status_code} after {answered:.1f} s"
    # Room was made by closing the oldest connections running no request: the closed ones are among the first opened
    # (the server accepts a burst of connections in tasks of their own, so its order may differ by a few; older idle
    # connections of the suite's own clients go first), the newest are open.
    assert probed < body_s, f"the table took {probed:.1f} s to fill and probe: the body deadline closed them first"
    assert len(closed) >= 8 and max(closed) < len(closed) + 8, f"closed: {closed[:40]} (not the oldest)"
    assert not set(range(count - 16, count)) & set(closed), f"closed: {closed[-20:]} (the newest)"
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    summary_note(f"{backend}: a trickled head closed after {head_took:.1f} s, a trickled body 408 after "
                 f"{body_took:.1f} s, /health beside {count} stalled sockets in {answered:.2f} s, the oldest "
                 f"{len(closed)} closed")


def closed_without_answer(sockets: list) -> list[int]:
    """The indices of ``sockets`` the server closed (reset, or end of stream) without answering, by epoll (more
    sockets than ``select`` takes)."""
    import selectors

    with selectors.DefaultSelector() as watch:
        for i, sock in enumerate(sockets):
            watch.register(sock, selectors.EVENT_READ, i)
        ready = sorted(key.data for key, _ in watch.select(timeout=0.5))
    closed = []
    for i in ready:
        sockets[i].settimeout(0.1)
        try:
            data = sockets[i].recv(64)
        except OSError:  # reset: aborted by the server
            data = b""
        if not data:
            closed.append(i)
    return closed


@pytest.mark.quick_on("llamacpp", reason=(
    "llama.cpp is where SIGTERM under a generating row crashed the server (SIGSEGV, issue 47); its text server is "
    "handed over running, as every backend's is since the check runs before the servers of other models"))
@pytest.mark.ends_servers  # the text server's last user: the pool hands it over instead of starting one for it
def test_sigterm_during_a_long_stream_exits_cleanly(pool, backend, summary_note):
    """SIGTERM while a long stream generates, with a drain shorter than the stream (the pool's servers drain for
    ``serve.drain_timeout_s`` 1, ``SERVED_TIMEOUTS``): the server shuts down cleanly (llama.cpp freed its model under
    the batcher's row before issue 47: SIGSEGV), and the stream's client is cut off rather than left hanging."""
    import threading

    import httpx

    from conformance.subjects.servers import SERVED_TIMEOUTS

    key, config = pool.servers.served_config(backend, pool.options.model)
    assert config["serve"]["drain_timeout_s"] == SERVED_TIMEOUTS["drain_timeout_s"] == 1
    server = pool.servers.hand_over(key, config)
    try:
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "messages": HI, "max_tokens": 2000, "min_tokens": 2000, "stream": True,
                "temperature": 0}
        started, lines = threading.Event(), []

        def read() -> None:
            try:
                with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as reply:
                    for line in reply.iter_lines():
                        lines.append(line)
                        if line.count("content") and len(lines) > 3:
                            started.set()
            except httpx.HTTPError:
                pass
            started.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert started.wait(120), "the stream never started"
        code = server.stop(timeout=90)
        reader.join(30)
    finally:
        server.stop(timeout=30)
    # uvicorn re-raises the SIGTERM it handled once shut down (-15); a model freed under a row was SIGSEGV (-11)
    assert code in (0, -signal.SIGTERM) and "Finished server process" in server.log(), \
        f"{backend}: the server exited with {code} on SIGTERM mid-stream\n{server.log()[-2000:]}"
    assert not reader.is_alive(), "the stream's client was left hanging"
    summary_note(f"SIGTERM mid-stream on {backend}: exit {code} (clean) after {len(lines)} stream lines")
