"""Engines shared across a conformance session: each model is loaded once per (backend, backend settings).

Checks ask for ``pool.engine(backend, model, **sections)``. Sections that only shape requests (the repeat guard's
thresholds, generation defaults, the pixel budget: ``engine.engine.REQUEST_SECTIONS``) never load a second model:
the pool derives such an engine from the loaded one (``GenerationEngine.derive``). ``shared=False`` builds one
through the whole config path instead, for the checks that prove the two are the same.

A check marked ``servable`` also runs as its served twin (the ``reach`` parameter, see ``conformance.subjects.served``):
then every engine it compares is reached through ``python -m engine.serve`` too, while references it only derives
expectations from (``pool.reference``) stay in-process. The servers are the server pool's
(``conformance/subjects/servers.py``, ``pool.servers``); each twin gets the session's
:class:`~conformance.subjects.served.Reach` and the way to its server explicitly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from conformance.compare import LOW_PRECISION_TOPK
from conformance.subjects.bill import STARTS, Bill, named
from conformance.subjects.plan import TEXT, TINY, sections_key
from conformance.subjects.served import Reach
from conformance.subjects.servers import ServerPool
from conformance.subjects.target import TargetOptions
from engine.backends.registry import SPECS

# On CPU hosts the suite's vLLM engines start eager with a small KV cache: a fixture engine then starts in about
# 10 s instead of 45 s (torch.compile buys about 10 % of decode speed on these models, which no check measures),
# and takes about 0.8 GiB less memory. torch.compile is off there too (conftest, ``turn_torch_compile_off``): vLLM
# would still compile two sampler helpers at the first logprobs or top-k request of each process (up to 33 s each).
# The benchmarks keep vLLM's defaults at full size.
CPU_VLLM = {"enforce_eager": True, "cpu_kv_cache_space_gib": 0.5}
TINY_KV_GIB = 1 / 16
"""The KV cache of a tiny model's engine on CPU (a tiny fixture needs 1 KiB per token: 64 MiB hold 32 full-length
sequences of tiny-looper); SmolLM2 (45 KiB per token) keeps ``CPU_VLLM``'s 0.5 GiB."""


def subject_name(key: tuple[str, ...]) -> str:
    """An engine as the outputs record names it: backend, model folder's name, its sections (and "own backend"),
    free of the host's paths.

    >>> subject_name(("hf", "/tmp/x/.fixtures/tiny-chat", "[('vllm', {'max_num_seqs': 4})]", ""))
    "hf tiny-chat [('vllm', {'max_num_seqs': 4})]"
    >>> subject_name(("vllm", "/m/smol", "[]", ""))
    'vllm smol'
    """
    from pathlib import Path

    backend, model, sections, own = key
    return " ".join(part for part in (backend, Path(model).name, "" if sections == "[]" else sections, own) if part)


def kv_cache_gib(model: str) -> float:
    """The CPU KV cache an engine of ``model`` gets: ``TINY_KV_GIB`` when 16 full-length sequences (the pool's
    ``max_num_seqs``) fit in it, else ``CPU_VLLM``'s. Every in-process vLLM engine stays alive for the session, so
    this is most of what a tiny fixture's engine holds."""
    shape = kv_shape(model)
    if shape is None:
        return float(CPU_VLLM["cpu_kv_cache_space_gib"])
    per_token, context = shape
    needed = 16 * per_token * context / 2**30
    return TINY_KV_GIB if needed <= TINY_KV_GIB else float(CPU_VLLM["cpu_kv_cache_space_gib"])


def kv_shape(model: str) -> tuple[int, int] | None:
    """(float32 KV bytes per token, context length) of the model folder ``model``; None without a ``config.json``."""
    from pathlib import Path

    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    text = config.get("text_config", config)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    per_token = text["num_hidden_layers"] * 2 * text.get("num_key_value_heads", text["num_attention_heads"]) \
        * head_dim * 4  # float32 keys and values
    return per_token, text.get("max_position_embeddings", 2048)


def context_that_fits(model: str, kv_gib: float) -> int | None:
    """The ``model.max_model_len`` a CPU vLLM engine of ``model`` needs with a KV cache of ``kv_gib``: the longest
    multiple of 1024 tokens whose float32 keys and values fit, where the model's own context does not (vLLM refuses to
    start unless one full-length sequence fits); None where it does. The pool sets it on every vLLM config whose KV
    cache a check shrinks below its own, so a check names only the cache, the same sections on every backend (and the
    server the pool starts ahead for another backend is the one that backend's check asks for).

    >>> import json, tempfile
    >>> folder = tempfile.mkdtemp()  # SmolLM2-135M's shape: 45 KiB per token, 8192 positions
    >>> _ = open(f"{folder}/config.json", "w").write(json.dumps({"hidden_size": 576, "num_attention_heads": 9,
    ...     "num_key_value_heads": 3, "num_hidden_layers": 30, "max_position_embeddings": 8192}))
    >>> context_that_fits(folder, 0.125), context_that_fits(folder, 0.5)
    (2048, None)
    """
    shape = kv_shape(model)
    if shape is None:
        return None
    per_token, context = shape
    fits = int(kv_gib * 2**30 // per_token)
    return None if fits >= context else max(1024, fits // 1024 * 1024)



def read_by(backend: str, sections: dict[str, Any]) -> dict[str, Any]:
    """``sections`` without the settings sections of the other backends (``hf``, ``vllm``, ``llamacpp``): what
    ``backend`` never reads, so a check that sizes every backend in one call (``hf={"max_batch_size": 8},
    vllm={"max_num_seqs": 4}``) loads no second engine, and starts no second server, of a backend it did not size.

    >>> sorted(read_by("llamacpp", {"vllm": {"max_num_seqs": 4}, "hf": {"max_batch_size": 8}, "stop": {}}))
    ['stop']
    >>> sorted(read_by("hf", {"vllm": {"max_num_seqs": 4}, "hf": {"max_batch_size": 8}}))
    ['hf']
    """
    from engine.backends.registry import settings_section

    foreign = {settings_section(name) for name in SPECS} - {settings_section(backend)}
    return {k: v for k, v in sections.items() if k not in foreign}


@dataclass(frozen=True)
class PoolOptions:
    backends: tuple[str, ...]
    model: str
    vlm_model: str
    dtype: str
    device: str
    vllm_multiprocessing: bool = False
    """vLLM engine cores in child processes (``vllm.multiprocessing: true``) instead of in-process."""
    servers_per_backend: int = 1
    """Servers of one backend kept alive at once for served twins (the least recently used one is stopped first):
    a vLLM server holds about 4 GB in two processes here, and a cross-backend check needs one of each backend."""
    gguf_models: tuple[tuple[str, str], ...] = ()
    """(HF model folder, its GGUF twin) pairs: what the llamacpp backend loads for a model the suite names."""
    tiny_model: str = ""
    """The tiny tier's payload model (``--engine-tiny-model``; default the ``tiny-chat`` fixture): the model of the
    ``engine``, ``engines`` and ``text_model`` fixtures in a module marked ``model_tier("tiny")``."""
    target: TargetOptions = field(default_factory=TargetOptions)
    """``--engine-target-*``: an external server to check against the HF reference
    (``conformance/subjects/target.py``)."""
    gpu_vllm_engines: int = 6
    """On a CUDA host: vLLM engines held on the card at once, servers' included. Each gets ``engine_share`` of
    this many (vLLM refuses to start below its share of free memory); beyond it, the least recently used
    in-process engine is stopped first (its engine core runs in a child process there, so stopping it frees the
    card and leaves the others intact)."""


@dataclass
class EnginePool:
    """Lazily built, session-wide engines keyed by (backend, model path, config sections), and the server pool
    their served twins reach."""

    options: PoolOptions
    reach: Reach = field(default_factory=Reach)
    """How the running check reaches engines (set per check by the ``reach`` fixture), handed to every twin."""
    bill: Bill = field(default_factory=Bill)
    """What this pool and its server pool started, and what it cost."""
    servers: ServerPool = field(init=False)
    _engines: dict[tuple[str, ...], Any] = field(default_factory=dict)
    _twins: dict[tuple[str, ...], Any] = field(default_factory=dict)
    _references: dict[tuple[str, ...], Any] = field(default_factory=dict)
    _raw: dict[tuple[str, ...], Any] = field(default_factory=dict)
    _loaded: dict[tuple[str, ...], tuple[str, ...]] = field(default_factory=dict)
    _sections: dict[tuple[str, ...], dict[str, Any]] = field(default_factory=dict)
    """Loaded engine key -> the sections it was loaded with (what a module's declaration is matched against)."""
    """Derived engine key -> the key of the engine whose loaded backend it shares."""
    twins: dict[str, str] = field(default_factory=dict)
    """HF model folder -> its GGUF twin (from ``options.gguf_models``; checks may register more)."""
    runners: set[str] = field(default_factory=set)
    """The model runners the started vLLM engines really use ("v1"/"v2"), for the header and the report."""
    derived: int = 0
    """Engines derived from a loaded one (no model loaded for them)."""
    leases: Any = None
    """On a CUDA host, the in-process vLLM engines holding a share of the card (``EngineLeases``)."""
    released: int = 0
    """vLLM engines stopped to make room on the card (started again when a later check asks for them)."""
    compile_off: bool = False
    """``torch.compile`` turned off for the session and its servers (CPU hosts, ``turn_torch_compile_off``)."""
    releasers: dict[str, Any] = field(default_factory=dict)
    """Kept objects that stop per backend, by the name a module declares them by (``kept(NAME)``): ``release(backend)``
    -> what it stopped. Whoever builds one registers it (the looper servers, ``conformance/conftest.py``)."""

    def __post_init__(self) -> None:
        self.twins.update(dict(self.options.gguf_models))
        self.servers = ServerPool(self.options, configure=self.config, bill=self.bill)

    @property
    def starts(self) -> list[tuple[str, str, float]]:
        """(kind, key, seconds) of every engine, server and kept object started, in order (the bill's)."""
        return self.bill.starts

    def model_for(self, backend: str, model: str) -> str:
        """The model ``backend`` loads for ``model``: the same folder, or on llamacpp its GGUF twin (no twin: the
        check is skipped with the reason)."""
        if SPECS[backend].model_format != "gguf":
            return model
        twin = self.twins.get(model)
        if twin is None:
            import pytest

            pytest.skip(f"llamacpp: no GGUF twin of {model} (the suite has twins of the text fixtures; for "
                        "--engine-model give --engine-gguf-model; vision-language models do not run on llama.cpp)")
        return twin

    def config(self, backend: str, model: str, /, **sections: Any) -> dict[str, Any]:
        from engine.backends.host import has_cuda

        sections = read_by(backend, sections)
        model_cfg: dict[str, Any] = {"path": self.model_for(backend, model), "dtype": self.options.dtype}
        if SPECS[backend].takes_device:
            model_cfg["device"] = self.options.device
        model_cfg.update(sections.pop("model", {}))  # more model settings (e.g. checkpoint_eos), not its path
        if model_cfg.get("adapters"):  # on llama.cpp each adapter's GGUF twin, as the model's
            model_cfg["adapters"] = {name: self.model_for(backend, path)
                                     for name, path in model_cfg["adapters"].items()}
        if has_cuda():
            from engine.backends.vllm.memory import engine_share

            host = {"gpu_memory_utilization": engine_share(self.options.gpu_vllm_engines)}
        else:
            host = {**CPU_VLLM, "cpu_kv_cache_space_gib": kv_cache_gib(model)}
        vllm = {"max_num_seqs": 16, "multiprocessing": self.options.vllm_multiprocessing, **host}
        generation: dict[str, Any] = {"max_new_tokens": 48}
        if self.options.dtype != "float32":  # a divergence is then judged by vLLM's rule, which reads the top-k
            generation["logprobs"] = LOW_PRECISION_TOPK
        # A check that shrinks vLLM's KV cache below the pool's gets the context that fits; the pool's own cache is
        # left to vLLM's own check (a model whose context it cannot hold is refused, not silently cut).
        kv_gib = sections.get("vllm", {}).get("cpu_kv_cache_space_gib")
        shrunk = kv_gib is not None and kv_gib < vllm.get("cpu_kv_cache_space_gib", kv_cache_gib(model))
        if backend == "vllm" and shrunk and "max_model_len" not in model_cfg:
            fits = context_that_fits(model, kv_gib)
            if fits is not None:
                model_cfg["max_model_len"] = fits
        return {"backend": backend, "model": model_cfg, "generation": generation, "vllm": vllm, **sections}

    # -- engines -------------------------------------------------------------------------------------------

    def engine(self, backend: str, model: str, /, *, shared: bool = True, **sections: Any) -> Any:
        """The session's engine for (backend, model, extra config sections such as repeat_terminate), as a
        :class:`~conformance.subjects.served.ServedTwin`: in-process, and under the served reach through its server too.

        ``shared`` (default): request-level sections derive from the loaded engine of (backend, model, the other
        sections); False: built from the whole config, its own backend loaded (the config path itself)."""
        from conformance.subjects.served import ServedTwin

        key = self._key(backend, model, shared, sections)
        if key not in self._twins:
            local = self._local(key, backend, model, shared, sections)
            # The guard travels per request (the engine extension's ``repeat_terminate``): a guarded engine's twin
            # reaches the server of its unguarded one, and no server is started per guard setting. A server's own
            # start-up guard keeps its checks (test_served's activation from the environment).
            guard = local.config.repeat_terminate.as_dict() if "repeat_terminate" in sections else None
            unguarded = {k: v for k, v in sections.items() if k != "repeat_terminate"}
            served, config = self.servers.served_config(backend, model, **unguarded)
            self._twins[key] = ServedTwin(local, lambda: self.servers.server(served, config), self.reach,
                                          guard=guard, subject=subject_name(key))
        else:
            self._count_user(self._loaded.get(key, key))  # a later module asking for the same engine uses it too
        return self._twins[key]

    def text_server(self, backend: str) -> Any:
        """The running server of ``backend``'s text engine: the one its served twins reach, and the chat checks'
        (``/v1/chat/completions`` and Pattern C ``/chat``)."""
        return self.servers.server(*self.servers.served_config(backend, self.options.model))

    def reference(self, backend: str, model: str, /, **sections: Any) -> Any:
        """The engine for expectations a check derives, not for what it compares: in-process whatever the reach
        (under the served reach it answers what it answered the check's in-process variant)."""
        from conformance.subjects.served import ServedTwin

        key = self._key(backend, model, True, sections)
        if key not in self._references:
            self._references[key] = ServedTwin(self._local(key, backend, model, True, sections), None, self.reach,
                                               subject=subject_name(key))
        else:
            self._count_user(self._loaded.get(key, key))
        return self._references[key]

    def loaded(self, backend: str, model: str, /, **sections: Any) -> Any:
        """The in-process ``GenerationEngine`` itself, not a twin: what the benchmarks time (a twin remembers the
        answers of the check's in-process variant). The same engine :meth:`engine` and :meth:`reference` wrap."""
        return self._local(self._key(backend, model, True, sections), backend, model, True, sections)

    def text_engine(self, backend: str) -> Any:
        return self.engine(backend, self.options.model)

    def tier_model(self, tier: str) -> str:
        """The model folder of a module's model tier (``conformance.subjects.plan.model_tier``): ``text``
        (``--engine-model``) or ``tiny`` (``--engine-tiny-model``).

        >>> options = PoolOptions(("hf",), "/m/smol", "/m/vl", "float32", "cpu", tiny_model="/m/tiny")
        >>> EnginePool(options).tier_model("tiny")
        '/m/tiny'
        """
        return {TEXT: self.options.model, TINY: self.options.tiny_model}[tier]

    def float32_reference(self, backend: str) -> Any:
        """``backend`` on ``--engine-model`` in float32 whatever the session's dtype: what a low-precision check
        calibrates each backend's own error against (``conformance.precision``)."""
        return self.reference(backend, self.options.model, model={"dtype": "float32"})

    @staticmethod
    def _key(backend: str, model: str, shared: bool, sections: dict[str, Any]) -> tuple[str, ...]:
        return (backend, model, sections_key(read_by(backend, sections)), "" if shared else "own backend")

    def _local(self, key: tuple[str, ...], backend: str, model: str, shared: bool, sections: dict[str, Any]) -> Any:
        if key in self._engines:
            self._count_user(self._loaded.get(key, key))
            if self.leases is not None and SPECS[backend].shares_card:
                self.leases.admit(self._loaded.get(key, key))  # used now: the last to be stopped
            return self._engines[key]
        from engine import GenerationEngine
        from engine.engine import REQUEST_SECTIONS

        sections = read_by(backend, sections)
        per_request = {k: v for k, v in sections.items() if k in REQUEST_SECTIONS or self._mode_only(backend, k, v)}
        if shared and per_request:
            loaded = {k: v for k, v in sections.items() if k not in per_request}
            base = self._local(self._key(backend, model, True, loaded), backend, model, True, loaded)
            config = self.config(backend, model, **sections)
            derived = {k: config[k] for k in REQUEST_SECTIONS if k in config}
            if "model" in per_request:
                derived["model"] = per_request["model"]
            self._engines[key] = base.derive(**derived)
            self._loaded[key] = self._loaded.get(self._key(backend, model, True, loaded),
                                                 self._key(backend, model, True, loaded))
            self.derived += 1
            return self._engines[key]
        if SPECS[backend].shares_card:
            self._make_room(key)
        self._sections[key] = sections
        self._count_user(key)
        with self.bill.timed("engine", key):
            self._engines[key] = GenerationEngine(self.config(backend, model, **sections))
        runner = self._engines[key].backend.load_decisions.get("runner")
        if runner is not None:
            self.runners.add(runner)
        return self._engines[key]

    @staticmethod
    def _mode_only(backend: str, name: str, value: Any) -> bool:
        """Whether a ``model`` section only sets ``logprobs_mode`` on a backend that reads it per call (an engine in
        that mode is then derived from the loaded one: no second model in memory)."""
        return (name == "model" and isinstance(value, dict) and set(value) == {"logprobs_mode"}
                and not SPECS[backend].logprobs_mode_at_load)

    def _make_room(self, key: tuple[str, ...]) -> None:
        """On a CUDA host, stop the least recently started vLLM engines beyond the card's budget (with every engine
        derived from them) before ``key`` starts; servers hold ``servers_per_backend`` of the budget."""
        from engine.backends.host import has_cuda
        from engine.backends.vllm.memory import EngineLeases

        if not has_cuda():
            return  # CPU hosts: every engine has its own KV cache size, none is stopped early
        if self.leases is None:
            self.leases = EngineLeases(max(1, self.options.gpu_vllm_engines - self.options.servers_per_backend))
        released = self.leases.admit(key)
        if released and not self.options.vllm_multiprocessing:
            raise RuntimeError(f"the card holds {self.leases.capacity} vLLM engines and closing an in-process one "
                               "breaks the others; fix: --engine-vllm-multiprocessing (the default on CUDA hosts) "
                               "or a larger --engine-gpu-vllm-engines")
        for old in released:
            self._close_loaded(old)
            self.released += 1

    def _close_loaded(self, loaded: tuple[str, ...]) -> None:
        """Close the engine loaded under ``loaded`` and forget it with every engine derived from it."""
        self._engines[loaded].close()
        for k in [k for k in self._engines if k == loaded or self._loaded.get(k) == loaded]:
            for table in (self._engines, self._loaded, self._twins, self._references, self._sections):
                table.pop(k, None)

    def drop(self, backend: str, model: str, /, **sections: Any) -> bool:
        """Close the engine ``engine(backend, model, **sections)`` loaded (and every engine derived from it) now, not
        at the session's end: for an engine only one check uses (its memory is the test process's until then). Only
        where closing it leaves the others intact: HF and llama.cpp engines, and vLLM engines whose engine core runs in
        a child process; an in-process vLLM engine is refused (closing it breaks every other live one, see
        :meth:`keep`). False when no such engine is loaded. A later ask loads it again.

        >>> pool = EnginePool(PoolOptions(("vllm",), "/m/smol", "/m/vl", "float32", "cpu"))
        >>> pool.drop("hf", "/m/smol")
        False
        """
        import time

        key = self._key(backend, model, True, sections)
        loaded = self._loaded.get(key, key)
        if loaded not in self._engines:
            return False
        if SPECS[backend].shares_card and not self._engines[loaded].config.vllm.multiprocessing:
            raise RuntimeError(f"{named(loaded)}: an in-process vLLM engine stays until the session's end (closing it "
                               "breaks every other live one); fix: load it with vllm.multiprocessing true to drop it")
        began = time.monotonic()
        self._close_loaded(loaded)
        self.bill.starts.append(("closed", named(loaded), time.monotonic() - began))
        self.bill.released.append((named(loaded), self.bill.user))
        return True

    def keep(self, key: tuple[str, ...], factory: Any) -> Any:
        """A session-lived object (e.g. a raw ``vllm.LLM``) built once by ``factory``.

        Destroying an in-process vLLM engine tears down vLLM's process-global parallel state and breaks
        every other live one, so the pool owns all of them and releases them only at session end.
        """
        self.bill.used("kept", key, model=str(key[0]), sections={})
        if key not in self._raw:
            with self.bill.timed("kept", key):
                self._raw[key] = factory()
        return self._raw[key]

    def release(self, subject: Any, backend: str, spare: Sequence[Any] = ()) -> list[str]:
        """Stop what ``subject`` names on ``backend`` (a pool server, or a kept object with a releaser): the session
        plan says its last user is done (``conformance/subjects/plan.py::last_users``), but not a server a ``spare``
        subject names (still to be used, ``plan.spared``). The bill notes each stop with the module after which it
        came; a later ask starts it again."""
        if subject.kind == "server":
            stopped = self.servers.release(backend, subject, spare)
        elif subject.kind == "kept" and subject.model in self.releasers:
            stopped = self.releasers[subject.model](backend)
        else:
            stopped = []
        self.bill.released.extend((name, self.bill.user) for name in stopped)
        return stopped

    def count_fixture_users(self, values: Any) -> None:
        """Count the running check's module as a user of every engine among its fixtures' values (a twin, or a dict
        or sequence of them, one level down): a session- or module-scoped fixture asks the pool once, for the first
        check that needs it, and later modules reach the same engines through it."""
        twins = {id(twin): key for table in (self._twins, self._references) for key, twin in table.items()}
        for value in values:
            inner = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else ()
            for candidate in (value, *inner):
                key = twins.get(id(candidate))
                if key is not None:
                    self._count_user(self._loaded.get(key, key))

    def _count_user(self, loaded: tuple[str, ...]) -> None:
        """The running check's module uses the engine loaded under ``loaded`` (backend, model, load sections, own)."""
        self.bill.used("engine", loaded, model=loaded[1], sections=self._sections.get(loaded, {}))

    @property
    def vllm_mode(self) -> str:
        return "child process" if self.options.vllm_multiprocessing else "in-process"

    # -- what it holds and what it cost ----------------------------------------------------------------------

    def report(self) -> list[str]:
        """What the pool started and what it cost: the session's start-up bill, and this process's peak memory."""
        lines = [f"{kind} {seconds:6.1f}s  {key}" for kind, key, seconds in self.starts]
        by_kind: dict[str, list[float]] = {}
        for kind, _, seconds in self.starts:
            by_kind.setdefault(kind, []).append(seconds)
        totals = ", ".join(f"{len(v)} {k} starts {sum(v):.0f}s" if k in STARTS else f"{len(v)} {k} (not a start)"
                           for k, v in by_kind.items()) or "nothing started"
        from conformance.kit.report import peak_gib

        peak = peak_gib()
        return [*lines, f"engine pool: {totals}; {self.derived} more engines derived from loaded ones; peak resident "
                        f"memory of this process {peak:.1f} GiB"]

    def close(self) -> None:
        """Stop everything the pool holds, at the session's end; the bill notes what the servers' and the engines'
        close took ("closed", not a start): it is the last check's teardown in a report."""
        import time

        self.reach.close()  # replayed requests still in flight end before their servers stop
        began = time.monotonic()
        self.servers.close()
        self.bill.starts.append(("closed", "every server", time.monotonic() - began))
        self._twins.clear()
        self._references.clear()
        for key, eng in self._engines.items():
            began = time.monotonic()
            eng.close()
            self.bill.starts.append(("closed", named(key), time.monotonic() - began))
        self._engines.clear()
        self._raw.clear()

