"""From a backend's token ids to the ``GenerationResult`` every caller gets: decode ``raw_text`` (special tokens
kept) and ``text`` (skipped), deterministic stop truncation, post-decode plugins, finish reason and per-request meta.

Shared by :class:`~engine.engine.GenerationEngine` (whole batches) and :class:`~engine.streaming.ResultStream`
(one streamed request), so a streamed answer ends in the very result ``generate`` gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.backends.base import BackendOutput, CallPlan
from engine.rules.events import events_within, repeat_meta
from engine.rules.stop import ended_by_rule, finish_reason, truncate_at_stop
from engine.types import GenerationResult

if TYPE_CHECKING:
    from engine.plugins import Plugin
    from engine.templates import RenderedPrompt


class ResultBuilder:
    """Turns backend outputs into results with one tokenizer (the engine's).

    >>> from types import SimpleNamespace
    >>> from engine.config import GenerationOptions, StopPolicy
    >>> from engine.templates import RenderedPrompt
    >>> words = {5: "Par", 6: "is.", 7: " Next", 2: "</s>"}
    >>> tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True:
    ...     "".join(words[i] for i in ids if not (skip_special_tokens and i == 2)))
    >>> plan = CallPlan(GenerationOptions(max_new_tokens=8), StopPolicy(strings=(".",)), (2,))
    >>> builder = ResultBuilder(tok, SimpleNamespace(pad_token_fallback=None))
    >>> r = builder.result(RenderedPrompt("p", (1,), None), BackendOutput(token_ids=(5, 6, 7)), plan, "hf", [])
    >>> r.text, r.raw_text, r.finish_reason, r.stop_reason
    ('Paris', 'Paris. Next', 'stop', '.')
    """

    def __init__(self, tokenizer: Any, load_info: Any) -> None:
        self.tokenizer = tokenizer
        self.load_info = load_info

    def finish(self, backend: str, rendered: Sequence[RenderedPrompt], outputs: Sequence[BackendOutput],
               plan: CallPlan, fallback: dict[str, Any] | None, plugins: list[Plugin]) -> list[GenerationResult]:
        """One result per (prompt, output), in order; ``fallback`` is recorded in each result's meta."""
        results = [self.result(r, o, plan, backend, plugins) for r, o in zip(rendered, outputs, strict=True)]
        for r in results:
            r.meta["fallback"] = fallback
        return results

    def visible_text(self, ids: Sequence[int], plan: CallPlan, *, partial: bool = False) -> tuple[str, int | None]:
        """The decoded text of generated ``ids`` before stop truncation, and where stop strings may start
        counting (the text length of the first ``min_new_tokens`` tokens). A terminal stop token id belongs to no
        text (as in vLLM) unless the policy keeps stops. ``partial`` (ids still growing): the second value is
        None while fewer than ``min_new_tokens`` ids exist."""
        decode = self.tokenizer.decode
        ids = list(ids)
        ends_on_stop_id = bool(ids) and ids[-1] in plan.terminal_token_ids and not plan.stop.include_stop_str
        text = decode(ids[:-1] if ends_on_stop_id else ids, skip_special_tokens=True)
        min_new = plan.options.min_new_tokens
        if not min_new:
            return text, 0
        if partial and len(ids) < min_new:
            return text, None
        return text, len(decode(ids[:min_new], skip_special_tokens=True))

    def result(self, prompt: RenderedPrompt, out: BackendOutput, plan: CallPlan, backend: str,
               plugins: list[Plugin]) -> GenerationResult:
        """One output's result (``backend``: the name recorded in its meta)."""
        ids = list(out.token_ids)
        events = events_within(out.events, generated=len(ids))  # async scheduling may run rules past the end
        raw_text = self.tokenizer.decode(ids, skip_special_tokens=False)
        full_text, min_end = self.visible_text(ids, plan)
        text, matched = truncate_at_stop(full_text, plan.stop.strings, include_stop=plan.stop.include_stop_str,
                                         min_end=min_end)
        reason, stop_reason = finish_reason(ids, stop_token_ids=plan.terminal_token_ids, matched_stop=matched,
                                            ended_by=ended_by_rule(events),
                                            max_new_tokens=plan.options.max_new_tokens)
        for plugin in plugins:  # post-decode steps, in order, after stop truncation; raw_text is never touched
            text = plugin.post_decode(text)
        prompt_ids = out.prompt_token_ids or prompt.token_ids
        meta = {
            "backend": backend,
            "chat_template_fallback": prompt.fallback,
            "pad_token_fallback": self.load_info.pad_token_fallback,
            "num_prompt_tokens": len(prompt_ids),
            "num_generated_tokens": len(ids),
            **repeat_meta(events),  # reported by the guard itself, never inferred from the finish reason
            "plugins": [p.name for p in plugins],
        }
        if getattr(prompt, "adapter", None) is not None:  # the LoRA adapter the row ran with (none: the base model)
            meta["adapter"] = prompt.adapter
        if plan.special_stops:  # stop strings that were a special token's text: the row ended at that token
            meta["stop_strings_as_token_ids"] = dict(plan.special_stops)
        if plan.draws_portably:  # replayable: the call's seed
            meta["sampler"], meta["seed"] = plan.options.sampler, plan.options.seed
        if out.logprobs is not None:  # which distribution they are (model.logprobs_mode): a learner checks it
            meta["logprobs_mode"] = plan.logprobs_mode
        for plugin in plugins:
            meta.update(plugin.result_meta(generated_text=full_text, text=text, events=events))
        return GenerationResult(text=text, raw_text=raw_text, token_ids=tuple(ids), prompt_token_ids=tuple(prompt_ids),
                                finish_reason=reason, stop_reason=stop_reason, logprobs=out.logprobs, meta=meta)
