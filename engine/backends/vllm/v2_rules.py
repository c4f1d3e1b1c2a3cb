"""Row rules on vLLM's Model Runner V2 (``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor``), the
default on CUDA hosts since vLLM 0.32.

How V2 differs from V1, and what this adapter does about it:

* State is keyed by a persistent **request slot**, recycled through a free list: ``add_request(slot, params)``
  builds the slot's rule state from scratch every time (a recycled slot never sees its previous occupant's
  rules). Slots are not told when they are freed; ``apply`` only looks at the slots in this step's batch.
* No live output list: the committed tokens are ``req_states.all_token_ids[slot, prompt_len:total_len]``
  (device tensors). Each step reads ``total_len`` and the last committed token of the rule-carrying slots in
  one device-to-host copy. A preempted request is re-added with its partial output as prefill, maybe in
  another slot; its rule state (kept by request key) resumes, and a slot behind by more than one token reads
  and feeds its missing span, so the rules end in the same state as if never interrupted.
* Logits rows follow ``ctx.idx_mapping_np`` (batch position -> slot). Speculative decoding (several rows per
  request) is refused when the engine plans its runner (``runner.plan_for_config``); a batch with more
  logits rows than requests raises here rather than misapplying a rule.

* Id-only repeat rules run in a :class:`~engine.rules.repeat_bank.RepeatBank` indexed by slot: the rows
  one token behind push this step's token together (array operations, no per-row Python); other rules run
  per row.

This module imports only vLLM's import-light V2 interface (the frontend loads the class to validate params);
torch and numpy are imported inside the methods.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

from engine.backends.row_apply import FORCE, apply_decisions, decide
from engine.backends.vllm.rules import RequestRules, Row, TokenizerText, build_row
from engine.rules.repeat_bank import RepeatBank


class RowRulesV2(RequestRules, LogitsProcessor):
    """Applies the row rules of requests that carry them (``extra_args``) under Model Runner V2.

    Registered by ``VllmBackend`` as ``LLM(logits_processors=["engine.backends.vllm.v2_rules:RowRulesV2"])``
    when vLLM will run Model Runner V2; per-request settings are the same ``extra_args`` as on V1
    (``engine.backends.vllm.rules.request_args``), validated at admission by :meth:`validate_params`.
    """

    def __init__(self, vllm_config: Any, req_states: Any) -> None:
        import numpy as np

        self.req_states = req_states
        self.slots: dict[int, Row] = {}
        self.bank = RepeatBank()  # id-only repeat rules, by slot
        self.bank.reserve(req_states.max_num_reqs)
        self.in_bank = np.zeros(req_states.max_num_reqs, dtype=bool)  # slot holds a row with a bank rule
        self.bank_seen = np.zeros(req_states.max_num_reqs, dtype=np.int64)  # output tokens offered to the bank
        self.has_row = np.zeros(req_states.max_num_reqs, dtype=bool)
        self.decode = TokenizerText(vllm_config.model_config.tokenizer)

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        previous = self.slots.pop(req_idx, None)
        if previous is not None and previous.bank_at == req_idx:  # its previous occupant finished or was preempted
            previous.leave()  # (unless that request already came back in another slot)
        self.has_row[req_idx] = self.in_bank[req_idx] = False
        args = self.row_args(sampling_params, check=False)
        if args is None:
            return False
        row = build_row(args, self.decode, track=self.tracks_events)
        row.take_draw(args, ())  # its prompt is read from the request state at the first step
        row.join(self.bank, req_idx, args.terminal)
        self.slots[req_idx] = row
        self.has_row[req_idx] = True
        self.in_bank[req_idx] = bool(row.repeat)
        self.bank_seen[req_idx] = 0
        return True

    def apply(self, logits: Any, ctx: Any) -> Any:
        import numpy as np
        import torch

        batch_slots = ctx.idx_mapping_np  # batch position -> slot, on the host
        positions = np.flatnonzero(self.has_row[batch_slots])
        if len(positions) == 0:
            return logits
        if logits.shape[0] != len(batch_slots):
            raise RuntimeError(f"row rules got {logits.shape[0]} logits rows for {len(batch_slots)} requests "
                               "(speculative decoding?); they support one row per request")
        states = self.req_states
        tokens = states.all_token_ids.gpu
        slots = batch_slots[positions].astype(np.int64)
        index = torch.as_tensor(slots, device=tokens.device)
        total = states.total_len.gpu[index].to(torch.int64)
        last = tokens[index, (total - 1).clamp(min=0)].to(torch.int64)
        totals, lasts = torch.stack([total, last]).cpu().numpy()  # one device-to-host copy
        outputs = totals - states.prompt_len.np[slots]  # committed output tokens per row
        forced = np.zeros(len(slots), dtype=bool)
        # Id-only repeat rules, vectorized: rows one token behind push this step's token together.
        in_bank = self.in_bank[slots]
        behind = np.where(in_bank, outputs - self.bank_seen[slots], 0)
        step = behind == 1
        if step.any():
            self.bank.push(slots[step], lasts[step])
        for i in np.flatnonzero(behind > 1):  # a resumed request: feed its committed tokens again
            slot, start = int(slots[i]), int(totals[i] - behind[i])
            for token in tokens[slot, start: int(totals[i])].tolist():
                self.bank.push([slot], [token])
        self.bank_seen[slots[in_bank]] = outputs[in_bank]
        if in_bank.any():  # fired now or before: forced until the EOS lands (a grammar may mask it for a while)
            forced[in_bank] = self.bank.has_fired(slots[in_bank])
        # Every other rule, per row.
        per_row = []
        for i, slot in enumerate(slots.tolist()):
            row = self.slots[slot]
            rules = row.rules
            if not rules.rules:
                continue
            start = int(totals[i] - outputs[i]) + rules.fed  # first committed token not yet fed
            if totals[i] - start == 1:
                rules.feed(int(lasts[i]))
            elif totals[i] - start > 1:  # tokens committed while the request was away (or first step)
                for token in tokens[slot, start: int(totals[i])].tolist():
                    rules.feed(int(token))
            if not forced[i]:
                per_row.append((int(positions[i]), rules, row.eos))
        decisions = decide(logits, per_row)
        decisions += [(int(positions[i]), self.slots[int(slots[i])].eos, FORCE) for i in np.flatnonzero(forced)]
        if any(d.force_eos for _, _, d in decisions):
            by_position = dict(zip(positions.tolist(), slots.tolist(), strict=True))
            self.ended([self.slots[by_position[p]] for p, _, d in decisions if d.force_eos])
        logits = apply_decisions(logits, decisions)
        for i, slot in enumerate(slots.tolist()):  # the portable draw, after the rules (engine...portable)
            draw = self.slots[slot].draw
            if draw is not None:
                begin = int(totals[i] - outputs[i])
                if not draw.prompt:
                    draw.prompt = tuple(tokens[slot, :begin].tolist())
                draw.step(logits[int(positions[i])], tokens[slot, begin: int(totals[i])].tolist())
        return logits
