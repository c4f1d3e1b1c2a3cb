"""A batch-first generation engine with one contract over Hugging Face transformers and vLLM.

``import engine`` stays light: torch, transformers and vllm are imported only when a backend loads.

>>> import engine
>>> cfg = engine.EngineConfig.from_dict({"backend": "vllm", "model": "/models/m"})
>>> cfg.backend
'vllm'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig, GenerationOptions, ModelConfig, StopPolicy
from engine.errors import (
    BackendUnavailableError,
    ConfigError,
    EngineError,
    PluginCompatibilityError,
    RequestError,
    UnsupportedCapabilityError,
)
from engine.types import ChatRequest, GenerationResult

if TYPE_CHECKING:
    from engine.engine import GenerationEngine

__all__ = [
    "BackendUnavailableError",
    "ChatRequest",
    "ConfigError",
    "EngineConfig",
    "EngineError",
    "GenerationEngine",
    "GenerationOptions",
    "GenerationResult",
    "ModelConfig",
    "PluginCompatibilityError",
    "RequestError",
    "StopPolicy",
    "UnsupportedCapabilityError",
]


def __getattr__(name: str) -> Any:
    if name == "GenerationEngine":
        from engine.engine import GenerationEngine

        return GenerationEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
