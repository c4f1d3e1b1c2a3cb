"""The worker side of the engine: a vLLM ``worker_extension_cls`` that hands the engine the events the row-rule
processor recorded in this worker's process, and receives the learner's weights (``engine.weights.sync``): the
model's own, or a LoRA adapter's alone.

``VllmBackend`` starts vLLM with ``worker_extension_cls="engine.backends.vllm.events.EngineWorkerExtension"`` and,
after a batch, calls ``llm.collective_rpc("engine_rule_events", args=(keys,))``. The call reaches the worker
wherever it runs (the calling process, an engine-core child process, every tensor-parallel rank), so the
trigger meta is reported by the guard itself in every deployment, never inferred from finish reasons.
"""

from __future__ import annotations

from typing import Any


class EngineWorkerExtension:
    """The engine's ``worker_extension_cls``, mixed into vLLM's worker class: the row rules' events
    (``engine_rule_events``), and weights and adapters received from a learner's group. Rule events have no state here
    (the store is process-wide); weight sync keeps this worker's communicator while a learner's group is open."""

    def engine_rule_events(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        """The events of each finished request key known in this process, removed from the store."""
        from engine.backends.vllm.rules import EVENTS

        return EVENTS.collect(keys)

    def engine_open_weights(self, host: str, port: int, world_size: int, transport: str,
                            timeout_s: float = 300.0, learner_rank: int | None = None,
                            packed: dict[str, Any] | None = None, secret: str | None = None) -> None:
        """Start joining the learner's group at this worker's rank (after the trainer's rank 0 when
        ``learner_rank`` is 0, vLLM's layout) on a thread of its own, so the engine core goes on generating while the
        learner joins (``engine.weights.sync.Joining``); the next load waits for it."""
        from engine.weights.sync import Joining, open_communicator

        rank, device = self.rank, getattr(self, "device", None)  # type: ignore[attr-defined]
        if learner_rank == 0:
            rank += 1

        def join() -> Any:
            communicator = open_communicator(host, port, rank, world_size, transport, device=device,
                                             timeout_s=timeout_s, learner_rank=learner_rank, secret=secret)
            communicator.packed = packed
            return communicator

        self.engine_weights = Joining(join)

    def engine_load_weights(self, announced: dict[str, Any], within_s: float = 300.0) -> int:
        """Receive what the learner announced (one named tensor, a flattened bucket, or vLLM's listed tensors; joined
        and arrived within ``within_s``) and load it into the model through vLLM's in-place reload
        (``model_executor.model_loader.reload``): the first push of a session puts the layers back in checkpoint
        form, each push loads by checkpoint name (fused projections included), and a layer is processed again (CPU
        weight packing, quantization) once all its weights arrived; ``engine_finish_weights`` ends the session.
        Returns the tensor count."""
        from engine.weights.description import check_finite
        from engine.weights.sync import receive

        weights = receive(getattr(self, "engine_weights", None), announced, within_s)
        check_finite(weights)  # before the reload starts: a refused push leaves the layers as they were
        self._engine_load(weights)
        return len(weights)

    def engine_receive_adapter(self, announced: dict[str, Any], folder: str, config: dict[str, Any],
                               within_s: float = 300.0) -> int:
        """Receive a LoRA adapter's tensors (every worker takes the broadcast) and save them into ``folder`` (the
        first worker; the server loads the folder as an adapter). Returns the tensor count."""
        from engine.adapters import write_adapter
        from engine.weights.sync import receive

        tensors = receive(getattr(self, "engine_weights", None), announced, within_s)
        if self.rank == 0:  # type: ignore[attr-defined]
            write_adapter(folder, config, tensors)
        return len(tensors)

    def engine_load_checkpoint(self, path: str) -> int:
        """Every tensor of a saved checkpoint folder, loaded as one whole session (in effect on return)."""
        from pathlib import Path

        from engine.weights.checkpoint import checkpoint_tensors

        weights = checkpoint_tensors(Path(path))
        self._engine_load(weights)
        self.engine_finish_weights()
        return len(weights)

    def _engine_load(self, weights: list[tuple[str, Any]]) -> None:
        model = self.model_runner.model  # type: ignore[attr-defined]
        if not getattr(self, "engine_reloading", False):
            from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

            initialize_layerwise_reload(model)
            self.engine_reloading = True
        model.load_weights(weights=weights)

    def engine_finish_weights(self) -> bool:
        """End the push session: layers that got no weights keep theirs, the rest are processed. False: none open."""
        if not getattr(self, "engine_reloading", False):
            return False
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(self.model_runner.model, self.vllm_config.model_config)  # type: ignore[attr-defined]
        self.engine_reloading = False
        return True

    def engine_close_weights(self) -> None:
        self.engine_weights = None

    def engine_state_keys(self) -> list[str]:
        """The model's parameter names as vLLM holds them (fused projections included)."""
        return [name for name, _ in self.model_runner.model.named_parameters()]  # type: ignore[attr-defined]
