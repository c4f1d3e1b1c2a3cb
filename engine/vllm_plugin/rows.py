"""Which rules a request's row runs under the plugin: the user's settings made into the engine's row arguments.

Pure and vLLM-free (``params`` is anything with ``SamplingParams``' fields), so the decision is tested without an
engine; :mod:`engine.vllm_plugin.processor` calls it from both runner adapters.

>>> from types import SimpleNamespace
>>> params = SimpleNamespace(extra_args={"repeat_terminate.max_consecutive_token_repeats": 4}, ignore_eos=False,
...                          min_tokens=0, eos_token_id=2, all_stop_token_ids={2, 7})
>>> args = row_args(params, check=False)
>>> args.eos, sorted(args.terminal), [s.target for s in args.specs]
(2, [2, 7], ['engine.rules.repeat:RepeatRule'])
>>> row_args(SimpleNamespace(**{**vars(params), "extra_args": None}), check=False) is None
True
"""

from __future__ import annotations

import uuid
from functools import cache
from typing import Any

from engine.backends.vllm.rules import EXTRA_KEY, RowArgs
from engine.errors import ConfigError
from engine.vllm_plugin.activation import server_guard
from engine.vllm_plugin.settings import GuardSettings, subtrees


@cache
def sentence_end_ids(tokenizer_path: str) -> tuple[int, ...]:
    """The ids whose text ends a sentence (min-length's ``punctuation_bias`` nudges them), once per tokenizer."""
    from transformers import AutoTokenizer

    from engine.rules.min_length import is_sentence_end_token

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return tuple(i for i in range(len(tokenizer)) if is_sentence_end_token(tokenizer.decode([i])))


def row_args(params: Any, *, check: bool, tokenizer: str | None = None) -> RowArgs | None:
    """The rules a request's row runs under the plugin, from its ``extra_args`` and the server's guard; None: none.

    ``check`` (at admission, in the frontend, before vLLM has filled in the EOS id): a bad setting raises
    ``ConfigError`` (a ``ValueError``: vLLM answers it as a 400 naming it). Rows of the engine's own requests (which
    carry ``extra_args["engine_rules"]``) are the engine's processor's, never the plugin's."""
    extra = params.extra_args or {}
    if EXTRA_KEY in extra:
        return None
    settings = GuardSettings.resolve(extra, server=server_guard())
    if settings is None:
        return None
    asked = bool(subtrees(extra))
    if params.ignore_eos:  # the guard ends rows with EOS, which this request ignores
        if asked and check:
            raise ConfigError(f"vllm_xargs.{'/'.join(sorted(subtrees(extra)))}", "given with ignore_eos",
                              "ends a row with EOS, which ignore_eos turns off",
                              fix="drop ignore_eos, or the guard's settings, from the request")
        return None
    if check:
        settings.specs(min_tokens=params.min_tokens)  # every spec builds (its values were checked on the way)
        return RowArgs(specs=(), key="check", eos=0, terminal=frozenset())
    eos = params.eos_token_id
    if eos is None:
        return None
    ends = sentence_end_ids(tokenizer) if settings.needs_sentence_ends and tokenizer else ()
    return RowArgs(specs=tuple(settings.specs(min_tokens=params.min_tokens, sentence_end_ids=ends)),
                   key=uuid.uuid4().hex, eos=int(eos), terminal=frozenset({int(eos), *params.all_stop_token_ids}),
                   min_new=int(params.min_tokens or 0))


