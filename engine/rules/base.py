"""The contract of a generation-time row rule: fed each generated token and its text, it says what the
row may do next. Backends apply decisions through thin adapters; rules never import torch or a backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Decision:
    """What the next token of one row may be. ``force_eos`` wins over ``ban_eos`` (hard stops end rows).

    >>> Decision(ban_eos=True).force_eos
    False
    """

    force_eos: bool = False
    """The row must end now: the adapter makes EOS the only choice (or stops the row)."""
    ban_eos: bool = False
    """The row may not end yet: EOS is masked out."""
    bias: Mapping[int, float] = field(default_factory=dict)
    """Additive logit bias per token id."""


CONTINUE = Decision()


class RowRule(ABC):
    """One row's incremental state. Subclasses implement :meth:`push` and :meth:`decision`."""

    needs_text: bool = False
    """Whether :meth:`push` needs the token's decoded text (adapters detokenize only then)."""

    @abstractmethod
    def push(self, token: int, text: str) -> None:
        """Feed the next generated token (prompt tokens never arrive here) and its decoded text."""

    @abstractmethod
    def decision(self) -> Decision:
        """What the row may do next, given everything pushed so far."""

    def note_eos_suppressed(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Called by adapters when ``ban_eos`` masked an EOS that was the model's top choice."""

    def events(self) -> dict[str, Any]:
        """Facts for the result's meta (e.g. whether and where a rule fired)."""
        return {}


@dataclass(frozen=True)
class RuleSpec:
    """A row rule by import path and parameters: what the engine sends to backends (vLLM rebuilds the rule
    from it in its worker). ``mechanism`` says how every backend applies it: ``"logits_processor"`` (an edit of each
    step's logits: the row ends with EOS) or ``"stopping_criteria"`` (the row simply stops, no EOS appended).

    >>> RuleSpec("engine.rules.json_boundary:JsonBoundaryRule").build().needs_text
    True
    """

    target: str
    params: Mapping[str, Any] = field(default_factory=dict)
    mechanism: str = "logits_processor"
    bank: bool = False
    """An id-only repeat rule (``params["thresholds"]`` reads token ids only), decided once where the spec is made
    (:meth:`~engine.rules.repeat.RepeatRule.spec`): adapters run it in a
    :class:`~engine.rules.repeat_bank.RepeatBank` from its thresholds and never build the rule."""

    def build(self) -> RowRule:
        import importlib

        module, _, name = self.target.partition(":")
        rule = getattr(importlib.import_module(module), name)(**dict(self.params))
        if not isinstance(rule, RowRule):
            raise TypeError(f"{self.target} built a {type(rule).__name__}, not a RowRule")
        return rule

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.target, "params": dict(self.params), "mechanism": self.mechanism, "bank": self.bank}


class RuleSet:
    """One row's rules with the shared feeding logic every adapter uses.

    Rows stop being fed once they end (a terminal token), so the padding a batch adds after a finished row
    never reaches a rule. Decisions combine as: any force wins; else any ban; biases add up.

    >>> from engine.rules.repeat import RepeatRule, RepeatThresholds
    >>> rs = RuleSet([RepeatRule(RepeatThresholds(max_consecutive_token_repeats=2))], terminal_ids={0})
    >>> rs.feed(5); rs.decision().force_eos
    False
    >>> rs.feed(5); rs.decision().force_eos
    True
    >>> late = RuleSet([RepeatRule(RepeatThresholds(max_consecutive_token_repeats=2))], terminal_ids={0},
    ...                min_new_tokens=3)
    >>> for tok in (5, 5): late.feed(tok)
    >>> late.decision().force_eos, (late.feed(5), late.decision().force_eos)[1]
    (False, True)
    """

    def __init__(self, rules: list[RowRule], *, terminal_ids: set[int] | frozenset[int], decode: Any = None,
                 min_new_tokens: int = 0) -> None:
        """``decode`` gives rules that read text their text: a table with ``stream()`` (the cheap path,
        ``engine.rules.token_text.TokenBytes``) or any ``ids -> str`` function (decoded incrementally).
        ``min_new_tokens``: no rule ends the row before that many tokens (generation.min_new_tokens wins, as it
        does over EOS and stop strings on every backend); a rule that asks earlier ends it then."""
        from engine.rules.detok import text_stream

        self.rules = rules
        self.terminal = terminal_ids
        self.detok: Any = None
        if any(r.needs_text for r in rules) and decode is not None:
            self.detok = text_stream(decode)
        self.min_new_tokens = min_new_tokens
        self.done = False
        self.fed = 0
        self.eos_noted = False
        """Whether a held-back EOS was ever the top choice (adapters stop checking once it was)."""

    def feed(self, token: int) -> None:
        self.fed += 1
        if self.done:
            return
        if token in self.terminal:
            self.done = True
            return
        text = self.detok.push(token) if self.detok is not None else ""
        for rule in self.rules:
            rule.push(token, text)

    def decision(self) -> Decision:
        if self.done or not self.rules:
            return CONTINUE
        may_end = self.fed >= self.min_new_tokens
        if len(self.rules) == 1:  # the common case: nothing to combine
            d = self.rules[0].decision()
            return d if may_end or not d.force_eos else CONTINUE
        decisions = [r.decision() for r in self.rules]
        if any(d.force_eos for d in decisions):
            if may_end:
                return Decision(force_eos=True)
            decisions = [d for d in decisions if not d.force_eos]
        bias: dict[int, float] = {}
        for d in decisions:
            for tok, b in d.bias.items():
                bias[tok] = bias.get(tok, 0.0) + b
        return Decision(ban_eos=any(d.ban_eos for d in decisions), bias=bias)

    def note_eos_suppressed(self) -> None:
        self.eos_noted = True
        for rule in self.rules:
            if rule.decision().ban_eos:
                rule.note_eos_suppressed()

    def events(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for rule in self.rules:
            merged.update(rule.events())
        return merged


def rule_sets(specs: Sequence[RuleSpec], batch: int, *, terminal_ids: Sequence[int],
              decode: Callable[[Sequence[int]], str] | None, min_new_tokens: int = 0) -> list[RuleSet]:
    """One fresh :class:`RuleSet` per row, built from ``specs``."""
    terminal = frozenset(terminal_ids)
    return [RuleSet([s.build() for s in specs], terminal_ids=terminal, decode=decode, min_new_tokens=min_new_tokens)
            for _ in range(batch)]
