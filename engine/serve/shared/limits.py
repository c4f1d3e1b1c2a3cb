"""What one request may ask of the server, checked before any tokenization or model work.

The body is read up to ``serve.max_body_bytes`` (413 beyond, whatever ``Content-Length`` says), each part within
``serve.body_timeout_s`` of the last (408 otherwise); a parsed call then stays within ``serve.max_prompts_per_call``,
``serve.max_stop_strings``, ``serve.max_stop_string_chars``, ``serve.max_stop_token_ids`` and
``serve.max_tokens_per_call`` (rows times tokens), and its ``max_new_tokens`` within the model's context length (a
row can never generate past it). Each refusal is a typed error naming the client's field, the value (cut
short) and the setting that raises the limit.

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
import re
from collections.abc import Mapping
from typing import Any

from engine.errors import RequestError, RequestTimedOut, RequestTooLarge

DRAIN_BYTES = 256 * 2**20
"""How far an oversized body is still read (and dropped) so that the client, still sending, gets its 413 rather
than a reset connection; beyond this the connection is closed with the 413."""
DRAIN_IDLE_S = 2.0
"""How long an oversized body's drain waits for its next part before the 413 is sent anyway."""


async def read_bytes(request: Any, max_bytes: int, within_s: float) -> bytes:
    """The request's body, kept at most ``max_bytes`` far (:class:`RequestTooLarge` beyond: HTTP 413), arriving whole
    within ``within_s`` (:class:`RequestTimedOut` otherwise: HTTP 408; a total deadline, so a body that stalls and one
    trickled a byte every few seconds are both refused in time; a client that declares ``Content-Length: 10**12`` and
    stops sending holds nothing for long)."""
    import asyncio

    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length", "")
    chunks: list[bytes] = []
    size = 0
    parts = request.stream().__aiter__()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        over = size > max_bytes or (declared.isdigit() and int(declared) > max_bytes)
        left = max(0.0, deadline - loop.time())
        try:  # a body already refused is drained only while it keeps coming
            chunk = await asyncio.wait_for(parts.__anext__(), min(left, DRAIN_IDLE_S) if over else left)
        except StopAsyncIteration:
            break
        except ClientDisconnect:  # round 4: a client leaving mid-body was a 500 and a traceback per request
            raise RequestTimedOut("body", f"{size} bytes received", "was cut off: the client closed the connection "
                                  "before sending it whole", fix="send the whole body") from None
        except TimeoutError:
            if over:  # Content-Length: 10**12 and ten bytes: the 413 now
                break
            raise RequestTimedOut("body", f"{size} bytes received", f"did not arrive whole within "
                                  f"serve.body_timeout_s ({within_s:g} s)",
                                  fix="send the whole body at once, or raise serve.body_timeout_s") from None
        size += len(chunk)
        if size > max_bytes or (declared.isdigit() and int(declared) > max_bytes):
            chunks.clear()  # nothing more is kept: the rest is read and dropped
            if size > DRAIN_BYTES:
                break
            continue
        chunks.append(chunk)
    if size > max_bytes or (declared.isdigit() and int(declared) > max_bytes):
        raise too_large(max(size, int(declared) if declared.isdigit() else 0), max_bytes)
    return b"".join(chunks)


SURROGATE_HINT = re.compile(r"[\ud800-\udfff]|\\u[dD][89a-fA-F]")
"""What only a text that may hold a lone surrogate has: a surrogate itself (raw UTF-8 bytes ``ED A0 80``, or UTF-16
code units, which ``json.loads`` lets through) or a ``\\uD800``-``\\uDFFF`` escape in any case."""


def parse_json(raw: bytes) -> Any:
    """``raw`` as JSON, or a ``RequestError`` naming the body (run off the event loop: a 16 MiB body takes a while);
    a key or string holding a lone surrogate, however it arrived (a ``\\uD800`` escape in either case, its raw
    UTF-8 bytes, a UTF-16 body), is refused by its path (:func:`check_unicode_strings`).

    >>> parse_json(b'{"prompt": "a\\xed\\xa0\\x80"}')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: prompt holds a lone surrogate at character 1 (not valid Unicode text), got ...
    >>> parse_json('{"prompt": "\\\\uD800"}'.encode("utf-16-le"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: prompt holds a lone surrogate at character 0 (not valid Unicode text), got ...
    """
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # as json.loads decodes bytes
    except (UnicodeDecodeError, LookupError) as err:
        raise RequestError("body", raw[:60].decode("utf8", "replace"), f"is not valid JSON text ({err})",
                           fix="send a JSON object in UTF-8 with Content-Type: application/json") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise RequestError("body", raw[:60].decode("utf8", "replace"), "nests arrays or objects too deeply",
                           fix="send a request body nested a few levels deep") from None
    except ValueError as err:  # not JSON, not UTF-8, or an integer beyond Python's 4300 digits
        raise RequestError("body", raw[:60].decode("utf8", "replace"), f"is not valid JSON ({err})",
                           fix="send a JSON object with Content-Type: application/json") from None
    if SURROGATE_HINT.search(text):  # most bodies skip the walk
        check_unicode_strings(data)
    return data


def check_unicode_strings(body: Any) -> None:
    """Refuse a parsed JSON body any of whose keys or strings holds a lone surrogate (JSON's ``"\\ud800"``: not
    valid Unicode, which no tokenizer, stop matcher or log line can take), naming where, before any field is read.

    >>> check_unicode_strings({"prompt": ["ok", "a" + chr(0xD800)]})
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: prompt[1] holds a lone surrogate at character 1 (not valid Unicode text), got \
'a\\ud800'. Fix: send the text as valid UTF-8.
    >>> check_unicode_strings({"engine": {"options": {chr(0xDC00) + "x": 1}}})
    Traceback (most recent call last):
    ...
    engine.errors.RequestError: engine.options (a key) holds a lone surrogate at character 0 (not valid Unicode \
text), got '\\udc00x'. Fix: send the text as valid UTF-8.
    """
    from engine.types import check_unicode

    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            check_unicode(value, path or "body")
        elif isinstance(value, Mapping):
            for key, item in value.items():
                check_unicode(key, f"{path or 'body'} (a key)")
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def check_counts(body: Any, *, max_items: int, requests: str | None, max_prompts: int) -> None:
    """Refuse a parsed JSON body holding an array longer than any field of the server takes (``max_items``: the
    largest of the count limits and the model's context length), or a request list (``requests``: its top-level
    name) over ``serve.max_prompts_per_call``, before the body model checks it: that check holds the interpreter
    for the whole body (a second for 100,000 conversations), this walk yields to the event loop as it goes.

    >>> check_counts({"prompt": ["hi"] * 9}, max_items=100, requests="prompt", max_prompts=8)
    Traceback (most recent call last):
    ...
    engine.errors.RequestTooLarge: prompt holds more than serve.max_prompts_per_call (8) conversations, got 9. \
Fix: split it into calls of at most 8, or raise the limit.
    >>> check_counts({"engine": {"stop": {"token_ids": [1] * 101}}}, max_items=100, requests=None, max_prompts=8)
    Traceback (most recent call last):
    ...
    engine.errors.RequestTooLarge: engine.stop.token_ids holds more items than any field of this server takes \
(100), got 101. Fix: send fewer.
    """
    if requests is not None and isinstance(body, Mapping) and isinstance(body.get(requests), list):
        count = len(body[requests])
        if count > max_prompts and not all(isinstance(t, int) for t in body[requests][:max_prompts + 1]):
            raise RequestTooLarge(requests, count, f"holds more than serve.max_prompts_per_call ({max_prompts}) "
                                  "conversations", fix=f"split it into calls of at most {max_prompts}, or raise the "
                                  "limit")
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, Mapping):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in value.items()
                         if isinstance(v, (Mapping, list)))
        elif isinstance(value, list):
            if len(value) > max_items:
                raise RequestTooLarge(path or "body", len(value), f"holds more items than any field of this server "
                                      f"takes ({max_items})", fix="send fewer")
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value) if isinstance(v, (Mapping, list)))


def too_large(size: int, max_bytes: int) -> RequestTooLarge:
    return RequestTooLarge("body", f"{size} bytes", f"is larger than serve.max_body_bytes ({max_bytes})",
                           fix="send a smaller request, or raise serve.max_body_bytes")


def check_call(serve: Any, *, prompts: int, options: Mapping[str, Any] | None, stop: Mapping[str, Any] | None,
               max_model_len: int | None, default_max_new: int | None = None) -> None:
    """Refuse a parsed call that goes over a limit of ``serve`` (a :class:`~engine.config.ServeConfig`), naming
    engine fields (``requests``, ``stop.strings``, ``generation.max_new_tokens``): the surface's field table names
    them as its client sent them. ``prompts`` counts rows (an OpenAI ``n`` of 8 is 8 rows); rows times the tokens
    each may generate (``default_max_new`` when the call gives none) is held to ``serve.max_tokens_per_call``.

    >>> from engine.config import ServeConfig
    >>> check_call(ServeConfig(max_tokens_per_call=65536), prompts=2048, options={"max_new_tokens": 64}, stop=None,
    ...            max_model_len=None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.RequestTooLarge: generation.max_new_tokens asks 2048 rows x 64 tokens (131072 in all), more \
than serve.max_tokens_per_call (65536) allows, got 64. Fix: ...
    """
    if prompts > serve.max_prompts_per_call:
        raise RequestTooLarge("requests", prompts, f"holds more than serve.max_prompts_per_call "
                              f"({serve.max_prompts_per_call}) conversations",
                              fix=f"split it into calls of at most {serve.max_prompts_per_call}, or raise the limit")
    token_ids = (stop or {}).get("token_ids") or ()
    if isinstance(token_ids, (list, tuple)) and len(token_ids) > serve.max_stop_token_ids:
        raise RequestTooLarge("stop.token_ids", len(token_ids), f"holds more than serve.max_stop_token_ids "
                              f"({serve.max_stop_token_ids}) stop token ids",
                              fix=f"send at most {serve.max_stop_token_ids}, or raise serve.max_stop_token_ids")
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
    per_row = default_max_new if max_new is None else max_new
    if isinstance(per_row, int) and prompts * per_row > serve.max_tokens_per_call:
        raise RequestTooLarge("generation.max_new_tokens", per_row, f"asks {prompts} rows x {per_row} tokens "
                              f"({prompts * per_row} in all), more than serve.max_tokens_per_call "
                              f"({serve.max_tokens_per_call}) allows",
                              fix="send fewer rows (prompts, n) or fewer tokens per row in one call, or raise "
                                  "serve.max_tokens_per_call")
