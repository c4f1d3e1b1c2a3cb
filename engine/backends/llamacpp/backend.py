"""The llama.cpp backend: llama-cpp-python's ``Llama`` on a GGUF file, fed the engine's own prompt token ids.

The engine renders every prompt with its one tokenizer (the Hugging Face files beside the GGUF, or the GGUF's own
tokenizer for a bare ``.gguf`` path); llama.cpp never applies a template or adds a BOS, it evaluates the ids it is
given. At load the GGUF's vocabulary is checked against that tokenizer, token by token, so the ids mean the same.

Every call's rows decode as parallel sequences of one llama.cpp batch per step
(:mod:`engine.backends.llamacpp.sequences`, up to ``llamacpp.n_seq`` rows at once on a second context; a call of one
row too, so a row's tokens do not depend on the batch it came in). Per token, each row's
:class:`~engine.backends.llamacpp.rules.LlamaCppRowStep` applies min_new_tokens, the repetition penalty, the row
rules, the temperature, min-p, top-k and top-p to its logits; the row's own llama.cpp sampler (greedy, or a draw
with the row's seed) picks from what it leaves. :class:`~engine.backends.llamacpp.row.LlamaCppRow` ends a row on a
terminal id, a stop string (found on the row's text with the engine's stop rule; the engine still truncates
``text``), a stopping rule, ``max_new_tokens`` or the context length.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine.backends.base import BackendBase, BackendOutput, CallPlan, Capabilities, Prompt
from engine.backends.registry import SPECS
from engine.config import LlamaCppConfig, ModelConfig
from engine.errors import BackendUnavailableError, ConfigError, EngineError

SPEC = SPECS["llamacpp"]
HOOKS = SPEC.hooks
SEED_MODULUS = 2**32 - 1
"""llama.cpp samples with a 32-bit seed, and 2**32 - 1 means "random" there: engine seeds map to seed mod this."""
KV_TYPES = {"float32": "GGML_TYPE_F32", "float16": "GGML_TYPE_F16", "bfloat16": "GGML_TYPE_BF16"}
"""``model.dtype`` -> llama.cpp's KV-cache type (the weights are whatever the GGUF holds); auto: llama.cpp's own."""


def _import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as err:
        raise BackendUnavailableError(SPEC.name, f"{err.name} is not installed",
                                      "pip install 'xbackend-engine[llamacpp]' (compiles llama.cpp; see "
                                      "docs/backends.md)") from err
    return llama_cpp


def resolve_gguf(model: ModelConfig, settings: LlamaCppConfig) -> Path:
    """The GGUF file to load: ``model.path`` itself, or the one ``*.gguf`` in that folder (``gguf_file`` picks)."""
    path = Path(model.path)
    if path.suffix == ".gguf":
        return path
    if settings.gguf_file is not None:
        chosen = path / settings.gguf_file
        if not chosen.is_file():
            raise ConfigError("llamacpp.gguf_file", settings.gguf_file, f"is not a file in {model.path}",
                              fix=f"pick one of: {', '.join(p.name for p in sorted(path.glob('*.gguf'))) or 'none'}")
        return chosen
    found = sorted(path.glob("*.gguf"))
    if len(found) != 1:
        raise ConfigError("model.path", model.path, f"holds {len(found)} .gguf files, the llamacpp backend needs one",
                          fix=("set llamacpp.gguf_file to one of " + ", ".join(p.name for p in found)) if found else
                          "put the GGUF beside the tokenizer files (python -m engine_fixtures build writes "
                          "smollm2-135m-instruct-gguf), or give the .gguf file as model.path")
    return found[0]


def check_vocabulary(llm: Any, tokenizer: Any) -> None:
    """Fail unless llama.cpp's token pieces are the engine tokenizer's, id by id (the engine hands it ids)."""
    from engine.rules.token_text import TokenBytes

    table = TokenBytes.from_tokenizer(tokenizer)
    n_vocab = llm.n_vocab()
    if len(tokenizer) > n_vocab:
        raise ConfigError("model.path", str(len(tokenizer)), f"tokens in the tokenizer, but the GGUF has {n_vocab}",
                          fix="use the tokenizer the GGUF was converted with")
    if table is None:
        return  # a decoder this check does not understand: the vocabulary size is all it can compare
    llama_cpp = _import_llama_cpp()
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    buf = (llama_cpp.ctypes.c_char * 256)()
    for token in range(len(tokenizer)):
        if token in table.special:
            continue
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
        if bytes(buf[: max(n, 0)]) != table.pieces[token]:
            raise ConfigError("model.path", f"token {token}", f"is {table.pieces[token]!r} in the tokenizer but "
                              f"{bytes(buf[: max(n, 0)])!r} in the GGUF", fix="use the tokenizer the GGUF was "
                              "converted with (the engine renders prompts with the tokenizer, llama.cpp reads ids)")


class LlamaCppBackend(BackendBase, backend="llamacpp"):
    """Generate with llama.cpp through llama-cpp-python (``pip install 'xbackend-engine[llamacpp]'``).

    Usually built by ``GenerationEngine`` (needs ``python -m engine_fixtures build``)::

        engine = GenerationEngine({"backend": "llamacpp",
                                   "model": str(fixture_path("smollm2-135m-instruct-gguf"))})
        engine.generate([[{"role": "user", "content": "Hi"}]], options={"max_new_tokens": 8})
    """

    streams_tokens = True
    """``generate`` takes ``on_token`` (the engine streams through it)."""

    def __init__(self, model: ModelConfig, settings: LlamaCppConfig, tokenizer: Any, processor: Any = None,
                 repeat_terminate: Any = None) -> None:
        llama_cpp = _import_llama_cpp()
        if processor is not None:
            raise ConfigError("model.path", model.path, "is a vision-language model, which the llamacpp backend "
                              "does not serve", fix="use backend hf or vllm for it")
        self.settings = settings
        self.tokenizer = tokenizer
        self.gguf = resolve_gguf(model, settings)
        threads = settings.n_threads or os.cpu_count() or 1
        kwargs: dict[str, Any] = {}
        if model.dtype in KV_TYPES:
            kv = getattr(llama_cpp, KV_TYPES[model.dtype])
            kwargs.update(type_k=kv, type_v=kv)
        n_ctx = min(n for n in (settings.n_ctx, model.max_model_len) if n)
        self.llm = llama_cpp.Llama(model_path=str(self.gguf), n_ctx=n_ctx, n_batch=settings.n_batch,
                                   n_threads=threads, n_threads_batch=threads, verbose=settings.verbose, **kwargs)
        train_ctx = int(self.llm.metadata.get("llama.context_length", 0) or 0) or None
        check_vocabulary(self.llm, tokenizer)
        self.n_ctx = min(n for n in (self.llm.n_ctx(), train_ctx) if n)
        self._table: Any = None
        self._sequences: Any = None
        """The parallel-sequences context (:class:`~engine.backends.llamacpp.sequences.ParallelSequences`), made
        at the first call."""
        self._lock = threading.Lock()
        self._closing = False
        """Set by :meth:`close`: the row in progress ends at its next token."""
        self._adapters: dict[str, Any] = self._load_adapters(model)
        """``model.adapters`` name -> the ``llama_adapter_lora_p`` llama.cpp loaded from its GGUF."""
        self.capabilities = Capabilities(name=SPEC.name, logprobs=True, supports_vlm=False, hooks=HOOKS,
                                         max_model_len=self.n_ctx, scoring=False, structured_outputs=False,
                                         adapters=tuple(self._adapters))

    def _load_adapters(self, model: ModelConfig) -> dict[str, Any]:
        """Each adapter of ``model.adapters`` (checked: ``engine.adapters``; its folder holds one ``.gguf``, or it
        is the ``.gguf``) loaded on the model."""
        from engine.adapters import AdapterSet

        self.adapter_set = AdapterSet(model, None)  # llama.cpp checks the GGUF's tensors against the model's itself
        return {a.name: self._init_adapter(a.name, a.path, f"model.adapters.{a.name}")
                for a in self.adapter_set.loaded.values()}

    def _init_adapter(self, name: str, path: str, field: str) -> Any:
        """llama.cpp's adapter of the one ``.gguf`` in ``path``; llama.cpp refuses another model's, which becomes a
        typed error naming ``field``."""
        llama_cpp = _import_llama_cpp()
        found = sorted(Path(path).glob("*.gguf"))
        if len(found) != 1:
            raise ConfigError(field, path, f"holds {len(found)} .gguf files; the llamacpp backend loads an adapter's "
                              "GGUF (one in its folder)", fix="give the folder of the adapter's GGUF twin (python -m "
                              "engine_fixtures build smollm2-lora-gguf writes the fixtures')")
        pointer = llama_cpp.llama_adapter_lora_init(self.llm.model, str(found[0]).encode())
        if not pointer:
            raise ConfigError(field, str(found[0]), f"was refused by llama.cpp as adapter {name!r} (not a LoRA GGUF "
                              "of this model: its log says which tensor)",
                              fix="convert the adapter of this model.path to GGUF")
        return pointer

    def load_adapter(self, name: str, path: str, *, replace: bool = False) -> None:
        """Load adapter ``name`` (its GGUF twin's folder) while serving; ``replace``: in place of the one of that
        name, which is freed once no row computes with it."""
        adapter = self.adapter_set.admit(name, path, replace=replace)
        pointer = self._init_adapter(name, adapter.path, "lora_path")
        with self._lock:
            old = self._adapters.get(name)
            self._adapters[name] = pointer
            self._free_adapter(old)
        self.adapter_set.keep(adapter)
        self.capabilities = dataclasses.replace(self.capabilities, adapters=self.adapter_set.names)

    def unload_adapter(self, name: str) -> None:
        self.adapter_set.drop(name)
        with self._lock:
            self._free_adapter(self._adapters.pop(name))
        self.capabilities = dataclasses.replace(self.capabilities, adapters=self.adapter_set.names)

    def _free_adapter(self, pointer: Any) -> None:
        """Free an adapter no context uses any more (under the lock: the decoding context lets go of it first)."""
        if pointer is None:
            return
        if self._sequences is not None:
            self._sequences.use_adapter(None)
        _import_llama_cpp().llama_adapter_lora_free(pointer)

    def close(self) -> None:
        """Free the model once no row is inside llama.cpp: a row in progress (the batcher thread, a stream the
        server is shutting down) ends at its next token and leaves first; freeing the model under it would crash
        the process (SIGSEGV)."""
        self._closing = True
        with self._lock:
            sequences, self._sequences = getattr(self, "_sequences", None), None
            if sequences is not None:
                sequences.close()  # its context before the model it was made on
            llama_cpp = _import_llama_cpp()
            for pointer in getattr(self, "_adapters", {}).values():  # before the model they were loaded on
                llama_cpp.llama_adapter_lora_free(pointer)
            self._adapters = {}
            llm, self.llm = getattr(self, "llm", None), None
            if llm is not None:
                llm.close()

    def _text_table(self) -> Any:
        """Token bytes for stop-string checks (built once), else None (then ``tokenizer.decode`` per token)."""
        if self._table is None:
            from engine.rules.token_text import TokenBytes

            self._table = TokenBytes.from_tokenizer(self.tokenizer) or False
        return self._table or None

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def generate(self, prompts: Sequence[Prompt], plan: CallPlan, *,
                 on_token: Callable[[int, int, int], bool | None] | None = None) -> list[BackendOutput]:
        """Outputs in prompt order. ``on_token(prompt_index, position, token_id)`` hears each kept token as soon as
        it is sampled; returning True ends that row (its caller went away)."""
        from engine.backends.llamacpp.row import LlamaCppRow

        if any(p.image is not None for p in prompts):
            raise EngineError("llamacpp backend got an image; it serves text models only")
        with self._lock:
            if self.llm is None:
                raise EngineError("the llamacpp backend is closed (the server is shutting down)")
            decode = self._text_table() or self._decode
            rows = [LlamaCppRow(i, p, plan, n_ctx=self.n_ctx, decode=decode, on_token=on_token)
                    for i, p in enumerate(prompts)]
            for row in rows:
                if not row.prompt.token_ids or row.context_need > self.n_ctx:
                    raise EngineError(f"llamacpp: prompt {row.index} has {len(row.prompt.token_ids)} tokens; it "
                                      f"needs 1 to {self.n_ctx - 1} (n_ctx {self.n_ctx})")
            if self._sequences is None:
                from engine.backends.llamacpp.sequences import ParallelSequences

                self._sequences = ParallelSequences(self.llm, n_seq=self.settings.n_seq, n_ctx=self.n_ctx)
            from engine.adapters import by_adapter

            for adapter, indices in by_adapter([p.adapter for p in prompts]):  # one adapter per context at a time
                if self._adapters:
                    self._sequences.use_adapter(None if adapter is None else self._adapters[adapter])
                group = [rows[i] for i in indices]
                self._sequences.decode(group, [self._seed(r.prompt) for r in group], closing=lambda: self._closing)
            return [row.output() for row in rows]

    @property
    def default_seed(self) -> int | None:
        """``llamacpp.seed``: the engine seeds a sampled call that gives none with it (rows then get their own
        seeds from it, ``engine.rules.seeding``, whether or not a batcher merged the call)."""
        return self.settings.seed

    @staticmethod
    def _seed(prompt: Prompt) -> int:
        """The row's own seed (``Prompt.seed``) as a 32-bit llama.cpp seed; none: a random one."""
        if prompt.seed is None:
            return int(_import_llama_cpp().LLAMA_DEFAULT_SEED)  # llama.cpp draws a random seed
        return prompt.seed % SEED_MODULUS
