"""vLLM adapter of the repeat guard: a V1-runner logits processor registered when the engine starts.

Per-request settings travel in ``SamplingParams.extra_args[EXTRA_KEY]`` (thresholds, EOS and terminal ids,
and a request key, since vLLM hands processors no request id). Each row's rule is the shared pure
:class:`~engine.rules.repeat.RepeatRule`; forcing EOS is vectorized over the triggered rows. Trigger
events are kept in :data:`EVENTS` by request key: the engine runs vLLM in-process ("colocate"), so it
reads them back after ``generate``.

Supported: vLLM's V1 model runner interface (``vllm.v1.sample.logits_processor.LogitsProcessor``), which is
what runs on CPU. Model Runner V2 (newer GPU builds) has another interface; :func:`check_supported`
refuses it at engine start with the fix (``VLLM_USE_V2_MODEL_RUNNER=0``) instead of running unguarded.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

from engine.errors import UnsupportedCapabilityError
from engine.rules.detok import IncrementalDetokenizer
from engine.rules.repeat import RepeatRule, RepeatThresholds

EXTRA_KEY = "engine_repeat_terminate"
EVENTS: dict[str, tuple[str, int]] = {}


def request_args(thresholds: RepeatThresholds, *, key: str, eos_id: int, terminal_ids: tuple[int, ...]) -> dict:
    """The ``extra_args`` entry for one request."""
    return {EXTRA_KEY: {"thresholds": asdict(thresholds), "key": key, "eos": eos_id, "terminal": list(terminal_ids)}}


@functools.cache
def processor_class() -> type:
    """The V1 logits-processor class (built on first use, so importing this module needs no vllm)."""
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    @dataclass
    class _Row:
        rule: RepeatRule
        output: list[int]
        key: str
        eos: int
        terminal: set[int]
        detok: IncrementalDetokenizer | None
        seen: int = 0
        done: bool = False

    class RepeatTerminateLogitsProcessor(LogitsProcessor):
        """Forces EOS for rows whose repeat rule fired; rows without the extra arg are untouched."""

        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
            self.rows: dict[int, _Row] = {}
            self.tokenizer_path = vllm_config.model_config.tokenizer
            self._decode: Any = None

        def is_argmax_invariant(self) -> bool:
            return False

        def decode(self, ids: Any) -> str:
            if self._decode is None:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(self.tokenizer_path)
                self._decode = lambda xs: tok.decode(list(xs), skip_special_tokens=True)
            return self._decode(ids)

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is None:
                return
            for index in batch_update.removed:
                self.rows.pop(index, None)
            for index, params, _prompt, output in batch_update.added:
                args = (params.extra_args or {}).get(EXTRA_KEY) if params is not None else None
                if args is None:
                    self.rows.pop(index, None)
                    continue
                thresholds = RepeatThresholds(**args["thresholds"])
                detok = IncrementalDetokenizer(self.decode) if thresholds.needs_text else None
                self.rows[index] = _Row(RepeatRule(thresholds), output, args["key"], args["eos"],
                                        set(args["terminal"]), detok)
            for a, b, direction in batch_update.moved:
                row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
                if row_a is not None:
                    self.rows[b] = row_a
                if direction == MoveDirectionality.SWAP and row_b is not None:
                    self.rows[a] = row_b

        def apply(self, logits: Any) -> Any:
            force: list[int] = []
            eos: list[int] = []
            for index, row in self.rows.items():
                while row.seen < len(row.output):  # normally one new token per step
                    tok = row.output[row.seen]
                    row.seen += 1
                    if row.done:
                        continue
                    if tok in row.terminal:
                        row.done = True
                        continue
                    text = row.detok.push(tok) if row.detok is not None else ""
                    if row.rule.push(tok, text) is not None:
                        EVENTS[row.key] = (row.rule.reason or "", row.rule.fired_at or 0)
                        row.done = True
                        force.append(index)
                        eos.append(row.eos)
            if force:
                import torch

                rows = torch.tensor(force, device=logits.device)
                logits[rows] = float("-inf")
                logits[rows, torch.tensor(eos, device=logits.device)] = 0.0
            return logits

    return RepeatTerminateLogitsProcessor


def check_supported(llm: Any = None) -> None:
    """Refuse to start when this vLLM cannot run the guard (no V1 interface, or Model Runner V2 active)."""
    try:
        from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor  # noqa: F401
    except ImportError as err:
        raise UnsupportedCapabilityError(
            f"repeat_terminate.enabled is true, but this vLLM has no V1 logits-processor interface ({err}); "
            "the guard cannot be activated. Fix: install a vLLM with vllm.v1.sample.logits_processor, or set "
            "repeat_terminate.enabled: false") from err
    if llm is not None and getattr(llm.llm_engine.vllm_config, "use_v2_model_runner", False):
        raise UnsupportedCapabilityError(
            "repeat_terminate.enabled is true, but vLLM runs Model Runner V2, whose logits-processor interface "
            "the guard does not support yet. Fix: set VLLM_USE_V2_MODEL_RUNNER=0, or disable the guard")
