"""``serve``: how ``python -m engine.serve`` serves the engine (ignored by in-process use)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from engine.config.generation import check_temperature
from engine.config.validation import check_range, check_type
from engine.errors import ConfigError

NAMESPACE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class PatternCConfig:
    """Defaults of ``POST /chat`` (Pattern C, the seed documents' name for min-length chat): min-length control inside
    generation, then cleanup.

    ``min_len``/``max_len`` are what a request gets when it sends none (``MIN_LEN``/``MAX_LEN`` in the server's
    environment override them at startup). The rest applies to every ``/chat`` request.

    >>> PatternCConfig().min_len, PatternCConfig().max_len, PatternCConfig().punctuation_bias
    (120, 240, 0.3)
    >>> PatternCConfig(min_len=300)
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: serve.chat.max_len must be in [300, inf), got 240. Fix: keep max_len at least min_len.
    """

    min_len: int = 120
    """EOS is suppressed while the answer has fewer characters, in [0, inf)."""
    max_len: int = 240
    """Hard cap in characters: the row ends once the answer reaches it, in [max(1, min_len), inf)."""
    punctuation_bias: float = 0.3
    """Logit bias on sentence-ending tokens (``.!?``, CJK full stop/question/exclamation marks, newline) once
    ``min_len`` is reached, in [0, inf)."""
    temperature: float = 0.7
    """Sampling temperature: 0 (greedy) or in [0.01, 2], the range every request is held to."""
    top_p: float = 0.95
    """Nucleus sampling mass, in (0, 1]."""
    max_new_tokens: int = 512
    """Token budget behind the character cap, in [1, inf)."""
    close_brackets: bool = True
    """Close an unterminated quote and open brackets at the end of the answer."""
    sentence_end: bool = True
    """Trim a trailing unfinished sentence (the safe trim after a cap)."""

    def __post_init__(self) -> None:
        w = "serve.chat"
        for name in ("min_len", "max_len", "max_new_tokens"):
            check_type(f"{w}.{name}", getattr(self, name), int, "an integer")
        check_range(f"{w}.min_len", self.min_len, low=0)
        check_range(f"{w}.max_len", self.max_len, low=max(1, self.min_len), fix="keep max_len at least min_len")
        check_range(f"{w}.max_new_tokens", self.max_new_tokens, low=1)
        for name in ("punctuation_bias", "temperature", "top_p"):
            check_type(f"{w}.{name}", getattr(self, name), (int, float), "a number")
        check_range(f"{w}.punctuation_bias", self.punctuation_bias, low=0, fix="use 0 to disable the bias")
        check_temperature(f"{w}.temperature", self.temperature)  # every request's rule: a default outside it
        # would refuse every /chat request
        check_range(f"{w}.top_p", self.top_p, low=0, high=1, low_open=True)
        if self.temperature == 0 and self.top_p != 1.0:  # the engine refuses the pair on every request
            raise ConfigError(f"{w}.top_p", self.top_p, "has no effect with temperature 0 (greedy)",
                              fix="set serve.chat.top_p to 1.0 for greedy answers, or temperature > 0")
        for name in ("close_brackets", "sentence_end"):
            check_type(f"{w}.{name}", getattr(self, name), bool, "true or false")


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
    raw text, stop reason, meta). The default is the name the seed documents give it. None: items are the bare
    ``ChatCompletionResponse`` dicts, no envelope."""
    model_name: str | None = None
    """The model name responses report. None: the model folder's name."""
    model_aliases: tuple[str, ...] = ()
    """Other names requests may give the model (``vllm serve --served-model-name A B``: A reports, B is accepted);
    the model's path as configured is always accepted too (a client written for ``vllm serve MODEL`` sends it)."""
    batch_wait_ms: float = 5.0
    """HF and llama.cpp backends: the batcher starts a ``generate`` once no request came for this long and none is
    being checked and prepared, in [0, 1000] milliseconds (or at ``batch_wait_max_ms``, or with ``max_batch_size``
    prompts)."""
    batch_wait_max_ms: float = 200.0
    """HF and llama.cpp backends: the longest the first request of a batch waits for the others of a burst (requests
    still being prepared), in [batch_wait_ms, 1000] milliseconds."""
    max_batch_size: int = 32
    """HF backend: most prompts per batched ``generate`` call, in [1, inf)."""
    drain_timeout_s: float = 30.0
    """On shutdown, how long in-flight requests may take to finish, in [0, inf)."""
    max_body_bytes: int = 16 * 2**20
    """Largest request body read, in bytes (default 16 MiB); a larger one gets 413 before it is parsed."""
    max_prompts_per_call: int = 4096
    """Most conversations in one ``/infer/`` call; more are refused before any is tokenized."""
    max_tokens_per_call: int = 2**20
    """Most tokens one call may ask to generate: its rows (prompts, times ``n`` on the OpenAI routes) times each
    row's ``max_tokens`` (the default, 1,048,576, is a GRPO step of 64 prompts x 16 samples x 1024 tokens); more are
    refused before any is tokenized. What a call holds in memory at once is bounded
    apart from it: the HF and llama.cpp batchers run at most ``max_batch_size`` rows at a time."""
    max_stop_strings: int = 64
    """Most stop strings in one request."""
    max_stop_string_chars: int = 256
    """Longest stop string, in characters (each generated token is searched for the longest one)."""
    max_stop_token_ids: int = 1024
    """Most stop token ids in one request."""
    max_scored_tokens: int = 16384
    """Most prompt tokens one ``/v1/completions`` call with ``echo`` and ``logprobs`` scores (lm-eval's
    ``local-completions`` sends one document per call by default); more are refused before any is scored."""
    body_timeout_s: float = 30.0
    """How long a request body may take to arrive whole, from the end of its head (408 after: a total deadline, so
    a trickled body is refused as a stalled one is), in (0, 3600]."""
    idle_connection_timeout_s: float = 10.0
    """How long a request's head (request line and headers) may take to arrive whole, from the connection's opening
    or from the first byte of a later request on it (the connection is closed after: a silent socket and a trickled
    head alike), in (0, 3600]; uvicorn's own keep-alive timeout covers the silence between requests."""
    max_connections: int = 1024
    """Most open client connections; one more closes the oldest connection that runs no request (silent, part of a
    head, idle between requests), or is closed at once when every one runs a request: stalled sockets cannot keep
    other clients (``/health``) out, nor exhaust the server's file descriptors."""
    weight_sync_hosts: tuple[str, ...] = ()
    """Addresses besides loopback and ``host`` on which ``/init_communicator/`` may open the learner's group store
    (its rank 0 listens there; over ``tcp`` it carries only values sealed with the group's secret, over ``nccl``
    vLLM's pickled rendezvous: expose it no wider than the HTTP port). swift's client asks for the wildcard
    (``0.0.0.0``), which binds ``host`` (a wildcard ``host`` only with an API key). Empty: loopback and ``host``
    only."""
    weight_sync_join_timeout_s: float = 60.0
    """How long ``/init_communicator/`` waits for the learner to join, in (0, 3600]; generation goes on meanwhile,
    and a learner that never joins fails the next weight call, not the server."""
    weight_sync_session_timeout_s: float = 30.0
    """How long generations wait for a learner's open push session to end (its cache reset, as swift's trainer sends
    after every update; vLLM's ``/finish_weight_update``) after its last push, in (0, 3600]; then they end it
    themselves. Also each push's deadline: its learner joined and its tensors arrived within it (over ``tcp``), so a
    learner that announces and never sends holds the rollouts no longer."""
    weight_sync_session_max_s: float = 120.0
    """The longest one push session may hold new generations, pushes or not, in (0, 3600]: a learner that keeps
    pushing without ever ending its session (no cache reset, no finish) has it ended here, and the rollouts run."""
    adapter_loading: bool = False
    """Serve vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (``--allow-adapter-loading``; vLLM's
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): a client then loads adapters from folders this server can read. Off: the
    routes do not exist (404), and ``/infer/``'s ``adapter_request`` may name loaded adapters only."""
    chat: PatternCConfig = field(default_factory=PatternCConfig)
    """Defaults of the Pattern C ``POST /chat`` endpoint."""

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
        check_type("serve.model_aliases", self.model_aliases, (tuple, list), "a list of names")
        for i, alias in enumerate(self.model_aliases):
            check_type(f"serve.model_aliases[{i}]", alias, str, "a name")
        check_type("serve.batch_wait_ms", self.batch_wait_ms, (int, float), "a number")
        check_range("serve.batch_wait_ms", self.batch_wait_ms, low=0, high=1000)
        check_type("serve.batch_wait_max_ms", self.batch_wait_max_ms, (int, float), "a number")
        check_range("serve.batch_wait_max_ms", self.batch_wait_max_ms, low=self.batch_wait_ms, high=1000,
                    fix=f"give a value in [{self.batch_wait_ms:g}, 1000]: at least serve.batch_wait_ms")
        check_type("serve.adapter_loading", self.adapter_loading, bool, "true or false")
        check_type("serve.max_batch_size", self.max_batch_size, int, "an integer")
        check_range("serve.max_batch_size", self.max_batch_size, low=1)
        check_type("serve.drain_timeout_s", self.drain_timeout_s, (int, float), "a number")
        check_range("serve.drain_timeout_s", self.drain_timeout_s, low=0)
        check_type("serve.weight_sync_hosts", self.weight_sync_hosts, (tuple, list), "a list of addresses")
        for i, address in enumerate(self.weight_sync_hosts):
            check_type(f"serve.weight_sync_hosts[{i}]", address, str, "an address string")
        check_type("serve.weight_sync_join_timeout_s", self.weight_sync_join_timeout_s, (int, float), "a number")
        check_range("serve.weight_sync_join_timeout_s", self.weight_sync_join_timeout_s, low=0, high=3600,
                    low_open=True)
        check_type("serve.weight_sync_session_timeout_s", self.weight_sync_session_timeout_s, (int, float),
                   "a number")
        check_range("serve.weight_sync_session_timeout_s", self.weight_sync_session_timeout_s, low=0, high=3600,
                    low_open=True)
        check_type("serve.weight_sync_session_max_s", self.weight_sync_session_max_s, (int, float), "a number")
        check_range("serve.weight_sync_session_max_s", self.weight_sync_session_max_s, low=0, high=3600,
                    low_open=True)
        for name in ("body_timeout_s", "idle_connection_timeout_s"):
            check_type(f"serve.{name}", getattr(self, name), (int, float), "a number")
            check_range(f"serve.{name}", getattr(self, name), low=0, high=3600, low_open=True)
        for name in ("max_body_bytes", "max_prompts_per_call", "max_tokens_per_call", "max_stop_strings",
                     "max_stop_string_chars",
                     "max_stop_token_ids", "max_scored_tokens", "max_connections"):
            check_type(f"serve.{name}", getattr(self, name), int, "an integer")
            check_range(f"serve.{name}", getattr(self, name), low=1)
