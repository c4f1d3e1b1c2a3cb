"""Reading a YAML config file: unreadable files, invalid YAML and duplicate keys are :class:`ConfigError` s.

YAML itself keeps the last of two equal keys in a mapping, so a second ``host: 0.0.0.0`` further down a file
silently wins; every config file the engine reads goes through :func:`load_yaml`, which refuses it by line.

>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "serve.yaml")
>>> _ = open(path, "w").write("serve:\\n  host: 127.0.0.1\\n  port: 8000\\n  host: 0.0.0.0\\n")
>>> load_yaml(path, field="--config")
Traceback (most recent call last):
...
engine.errors.ConfigError: --config line 4 has the key 'host' twice in one mapping (first on line 2; YAML would \
silently keep the last), got 'host'. Fix: keep one 'host' in that mapping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import ConfigError


def load_yaml(path: str | Path, *, field: str) -> Any:
    """The document in ``path``; ``field`` names the file in errors (e.g. ``--config``)."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise ConfigError(field, str(path), f"cannot be read ({reason})", fix="give an existing YAML file") from err
    try:
        return yaml.load(text, Loader=_loader())  # a SafeLoader subclass: no arbitrary objects
    except _DuplicateKey as dup:
        raise ConfigError(f"{field} line {dup.line}", dup.key, f"has the key {dup.key!r} twice in one mapping "
                          f"(first on line {dup.first}; YAML would silently keep the last)",
                          fix=f"keep one {dup.key!r} in that mapping") from None
    except yaml.YAMLError as err:
        raise ConfigError(field, str(path), f"is not valid YAML ({' '.join(str(err).split())})",
                          fix="fix the YAML at the line it names") from err


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first: int) -> None:
        self.key, self.line, self.first = key, line, first


_LOADER: Any = None


def _loader() -> Any:
    """A ``yaml.SafeLoader`` whose mappings refuse a key written twice (merge keys ``<<`` may still override)."""
    global _LOADER
    if _LOADER is None:
        import yaml

        class UniqueKeySafeLoader(yaml.SafeLoader):
            pass

        def mapping(loader: Any, node: Any) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = loader.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise _DuplicateKey(key, key_node.start_mark.line + 1, seen[key])
                    seen[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: SafeLoader's own error names it below
                    continue
            return yaml.SafeLoader.construct_mapping(loader, node, deep=True)  # merges, refuses unhashable keys

        UniqueKeySafeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
        _LOADER = UniqueKeySafeLoader
    return _LOADER
