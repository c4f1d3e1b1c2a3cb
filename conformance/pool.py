"""Engines shared across a conformance session: each (backend, model) is loaded once, on first use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# On CPU hosts the suite's vLLM engines start eager with a small KV cache: a fixture engine then starts in about
# 10 s instead of 45 s (torch.compile buys about 10 % of decode speed on these models, which no check measures),
# and takes about 0.8 GiB less memory. The benchmarks keep vLLM's defaults.
CPU_VLLM = {"enforce_eager": True, "cpu_kv_cache_space_gib": 0.5}


@dataclass(frozen=True)
class PoolOptions:
    backends: tuple[str, ...]
    model: str
    vlm_model: str
    dtype: str
    device: str
    vllm_multiprocessing: bool = False
    """vLLM engine cores in child processes (``vllm.multiprocessing: true``) instead of in-process."""
    served: bool = False
    """Reach every pooled engine through ``python -m engine.serve`` too (see ``conformance.served``)."""
    max_servers: int = 2
    """Servers kept alive at once under ``served`` (least recently used ones are stopped)."""
    gguf_models: tuple[tuple[str, str], ...] = ()
    """(HF model folder, its GGUF twin) pairs: what the llamacpp backend loads for a model the suite names."""


@dataclass
class EnginePool:
    """Lazily built, session-wide engines keyed by (backend, model path)."""

    options: PoolOptions
    _engines: dict[tuple[str, str, str], Any] = field(default_factory=dict)
    _raw: dict[tuple[str, ...], Any] = field(default_factory=dict)
    _servers: dict[tuple[str, str, str], Any] = field(default_factory=dict)
    twins: dict[str, str] = field(default_factory=dict)
    """HF model folder -> its GGUF twin (from ``options.gguf_models``; checks may register more)."""
    runners: set[str] = field(default_factory=set)
    """The model runners the started vLLM engines really use ("v1"/"v2"), for the header and the report."""

    def model_for(self, backend: str, model: str) -> str:
        """The model ``backend`` loads for ``model``: the same folder, or on llamacpp its GGUF twin (no twin: the
        check is skipped with the reason)."""
        if backend != "llamacpp":
            return model
        twin = self.twins.get(model)
        if twin is None:
            import pytest

            pytest.skip(f"llamacpp: no GGUF twin of {model} (the suite has twins of the text fixtures; for "
                        "--engine-model give --engine-gguf-model; vision-language models do not run on llama.cpp)")
        return twin

    def config(self, backend: str, model: str, **sections: Any) -> dict[str, Any]:
        from engine.backends.vllm import has_cuda

        model_cfg: dict[str, Any] = {"path": self.model_for(backend, model), "dtype": self.options.dtype}
        if backend == "hf":
            model_cfg["device"] = self.options.device
        vllm = {"max_num_seqs": 16, "multiprocessing": self.options.vllm_multiprocessing,
                **({} if has_cuda() else CPU_VLLM)}
        return {"backend": backend, "model": model_cfg, "generation": {"max_new_tokens": 48}, "vllm": vllm,
                **sections}

    def engine(self, backend: str, model: str, **sections: Any) -> Any:
        """The shared engine for (backend, model, extra config sections such as repeat_terminate)."""
        key = (backend, model, repr(sorted(sections.items())))
        if key not in self._engines:
            from engine import GenerationEngine

            self._engines[key] = GenerationEngine(self.config(backend, model, **sections))
            runner = getattr(self._engines[key].backend, "runner", None)
            if runner is not None:
                self.runners.add(runner)
            if self.options.served:
                from conformance.served import ServedTwin

                local, config = self._engines[key], self.config(backend, model, **sections)
                self._engines[key] = ServedTwin(local, lambda: self.server(key, config))
        return self._engines[key]

    def server(self, key: tuple[str, str, str], config: dict[str, Any]) -> Any:
        """The running server for ``key`` (started on first need; least recently used ones stop beyond
        ``max_servers``, to bound memory)."""
        from engine.client import launch_server

        if key in self._servers:
            self._servers[key] = self._servers.pop(key)  # most recently used last
            return self._servers[key]
        while len(self._servers) >= self.options.max_servers:
            self._servers.pop(next(iter(self._servers))).stop()
        self._servers[key] = launch_server({**config, "serve": {"port": 0}})
        return self._servers[key]

    def __post_init__(self) -> None:
        self.twins.update(dict(self.options.gguf_models))

    @property
    def vllm_mode(self) -> str:
        return "child process" if self.options.vllm_multiprocessing else "in-process"

    def text_engine(self, backend: str) -> Any:
        return self.engine(backend, self.options.model)

    def keep(self, key: tuple[str, ...], factory: Any) -> Any:
        """A session-lived object (e.g. a raw ``vllm.LLM``) built once by ``factory``.

        Destroying an in-process vLLM engine tears down vLLM's process-global parallel state and breaks
        every other live one, so the pool owns all of them and releases them only at session end.
        """
        if key not in self._raw:
            self._raw[key] = factory()
        return self._raw[key]

    served_total: int = 0
    """Calls answered through a server under ``served`` (summed at close; a served run with none fails)."""

    def close(self) -> None:
        self.served_total += sum(getattr(e, "served_calls", 0) for e in self._engines.values())
        for server in self._servers.values():
            server.stop()
        self._servers.clear()
        for eng in self._engines.values():
            eng.close()
        self._engines.clear()
        self._raw.clear()
