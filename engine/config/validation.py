"""Validation shared by every config section and every surface that checks user input: turn plain mappings (parsed
YAML, dicts, request bodies) into frozen dataclasses strictly, and check types and ranges with messages that name
the field, the value and the fix.

Unknown keys fail with a "did you mean" hint; nested dataclasses are built recursively; lists become tuples
so configs stay hashable and immutable. Range checks live in each dataclass's ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from engine.errors import ConfigError, did_you_mean

T = TypeVar("T")


def build(cls: type[T], data: Any, path: str) -> T:
    """Build dataclass ``cls`` from ``data`` (a mapping or an instance), naming keys by dotted ``path``."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(path or cls.__name__, data, "must be a mapping", fix=f"give a mapping of {cls.__name__} keys")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in fields:
            raise ConfigError(full, value, "is not a known key", fix=did_you_mean(str(key), fields))
        kwargs[key] = _coerce(hints[key], value, full)
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        full = f"{path}.{missing[0]}" if path else missing[0]
        raise ConfigError(full, None, "is required", fix=f"set {full}")
    return cls(**kwargs)


def merge(base: T, overrides: Any, path: str) -> T:
    """``base`` with ``overrides`` applied: None keeps it, an instance replaces it, a mapping overrides
    fields and is validated together with the rest (so cross-field checks see the merged whole)."""
    if overrides is None:
        return base
    if isinstance(overrides, type(base)):
        return overrides
    if not isinstance(overrides, Mapping):
        raise ConfigError(path, overrides, "must be a mapping of fields or a whole config object",
                          fix=f"pass a dict of {type(base).__name__} fields")
    return build(type(base), {**dataclasses.asdict(base), **overrides}, path)  # type: ignore[call-overload]


def _coerce(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        non_none = [o for o in options if o is not type(None)]
        if len(non_none) == 1:
            return _coerce(non_none[0], value, path)
        return value
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return build(hint, value, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):  # not a string's characters, a mapping's keys or a set's order
            raise ConfigError(path, value, "must be a list", fix="write it as a YAML list, e.g. [a, b]")
        return tuple(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def check_type(path: str, value: Any, kind: type | tuple[type, ...], what: str) -> None:
    """Reject values of the wrong type (bools are not ints here)."""
    if isinstance(value, bool) and kind is not bool and (kind is int or (isinstance(kind, tuple) and bool not in kind)):
        raise ConfigError(path, value, f"must be {what}", fix=f"give {what}, not a boolean")
    if not isinstance(value, kind):
        raise ConfigError(path, value, f"must be {what}", fix=f"give {what}")


def _bound(value: float) -> str:
    """A bound as written in a message: integers whole (``2147483647``, not ``2.14748e+09``), floats short."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else f"{value:g}"


def check_range(path: str, value: float, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False, fix: str | None = None) -> None:
    """Check ``value`` is finite and lies in the interval, with a message that states exactly the interval checked
    and a fix (``fix``, or the interval itself).

    >>> check_range("generation.temperature", float("nan"), low=0)
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: generation.temperature must be a finite number, got nan. Fix: give a value in [0, inf).
    """
    left = "(" if low_open or low is None else "["
    right = ")" if high_open or high is None else "]"
    lo = "-inf" if low is None else _bound(low)
    hi = "inf" if high is None else _bound(high)
    interval = f"{left}{lo}, {hi}{right}"
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(path, value, "must be a finite number", fix=fix or f"give a value in {interval}")
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        raise ConfigError(path, value, f"must be in {interval}", fix=fix or f"give a value in {interval}")
