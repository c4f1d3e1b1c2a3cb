"""vLLM adapter of row rules: one V1-runner logits processor, registered when the engine starts.

Per-request rules travel in ``SamplingParams.extra_args[EXTRA_KEY]`` as :class:`RuleSpec` dicts plus EOS
and terminal ids and a request key (vLLM hands processors no request id). The processor rebuilds each
row's :class:`RuleSet` from the specs and applies its decision; forcing and banning EOS are vectorized
over the affected rows. The engine runs vLLM in-process ("colocate"), so it reads each row's rule
events back from :data:`LIVE` by request key after ``generate``.

Supported: vLLM's V1 model-runner interface (``vllm.v1.sample.logits_processor.LogitsProcessor``), which
is what runs on CPU. Model Runner V2 (newer GPU builds) has another interface; :func:`supported` reports
why it cannot be used, and the engine refuses rules that need it instead of running them unapplied.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from engine.rules.base import RuleSet, RuleSpec

EXTRA_KEY = "engine_rules"
LIVE: dict[str, RuleSet] = {}


def request_args(specs: Sequence[RuleSpec], *, key: str, eos_id: int, terminal_ids: Sequence[int]) -> dict:
    """The ``extra_args`` for one request."""
    return {EXTRA_KEY: {"specs": [s.as_dict() for s in specs], "key": key, "eos": eos_id,
                        "terminal": list(terminal_ids)}}


def interface_problem() -> str | None:
    """Why this vLLM has no usable V1 logits-processor interface, or None."""
    try:
        from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor  # noqa: F401
    except ImportError as err:
        return f"this vLLM has no V1 logits-processor interface ({err})"
    return None


def runner_problem(llm: Any) -> str | None:
    """Why the started engine cannot run our processor (Model Runner V2), or None."""
    if getattr(llm.llm_engine.vllm_config, "use_v2_model_runner", False):
        return ("vLLM runs Model Runner V2, whose logits-processor interface is not supported yet "
                "(set VLLM_USE_V2_MODEL_RUNNER=0)")
    return None


@functools.cache
def processor_class() -> type:
    """The V1 logits-processor class (built on first use, so importing this module needs no vllm)."""
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    class RowRulesLogitsProcessor(LogitsProcessor):
        """Applies the row rules of requests that carry them; other rows are untouched."""

        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
            self.rows: dict[int, tuple[RuleSet, list[int], int]] = {}  # index -> (rules, output ids, eos)
            self.tokenizer_path = vllm_config.model_config.tokenizer
            self._tokenizer: Any = None

        def is_argmax_invariant(self) -> bool:
            return False

        def decode(self, ids: Sequence[int]) -> str:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

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
                specs = [RuleSpec(**s) for s in args["specs"]]
                rules = RuleSet([s.build() for s in specs], terminal_ids=frozenset(args["terminal"]),
                                decode=self.decode)
                LIVE[args["key"]] = rules
                self.rows[index] = (rules, output, args["eos"])
            for a, b, direction in batch_update.moved:
                row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
                if row_a is not None:
                    self.rows[b] = row_a
                if direction == MoveDirectionality.SWAP and row_b is not None:
                    self.rows[a] = row_b

        def apply(self, logits: Any) -> Any:
            if not self.rows:
                return logits
            import torch

            force, ban, ban_eos = [], [], []
            for index, (rules, output, eos) in self.rows.items():
                while rules.fed < len(output):  # normally one new token per step
                    rules.feed(output[rules.fed])
                d = rules.decision()
                if d.force_eos:
                    force.append((index, eos))
                    continue
                if d.ban_eos:
                    if int(logits[index].argmax()) == eos:
                        rules.note_eos_suppressed()
                    ban.append(index)
                    ban_eos.append(eos)
                for tok, b in d.bias.items():
                    logits[index, tok] += b
            if ban:
                logits[torch.tensor(ban), torch.tensor(ban_eos)] = float("-inf")
            if force:
                rows = torch.tensor([i for i, _ in force])
                logits[rows] = float("-inf")
                logits[rows, torch.tensor([e for _, e in force])] = 0.0
            return logits

    return RowRulesLogitsProcessor
