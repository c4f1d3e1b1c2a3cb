"""Row rules on vLLM's V1 model runner (``vllm.v1.sample.logits_processor.LogitsProcessor``; vLLM's CPU build).

The V1 runner tells processors about batch changes (``update_state(BatchUpdate)``: rows added with their
params and a live list of output ids, removed, moved or swapped) and calls ``apply(logits)`` with one logits
row per batch index. Id-only repeat rules run in a :class:`~engine.rules.repeat_bank.RepeatBank` indexed by
batch index (moves and swaps move its rows too); everything else is shared with the V2 adapter
(:mod:`engine.backends.vllm.rules`).
Importing this module imports vLLM; the engine names it as ``module:Class`` so child processes can load it.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from engine.backends.row_apply import FORCE, apply_decisions, decide
from engine.backends.vllm.rules import RequestRules, Row, TokenizerText, build_row
from engine.rules.repeat_bank import RepeatBank


class RowRulesV1(RequestRules, LogitsProcessor):
    """Applies the row rules of requests that carry them (``extra_args``); other rows are untouched.

    Registered by ``VllmBackend`` as ``LLM(logits_processors=["engine.backends.vllm.v1_rules:RowRulesV1"])``
    when vLLM will run its V1 runner; requests opt in through ``SamplingParams(extra_args=...)`` built by
    ``engine.backends.vllm.rules.request_args(specs, key=..., eos_id=..., terminal_ids=...)``.
    """

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[Row, list[int]]] = {}  # batch index -> (row, live output ids)
        self.bank = RepeatBank()  # id-only repeat rules, by batch index
        self.decode = TokenizerText(vllm_config.model_config.tokenizer)

    def is_argmax_invariant(self) -> bool:
        return False

    def _drop(self, index: int) -> tuple[Row, list[int]] | None:
        entry = self.rows.pop(index, None)
        if entry is not None:
            entry[0].leave()
        return entry

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._drop(index)
        for index, params, prompt, output in batch_update.added:
            self._drop(index)  # an added request may replace the one at its index
            args = self.row_args(params, check=False) if params is not None else None
            if args is None:
                continue
            # A preempted request comes back with its output so far; its rules resume where they stopped.
            row = build_row(args, self.decode, track=self.tracks_events)
            row.take_draw(args, prompt or ())
            row.join(self.bank, index, args.terminal)
            self.rows[index] = (row, output)
        for a, b, direction in batch_update.moved:
            if direction == MoveDirectionality.SWAP:
                row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
                self.bank.swap_rows(a, b)
                for entry, index in ((row_a, b), (row_b, a)):
                    if entry is not None:
                        entry[0].moved_to(index)
                        self.rows[index] = entry
                continue
            entry = self.rows.pop(a, None)
            self._drop(b)
            if entry is not None:
                self.bank.copy_row(a, b)
                entry[0].moved_to(b)
                self.rows[b] = entry

    def apply(self, logits: Any) -> Any:
        if not self.rows:
            return logits
        step_rows, step_tokens, forced, per_row = [], [], set(), []
        for index, (row, output) in self.rows.items():
            if row.repeat:
                behind = len(output) - row.bank_seen
                if behind == 1:  # the common case: one new token, pushed with the batch below
                    step_rows.append(index)
                    step_tokens.append(output[-1])
                elif behind > 1:  # a resumed request: feed its committed tokens again
                    for token in output[row.bank_seen:]:
                        self.bank.push([index], [token])
                row.bank_seen = len(output)
            rules = row.rules
            if rules.rules:
                while rules.fed < len(output):  # normally one new token per step
                    rules.feed(output[rules.fed])
                per_row.append((index, rules, row.eos))
        if step_rows:
            self.bank.push(step_rows, step_tokens)
        repeat_rows = [index for index, (row, _) in self.rows.items() if row.repeat]
        if repeat_rows:  # fired now or before: forced until the EOS lands (a grammar may mask it for a while)
            forced.update(i for i, f in zip(repeat_rows, self.bank.has_fired(repeat_rows).tolist(), strict=True) if f)
        decisions = decide(logits, [r for r in per_row if r[0] not in forced])
        decisions += [(index, self.rows[index][0].eos, FORCE) for index in forced]
        ending = [self.rows[index][0] for index, _, d in decisions if d.force_eos]
        if ending:
            self.ended(ending)
        logits = apply_decisions(logits, decisions)
        for index, (row, output) in self.rows.items():  # the portable draw, after the rules (engine...portable)
            if row.draw is not None:
                row.draw.step(logits[index], output)
        return logits
