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


@dataclass
class EnginePool:
    """Lazily built, session-wide engines keyed by (backend, model path)."""

    options: PoolOptions
    _engines: dict[tuple[str, str, str], Any] = field(default_factory=dict)
    _raw: dict[tuple[str, ...], Any] = field(default_factory=dict)

    def config(self, backend: str, model: str, **sections: Any) -> dict[str, Any]:
        model_cfg: dict[str, Any] = {"path": model, "dtype": self.options.dtype}
        if backend == "hf":
            model_cfg["device"] = self.options.device
        return {"backend": backend, "model": model_cfg, "generation": {"max_new_tokens": 48},
                "vllm": {"max_num_seqs": 16}, **sections}

    def engine(self, backend: str, model: str, **sections: Any) -> Any:
        """The shared engine for (backend, model, extra config sections such as repeat_terminate)."""
        key = (backend, model, repr(sorted(sections.items())))
        if key not in self._engines:
            from engine import GenerationEngine

            self._engines[key] = GenerationEngine(self.config(backend, model, **sections))
        return self._engines[key]

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
