"""Where the served engine's ``repeat_terminate`` subtree comes from, decided once at startup.

Sources, in precedence order (the first one given wins; the served config's own subtree is the default):

1. ``--repeat-terminate-from FILE.yaml:dotted.path`` -- a subtree inside the learner's own YAML, e.g.
   ``train.yaml:custom.extra.rollout_matching.repeat_terminate``;
2. ``ENGINE_REPEAT_TERMINATE_JSON`` -- the subtree as a JSON object string, in the server process's environment;
3. ``ENGINE_REPEAT_TERMINATE_FILE`` -- a path to a JSON file holding the subtree;
4. the served config's ``repeat_terminate`` key.

The seed documents' variables are accepted as aliases of 2-3: ``COORDEXP_ENABLE_VLLM_REPEAT_TERMINATE_INJECTION=1``
with ``COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON=<json>`` or ``COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON_PATH=<file>``
(``...INJECTION=0`` alone: the guard off). Setting variables of both kinds is one error naming them.

Giving more than one of 1-3 is an error (which one was meant is ambiguous), as is a source that names nothing.
The subtree is taken whole and unchanged, then validated with the rest of the config before vLLM or torch is
imported. There is no request-time path: a request cannot turn the guard on or off.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config.yaml_file import load_yaml
from engine.errors import ConfigError

ENV_JSON = "ENGINE_REPEAT_TERMINATE_JSON"
ENV_FILE = "ENGINE_REPEAT_TERMINATE_FILE"
SEED_ENABLE = "COORDEXP_ENABLE_VLLM_REPEAT_TERMINATE_INJECTION"
SEED_JSON = "COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON"
SEED_FILE = "COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON_PATH"
FLAG = "--repeat-terminate-from"


@dataclass(frozen=True)
class Activation:
    """The chosen subtree (unvalidated, as given) and where it came from (reported by ``/health``)."""

    subtree: Any
    source: str

    @property
    def public_source(self) -> str:
        """``source`` without filesystem paths: what ``/health`` shows a caller that did not send the API key.

        >>> Activation(None, "env:ENGINE_REPEAT_TERMINATE_FILE=/home/me/rt.json").public_source
        'env:ENGINE_REPEAT_TERMINATE_FILE'
        >>> Activation(None, "--repeat-terminate-from /home/me/train.yaml:a.b").public_source
        '--repeat-terminate-from'
        """
        if self.source.startswith(FLAG):
            return FLAG
        name = self.source.partition("=")[0]
        return name if name.removeprefix("env:") in (ENV_FILE, SEED_FILE) else self.source


def subtree_from_yaml(spec: str) -> Any:
    """The value at ``dotted.path`` inside ``FILE.yaml`` for a ``FILE.yaml:dotted.path`` spec.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "train.yaml"
    >>> _ = f.write_text("custom:\\n  rt: {enabled: true, ngram_size: 3, ngram_repeats: 2}\\n")
    >>> subtree_from_yaml(f"{f}:custom.rt")["ngram_size"]
    3
    >>> subtree_from_yaml(f"{f}:custom.missing")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: --repeat-terminate-from custom.missing has no key 'missing' ...
    """
    path, sep, dotted = spec.rpartition(":")
    if not sep or not path or not dotted:
        raise ConfigError(FLAG, spec, "must be FILE.yaml:dotted.path",
                          fix="e.g. train.yaml:custom.extra.rollout_matching.repeat_terminate")
    data = load_yaml(path, field=f"{FLAG} {path}")
    node, walked = data, []
    for key in dotted.split("."):
        if not isinstance(node, Mapping) or key not in node:
            available = ", ".join(sorted(map(str, node))) if isinstance(node, Mapping) else "none (not a mapping)"
            raise ConfigError(f"{FLAG} {dotted}", spec, f"has no key {key!r} under {'.'.join(walked) or 'the top'}",
                              fix=f"check the dotted path; keys there: {available}")
        node = node[key]
        walked.append(key)
    return node


def subtree_from_env(environ: Mapping[str, str]) -> tuple[Any, str] | None:
    """The subtree from ``ENGINE_REPEAT_TERMINATE_JSON`` or ``..._FILE`` (never both), or from the seeds' variables
    (never beside ours), with its source name.

    >>> subtree_from_env({SEED_ENABLE: "1", SEED_JSON: '{"enabled": true, "ngram_size": 4, "ngram_repeats": 3}'})[1]
    'env:COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON'
    >>> subtree_from_env({SEED_ENABLE: "1", SEED_JSON: "{}", ENV_JSON: "{}"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: ENGINE_REPEAT_TERMINATE_JSON and COORDEXP_... are two ways to give one subtree, ...
    """
    ours = [name for name in (ENV_JSON, ENV_FILE) if environ.get(name) is not None]
    seeds = [name for name in (SEED_ENABLE, SEED_JSON, SEED_FILE) if environ.get(name) is not None]
    if ours and seeds:
        raise ConfigError(f"{' and '.join(ours)} and {', '.join(seeds)}", "both kinds set",
                          "are two ways to give one subtree, the engine's and the seeds' (its aliases)",
                          fix="set the variables of one kind only")
    if seeds:
        return _seed_subtree(environ)
    return _subtree(environ, ENV_JSON, ENV_FILE)


def _subtree(environ: Mapping[str, str], json_var: str, file_var: str) -> tuple[Any, str] | None:
    text, path = environ.get(json_var), environ.get(file_var)
    if text is not None and path is not None:
        raise ConfigError(f"{json_var} and {file_var}", "both set", "are alternatives", fix="set one of them")
    if text is not None:
        return _json(text, json_var), f"env:{json_var}"
    if path is not None:
        try:
            content = Path(path).read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(file_var, path, f"cannot be read ({err.strerror})",
                              fix="point it at a JSON file") from err
        return _json(content, file_var), f"env:{file_var}={path}"
    return None


def _seed_subtree(environ: Mapping[str, str]) -> tuple[Any, str]:
    """The seeds' variables: injection 1 takes the subtree from their JSON or file; 0 (with neither) turns the
    guard off; anything else, or a subtree beside injection 0 or none, is refused."""
    enable = environ.get(SEED_ENABLE)
    chosen = _subtree(environ, SEED_JSON, SEED_FILE)
    if enable not in ("0", "1"):
        raise ConfigError(SEED_ENABLE, enable, "must be 1 (use the subtree) or 0 (guard off)",
                          fix=f"set {SEED_ENABLE}=1 beside {SEED_JSON} or {SEED_FILE}")
    if enable == "0":
        if chosen is not None:
            raise ConfigError(SEED_ENABLE, enable, f"turns the guard off, but {chosen[1].removeprefix('env:')} "
                              "gives a subtree", fix=f"set {SEED_ENABLE}=1 to use it, or unset it")
        return {"enabled": False}, f"env:{SEED_ENABLE}=0"
    if chosen is None:
        raise ConfigError(SEED_ENABLE, enable, f"asks for the guard, but neither {SEED_JSON} nor {SEED_FILE} is set",
                          fix="give the repeat_terminate subtree in one of them")
    return chosen


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(where, text[:80], f"is not valid JSON ({err.msg} at char {err.pos})",
                          fix='give a JSON object, e.g. {"enabled": true, "max_consecutive_token_repeats": 8}') from err


def resolve(config: Mapping[str, Any], *, from_yaml: str | None = None,
            environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any], Activation]:
    """The served config with the chosen ``repeat_terminate`` subtree in place, and the choice.

    >>> cfg, act = resolve({"backend": "hf", "model": "/m"}, environ={ENV_JSON: '{"enabled": false}'})
    >>> cfg["repeat_terminate"], act.source
    ({'enabled': False}, 'env:ENGINE_REPEAT_TERMINATE_JSON')
    >>> resolve({"backend": "hf", "model": "/m"}, environ={})[1].source
    'default (disabled)'
    """
    environ = os.environ if environ is None else environ
    from_env = subtree_from_env(environ)
    if from_yaml is not None and from_env is not None:
        raise ConfigError(FLAG, from_yaml, f"conflicts with {from_env[1].split('=')[0].removeprefix('env:')} "
                          "in the environment", fix="give the subtree one way only")
    if from_yaml is not None:
        chosen: tuple[Any, str] | None = (subtree_from_yaml(from_yaml), f"{FLAG} {from_yaml}")
    else:
        chosen = from_env
    out = dict(config)
    if chosen is not None:
        out["repeat_terminate"] = chosen[0]
        return out, Activation(chosen[0], chosen[1])
    if "repeat_terminate" in config:
        return out, Activation(config["repeat_terminate"], "served config")
    return out, Activation(None, "default (disabled)")
