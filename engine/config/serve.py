"""``serve``: how ``python -m engine.serve`` serves the engine (ignored by in-process use)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.config._build import check_range, check_type
from engine.errors import ConfigError

NAMESPACE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class ServeConfig:
    """Settings of the served engine: where it listens, the envelope key, and the HF request batcher.

    >>> ServeConfig().host, ServeConfig().namespace
    ('127.0.0.1', 'coordexp')
    >>> ServeConfig(namespace="response")
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: serve.namespace must not be 'response' (the wrapped response's own key), \
got 'response'. Fix: pick another key, e.g. 'coordexp'.
    """

    host: str = "127.0.0.1"
    """Address to bind. 127.0.0.1 by default: nothing outside this machine can reach the server."""
    port: int = 8000
    """TCP port, in [0, 65535]; 0 picks a free one (printed on the ready line)."""
    namespace: str | None = "coordexp"
    """Key of the additive envelope beside ``response`` in each ``/infer/`` item (per-sequence trigger flag,
    raw text, stop reason, meta). None: items are the bare ``ChatCompletionResponse`` dicts, no envelope."""
    model_name: str | None = None
    """The model name responses report. None: the model folder's name."""
    batch_wait_ms: float = 5.0
    """HF backend: how long the batcher waits for more requests before one ``generate``, in [0, 1000]."""
    max_batch_size: int = 32
    """HF backend: most prompts per batched ``generate`` call, in [1, inf)."""
    drain_timeout_s: float = 30.0
    """On shutdown, how long in-flight requests may take to finish, in [0, inf)."""

    def __post_init__(self) -> None:
        check_type("serve.host", self.host, str, "an address string")
        check_type("serve.port", self.port, int, "an integer")
        check_range("serve.port", self.port, low=0, high=65535)
        if self.namespace is not None:
            check_type("serve.namespace", self.namespace, str, "a string or null")
            if self.namespace == "response":
                raise ConfigError("serve.namespace", self.namespace, "must not be 'response' (the wrapped "
                                  "response's own key)", fix="pick another key, e.g. 'coordexp'")
            if not NAMESPACE.match(self.namespace):
                raise ConfigError("serve.namespace", self.namespace, "must be a short identifier",
                                  fix="use letters, digits, '_', '.', '-' (e.g. 'coordexp')")
        if self.model_name is not None:
            check_type("serve.model_name", self.model_name, str, "a string or null")
        check_type("serve.batch_wait_ms", self.batch_wait_ms, (int, float), "a number")
        check_range("serve.batch_wait_ms", self.batch_wait_ms, low=0, high=1000)
        check_type("serve.max_batch_size", self.max_batch_size, int, "an integer")
        check_range("serve.max_batch_size", self.max_batch_size, low=1)
        check_type("serve.drain_timeout_s", self.drain_timeout_s, (int, float), "a number")
        check_range("serve.drain_timeout_s", self.drain_timeout_s, low=0)
