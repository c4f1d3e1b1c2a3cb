"""The built-in plugins: balanced-JSON boundary stop, post-decode cleanup, min-length control."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from engine.config.validation import check_range, check_type
from engine.errors import ConfigError
from engine.plugins.base import (
    HF_STOPPING_CRITERIA,
    POST_DECODE,
    Plugin,
    PluginContext,
    logits_processor_hook,
)
from engine.rules.base import RuleSpec
from engine.rules.cleanup import cleanup, stable_prefix
from engine.rules.min_length import MAX_PUNCTUATION_BIAS
from engine.rules.repeat import MAX_COUNT

MECHANISMS = ("auto", "stopping_criteria", "logits_processor")


class JsonBoundaryPlugin(Plugin):
    """Stop a row once the first top-level JSON object or array in its output is balanced.

    ``mechanism: auto`` (the default) and ``logits_processor`` force EOS right after the closing token on every
    backend, so the row ends like any rule-ended row: ``token_ids`` end with that EOS, ``finish_reason "stop"``,
    ``stop_reason "json_boundary"``, identical on HF and vLLM. ``stopping_criteria`` (HF only: vLLM rejects it)
    stops the row on the closing token itself, without an EOS; finish and stop reasons are the same.
    """

    name = "json_boundary"
    params: ClassVar[Mapping[str, Any]] = {"mechanism": "auto"}

    def validate(self) -> None:
        if self.settings["mechanism"] not in MECHANISMS:
            raise ConfigError(f"{self.where}.mechanism", self.settings["mechanism"],
                              f"must be one of {', '.join(MECHANISMS)}", fix="use auto")

    def hooks(self, backend: str) -> frozenset[str]:
        mechanism = self.settings["mechanism"]
        if mechanism == "stopping_criteria":
            return frozenset({HF_STOPPING_CRITERIA})
        return frozenset({logits_processor_hook(backend)})

    def rule_spec(self, backend: str, ctx: PluginContext) -> RuleSpec:
        hook = "stopping_criteria" if self.settings["mechanism"] == "stopping_criteria" else "logits_processor"
        return RuleSpec("engine.rules.json_boundary:JsonBoundaryRule", {}, mechanism=hook)


class CleanupPlugin(Plugin):
    """Deterministic, non-parsing post-decode cleanup of ``text`` (``raw_text`` is never touched)."""

    name = "cleanup"
    params: ClassVar[Mapping[str, Any]] = {"trim_whitespace": True, "close_brackets": False, "sentence_end": False}

    def validate(self) -> None:
        for key in self.params:
            check_type(f"{self.where}.{key}", self.settings[key], bool, "true or false")

    def hooks(self, backend: str) -> frozenset[str]:
        return frozenset({POST_DECODE})

    def post_decode(self, text: str) -> str:
        return cleanup(text, **self.settings)

    def stream_prefix(self, text: str) -> str:
        return stable_prefix(text, **self.settings)


class MinLengthPlugin(Plugin):
    """Pattern C: EOS suppressed below ``min_chars`` decoded characters, then ``punctuation_bias`` on
    sentence-ending tokens, with ``max_chars`` as a hard cap. Meta: ``generated_chars``, ``returned_chars``,
    ``eos_suppressed`` (EOS was the model's top choice while suppressed), ``min_length_capped``."""

    name = "min_length"
    params: ClassVar[Mapping[str, Any]] = {"min_chars": 0, "max_chars": None, "punctuation_bias": 0.0}
    needs_sentence_ends = True

    def validate(self) -> None:
        s, w = self.settings, self.where
        check_type(f"{w}.min_chars", s["min_chars"], int, "an integer")
        check_range(f"{w}.min_chars", s["min_chars"], low=0, high=MAX_COUNT)
        if s["max_chars"] is not None:
            check_type(f"{w}.max_chars", s["max_chars"], int, "an integer")
            check_range(f"{w}.max_chars", s["max_chars"], low=max(1, s["min_chars"]), high=MAX_COUNT,
                        fix=f"keep max_chars at least min_chars and at most {MAX_COUNT}")
        check_type(f"{w}.punctuation_bias", s["punctuation_bias"], (int, float), "a number")
        check_range(f"{w}.punctuation_bias", s["punctuation_bias"], low=0, high=MAX_PUNCTUATION_BIAS,
                    fix=f"use a value in [0, {MAX_PUNCTUATION_BIAS:g}]; 0 disables the bias")

    def hooks(self, backend: str) -> frozenset[str]:
        return frozenset({logits_processor_hook(backend)})

    def rule_spec(self, backend: str, ctx: PluginContext) -> RuleSpec:
        s = self.settings
        return RuleSpec("engine.rules.min_length:MinLengthRule",
                        {"min_chars": s["min_chars"], "max_chars": s["max_chars"],
                         "punctuation_bias": float(s["punctuation_bias"]),
                         "sentence_end_ids": list(ctx.sentence_end_ids) if s["punctuation_bias"] else []})

    def result_meta(self, *, generated_text: str, text: str, events: Mapping[str, Any]) -> dict[str, Any]:
        return {"generated_chars": len(generated_text), "returned_chars": len(text),
                "eos_suppressed": bool(events.get("min_length_eos_suppressed", False)),
                "min_length_capped": bool(events.get("min_length_capped", False))}
