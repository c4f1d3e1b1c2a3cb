"""The example backend's class: transformers underneath, one row per forward batch (what a backend without padded
batching looks like), so the suite compares two batch paths over one model."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.backends.hf.backend import HfBackend


class ExampleBackend(HfBackend, backend="example"):
    """HF's backend generating every prompt alone (``max_batch_size`` 1): a third-party class the registry found by
    entry point. Its results must equal HF's batched ones token for token in float32, as any backend's must."""

    def __init__(self, model: Any, settings: Any, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(model, dataclasses.replace(settings, max_batch_size=1), tokenizer, **kwargs)
