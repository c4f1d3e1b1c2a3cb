"""JSON-Schema-constrained decoding on HF: xgrammar's grammar matcher, one per row, as a logits processor.

vLLM's structured outputs use the same xgrammar grammar (compact JSON: no whitespace between tokens), so on
the same prompt ids both backends are allowed the same tokens at every step. The mask runs before any
sampling warper (temperature, top-k, top-p), as in vLLM: ``hf.sampling.RowSampler``, the last processor,
applies them.
"""

from __future__ import annotations

from typing import Any

from engine.backends.registry import SPECS
from engine.errors import BackendUnavailableError


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as err:
        raise BackendUnavailableError(SPECS["hf"].name, "constrained decoding needs xgrammar, which is not installed",
                                      "pip install 'xbackend-engine[lm-eval]' (or xgrammar)") from err
    return xgrammar


KEPT = 64
"""Compiled grammars kept (least recently used dropped first): a few MB each, so a client that sends a new schema
every call cannot grow the server without bound."""
CACHE_BYTES = 256 * 2**20
"""xgrammar's own compiler cache bound (vLLM bounds its one too: ``VLLM_XGRAMMAR_CACHE_MB``)."""


class SchemaCompiler:
    """Compiles JSON Schemas for one tokenizer, each schema once while it is among the :data:`KEPT` latest. The
    engine compiles a request's schema while it prepares the request (off the server's event loop and before the
    batcher), so a batch finds it compiled.

    >>> SchemaCompiler.__name__
    'SchemaCompiler'
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import threading
        from collections import OrderedDict

        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=CACHE_BYTES)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, schema: str) -> Any:
        with self._lock:
            if schema in self._compiled:
                self._compiled.move_to_end(schema)
                return self._compiled[schema]
        compiled = self._compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        with self._lock:
            self._compiled[schema] = compiled
            while len(self._compiled) > KEPT:
                self._compiled.popitem(last=False)
        return compiled


class GrammarMask:
    """Masks every row's logits to the tokens its grammar allows next.

    A row that another rule ended (a stop string, a guard) is padded by ``generate`` with tokens its grammar
    may refuse; such a row is finished, so its matcher simply stops being fed.
    """

    def __init__(self, compiled: Any, batch: int, prompt_len: int, vocab_size: int) -> None:
        xgr = _xgrammar()
        self._xgr = xgr
        self.matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        self.active = [True] * batch
        self.bitmask = xgr.allocate_token_bitmask(batch, vocab_size)
        self.prompt_len = prompt_len

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if input_ids.shape[1] > self.prompt_len:  # a token was sampled since the last call: feed it
            for row, token in enumerate(input_ids[:, -1].tolist()):
                matcher = self.matchers[row]
                if self.active[row] and not matcher.is_terminated() and not matcher.accept_token(token):
                    self.active[row] = False
        self._xgr.reset_token_bitmask(self.bitmask)  # all allowed, for rows that are finished
        for row, matcher in enumerate(self.matchers):
            if self.active[row] and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(self.bitmask, row)
        device = scores.device
        masked = scores.to("cpu") if device.type not in ("cpu", "cuda") else scores
        self._xgr.apply_token_bitmask_inplace(masked, self.bitmask.to(masked.device))
        return masked.to(device)
