"""Engines shared across a conformance session: each (backend, model) is loaded once, on first use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PoolOptions:
    backends: tuple[str, ...]
    model: str
    vlm_model: str
    dtype: str
    device: str
    vllm_multiprocessing: bool = False
    """vLLM engine cores in child processes (``vllm.multiprocessing: true``) instead of in-process."""


@dataclass
class EnginePool:
    """Lazily built, session-wide engines keyed by (backend, model path)."""

    options: PoolOptions
    _engines: dict[tuple[str, str, str], Any] = field(default_factory=dict)
    _raw: dict[tuple[str, ...], Any] = field(default_factory=dict)
    runners: set[str] = field(default_factory=set)
    """The model runners the started vLLM engines really use ("v1"/"v2"), for the header and the report."""

    def config(self, backend: str, model: str, **sections: Any) -> dict[str, Any]:
        model_cfg: dict[str, Any] = {"path": model, "dtype": self.options.dtype}
        if backend == "hf":
            model_cfg["device"] = self.options.device
        vllm = {"max_num_seqs": 16, "multiprocessing": self.options.vllm_multiprocessing}
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
        return self._engines[key]

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

    def close(self) -> None:
        for eng in self._engines.values():
            eng.close()
        self._engines.clear()
        self._raw.clear()
