"""The plugin contract: what a plugin needs (hooks, request kinds) and what it supplies.

A plugin supplies at most two things: a generation-time :class:`~engine.rules.base.RowRule` (as a
:class:`~engine.rules.base.RuleSpec`, which each backend's adapter applies per row), and a post-decode text
step (deterministic, non-parsing). It declares per backend which hooks those need; the engine checks them
against the backend's capabilities and the request kind before any generation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.errors import ConfigError
from engine.rules.base import RuleSpec

HF_STOPPING_CRITERIA = "hf_stopping_criteria"
"""HF's stopping-criteria hook (a plugin that stops rows only HF can run); the other backends' hooks are their specs'
(``engine.backends.registry``)."""
POST_DECODE = "post_decode"


def logits_processor_hook(backend: str) -> str:
    """The hook through which ``backend`` applies a row rule to each step's logits.

    >>> logits_processor_hook("llamacpp")
    'llamacpp_logits_processor'
    """
    from engine.backends.registry import spec

    return spec(backend).logits_hook
REQUEST_KINDS = ("text", "vlm")


@dataclass(frozen=True)
class PluginContext:
    """Tokenizer facts a plugin may need to build its rule (computed once per engine, on demand)."""

    eos_token_id: int
    sentence_end_ids: tuple[int, ...] = field(default_factory=tuple)


class Plugin(ABC):
    """Base class of every plugin. Subclasses set ``name``, implement :meth:`hooks`, and override
    :meth:`rule_spec` and/or :meth:`post_decode`.

    >>> from engine.plugins import create_plugin
    >>> p = create_plugin({"name": "cleanup", "close_brackets": True}, index=0)
    >>> p.hooks("vllm"), p.post_decode('{"a": [1')
    (frozenset({'post_decode'}), '{"a": [1]}')
    """

    name: ClassVar[str]
    request_kinds: ClassVar[frozenset[str]] = frozenset(REQUEST_KINDS)
    params: ClassVar[Mapping[str, Any]] = {}
    """Accepted parameters and their defaults."""
    needs_sentence_ends: ClassVar[bool] = False

    def __init__(self, index: int = 0, *, where: str | None = None, **params: Any) -> None:
        self.where = where or f"plugins[{index}]"  # ``where``: how a caller outside a config names the settings
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            from engine.errors import did_you_mean

            raise ConfigError(f"{self.where}.{unknown[0]}", params[unknown[0]],
                              f"is not a parameter of plugin {self.name!r}", fix=did_you_mean(unknown[0], self.params))
        self.settings = {**self.params, **params}
        self.validate()

    def validate(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Check ``self.settings``; raise ConfigError naming ``{self.where}.<key>``."""

    @abstractmethod
    def hooks(self, backend: str) -> frozenset[str]:
        """The hooks this plugin needs when running on ``backend``."""

    def rule_spec(self, backend: str, ctx: PluginContext) -> RuleSpec | None:
        """The generation-time row rule, if any."""
        return None

    def post_decode(self, text: str) -> str:
        """The post-decode text step (after stop truncation); identity by default."""
        return text

    def stream_prefix(self, text: str) -> str:
        """The part of ``post_decode(more)`` that is fixed for every ``more`` extending ``text``: what a stream may
        emit before the answer is complete. Default: all of ``text`` when ``post_decode`` is the identity, else
        nothing (the step's output is then streamed once the answer is complete)."""
        return text if type(self).post_decode is Plugin.post_decode else ""

    def result_meta(self, *, generated_text: str, text: str, events: Mapping[str, Any]) -> dict[str, Any]:
        """Facts this plugin adds to each result's meta."""
        return {}
