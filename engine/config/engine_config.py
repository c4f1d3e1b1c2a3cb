"""The engine's top-level configuration: one YAML file or dict, validated into frozen objects at load time."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.backends.registry import SPECS
from engine.config.generation import LOGPROBS_MODES, GenerationOptions, StopPolicy
from engine.config.repeat import RepeatTerminateConfig
from engine.config.serve import ServeConfig
from engine.config.validation import build, check_range, check_type
from engine.config.vision import PixelBudget
from engine.errors import ConfigError, did_you_mean

BACKENDS = tuple(SPECS)
DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_LORA_SLOTS = 256
"""The most LoRA slots ``vllm.max_loras`` may ask for (vLLM allocates each at start, at ``max_lora_rank``)."""
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The LoRA ranks vLLM sizes its slots for (``model.max_lora_rank`` must be one of them): the engine's limit is the
smallest of these that holds the largest configured adapter, unless ``model.max_lora_rank`` says otherwise."""


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how. One tokenizer (from ``path``) serves every backend.

    >>> ModelConfig(path="/models/x", dtype="float32").dtype
    'float32'
    >>> ModelConfig(path="/models/x", dtype="fp16")
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: model.dtype must be one of auto, float32, bfloat16, float16, got 'fp16'. \
Fix: did you mean 'float16'? available: auto, bfloat16, float16, float32.
    """

    path: str
    """Local directory of a Hugging Face checkpoint (weights, config, tokenizer, chat template)."""
    dtype: str = "auto"
    """One of auto, float32, bfloat16, float16. auto: the checkpoint's dtype on HF, vLLM's own pick on vLLM (a
    float32 checkpoint runs in half precision there: log-probs 5e-3 off HF's); set float32 for cross-backend parity."""
    device: str = "auto"
    """HF backend device: auto (cuda when available, else cpu), cpu, cuda or cuda:N. vLLM picks its own."""
    attn_implementation: str | None = None
    """HF attention implementation (eager, sdpa, flash_attention_2, ...). None: the HF default.
    Not applicable to vLLM, which chooses its own attention backend."""
    trust_remote_code: bool = False
    """Allow model code shipped inside the checkpoint."""
    max_model_len: int | None = None
    """Context length cap (prompt + output); vLLM sizes its KV cache by it. None: the model's own."""
    checkpoint_eos: bool = False
    """Rows end at the tokenizer's EOS (plus ``stop.token_ids``) only: a checkpoint's ``generation_config.json``
    ``eos_token_id`` list never applies by itself (vLLM would otherwise read it). True: every id in that list ends
    rows too, on every backend alike, and ``min_new_tokens`` holds them all back."""
    logprobs_mode: str = "raw_logprobs"
    """What returned logprobs are, one of :data:`LOGPROBS_MODES` (vLLM's ``--logprobs-mode`` and its exact
    semantics). Fixed when the engine loads, as vLLM fixes it: a request may state the mode it expects
    (``generation.logprobs_mode``) and is refused when it differs. ``processed_logprobs`` is what an importance-sampled
    trainer needs (the probability of the token under the distribution it was drawn from); docs/serving.md."""
    adapters: dict[str, str] = field(default_factory=dict)
    """LoRA adapters every backend loads at start, name -> folder (PEFT's ``save_pretrained``: adapter_config.json
    and adapter_model.safetensors; on llama.cpp the folder of its GGUF twin); a request picks one by name
    (``ChatRequest.adapter``, a call's ``adapter=``), none runs the base model. Each is checked before the backend
    starts: its rank against ``max_lora_rank``, its shapes against this model's weights (``engine.adapters``)."""
    max_lora_rank: int | None = None
    """The largest LoRA rank the engine takes (vLLM sizes its LoRA slots by it at start: one of 1, 8, 16, 32, 64, 128,
    256, 320, 512); every backend holds adapters to it alike. None: the smallest of those that holds every adapter of
    ``adapters``."""

    def __post_init__(self) -> None:
        check_type("model.path", self.path, str, "a path string")
        if not self.path:
            raise ConfigError("model.path", self.path, "must not be empty", fix="give a local model directory")
        if self.dtype not in DTYPES:
            raise ConfigError("model.dtype", self.dtype, f"must be one of {', '.join(DTYPES)}",
                              fix=did_you_mean(str(self.dtype), DTYPES))
        check_type("model.device", self.device, str, "a device string")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError("model.device", self.device, "must be auto, cpu, cuda or cuda:N",
                              fix="use one of those device names")
        if self.attn_implementation is not None:
            check_type("model.attn_implementation", self.attn_implementation, str, "a string")
        check_type("model.trust_remote_code", self.trust_remote_code, bool, "true or false")
        check_type("model.checkpoint_eos", self.checkpoint_eos, bool, "true or false")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError("model.logprobs_mode", self.logprobs_mode, f"must be one of {', '.join(LOGPROBS_MODES)}",
                              fix=did_you_mean(str(self.logprobs_mode), LOGPROBS_MODES))
        if self.max_model_len is not None:
            check_type("model.max_model_len", self.max_model_len, int, "an integer")
            check_range("model.max_model_len", self.max_model_len, low=1)
        check_adapters(self.adapters, self.max_lora_rank)


ADAPTER_NAME_FIX = "name each adapter with letters, digits, '-', '_' or '.' (what requests pick it by)"


def check_adapter_entry(name: Any, path: Any, field: str = "model.adapters") -> None:
    """One adapter's name and folder (``model.adapters``, or a load at run time naming ``field``).

    >>> check_adapter_entry("a b", "/x")
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: model.adapters is not an adapter name, got 'a b'. Fix: name each adapter with letters, \
digits, '-', '_' or '.' (what requests pick it by).
    """
    import re

    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,128}", name):
        raise ConfigError(field, name, "is not an adapter name", fix=ADAPTER_NAME_FIX)
    at = f"model.adapters.{name}" if field == "model.adapters" else "lora_path"
    check_type(at, path, str, "a folder path")
    if not path or "\x00" in path or len(path) > 4096:
        raise ConfigError(at, path[:64], "must be a folder path (not empty, no NUL, at most 4096 characters)",
                          fix="give the adapter's folder")


def check_adapters(adapters: Any, max_rank: Any) -> None:
    """The shape of ``model.adapters`` and ``model.max_lora_rank`` (their files are checked when a backend loads).

    >>> check_adapters({"": "/a"}, None)
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: model.adapters has an empty adapter name, got {'': '/a'}. Fix: name each adapter \
with letters, digits, '-', '_' or '.' (what requests pick it by).
    """
    check_type("model.adapters", adapters, dict, "a mapping of adapter name -> folder")
    for name, path in adapters.items():
        if not isinstance(name, str) or not name:
            raise ConfigError("model.adapters", adapters, "has an empty adapter name", fix=ADAPTER_NAME_FIX)
        check_adapter_entry(name, path)
    if max_rank is not None:
        check_type("model.max_lora_rank", max_rank, int, "an integer")
        if max_rank not in LORA_RANKS:
            raise ConfigError("model.max_lora_rank", max_rank, f"must be one of {', '.join(map(str, LORA_RANKS))} (the "
                              "ranks vLLM sizes its LoRA slots for)", fix="round it up to one of those")


@dataclass(frozen=True)
class HfConfig:
    """Settings of the Hugging Face transformers backend."""

    max_batch_size: int | None = None
    """Most requests per ``generate`` call; larger batches are split. None: the whole batch at once."""
    merge_adapters: bool = False
    """LoRA adapters (``model.adapters``) merged into the weights for the rows that use them (no LoRA arithmetic per
    token), and the weights restored exactly after, instead of PEFT's unmerged forward (the default). Costs a copy of
    every weight an adapter changes; the rows equal the unmerged ones up to float rounding
    (``conformance/test_adapters.py``)."""

    def __post_init__(self) -> None:
        check_type("hf.merge_adapters", self.merge_adapters, bool, "true or false")
        if self.max_batch_size is not None:
            check_type("hf.max_batch_size", self.max_batch_size, int, "an integer")
            check_range("hf.max_batch_size", self.max_batch_size, low=1)


@dataclass(frozen=True)
class VllmConfig:
    """Settings of the vLLM backend (a ``vllm.LLM`` owned by the engine); parallelism passes straight to it."""

    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take, in (0, 1]."""
    cpu_kv_cache_space_gib: float = 1
    """KV-cache size on CPU hosts in GiB, > 0 (vLLM's ``kv_cache_memory_bytes``; it must hold one sequence of the
    model's context length). vLLM's own ``VLLM_CPU_KVCACHE_SPACE``, when set in the environment, wins."""
    enforce_eager: bool = False
    """Disable CUDA graphs (faster start, slower decode)."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism, in [1, inf)."""
    data_parallel_size: int = 1
    """vLLM data parallelism: only 1. With data parallel > 1, vLLM's ``collective_rpc`` answers with the first
    engine's reply only, so the rule events (trigger flags, meta) of rows served by the other engines would be lost;
    run one engine per data-parallel rank instead (one server each, behind a router)."""
    max_num_seqs: int | None = None
    """Most sequences vLLM schedules at once. None: vLLM's default."""
    multiprocessing: bool | None = None
    """Run vLLM's engine core in a child process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``). false: in-process
    ("colocate"). Rule events reach the engine the same way in both modes (``collective_rpc``). None (default):
    true when served (``async_engine``, as ``python -m engine.serve`` sets it: the layout ``vllm serve`` runs, whose
    pinned worker threads matched stock's speed on CPU hosts where the in-process layout ran at 0.57x beside one busy
    process), false for an in-process engine (``vllm.LLM`` in the caller's process, as verl and OpenRLHF colocate
    it). :meth:`in_child_process` resolves it."""
    async_engine: bool = False
    """Generate through ``AsyncLLM`` (continuous batching across concurrent callers; its engine core always runs
    in a child process) instead of ``vllm.LLM``. The served engine sets it; ``generate`` works either way."""
    max_loras: int | None = None
    """LoRA adapters vLLM computes with in one step (its ``max_loras``: slots of ``model.max_lora_rank``), in [1, inf).
    None: one per adapter of ``model.adapters`` (and one more on CPU hosts: ``engine.backends.vllm.lora``)."""
    limit_images_per_prompt: int = 1
    """Images vLLM accepts per prompt for a vision-language model, in [0, 1]; 0 starts it text-only
    (then ``supports_vlm`` is False and VLM requests fail fast or go to ``fallback_backend``)."""

    def in_child_process(self) -> bool:
        """``multiprocessing`` resolved: as set, else true exactly when served (``async_engine``).

        >>> VllmConfig().in_child_process(), VllmConfig(async_engine=True).in_child_process()
        (False, True)
        >>> VllmConfig(async_engine=True, multiprocessing=False).in_child_process()
        False
        """
        return self.async_engine if self.multiprocessing is None else self.multiprocessing

    def __post_init__(self) -> None:
        check_type("vllm.gpu_memory_utilization", self.gpu_memory_utilization, (int, float), "a number")
        check_range("vllm.gpu_memory_utilization", self.gpu_memory_utilization, low=0, high=1, low_open=True)
        check_type("vllm.cpu_kv_cache_space_gib", self.cpu_kv_cache_space_gib, (int, float), "a number")
        check_range("vllm.cpu_kv_cache_space_gib", self.cpu_kv_cache_space_gib, low=0, low_open=True)
        check_type("vllm.enforce_eager", self.enforce_eager, bool, "true or false")
        if self.multiprocessing is not None:
            check_type("vllm.multiprocessing", self.multiprocessing, bool, "true or false (or leave it out)")
        check_type("vllm.async_engine", self.async_engine, bool, "true or false")
        for name in ("tensor_parallel_size", "data_parallel_size"):
            check_type(f"vllm.{name}", getattr(self, name), int, "an integer")
            check_range(f"vllm.{name}", getattr(self, name), low=1)
        if self.data_parallel_size > 1:
            raise ConfigError("vllm.data_parallel_size", self.data_parallel_size,
                              "must be 1: vLLM's collective_rpc returns the first data-parallel engine's reply only, "
                              "so rule events of rows on the other engines would be lost",
                              fix="run one engine per data-parallel rank (one engine-serve each, behind a router), "
                                  "each with data_parallel_size 1")
        if self.max_num_seqs is not None:
            check_type("vllm.max_num_seqs", self.max_num_seqs, int, "an integer")
            check_range("vllm.max_num_seqs", self.max_num_seqs, low=1)
        if self.max_loras is not None:
            check_type("vllm.max_loras", self.max_loras, int, "an integer")
            check_range("vllm.max_loras", self.max_loras, low=1, high=MAX_LORA_SLOTS,
                        fix=f"give a value in [1, {MAX_LORA_SLOTS}] (vLLM allocates every slot at start)")
        check_type("vllm.limit_images_per_prompt", self.limit_images_per_prompt, int, "an integer")
        check_range("vllm.limit_images_per_prompt", self.limit_images_per_prompt, low=0, high=1,
                    fix="the engine's VLM path takes exactly one image per request")


@dataclass(frozen=True)
class LlamaCppConfig:
    """Settings of the llama.cpp backend (llama-cpp-python's ``Llama`` on a GGUF file).

    ``model.path`` is a ``.gguf`` file (the tokenizer is then read from it) or a folder holding the Hugging Face
    tokenizer files and one ``.gguf`` file (``gguf_file`` picks one when there are several).

    >>> LlamaCppConfig(n_ctx=2048).n_ctx
    2048
    """

    gguf_file: str | None = None
    """The GGUF file inside a ``model.path`` folder. None: the folder's only ``*.gguf``."""
    n_ctx: int = 4096
    """Context length llama.cpp allocates its KV cache for (prompt + output), in [16, inf); capped by the model's
    training context and ``model.max_model_len``."""
    n_threads: int | None = None
    """CPU threads for decoding (and prompt evaluation). None: every core of the machine (``os.cpu_count()``)."""
    n_batch: int = 512
    """Most prompt tokens llama.cpp evaluates in one step, in [1, inf)."""
    n_seq: int = 16
    """Most rows of a batch decoded together as parallel sequences of one llama.cpp batch, in [1, 256]; 1: rows
    one after another. They share one KV pool of ``n_ctx`` cells (a second context beside the one-row context)."""
    seed: int | None = None
    """Seed of requests that give none, in [0, 2**63). None: such requests sample with a fresh random seed."""
    verbose: bool = False
    """Let llama.cpp print its load and timing logs to stderr."""

    def __post_init__(self) -> None:
        if self.gguf_file is not None:
            check_type("llamacpp.gguf_file", self.gguf_file, str, "a file name")
            if not self.gguf_file.endswith(".gguf"):
                raise ConfigError("llamacpp.gguf_file", self.gguf_file, "is not a .gguf file name",
                                  fix="name the GGUF file inside model.path, e.g. model-f32.gguf")
        check_type("llamacpp.n_ctx", self.n_ctx, int, "an integer")
        check_range("llamacpp.n_ctx", self.n_ctx, low=16)
        if self.n_threads is not None:
            check_type("llamacpp.n_threads", self.n_threads, int, "an integer")
            check_range("llamacpp.n_threads", self.n_threads, low=1)
        check_type("llamacpp.n_batch", self.n_batch, int, "an integer")
        check_range("llamacpp.n_batch", self.n_batch, low=1)
        check_type("llamacpp.n_seq", self.n_seq, int, "an integer")
        check_range("llamacpp.n_seq", self.n_seq, low=1, high=256)
        if self.seed is not None:
            check_type("llamacpp.seed", self.seed, int, "an integer")
            check_range("llamacpp.seed", self.seed, low=0, high=2**63, high_open=True)
        check_type("llamacpp.verbose", self.verbose, bool, "true or false")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, validated at load time. The backend is explicit and never changes.

    >>> cfg = EngineConfig.from_dict({"backend": "hf", "model": {"path": "/m"}, "generation": {"max_new_tokens": 8}})
    >>> cfg.backend, cfg.generation.max_new_tokens
    ('hf', 8)
    >>> EngineConfig.from_dict({"backend": "hf", "model": "/m", "genration": {}})
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: genration is not a known key, got {}. Fix: did you mean 'generation'? \
available: backend, fallback_backend, generation, hf, llamacpp, model, plugins, repeat_terminate, serve, stop, vision, \
vllm.
    """

    backend: str
    """Which backend runs generation: hf, vllm or llamacpp."""
    model: ModelConfig
    """The model; a bare string is taken as ``model.path``."""
    generation: GenerationOptions = field(default_factory=GenerationOptions)
    """Default generation options; each call may override fields."""
    stop: StopPolicy = field(default_factory=StopPolicy)
    """Default stop policy; each call may override it."""
    hf: HfConfig = field(default_factory=HfConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    llamacpp: LlamaCppConfig = field(default_factory=LlamaCppConfig)
    vision: PixelBudget = field(default_factory=PixelBudget)
    """Pixel budget for images on the VLM path (every backend applies the same one)."""
    repeat_terminate: RepeatTerminateConfig = field(default_factory=RepeatTerminateConfig)
    """Repeat-aware termination guard (per-sequence EOS on degenerate repetition)."""
    plugins: tuple[Any, ...] = ()
    """Plugins enabled for every call, in order: mappings ``{name: ..., <params>}`` (see ``engine.plugins``). Kept
    as data here; ``engine.plugins.create_plugins`` checks them (the engine and the server's launcher do, before
    loading anything)."""
    serve: ServeConfig = field(default_factory=ServeConfig)
    """How ``python -m engine.serve`` serves this engine (host, port, envelope key, HF batcher); unused in-process."""
    fallback_backend: str | None = None
    """Where VLM requests go when ``backend`` cannot serve them (loaded lazily, on first need, and
    recorded in each result's meta and the log). None: such requests fail fast. Never silent."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError("backend", self.backend, f"must be one of {', '.join(BACKENDS)}",
                              fix=did_you_mean(str(self.backend), BACKENDS))
        if self.fallback_backend is not None:
            if self.fallback_backend not in BACKENDS:
                raise ConfigError("fallback_backend", self.fallback_backend, f"must be one of {', '.join(BACKENDS)}",
                                  fix=did_you_mean(str(self.fallback_backend), BACKENDS))
            if self.fallback_backend == self.backend:
                raise ConfigError("fallback_backend", self.fallback_backend, "must differ from backend",
                                  fix="name another backend, or remove fallback_backend")
        spec = SPECS[self.backend]
        if self.model.path.endswith(".gguf") and spec.model_format != "gguf":
            gguf = ", ".join(n for n, s in SPECS.items() if s.model_format == "gguf")
            raise ConfigError("model.path", self.model.path, f"is a GGUF file, which backend {self.backend!r} does "
                              "not load here", fix=f"use backend: {gguf}, or a Hugging Face checkpoint folder")
        if not spec.takes_attn_implementation and self.model.attn_implementation is not None:
            raise ConfigError("model.attn_implementation", self.model.attn_implementation,
                              f"does not apply to the {self.backend} backend",
                              fix=f"remove it ({self.backend} picks its own attention implementation)")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        """Validate a mapping (e.g. parsed YAML) into a config; unknown keys and bad values raise ConfigError."""
        if isinstance(data, dict) and isinstance(data.get("model"), str):
            data = {**data, "model": {"path": data["model"]}}
        return build(cls, data, "")

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        """Load and validate a YAML config file."""
        from engine.config.yaml_file import load_yaml

        data = load_yaml(path, field=str(path))
        if not isinstance(data, dict):
            raise ConfigError(str(path), data, "must hold a YAML mapping at the top level",
                              fix="start the file with keys such as 'backend:' and 'model:'")
        return cls.from_dict(data)
