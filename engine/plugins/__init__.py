"""Plugins: explicit, validated generation-time customization. Built-ins by name; third-party plugins
through the ``engine.plugins`` entry-point group (``name = "package.module:PluginClass"``).

>>> sorted(available_plugins())[:3]
['cleanup', 'json_boundary', 'min_length']
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Mapping, Sequence
from typing import Any

from engine.errors import ConfigError
from engine.plugins.base import POST_DECODE, REQUEST_KINDS, Plugin, PluginContext

ENTRY_POINT_GROUP = "engine.plugins"
BUILTINS: dict[str, str] = {
    "json_boundary": "engine.plugins.builtin:JsonBoundaryPlugin",
    "cleanup": "engine.plugins.builtin:CleanupPlugin",
    "min_length": "engine.plugins.builtin:MinLengthPlugin",
}


def available_plugins() -> dict[str, str]:
    """Every plugin name and its ``module:Class``: built-ins, then entry points (which may not shadow them)."""
    found = dict(BUILTINS)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def plugin_class(name: str, *, where: str = "plugins") -> type[Plugin]:
    from engine.errors import did_you_mean

    if not isinstance(name, str):
        raise ConfigError(f"{where}.name", name, "must be a plugin name (a string)",
                          fix=f"use one of {', '.join(sorted(available_plugins()))}")
    # Built-ins resolve without the entry-point scan (about 10 ms: it would run on every request of a server).
    registry = BUILTINS if name in BUILTINS else available_plugins()
    if name not in registry:
        raise ConfigError(f"{where}.name", name, "is not a registered plugin", fix=did_you_mean(str(name), registry))
    module, _, attr = registry[name].partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Plugin)):
        raise ConfigError(f"{where}.name", name, f"resolves to {registry[name]}, which is not a Plugin subclass",
                          fix="point the entry point at a subclass of engine.plugins.Plugin")
    return cls


def create_plugin(spec: Plugin | Mapping[str, Any], *, index: int) -> Plugin:
    """A plugin from ``{"name": ..., **params}`` (or an instance, returned as is)."""
    if isinstance(spec, Plugin):
        return spec
    where = f"plugins[{index}]"
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ConfigError(where, spec, "must be a mapping with a 'name' key", fix="write {name: cleanup, ...}")
    params = {k: v for k, v in spec.items() if k != "name"}
    return plugin_class(spec["name"], where=where)(index, **params)


def create_plugins(specs: Any) -> list[Plugin]:
    """Plugins from a list of specs (``create_plugin`` each); anything but a list is refused by name.

    >>> create_plugins(5)
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: plugins must be a list of plugins, got 5. Fix: write [{name: cleanup}], or [] for none.
    """
    if isinstance(specs, (str, bytes, Mapping)) or not isinstance(specs, Sequence):
        raise ConfigError("plugins", specs, "must be a list of plugins", fix="write [{name: cleanup}], or [] for none")
    return [create_plugin(p, index=i) for i, p in enumerate(specs)]


__all__ = ["BUILTINS", "ENTRY_POINT_GROUP", "POST_DECODE", "REQUEST_KINDS", "Plugin", "PluginContext",
           "available_plugins", "create_plugin", "create_plugins", "plugin_class"]
