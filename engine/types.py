"""Requests in, results out: the engine's public data types."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import RequestError

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatRequest:
    """One chat conversation to continue; the engine renders it with the model's chat template.

    >>> req = ChatRequest.of([{"role": "user", "content": "Hi"}], index=0)
    >>> req.messages[0]["content"]
    'Hi'
    >>> ChatRequest.of([], index=3)
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: requests[3].messages must be a non-empty list of messages, got []. \
Fix: give at least one {'role': 'user', 'content': ...} message.
    """

    messages: tuple[Mapping[str, Any], ...]

    @classmethod
    def of(cls, raw: ChatRequest | Sequence[Mapping[str, Any]], *, index: int) -> ChatRequest:
        """Validate one request (a ChatRequest or a list of ``{"role", "content"}`` messages)."""
        if isinstance(raw, ChatRequest):
            raw = raw.messages
        where = f"requests[{index}]"
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence) or len(raw) == 0:
            raise RequestError(f"{where}.messages", raw, "must be a non-empty list of messages",
                               fix="give at least one {'role': 'user', 'content': ...} message")
        for j, msg in enumerate(raw):
            at = f"{where}.messages[{j}]"
            if not isinstance(msg, Mapping):
                raise RequestError(at, msg, "must be a mapping with 'role' and 'content'",
                                   fix="write it as {'role': 'user', 'content': 'text'}")
            role = msg.get("role")
            if role not in ROLES:
                raise RequestError(f"{at}.role", role, f"must be one of {', '.join(ROLES)}",
                                   fix="use a standard chat role")
            if "content" not in msg:
                raise RequestError(f"{at}.content", None, "is required", fix="add the message text as 'content'")
            if not isinstance(msg["content"], str):
                raise RequestError(f"{at}.content", msg["content"], "must be a string on the text path",
                                   fix="pass the message text as a string")
        return cls(tuple(dict(m) for m in raw))


@dataclass(frozen=True)
class GenerationResult:
    """What one request produced. Decoded text only: the engine never parses outputs.

    ``text`` is the assistant text (special tokens skipped, cut at the earliest stop string, post-decode
    steps applied); ``raw_text`` is the same tokens decoded with special tokens kept and nothing removed.
    ``token_ids`` are the generated ids, up to and including the token that ended the row.

    >>> r = GenerationResult(text="Paris.", raw_text="Paris.<|im_end|>", token_ids=(1, 2), prompt_token_ids=(7,),
    ...                      finish_reason="stop", stop_reason=2)
    >>> r.num_generated_tokens
    2
    """

    text: str
    raw_text: str
    token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    finish_reason: str
    """"stop" (EOS, stop token id, stop string, or a rule that ended the row) or "length" (token budget or context
    length)."""
    stop_reason: str | int | None
    """The matched stop string; else the rule that ended the row ("repeat_terminate", "json_boundary",
    "min_length"), whose forced EOS is the last token; else the token id that ended it (EOS included); None for
    "length"."""
    logprobs: tuple[dict[int, float], ...] | None = None
    """Per generated token: token id -> log-probability (top-k plus the chosen token), if asked for."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Per-request facts: backend, template fallback, pad-token fallback, token counts, ..."""

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)
