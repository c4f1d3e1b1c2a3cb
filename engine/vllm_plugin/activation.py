"""The server-wide guard of a vLLM that loads the plugin: the seeds' start-up variables, read once per process.

The same variables as ``python -m engine.serve`` and the ms-swift plugin take (:mod:`engine.serve.activation`, one
kind only): ``COORDEXP_ENABLE_VLLM_REPEAT_TERMINATE_INJECTION=1`` with ``COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON``
(or ``..._CONFIG_JSON_PATH``), or the engine's ``ENGINE_REPEAT_TERMINATE_JSON`` / ``ENGINE_REPEAT_TERMINATE_FILE``.
With one of them set, every request runs the guard unless it says otherwise (:mod:`engine.vllm_plugin.settings`).

They are read when the engine builds the processor, at start-up, in the worker (and in the API server process when it
first validates a request): a bad value stops the engine's start with the variable, the field, the value and the fix,
before any request is served.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cache

from engine.config.repeat import RepeatTerminateConfig
from engine.serve.activation import subtree_from_env
from engine.vllm_plugin.settings import server_subtree


def guard_from_env(environ: Mapping[str, str]) -> RepeatTerminateConfig | None:
    """The server-wide ``repeat_terminate`` subtree the variables give, validated; None when none is set.

    >>> guard = guard_from_env(
    ...     {"ENGINE_REPEAT_TERMINATE_JSON": '{"enabled": true, "max_consecutive_token_repeats": 4}'})
    >>> guard.max_consecutive_token_repeats
    4
    >>> guard_from_env({}) is None
    True
    >>> guard_from_env({"ENGINE_REPEAT_TERMINATE_JSON": '{"enabled": true, "ngram_size": 4}'})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: repeat_terminate.ngram_repeats (from env:ENGINE_REPEAT_TERMINATE_JSON) must be set ...
    """
    chosen = subtree_from_env(environ)
    if chosen is None:
        return None
    subtree, source = chosen
    return server_subtree(subtree, source.partition("=")[0])


@cache
def server_guard() -> RepeatTerminateConfig | None:
    """:func:`guard_from_env` of this process's environment, read once."""
    return guard_from_env(os.environ)
