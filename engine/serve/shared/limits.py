"""What one request may ask of the server, checked before any tokenization or model work.

The body is read up to ``serve.max_body_bytes`` (413 beyond, whatever ``Content-Length`` says); a parsed call
then stays within ``serve.max_prompts_per_call``, ``serve.max_stop_strings`` and ``serve.max_stop_string_chars``,
and its ``max_new_tokens`` within the model's context length (a row can never generate past it). Each refusal is
a typed error naming the client's field, the value (cut short) and the setting that raises the limit.

>>> from engine.config import ServeConfig
>>> check_call(ServeConfig(max_stop_strings=2), prompts=1, options={}, stop={"strings": ["a", "b", "c"]},
...            max_model_len=8192)
Traceback (most recent call last):
...
engine.errors.RequestTooLarge: stop.strings holds more than serve.max_stop_strings (2) stop strings, got 3. Fix: \
send at most 2, or raise serve.max_stop_strings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine.errors import RequestError, RequestTooLarge

DRAIN_BYTES = 256 * 2**20
"""How far an oversized body is still read (and dropped) so that the client, still sending, gets its 413 rather
than a reset connection; beyond this the connection is closed with the 413."""


async def read_json(request: Any, max_bytes: int) -> Any:
    """The request's JSON body, kept at most ``max_bytes`` far (:class:`RequestTooLarge` beyond: HTTP 413)."""
    declared = request.headers.get("content-length", "")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes or (declared.isdigit() and int(declared) > max_bytes):
            chunks.clear()  # nothing more is kept: the rest is read and dropped
            if size > DRAIN_BYTES:
                break
            continue
        chunks.append(chunk)
    if size > max_bytes or (declared.isdigit() and int(declared) > max_bytes):
        raise too_large(max(size, int(declared) if declared.isdigit() else 0), max_bytes)
    raw = b"".join(chunks)
    try:
        return json.loads(raw)
    except RecursionError:
        raise RequestError("body", raw[:60].decode("utf8", "replace"), "nests arrays or objects too deeply",
                           fix="send a request body nested a few levels deep") from None
    except ValueError as err:  # not JSON, not UTF-8, or an integer beyond Python's 4300 digits
        raise RequestError("body", raw[:60].decode("utf8", "replace"), f"is not valid JSON ({err})",
                           fix="send a JSON object with Content-Type: application/json") from None


def too_large(size: int, max_bytes: int) -> RequestTooLarge:
    return RequestTooLarge("body", f"{size} bytes", f"is larger than serve.max_body_bytes ({max_bytes})",
                           fix="send a smaller request, or raise serve.max_body_bytes")


def check_call(serve: Any, *, prompts: int, options: Mapping[str, Any] | None, stop: Mapping[str, Any] | None,
               max_model_len: int | None) -> None:
    """Refuse a parsed call that goes over a limit of ``serve`` (a :class:`~engine.config.ServeConfig`), naming
    engine fields (``requests``, ``stop.strings``, ``generation.max_new_tokens``): the surface's field table names
    them as its client sent them."""
    if prompts > serve.max_prompts_per_call:
        raise RequestTooLarge("requests", prompts, f"holds more than serve.max_prompts_per_call "
                              f"({serve.max_prompts_per_call}) conversations",
                              fix=f"split it into calls of at most {serve.max_prompts_per_call}, or raise the limit")
    strings = (stop or {}).get("strings") or ()
    if isinstance(strings, (list, tuple)):
        if len(strings) > serve.max_stop_strings:
            raise RequestTooLarge("stop.strings", len(strings), f"holds more than serve.max_stop_strings "
                                  f"({serve.max_stop_strings}) stop strings",
                                  fix=f"send at most {serve.max_stop_strings}, or raise serve.max_stop_strings")
        for i, text in enumerate(strings):
            if isinstance(text, str) and len(text) > serve.max_stop_string_chars:
                raise RequestTooLarge("stop.strings", text, f"holds a stop string (index {i}) longer than "
                                      f"serve.max_stop_string_chars ({serve.max_stop_string_chars} characters)",
                                      fix="send a shorter stop string, or raise serve.max_stop_string_chars")
    max_new = (options or {}).get("max_new_tokens")
    if max_model_len is not None and isinstance(max_new, int) and max_new > max_model_len:
        raise RequestError("generation.max_new_tokens", max_new, f"is more than the model's context length "
                           f"({max_model_len} tokens), which no row can go past",
                           fix=f"ask for at most {max_model_len} tokens")
