"""Chat-template rendering, centralized: rendered once, the same token ids go to every backend.

Rules:

* ``apply_chat_template(..., add_generation_prompt=True, enable_thinking=False)`` on every call (``True`` where a
  request asks for thinking: ``ChatRequest.thinking``);
* if the tokenizer or its template rejects ``enable_thinking``, render the same messages without it and
  record why (``RenderedPrompt.fallback``); any other template error propagates;
* tokenize the rendered text without letting the tokenizer add special tokens, and add BOS only when the
  tokenizer normally adds one and the template did not already write it (no double BOS).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError


@dataclass(frozen=True)
class RenderedPrompt:
    """A chat rendered to text and token ids, with the fallback taken (None when none was needed)."""

    text: str
    token_ids: tuple[int, ...]
    fallback: str | None
    seed: int | None = None
    """The request's own sampling seed (``ChatRequest.seed``), or None: the call's, by the row's index."""
    adapter: str | None = None
    """The LoRA adapter the row runs with (``ChatRequest.adapter``, else the call's), or None: the base model."""


def _mentions_thinking(err: BaseException) -> bool:
    return "enable_thinking" in str(err)


def render_text(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                thinking: bool = False) -> tuple[str, str | None]:
    """Render ``messages`` with thinking disabled (enabled with ``thinking``); return the text and the fallback
    reason, if any. ``add_generation_prompt=False`` continues the last message instead (an assistant prefill)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError("model.path", getattr(tokenizer, "name_or_path", "?"), "has no chat template",
                          fix="use a checkpoint whose tokenizer_config.json carries a chat_template")
    msgs = [dict(m) for m in messages]
    turn: dict[str, Any] = {"add_generation_prompt": True}
    if not add_generation_prompt:
        turn = {"add_generation_prompt": False, "continue_final_message": True}
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, enable_thinking=thinking, **turn)
        return text, None
    except TypeError as err:  # a tokenizer whose signature has no **kwargs
        reason = f"tokenizer rejected enable_thinking: {err}"
    except Exception as err:  # a template that raises on the keyword (jinja raise_exception and kin)
        if not _mentions_thinking(err):
            raise
        reason = f"chat template rejected enable_thinking: {err}"
    text = tokenizer.apply_chat_template(msgs, tokenize=False, **turn)
    return text, reason


def _adds_bos(tokenizer: Any) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    return bos in tokenizer("x", add_special_tokens=True)["input_ids"][:1]


def tokenize_rendered(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered prompt, with exactly one BOS where the tokenizer wants one."""
    ids: list[int] = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if _adds_bos(tokenizer) and not (ids and ids[0] == tokenizer.bos_token_id):
        ids.insert(0, tokenizer.bos_token_id)
    return ids


def render_prompt(renderer: Any, messages: Sequence[Mapping[str, Any]], *, tokenizer: Any = None,
                  thinking: bool = False) -> RenderedPrompt:
    """Render one chat with ``renderer`` (a tokenizer, or a VLM processor that owns its chat template) and
    tokenize it with ``tokenizer`` (default: the renderer); the result is what every backend receives."""
    text, fallback = render_text(renderer, messages, thinking=thinking)
    tok = tokenizer if tokenizer is not None else renderer
    return RenderedPrompt(text=text, token_ids=tuple(tokenize_rendered(tok, text)), fallback=fallback)
