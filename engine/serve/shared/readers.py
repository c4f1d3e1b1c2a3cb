"""What the wire formats read alike (``/infer/``, ``/v1/chat/completions``, ``/v1/completions``, Pattern C ``/chat``):
the ``engine`` extension field, stop strings and chat messages, checked into the engine's terms. No web framework is
imported here; what they write alike is :mod:`engine.serve.shared.writers`.

Each surface's own format lives in its folder: ``rollout/infer.py``, ``openai/chat.py``, ``openai/text.py``,
``pattern_c/chat.py``; field names both ways: :mod:`engine.serve.shared.fields`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.errors import RequestError
from engine.types import check_messages


def stop_strings(value: Any) -> dict[str, Any] | None:
    """A wire ``stop`` (a string or a list of strings, as the body model checked; None or [] for none) as an engine
    stop policy."""
    if value is None or value == []:
        return None
    return {"strings": [value] if isinstance(value, str) else list(value)}


def engine_extension(extension: Any, options: dict[str, Any], stop: dict[str, Any] | None, *,
                     options_from: str, stop_field: str) -> tuple[dict[str, Any], Any, Any, Any]:
    """Merge the additive ``engine: {options, stop, plugins, repeat_terminate}`` envelope (a validated
    ``EngineExtension``, or None) into what the wire's own fields set (``options``, ``stop``); a field set in both
    places is refused. Returns (options, stop, plugins, repeat_terminate)."""
    if extension is None:
        return options, stop, None, None
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
    return options, stop, extension.plugins, extension.repeat_terminate


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages as engine messages: text content parts joined into one string, other parts refused
    (the engine validates roles and the rest).

    >>> chat_messages([{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "!"}]}])
    [{'role': 'user', 'content': 'Hi !'}]
    """
    check_messages(messages, "messages", fix='send [{"role": "user", "content": "..."}]')
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
