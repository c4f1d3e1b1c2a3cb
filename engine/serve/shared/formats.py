"""What the wire formats share (``/infer/``, ``/v1/chat/completions``, ``/v1/completions``, Pattern C ``/chat``):
the ``engine`` extension field, stop strings, chat messages, per-token logprobs and usage. No web framework is
imported here.

Each surface's own format lives in its folder: ``rollout/infer.py``, ``openai/chat.py``, ``openai/text.py``,
``pattern_c/chat.py``; field names both ways: :mod:`engine.serve.shared.fields`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from engine.errors import RequestError
from engine.types import GenerationResult


def stop_strings(value: Any) -> dict[str, Any] | None:
    """A wire ``stop`` (a string or a list of strings, as the body model checked; None or [] for none) as an engine
    stop policy."""
    if value is None or value == []:
        return None
    return {"strings": [value] if isinstance(value, str) else list(value)}


def engine_extension(extension: Any, options: dict[str, Any], stop: dict[str, Any] | None, *,
                     options_from: str, stop_field: str) -> tuple[dict[str, Any], Any, Any]:
    """Merge the additive ``engine: {options, stop, plugins}`` envelope (a validated ``EngineExtension``, or None)
    into what the wire's own fields set (``options``, ``stop``); a field set in both places is refused. Returns
    (options, stop, plugins)."""
    if extension is None:
        return options, stop, None
    extra = extension.options or {}
    clash = sorted(set(extra) & set(options))
    if clash:
        raise RequestError(f"engine.options.{clash[0]}", extra[clash[0]], f"is also set {options_from}",
                           fix="set it in one place")
    options = {**options, **extra}
    if extension.stop is not None:
        if stop is not None:
            raise RequestError("engine.stop", extension.stop, f"conflicts with {stop_field}",
                               fix="give stop strings in one place")
        stop = dict(extension.stop)
    return options, stop, extension.plugins


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages as engine messages: text content parts joined into one string, other parts refused
    (the engine validates roles and the rest).

    >>> chat_messages([{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "!"}]}])
    [{'role': 'user', 'content': 'Hi !'}]
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", messages, "must be a non-empty list of messages",
                           fix='send [{"role": "user", "content": "..."}]')
    out = []
    for i, msg in enumerate(messages):
        if isinstance(msg, Mapping) and isinstance(msg.get("content"), list):
            parts = []
            for j, part in enumerate(msg["content"]):
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise RequestError(f"messages[{i}].content[{j}]", kind, "is not a text part (this endpoint "
                                       "serves text chat)", fix='send {"type": "text", "text": "..."} parts')
                parts.append(part["text"])
            msg = {**msg, "content": "".join(parts)}
        out.append(dict(msg) if isinstance(msg, Mapping) else msg)
    return out


# -- responses ------------------------------------------------------------------------------------------

FLOOR = -9999.0
"""What ``choices[].logprobs`` shows for a -inf log-probability (JSON has no infinities; vLLM's OpenAI server uses
the same floor). The ``/infer/`` envelope's ``token_logprobs`` keeps the exact value, as the string "-inf"."""


def shown_logprob(value: float) -> float:
    """The value shown in ``choices[].logprobs``.

    >>> shown_logprob(float("-inf")), shown_logprob(-0.5)
    (-9999.0, -0.5)
    """
    return value if math.isfinite(value) else FLOOR


def token_name(token_id: int, tokenizer: Any, as_ids: bool = False) -> str:
    """How logprobs name a token: its text, or ``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids``, for tokens
    whose text is not valid on its own, e.g. half of a UTF-8 character).

    >>> token_name(7, None, as_ids=True)
    'token_id:7'
    """
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


def logprobs_content(result: GenerationResult, tokenizer: Any, top: int | None,
                     as_ids: bool = False) -> dict[str, Any] | None:
    """Per-token logprobs in OpenAI's (and swift's) shape: token (or ``"token_id:<id>"`` with ``as_ids``), logprob,
    bytes (of the token's text), and ``top`` alternatives."""
    if result.logprobs is None:
        return None
    content = []

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_name(token_id, tokenizer, as_ids), "logprob": shown_logprob(logprob),
                "bytes": list(tokenizer.decode([token_id]).encode("utf8"))}

    for token_id, step in zip(result.token_ids, result.logprobs, strict=True):
        chosen = entry(token_id, step[token_id])
        if top is not None:
            chosen["top_logprobs"] = [entry(k, lp) for k, lp in sorted(step.items(), key=lambda kv: -kv[1])[:top]]
        content.append(chosen)
    return {"content": content}


def usage(result: GenerationResult) -> dict[str, int]:
    prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
