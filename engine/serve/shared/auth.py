"""The served engine's bearer API key, as ``swift rollout --api_key`` and ``vllm serve --api-key`` have it.

With a key set (``--api-key`` or ``ENGINE_API_KEY``), every route but the health probe (``/health``, ``/health/``)
answers 401 unless the request carries ``Authorization: Bearer <key>``: ``/infer/``, the OpenAI and Pattern C
routes, ``/metrics``, ``/openapi.json`` and ``/docs`` alike. The health probe stays open (load balancers and
``launch_server`` poll it) but shows filesystem paths (the model folder, a subtree's file) only to a caller that
sends the key. Keys are compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from typing import Any

from engine.errors import ConfigError

ENV_API_KEY = "ENGINE_API_KEY"
OPEN_PATHS = frozenset({"/health", "/health/"})
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def api_key_from(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The key from ``--api-key`` or ``ENGINE_API_KEY`` (the same key both ways is fine; two keys are refused).

    >>> api_key_from(None, {ENV_API_KEY: "s3cret"}), api_key_from(None, {})
    ('s3cret', None)
    >>> api_key_from("a", {ENV_API_KEY: "b"})
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: --api-key differs from ENGINE_API_KEY in the environment, got '(hidden)'. \
Fix: give the key one way.
    """
    env = environ.get(ENV_API_KEY)
    if flag is not None and env is not None and flag != env:
        raise ConfigError("--api-key", "(hidden)", f"differs from {ENV_API_KEY} in the environment",
                          fix="give the key one way")
    key = flag if flag is not None else env
    if key is not None and (not key.strip() or key != key.strip()):
        where = "--api-key" if flag is not None else ENV_API_KEY
        raise ConfigError(where, "(hidden)", "must be a non-empty key without surrounding whitespace",
                          fix=f"set a key, or leave {where} out for a server without one")
    return key


def bearer_matches(headers: Iterable[tuple[bytes, bytes]], key: str) -> bool:
    """Whether raw ASGI ``headers`` carry ``Authorization: Bearer <key>`` (constant-time comparison).

    >>> bearer_matches([(b"authorization", b"Bearer s3cret")], "s3cret"), bearer_matches([], "s3cret")
    (True, False)
    """
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())
    return False


class ApiKeyGate:
    """ASGI middleware: a 401 (OpenAI's error object, ``WWW-Authenticate: Bearer``) for any request outside
    ``OPEN_PATHS`` without the key. Plain ASGI, so streamed answers and disconnects pass through untouched.

    Example: ``app.add_middleware(ApiKeyGate, key="s3cret")``.
    """

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.key = key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not bearer_matches(scope["headers"],
                                                                                               self.key):
            from engine.serve.shared.errors import Unauthenticated, error_response

            refusal = error_response(Unauthenticated(), headers={"WWW-Authenticate": "Bearer"})
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)
