"""One row of a llama.cpp batch: its logits processor, sampler, stop watch, budget and output.

The decoder (:mod:`engine.backends.llamacpp.sequences`) hands each token sampled for the row to
:meth:`LlamaCppRow.take`, which keeps it and says whether the row is done: a terminal id, ``max_new_tokens`` or the
context, a stop string (found on the row's text with the engine's stop rule; the engine still truncates ``text``),
a stopping rule, or the caller going away (``on_token`` returned True). The row draws with a sampler of its own
(:func:`sampler_chain`), seeded with the row's own seed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.backends.base import BackendOutput, CallPlan, Prompt
from engine.rules.events import stopped_on_seen_token


def sampler_chain(llm: Any, greedy: bool, seed: int) -> Any:
    """The row's llama.cpp sampler, seeded with ``seed``: the chain ``Llama.generate`` builds for the engine's
    arguments (llama-cpp-python 0.3's ``_init_sampler``: penalties, top-k, typical, top-p and min-p all off, the
    temperature 1, then greedy or a seeded draw), without its custom step: the row's step has already edited the
    logits (penalty, temperature, min-p, top-k, top-p, rules). One chain per row, so a row draws what it drew through
    ``Llama.generate``, whichever rows share its batch."""
    from llama_cpp import _internals

    sampler = _internals.LlamaSampler()
    sampler.add_penalties(n_vocab=llm.n_vocab(), penalty_last_n=llm.last_n_tokens_size, penalty_repeat=1.0,
                          penalty_freq=0.0, penalty_present=0.0)
    if greedy:
        sampler.add_greedy()
        return sampler
    sampler.add_top_k(0)
    sampler.add_typical(1.0, 1)
    sampler.add_top_p(1.0, 1)
    sampler.add_min_p(0.0, 1)
    sampler.add_temp(1.0)
    sampler.add_dist(seed)
    return sampler


class LlamaCppRow:
    """A row's state while it decodes; :meth:`take` each sampled token, :meth:`output` at the end.

    >>> from engine.config import GenerationOptions, StopPolicy
    >>> plan = CallPlan(GenerationOptions(max_new_tokens=2), StopPolicy(), (0,))
    >>> row = LlamaCppRow(3, Prompt((7, 8), "ab"), plan, n_ctx=64, decode=lambda ids: "x" * len(ids))
    >>> row.budget, row.take(5), row.take(6), row.output().token_ids
    (2, False, True, (5, 6))
    """

    def __init__(self, index: int, prompt: Prompt, plan: CallPlan, *, n_ctx: int,
                 decode: Callable[[Any], str] | Any,
                 on_token: Callable[[int, int, int], bool | None] | None = None) -> None:
        from engine.backends.llamacpp.rules import LlamaCppRowStep
        from engine.rules.base import rule_sets
        from engine.rules.detok import text_stream
        from engine.rules.stop import StopStringWatch

        opts = plan.options
        self.index, self.prompt, self.on_token = index, prompt, on_token
        self.greedy = opts.is_greedy or opts.sampler != "native"  # the portable draw is made by the row's step
        self.terminal = set(plan.terminal_token_ids)
        self.want_logprobs = opts.logprobs
        make = lambda specs: rule_sets(specs, 1, terminal_ids=plan.terminal_token_ids, decode=decode,  # noqa: E731
                                       min_new_tokens=opts.min_new_tokens)[0] if specs else None
        self.rules = make([s for s in plan.rules if s.mechanism == "logits_processor"])
        self.stoppers = make([s for s in plan.rules if s.mechanism == "stopping_criteria"])
        self.step = LlamaCppRowStep(prompt_len=len(prompt.token_ids), terminal_ids=plan.terminal_token_ids,
                                    rules=self.rules, eos_id=plan.eos_token_ids[0], options=opts,
                                    logprobs_mode=plan.logprobs_mode, seed=prompt.seed, processing=plan.processing)
        self.stops = StopStringWatch(plan.stop.strings, text_stream(decode),
                                     min_new_tokens=opts.min_new_tokens) if plan.stop.strings else None
        self.budget = min(opts.max_new_tokens, n_ctx - len(prompt.token_ids))
        self.tokens: list[int] = []
        self.logprobs: list[dict[int, float]] = []

    @property
    def context_need(self) -> int:
        """KV cells the row may fill: its prompt and every token it may generate (at least one)."""
        return len(self.prompt.token_ids) + max(self.budget, 1)

    def ids(self) -> tuple[int, ...]:
        """The row's ids so far, for its step (which reads them for the repetition penalty only)."""
        if self.step.processing.repetition_penalty == 1.0:
            return self.prompt.token_ids
        return tuple(self.prompt.token_ids) + tuple(self.tokens)

    def take(self, token: int) -> bool:
        """Keep ``token`` (just sampled for this row); True when the row is done."""
        self.tokens.append(token)
        self.step.feed(token)
        if self.want_logprobs is not None:
            self.logprobs.append(self.step.top_logprobs(token, self.want_logprobs))
        done = token in self.terminal or len(self.tokens) >= self.budget
        if self.stops is not None and not done:
            done = self.stops.feed(token)
        if self.stoppers is not None and not done:
            self.stoppers.feed(token)
            done = self.stoppers.decision().force_eos
        if self.on_token is not None and self.on_token(self.index, len(self.tokens) - 1, token):
            done = True
        return done

    def output(self) -> BackendOutput:
        events: dict[str, Any] = {}
        if self.rules is not None:
            events.update(self.rules.events())
        if self.stoppers is not None:
            events.update(stopped_on_seen_token(self.stoppers.events()))
        return BackendOutput(token_ids=tuple(self.tokens),
                             logprobs=tuple(self.logprobs) if self.want_logprobs is not None else None,
                             prompt_token_ids=tuple(self.prompt.token_ids), events=events)
