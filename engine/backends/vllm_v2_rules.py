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
  request) is refused when the engine plans its runner (``vllm_runner.plan_for_config``); a batch with more
  logits rows than requests raises here rather than misapplying a rule.

This module imports only vLLM's import-light V2 interface (the frontend loads the class to validate params);
torch is imported inside ``apply``.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

from engine.backends.row_apply import apply_decisions, decide
from engine.backends.vllm_rules import Row, TokenizerText, build_row, parse_request_args


class RowRulesV2(LogitsProcessor):
    """Applies the row rules of requests that carry them (``extra_args``) under Model Runner V2.

    Registered by ``VllmBackend`` as ``LLM(logits_processors=["engine.backends.vllm_v2_rules:RowRulesV2"])``
    when vLLM will run Model Runner V2; per-request settings are the same ``extra_args`` as on V1
    (``engine.backends.vllm_rules.request_args``), validated at admission by :meth:`validate_params`.
    """

    def __init__(self, vllm_config: Any, req_states: Any) -> None:
        self.req_states = req_states
        self.slots: dict[int, Row] = {}
        self.decode = TokenizerText(vllm_config.model_config.tokenizer)

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        parse_request_args(sampling_params.extra_args)

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        args = parse_request_args(sampling_params.extra_args)
        if args is None:
            self.slots.pop(req_idx, None)
            return False
        self.slots[req_idx] = build_row(args, self.decode)
        return True

    def apply(self, logits: Any, ctx: Any) -> Any:
        import torch

        batch_slots = ctx.idx_mapping_np.tolist()  # batch position -> slot, on the host
        active = [(pos, slot) for pos, slot in enumerate(batch_slots) if slot in self.slots]
        if not active:
            return logits
        if logits.shape[0] != len(batch_slots):
            raise RuntimeError(f"row rules got {logits.shape[0]} logits rows for {len(batch_slots)} requests "
                               "(speculative decoding?); they support one row per request")
        states = self.req_states
        tokens = states.all_token_ids.gpu
        slots = torch.tensor([slot for _, slot in active], device=tokens.device)
        total = states.total_len.gpu[slots].to(torch.int64)
        last = tokens[slots, (total - 1).clamp(min=0)].to(torch.int64)
        totals, lasts = torch.stack([total, last]).cpu().tolist()  # one device-to-host copy
        rows = []
        for (pos, slot), n_total, last_token in zip(active, totals, lasts, strict=True):
            row = self.slots[slot]
            start = int(states.prompt_len.np[slot]) + row.rules.fed  # first committed token not yet fed
            if n_total - start == 1:
                row.rules.feed(int(last_token))
            elif n_total - start > 1:  # tokens committed while the request was away (or first step)
                for token in tokens[slot, start:n_total].tolist():
                    row.rules.feed(int(token))
            rows.append((pos, row.rules, row.eos))
        return apply_decisions(logits, decide(logits, rows))
