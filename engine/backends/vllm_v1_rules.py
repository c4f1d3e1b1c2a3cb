"""Row rules on vLLM's V1 model runner (``vllm.v1.sample.logits_processor.LogitsProcessor``; vLLM's CPU build).

The V1 runner tells processors about batch changes (``update_state(BatchUpdate)``: rows added with their
params and a live list of output ids, removed, moved or swapped) and calls ``apply(logits)`` with one logits
row per batch index. Everything else is shared with the V2 adapter (:mod:`engine.backends.vllm_rules`).
Importing this module imports vLLM; the engine names it as ``module:Class`` so child processes can load it.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from engine.backends.row_apply import apply_decisions, decide
from engine.backends.vllm_rules import Row, TokenizerText, build_row, parse_request_args


class RowRulesV1(LogitsProcessor):
    """Applies the row rules of requests that carry them (``extra_args``); other rows are untouched.

    Registered by ``VllmBackend`` as ``LLM(logits_processors=["engine.backends.vllm_v1_rules:RowRulesV1"])``
    when vLLM will run its V1 runner; requests opt in through ``SamplingParams(extra_args=...)`` built by
    ``engine.backends.vllm_rules.request_args(specs, key=..., eos_id=..., terminal_ids=...)``.
    """

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[Row, list[int]]] = {}  # batch index -> (row, live output ids)
        self.decode = TokenizerText(vllm_config.model_config.tokenizer)

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        parse_request_args(sampling_params.extra_args)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt, output in batch_update.added:
            args = parse_request_args(params.extra_args) if params is not None else None
            if args is None:
                self.rows.pop(index, None)
                continue
            # A preempted request comes back with its output so far; its rules resume where they stopped.
            self.rows[index] = (build_row(args, self.decode), output)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if direction == MoveDirectionality.SWAP and row_b is not None:
                self.rows[a] = row_b

    def apply(self, logits: Any) -> Any:
        if not self.rows:
            return logits
        for row, output in self.rows.values():
            rules = row.rules
            while rules.fed < len(output):  # normally one new token per step
                rules.feed(output[rules.fed])
        return apply_decisions(logits, decide(logits, [(i, row.rules, row.eos) for i, (row, _) in self.rows.items()]))
