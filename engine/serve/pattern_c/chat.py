"""The Pattern C ``POST /chat`` wire format: ``{model?, messages, min_len?, max_len?, stream?}`` -> ``{text, meta}``
(its body: ``pattern_c/bodies.py``; what every surface reads and writes alike: :mod:`engine.serve.shared.readers`,
:mod:`engine.serve.shared.writers`). "Pattern C" is the seeds' name for min-length chat.

Min-length control runs inside generation: the request becomes the engine's ``min_length`` plugin (EOS banned
below ``min_len`` characters, ``punctuation_bias`` on sentence-ending tokens past it, ``max_len`` as a hard cap)
followed by the ``cleanup`` plugin (safe sentence trim, closing of unbalanced quotes and brackets, whitespace
trim). Sampling and the plugin settings other than the two lengths come from ``serve.chat``
(:class:`~engine.config.serve.PatternCConfig`). No web framework is imported here.

Streaming (``stream: true``) answers with server-sent events: ``{"delta": "..."}`` objects whose deltas
concatenate to the final text, then one ``{"text": ..., "meta": {...}}`` object (the non-streamed body), then
``[DONE]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import RequestError
from engine.serve.pattern_c.bodies import PatternCRequest
from engine.serve.shared.bodies import messages_of
from engine.serve.shared.readers import chat_messages
from engine.serve.shared.writers import usage
from engine.types import GenerationResult

STRATEGY = "logits_processor"
"""How min-length is enforced: inside generation, on the logits (not by re-prompting or post-hoc padding)."""


@dataclass(frozen=True)
class PatternCCall:
    """One checked ``/chat`` body with the server's defaults filled in."""

    messages: list[dict[str, Any]]
    min_len: int
    max_len: int
    model: str | None = None
    stream: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    plugins: list[dict[str, Any]] = field(default_factory=list)
    stop: None = None
    prompt_count: int = 1

    @property
    def kwargs(self) -> dict[str, Any]:
        """The engine call's keyword arguments."""
        return {"options": self.options, "plugins": self.plugins}


def _length(body: PatternCRequest, key: str, default: int, low: int) -> int:
    value = getattr(body, key)
    if value is None:
        return default
    if value < low:
        raise RequestError(key, value, f"must be at least {low}", fix=f"e.g. {default}")
    return value


def parse_pattern_c(body: PatternCRequest, defaults: Any) -> PatternCCall:
    """Read a validated ``/chat`` body with ``defaults`` (a ``PatternCConfig``); raise ``RequestError`` naming the
    field.

    >>> from engine.config.serve import PatternCConfig
    >>> hi = {"messages": [{"role": "user", "content": "Hi"}]}
    >>> call = parse_pattern_c(PatternCRequest.model_validate(hi), PatternCConfig())
    >>> call.min_len, call.max_len, call.plugins[0]
    (120, 240, {'name': 'min_length', 'min_chars': 120, 'max_chars': 240, 'punctuation_bias': 0.3})
    >>> parse_pattern_c(PatternCRequest.model_validate({**hi, "min_len": 300}), PatternCConfig())
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: min_len must not exceed max_len (240), got 300. Fix: send min_len <= max_len.
    """
    model, stream = body.model, bool(body.stream)
    min_len = _length(body, "min_len", defaults.min_len, 0)
    max_len = _length(body, "max_len", defaults.max_len, 1)
    if min_len > max_len:
        if body.min_len is None:  # the server's default against the client's max_len: name what was sent
            raise RequestError("max_len", max_len, f"must be at least min_len ({min_len}, the server's default)",
                               fix=f"send max_len >= {min_len}, or a smaller min_len")
        raise RequestError("min_len", min_len, f"must not exceed max_len ({max_len})", fix="send min_len <= max_len")
    plugins = [
        {"name": "min_length", "min_chars": min_len, "max_chars": max_len,
         "punctuation_bias": defaults.punctuation_bias},
        {"name": "cleanup", "trim_whitespace": True, "close_brackets": defaults.close_brackets,
         "sentence_end": defaults.sentence_end},
    ]
    options = {"temperature": defaults.temperature, "top_p": defaults.top_p, "max_new_tokens": defaults.max_new_tokens}
    return PatternCCall(messages=chat_messages(messages_of(body.messages)), min_len=min_len, max_len=max_len,
                        model=model, stream=stream, options=options, plugins=plugins)


def pattern_c_body(result: GenerationResult, call: PatternCCall, *, model: str) -> dict[str, Any]:
    """``{text, meta}``: the numbers in ``meta`` are the min-length rule's own (``eos_suppressed``: EOS was the
    model's top choice while banned; ``min_length_capped``: ``max_len`` ended the row)."""
    meta = result.meta
    return {
        "text": result.text,
        "meta": {
            "model": model, "strategy": STRATEGY, "min_len": call.min_len, "max_len": call.max_len,
            "generated_chars": meta["generated_chars"], "returned_chars": meta["returned_chars"],
            "eos_suppressed": meta["eos_suppressed"], "min_length_capped": meta["min_length_capped"],
            "finish_reason": result.finish_reason, "usage": usage(result),
        },
    }


async def answer(call: Any, served: Any) -> Any:
    """The parsed call's answer through the one call path (:class:`engine.serve.shared.calls.Call`): one ``agenerate``
    answered as ``{text, meta}``, or one ``astream`` as ``{delta}`` events closed by that body."""
    c, engine = call.parsed, served.engine
    if not c.stream:
        return await call.whole(lambda: engine.agenerate([c.messages], **c.kwargs, prepared=call.prepared),
                                body=lambda results: pattern_c_body(results[0], c, model=served.model_name))

    async def open_stream() -> tuple[Any, list[Any]]:
        return engine.astream(c.messages, **c.kwargs, prepared=call.prepared), []

    def events(part: Any) -> list[Any]:
        out: list[Any] = [{"delta": part.delta}] if part.delta else []
        if part.result is not None:
            out.append(pattern_c_body(part.result, c, model=served.model_name))
        return out

    return await call.stream(open_stream, events)
