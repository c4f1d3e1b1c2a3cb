"""Requests in, results out: the engine's public data types."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import RequestError

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = ("role", "content")
"""What the engine reads from a message. Any other key (``name``, ``tool_calls``) is refused by name: the chat
template would otherwise drop it or not, silently, depending on the model."""


def check_unicode(text: str, at: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate, as ``"\\ud800"`` in JSON gives): no tokenizer
    can encode it.

    >>> check_unicode("caf\\u00e9", "x")
    >>> check_unicode("a\\ud800b", "requests[0].messages[0].content")
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: requests[0].messages[0].content holds a lone surrogate at character 1 (not valid \
Unicode text), got 'a\\ud800b'. Fix: send the text as valid UTF-8.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(at, text, f"holds a lone surrogate at character {err.start} (not valid Unicode text)",
                           fix="send the text as valid UTF-8") from None


def check_messages(raw: Any, at: str, *, fix: str) -> None:
    """Refuse anything but a non-empty list of messages at ``at`` (every surface's first check of a conversation).

    >>> check_messages([], "requests[0].messages", fix="give a message")
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: requests[0].messages must be a non-empty list of messages, got []. Fix: give a message.
    """
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence) or len(raw) == 0:
        raise RequestError(at, raw, "must be a non-empty list of messages", fix=fix)


def check_message(msg: Any, at: str, *, fix: str) -> None:
    """Refuse a message that is not a mapping of the keys the engine reads with a standard role (its content is the
    caller's to check: text, or a VLM request's parts).

    >>> check_message({"role": "robot", "content": "Hi"}, "messages[0]", fix="")
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: messages[0].role must be one of system, user, assistant, tool, got 'robot'. \
Fix: use a standard chat role.
    """
    if not isinstance(msg, Mapping):
        raise RequestError(at, msg, "must be a mapping with 'role' and 'content'", fix=fix)
    check_message_keys(msg, at)
    if msg.get("role") not in ROLES:
        raise RequestError(f"{at}.role", msg.get("role"), f"must be one of {', '.join(ROLES)}",
                           fix="use a standard chat role")


def check_message_keys(msg: Mapping[str, Any], at: str) -> None:
    """Refuse the first key of ``msg`` the engine does not read, naming it.

    >>> check_message_keys({"role": "user", "content": "Hi", "name": "ann"}, "requests[0].messages[0]")
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: requests[0].messages[0].name is not read by the engine (a message is its role and \
content, rendered with the model's chat template), got 'ann'. Fix: drop 'name' from the message.
    """
    for key in msg:
        if key not in MESSAGE_KEYS:
            raise RequestError(f"{at}.{key}", msg[key], "is not read by the engine (a message is its role and "
                               "content, rendered with the model's chat template)",
                               fix=f"drop {key!r} from the message")


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
    thinking: bool = False
    """Render with the template's ``enable_thinking`` on (vLLM's ``chat_template_kwargs: {"enable_thinking":
    true}``); off by default, as the seeds require. A template that does not read it renders the same text."""
    seed: int | None = None
    """This conversation's own sampling seed in [0, 2**63), in place of the one its index in the call derives from
    the call's seed (``engine.rules.seeding``): its row draws alike wherever it stands in a batch (with the portable
    sampler, on every backend). Only in sampled calls; None: the call's."""
    adapter: str | None = None
    """The LoRA adapter this conversation runs with, by its ``model.adapters`` name; None: the call's ``adapter=``,
    else the base model. Rows of one call may name different adapters (``engine.adapters``)."""

    @classmethod
    def of(cls, raw: ChatRequest | Sequence[Mapping[str, Any]], *, index: int) -> ChatRequest:
        """Validate one request (a ChatRequest or a list of ``{"role", "content"}`` messages)."""
        thinking, seed, adapter = False, None, None
        if isinstance(raw, ChatRequest):
            raw, thinking, seed, adapter = raw.messages, raw.thinking, raw.seed, raw.adapter
        where = f"requests[{index}]"
        if adapter is not None and not isinstance(adapter, str):
            raise RequestError(f"{where}.adapter", adapter, "must be an adapter's name",
                               fix="name one of the engine's model.adapters, or leave it out for the base model")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
            raise RequestError(f"{where}.seed", seed, "must be an integer in [0, 2**63)",
                               fix="give the row's seed as a non-negative integer, or leave it out")
        check_messages(raw, f"{where}.messages", fix="give at least one {'role': 'user', 'content': ...} message")
        for j, msg in enumerate(raw):
            at = f"{where}.messages[{j}]"
            check_message(msg, at, fix="write it as {'role': 'user', 'content': 'text'}")
            if "content" not in msg:
                raise RequestError(f"{at}.content", None, "is required", fix="add the message text as 'content'")
            if not isinstance(msg["content"], str):
                raise RequestError(f"{at}.content", msg["content"], "must be a string on the text path",
                                   fix="pass the message text as a string")
            check_unicode(msg["content"], f"{at}.content")
        return cls(tuple(dict(m) for m in raw), thinking=thinking, seed=seed, adapter=adapter)


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
