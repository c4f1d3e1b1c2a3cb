"""``repeat_terminate``: the config subtree of the repeat-aware termination guard."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from engine.config._build import check_range, check_type
from engine.errors import ConfigError
from engine.rules.repeat import RepeatThresholds


@dataclass(frozen=True)
class RepeatTerminateConfig:
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
    """Activate the guard."""
    min_new_tokens: int = 0
    """No trigger before this many generated tokens exist, in [0, inf). (Generation's own
    ``min_new_tokens`` is honoured too: the guard never ends a row before it.)"""
    max_consecutive_token_repeats: int | None = None
    """Fire when the last N generated tokens are one token id, N in [2, inf). None: off."""
    ngram_size: int | None = None
    """n of the repeated n-gram, in [2, inf) (a 1-gram is the consecutive threshold). None: off."""
    ngram_repeats: int | None = None
    """Back-to-back repetitions of the n-gram that fire, in [2, inf). Set together with ngram_size."""
    max_object_keys: int | None = None
    """Fire when one JSON-like object in the decoded output gets more than K keys, K in [1, inf). None: off."""

    def __post_init__(self) -> None:
        p = "repeat_terminate"
        check_type(f"{p}.enabled", self.enabled, bool, "true or false")
        check_type(f"{p}.min_new_tokens", self.min_new_tokens, int, "an integer")
        check_range(f"{p}.min_new_tokens", self.min_new_tokens, low=0)
        for name, low in (("max_consecutive_token_repeats", 2), ("ngram_size", 2), ("ngram_repeats", 2),
                          ("max_object_keys", 1)):
            value = getattr(self, name)
            if value is not None:
                check_type(f"{p}.{name}", value, int, "an integer")
                check_range(f"{p}.{name}", value, low=low)
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

    def thresholds(self, generation_min_new_tokens: int = 0) -> RepeatThresholds:
        """The pure rule's thresholds; the gate is the larger of both min_new_tokens."""
        return RepeatThresholds(
            min_new_tokens=max(self.min_new_tokens, generation_min_new_tokens),
            max_consecutive_token_repeats=self.max_consecutive_token_repeats,
            ngram_size=self.ngram_size,
            ngram_repeats=self.ngram_repeats,
            max_object_keys=self.max_object_keys,
        )
