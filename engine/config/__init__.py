"""Typed, frozen, validated configuration. Start at :class:`EngineConfig`."""

from engine.config.engine_config import (
    BACKENDS,
    DTYPES,
    EngineConfig,
    HfConfig,
    LlamaCppConfig,
    ModelConfig,
    VllmConfig,
)
from engine.config.generation import GenerationOptions, StopPolicy
from engine.config.repeat import RepeatTerminateConfig
from engine.config.serve import ServeConfig
from engine.config.vision import PixelBudget

__all__ = [
    "BACKENDS",
    "DTYPES",
    "EngineConfig",
    "GenerationOptions",
    "HfConfig",
    "LlamaCppConfig",
    "ModelConfig",
    "PixelBudget",
    "RepeatTerminateConfig",
    "ServeConfig",
    "StopPolicy",
    "VllmConfig",
]
