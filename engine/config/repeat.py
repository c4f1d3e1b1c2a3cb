"""``repeat_terminate``: the config subtree of the repeat-aware termination guard."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from engine.config.validation import check_range, check_type
from engine.errors import ConfigError
from engine.rules.repeat import MAX_COUNT, MAX_NGRAM_SIZE, RepeatThresholds


@dataclass(frozen=True)
class RepeatTerminateConfig(RepeatThresholds):
    """Per-sequence EOS for degenerate repetition; semantics in :mod:`engine.rules.repeat`.

    This subtree is the single source of truth: it reaches every backend unchanged, and the engine
    refuses to start when ``enabled`` is true but the selected backend cannot run the guard.

    >>> RepeatTerminateConfig(enabled=True, ngram_size=4, ngram_repeats=3).thresholds().ngram_size
    4
    >>> RepeatTerminateConfig(enabled=True)
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: repeat_terminate.enabled has no threshold set, got True. \
Fix: set max_consecutive_token_repeats, ngram_size + ngram_repeats, or max_object_keys.
    """

    enabled: bool = False
    """Activate the guard. The thresholds are :class:`~engine.rules.repeat.RepeatThresholds`' fields (one
    definition, documented there): this subtree is those plus ``enabled``, validated here."""

    def __post_init__(self) -> None:
        p = "repeat_terminate"
        check_type(f"{p}.enabled", self.enabled, bool, "true or false")
        check_type(f"{p}.min_new_tokens", self.min_new_tokens, int, "an integer")
        check_range(f"{p}.min_new_tokens", self.min_new_tokens, low=0, high=MAX_COUNT)
        for name, low, high in (("max_consecutive_token_repeats", 2, MAX_COUNT), ("ngram_size", 2, MAX_NGRAM_SIZE),
                                ("ngram_repeats", 2, MAX_COUNT), ("max_object_keys", 1, MAX_COUNT)):
            value = getattr(self, name)
            if value is not None:
                check_type(f"{p}.{name}", value, int, "an integer")
                check_range(f"{p}.{name}", value, low=low, high=high)
        if (self.ngram_size is None) != (self.ngram_repeats is None):
            missing = "ngram_repeats" if self.ngram_repeats is None else "ngram_size"
            raise ConfigError(f"{p}.{missing}", None, "must be set together with the other n-gram key",
                              fix="set both ngram_size and ngram_repeats, or neither")
        if self.enabled and not self.has_threshold:
            raise ConfigError(f"{p}.enabled", True, "has no threshold set",
                              fix="set max_consecutive_token_repeats, ngram_size + ngram_repeats, or max_object_keys")

    @property
    def has_threshold(self) -> bool:
        return any(v is not None for v in (self.max_consecutive_token_repeats, self.ngram_size,
                                           self.max_object_keys))

    def as_dict(self) -> dict[str, object]:
        """Every key with its effective value (defaults filled in): what a server reports and hashes."""
        return asdict(self)

    def fingerprint(self) -> str:
        """SHA-256 of the effective subtree (canonical JSON); equal for subtrees that differ only in omitted
        defaults, different for any setting that changes the guard.

        >>> a = RepeatTerminateConfig(enabled=True, max_consecutive_token_repeats=4)
        >>> a.fingerprint() == RepeatTerminateConfig(enabled=True, max_consecutive_token_repeats=4,
        ...                                          min_new_tokens=0).fingerprint()
        True
        >>> a.fingerprint() == RepeatTerminateConfig(enabled=True, max_consecutive_token_repeats=5).fingerprint()
        False
        """
        canonical = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def overlaid(self, fields: Mapping[str, Any] | RepeatTerminateConfig | None,
                 where: str = "repeat_terminate") -> RepeatTerminateConfig:
        """The guard of one request on an engine (or server) whose own subtree is this one: a whole
        ``RepeatTerminateConfig`` replaces it; a mapping's fields are laid over it one by one (over the defaults when
        this guard is off, so an engine's unused thresholds never leak in). Giving a threshold turns the guard on
        unless the fields say ``enabled: false``; ``{"enabled": false}`` turns it off. One rule for the engine's
        per-call ``repeat_terminate`` and the vLLM plugin's per-request keys (``engine.vllm_plugin.settings``).

        >>> server = RepeatTerminateConfig(enabled=True, max_consecutive_token_repeats=8)
        >>> server.overlaid({"ngram_size": 3, "ngram_repeats": 2}).max_consecutive_token_repeats
        8
        >>> RepeatTerminateConfig().overlaid({"max_consecutive_token_repeats": 4}).enabled
        True
        >>> server.overlaid({"enabled": False}).enabled, RepeatTerminateConfig().overlaid({"min_new_tokens": 3}).enabled
        (False, False)
        >>> server.overlaid({"ngram_size": 1, "ngram_repeats": 2})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        engine.errors.ConfigError: repeat_terminate.ngram_size must be in [2, 1024], got 1. ...
        """
        from engine.config.validation import merge

        if fields is None:
            return self
        if isinstance(fields, RepeatTerminateConfig):
            return fields
        if not isinstance(fields, Mapping):
            raise ConfigError(where, fields, "must be a mapping of the guard's fields or a RepeatTerminateConfig",
                              fix='give e.g. {"max_consecutive_token_repeats": 4}')
        given = dict(fields)
        if "enabled" not in given:
            given["enabled"] = self.enabled or bool(set(given) - {"min_new_tokens"})
        return merge(self if self.enabled else RepeatTerminateConfig(), given, where)

    def thresholds(self, generation_min_new_tokens: int = 0) -> RepeatThresholds:
        """The pure rule's thresholds; the gate is the larger of both min_new_tokens."""
        values = {f.name: getattr(self, f.name) for f in fields(RepeatThresholds)}
        return RepeatThresholds(**{**values, "min_new_tokens": max(self.min_new_tokens, generation_min_new_tokens)})
