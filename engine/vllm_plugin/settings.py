"""What the guard does to one request, decided from the request's own settings and the server's: pure, no vLLM.

Per request, in ``SamplingParams.extra_args`` (``vllm_xargs`` on vLLM's OpenAI routes, whose values are flat
strings and numbers), the seeds' subtrees field by field, as ``<subtree>.<field>`` keys:

==========================================  ========================================================================
``repeat_terminate.enabled``                 ``true``/``false`` (``1``/``0``): the guard on or off for this request
``repeat_terminate.<threshold>``             ``max_consecutive_token_repeats``, ``ngram_size`` + ``ngram_repeats``,
                                             ``max_object_keys``, ``min_new_tokens`` (:mod:`engine.rules.repeat`)
``min_length.<field>``                       ``min_chars``, ``max_chars``, ``punctuation_bias`` (Pattern C's
                                             min-length control, the engine's ``min_length`` plugin)
==========================================  ========================================================================

In-process callers may give a whole subtree as a mapping instead (``extra_args={"repeat_terminate": {...}}``).
Keys of other prefixes belong to other extensions and are left alone. A request's ``repeat_terminate`` fields are
laid over the server's subtree (:mod:`engine.vllm_plugin.activation`) one by one; giving a threshold turns the guard
on for that request unless it says ``enabled: false``. vLLM's own ``min_tokens`` is honoured: no rule ends a row
before it.

>>> s = GuardSettings.resolve({"repeat_terminate.ngram_size": 3, "repeat_terminate.ngram_repeats": 2})
>>> s.repeat.ngram_size, s.repeat.enabled, s.min_length
(3, True, None)
>>> GuardSettings.resolve({"temperature_schedule": "x"}) is None  # another extension's key
True
>>> GuardSettings.resolve({"repeat_terminate.ngram_size": 1, "repeat_terminate.ngram_repeats": 2})
... # doctest: +ELLIPSIS
Traceback (most recent call last):
...
engine.errors.ConfigError: repeat_terminate.ngram_size must be in [2, 1024], got 1. ...
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.config.repeat import RepeatTerminateConfig
from engine.config.validation import build
from engine.errors import ConfigError, did_you_mean
from engine.rules.base import RuleSpec

REPEAT = "repeat_terminate"
MIN_LENGTH = "min_length"
SUBTREES = (REPEAT, MIN_LENGTH)
"""The prefixes of the guard's per-request keys: the seeds' config subtrees."""
OFF = RepeatTerminateConfig()


def subtrees(extra_args: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The guard's fields a request gives, by subtree (only the subtrees it names).

    >>> subtrees({"repeat_terminate.ngram_size": 4, "min_length": {"min_chars": 20}, "other.x": 1})
    {'repeat_terminate': {'ngram_size': 4}, 'min_length': {'min_chars': 20}}
    >>> subtrees({"min_lenght.min_chars": 20})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: vllm_xargs.min_lenght.min_chars is not a key of the engine's guard, got 20. ...
    """
    found: dict[str, dict[str, Any]] = {}
    for key, value in (extra_args or {}).items():
        if not isinstance(key, str):
            continue
        name, dot, field = key.partition(".")
        if name in SUBTREES and not dot:
            if not isinstance(value, Mapping):
                raise ConfigError(key, value, "must be a mapping of its fields", fix=f"give {name}.<field> keys "
                                  f"(vllm_xargs takes flat keys), e.g. {name}.{_example(name)}")
            found.setdefault(name, {}).update(value)
        elif name in SUBTREES:
            found.setdefault(name, {})[field] = value
        elif dot and _near(name):
            raise ConfigError(f"vllm_xargs.{key}", value, "is not a key of the engine's guard",
                              fix=f"{did_you_mean(name, SUBTREES)} (keys are <subtree>.<field>, subtrees "
                                  f"{', '.join(SUBTREES)})")
    return found


def _near(name: str) -> bool:
    """A prefix close to one of ours (a misspelt subtree), not another extension's."""
    import difflib

    return bool(difflib.get_close_matches(name, SUBTREES, n=1, cutoff=0.8))


def _example(name: str) -> str:
    return "ngram_size" if name == REPEAT else "min_chars"


def _enabled(value: Any) -> Any:
    """``enabled`` as sent: JSON true/false reach vLLM's ``vllm_xargs`` as 1/0, a form as "true"/"false"."""
    spelled = {1: True, 0: False, "1": True, "0": False, "true": True, "false": False}
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, str)) and value in spelled:
        return spelled[value]
    raise ConfigError(f"{REPEAT}.enabled", value, "must be true or false (1 or 0)", fix="send true or false")


@dataclass(frozen=True)
class GuardSettings:
    """One request's guard: the repeat guard's subtree (None: off) and min-length's bounds (None: off).

    >>> GuardSettings.resolve({"min_length.min_chars": 40}).min_length
    {'min_chars': 40, 'max_chars': None, 'punctuation_bias': 0.0}
    >>> server = RepeatTerminateConfig(enabled=True, max_consecutive_token_repeats=8)
    >>> GuardSettings.resolve({}, server=server).repeat.max_consecutive_token_repeats
    8
    >>> GuardSettings.resolve({"repeat_terminate.enabled": 0}, server=server) is None
    True
    """

    repeat: RepeatTerminateConfig | None = None
    min_length: dict[str, Any] | None = None

    @classmethod
    def resolve(cls, extra_args: Mapping[str, Any] | None, *,
                server: RepeatTerminateConfig | None = None) -> GuardSettings | None:
        """The guard for a request with ``extra_args`` on a server whose own subtree is ``server``; None when no
        rule runs. A bad value raises :class:`~engine.errors.ConfigError` naming the field, the value and the fix."""
        given = subtrees(extra_args)
        repeat = server if server is not None and server.enabled else None
        if REPEAT in given:
            fields = dict(given[REPEAT])
            if "enabled" in fields:
                fields["enabled"] = _enabled(fields["enabled"])
            repeat = (server or OFF).overlaid(fields, REPEAT)
            repeat = repeat if repeat.enabled else None
        min_length = None
        if MIN_LENGTH in given:
            from engine.plugins.builtin import MinLengthPlugin

            min_length = MinLengthPlugin(where=MIN_LENGTH, **given[MIN_LENGTH]).settings
            if not min_length["min_chars"] and min_length["max_chars"] is None:
                min_length = None  # nothing to hold back or cap
        return cls(repeat, min_length) if repeat is not None or min_length is not None else None

    @property
    def needs_sentence_ends(self) -> bool:
        return bool(self.min_length and self.min_length["punctuation_bias"])

    def specs(self, *, min_tokens: int = 0, sentence_end_ids: Iterable[int] = ()) -> list[RuleSpec]:
        """The rule specs of the row (the engine's own: the same classes, thresholds and bank decision), with vLLM's
        ``min_tokens`` as the floor of the repeat guard's ``min_new_tokens``.

        >>> [s.target for s in GuardSettings.resolve({"repeat_terminate.max_consecutive_token_repeats": 4,
        ...                                            "min_length.min_chars": 10}).specs()]
        ['engine.rules.repeat:RepeatRule', 'engine.rules.min_length:MinLengthRule']
        """
        from engine.rules.repeat import RepeatRule

        specs = []
        if self.repeat is not None:
            specs.append(RepeatRule.spec(self.repeat.thresholds(min_tokens)))
        if self.min_length is not None:
            from engine.plugins.base import PluginContext
            from engine.plugins.builtin import MinLengthPlugin

            plugin = MinLengthPlugin(where=MIN_LENGTH, **self.min_length)
            specs.append(plugin.rule_spec("vllm", PluginContext(eos_token_id=-1,
                                                                sentence_end_ids=tuple(sentence_end_ids))))
        return specs


def server_subtree(subtree: Any, source: str) -> RepeatTerminateConfig:
    """The server-wide subtree, validated (the field names say where it came from when it is bad)."""
    try:
        return build(RepeatTerminateConfig, subtree, REPEAT)
    except ConfigError as err:
        raise ConfigError(f"{err.field} (from {source})", err.value, err.problem, fix=err.fix) from None
