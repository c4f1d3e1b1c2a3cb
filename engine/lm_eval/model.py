"""``EngineLM``: the engine as an lm-evaluation-harness model (``--model engine``), with schema-constrained answers.

All three request types go through one :class:`~engine.GenerationEngine`, so HF and vLLM share the tokenizer,
the windows, the stop handling and the answer rules:

* ``loglikelihood``: lm-eval's own context/continuation split (``TemplateLM``), then ``engine.score`` (HF forward
  pass, vLLM prompt log-probs) over ``(context + continuation)[-(max_length + 1):]``, as lm-eval's ``hf`` model;
* ``loglikelihood_rolling``: lm-eval's disjoint rolling windows of ``max_length`` tokens, each scored the same way;
* ``generate_until``: ``engine.complete`` on the left-truncated context ids, ``until`` as stop strings (the EOS
  token already ends a row), ``max_gen_toks`` and the sampling arguments mapped onto ``GenerationOptions``.

With ``response_schema`` / ``schema_model`` every generation becomes canonical JSON valid for the schema, or a
failure handled by ``on_invalid`` (:data:`engine.lm_eval.schema.ON_INVALID`); ``constrained=true`` decodes
under the schema's grammar (xgrammar on HF, structured outputs on vLLM). Counts go to the log and to the run's
``results["config"]["engine"]``. ``cache=PATH`` keeps answers in :class:`~engine.lm_eval.cache.AnswerCache`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from tqdm import tqdm

from engine.config import EngineConfig
from engine.config.generation import SAMPLING_ONLY, GenerationOptions
from engine.errors import ConfigError
from engine.lm_eval.cache import AnswerCache, cache_key
from engine.lm_eval.schema import ON_INVALID, AnswerStats, InvalidAnswer, InvalidAnswerError, ResponseSchema

log = logging.getLogger("engine.lm_eval")

LM_EVAL_DEFAULT_DEVICE = "cuda:0"
"""What lm-eval's CLI passes as ``device`` when none is given."""

NOT_GEN_KWARGS = {"max_new_tokens": "lm-eval's max_gen_toks", "logprobs": "generate_until answers text",
                  "logprobs_mode": "generate_until answers text"}
"""Engine options a task's ``generation_kwargs`` do not name, each with why."""
SAMPLING_KEYS = ("do_sample", *(f.name for f in dataclasses.fields(GenerationOptions) if f.name not in NOT_GEN_KWARGS))
"""The generation arguments a task may give besides ``until`` and ``max_gen_toks`` (``do_sample`` and every engine
option but :data:`NOT_GEN_KWARGS`, read from ``GenerationOptions``: a new option reaches lm-eval without a list to
keep); any other is refused."""


@register_model("engine")
class EngineLM(TemplateLM):
    """An lm-eval model over the engine (HF or vLLM), with optional schema-constrained JSON answers.

    Usually built by lm-eval from ``--model engine --model_args ...``; in Python (needs a built model)::

        from lm_eval import simple_evaluate
        lm = EngineLM(backend="hf", pretrained=".fixtures/smollm2-135m-instruct", dtype="float32")
        simple_evaluate(model=lm, tasks=["engine_mc"], task_manager=TaskManager(include_path="fixtures/lm_eval_tasks"))

    Arguments: ``config`` (an engine YAML) with overrides ``backend``, ``pretrained`` (or ``model``), ``dtype``,
    ``device``, ``batch_size``; ``max_length`` (window for log-likelihoods, default the model's context - 1),
    ``max_gen_toks`` (default 256), ``add_bos_token``; the schema options ``response_schema``, ``schema_model``,
    ``on_invalid``, ``retries``, ``retry_temperature``, ``invalid_answer``, ``constrained``; ``cache``.
    ``engine``: an already built :class:`~engine.GenerationEngine` to use instead (tests share one).
    """

    def __init__(self, config: str | None = None, backend: str | None = None, pretrained: str | None = None,
                 model: str | None = None, dtype: str | None = None, device: str | None = None,
                 batch_size: int | str | None = None, max_batch_size: int | None = None,
                 max_length: int | None = None, max_gen_toks: int = 256, add_bos_token: bool = False,
                 response_schema: str | Mapping[str, Any] | None = None, schema_model: str | None = None,
                 on_invalid: str = "error_string", retries: int = 2, retry_temperature: float = 0.7,
                 invalid_answer: str = "[invalid]", constrained: bool = False, cache: str | None = None,
                 engine: Any = None, **unknown: Any) -> None:
        super().__init__()
        if unknown:
            raise ConfigError("model_args", ", ".join(sorted(unknown)), "are not arguments of the engine model",
                              fix="see engine.lm_eval.model.EngineLM for the accepted arguments")
        if on_invalid not in ON_INVALID:
            raise ConfigError("on_invalid", on_invalid, f"must be one of {', '.join(ON_INVALID)}",
                              fix="use error_string (the default), retry, raw or raise")
        _check_int("retries", retries, low=0)
        _check_int("max_gen_toks", max_gen_toks, low=1)
        self.schema = (ResponseSchema.load(response_schema, schema_model)
                       if response_schema is not None or schema_model is not None else None)
        if constrained and self.schema is None:
            raise ConfigError("constrained", constrained, "needs a schema to constrain by",
                              fix="give response_schema or schema_model, or drop constrained")
        self.on_invalid, self.retries, self.retry_temperature = on_invalid, retries, float(retry_temperature)
        self.invalid_answer, self.constrained = invalid_answer, bool(constrained)
        self.engine = engine if engine is not None else _build_engine(config, backend, pretrained or model, dtype,
                                                                      device, batch_size)
        self.tokenizer = self.engine.tokenizer
        context = self.engine.backend.capabilities.max_model_len or 2048
        if max_length is not None:
            _check_int("max_length", max_length, low=2, high=context - 1,
                       fix=f"keep it below the model's context length ({context})")
        self.max_length = int(max_length or context - 1)  # a window of max_length + 1 tokens must fit
        self.max_gen_toks, self.add_bos_token = int(max_gen_toks), bool(add_bos_token)
        self.batch_size = int(batch_size) if isinstance(batch_size, int) or str(batch_size).isdigit() else 16
        self.stats = AnswerStats()
        self.backend_calls = 0
        self.cache = AnswerCache(cache) if cache else None
        self.cache_hits = self.cache_misses = 0
        self._cache_context = self._answer_context()

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None) -> Any:
        """lm-eval's constructor path. Its run-level ``device`` (``--device``) applies unless ``model_args`` name
        one; its config default ``cuda:0`` is taken as "not given" (the engine's ``auto``), and logged."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        device = extra.pop("device", None)
        if device == LM_EVAL_DEFAULT_DEVICE and "device" not in arg_dict:
            log.info("lm-eval's default device %s is not applied: the engine picks its device (model.device auto); "
                     "give device=... in --model_args to choose", device)
            device = None
        if device is not None:
            extra.setdefault("device", device)
        return cls(**{**extra, **arg_dict})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> Any:
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    # -- what lm-eval asks of a TemplateLM ----------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return int(self.engine.load_info.eos_token_ids[0])

    @property
    def prefix_token_id(self) -> int:
        """What an empty context (and a rolling text's first window) is conditioned on: BOS, else EOS (as
        lm-eval's hf and vllm models)."""
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.engine.config.model.path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        ids = list(self.tokenizer.encode(string, add_special_tokens=special))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        from engine.templates import render_text

        text, _ = render_text(self.tokenizer, chat_history, add_generation_prompt=add_generation_prompt)
        return text

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval writes into ``results["config"]``: the engine's identity and the answer counts."""
        info: dict[str, Any] = {
            "backend": self.engine.backend.name, "model": str(self.engine.config.model.path),
            "dtype": self.engine.config.model.dtype, "max_length": self.max_length,
            "constrained": self.constrained, "on_invalid": self.on_invalid,
            "schema_hash": self.schema.hash if self.schema else None,
            "schema_answers": self.stats.as_dict() if self.schema else None,
            "backend_calls": self.backend_calls,
            "cache": {"path": str(self.cache.path), "hits": self.cache_hits, "misses": self.cache_misses}
            if self.cache is not None else None,
        }
        return {"engine": info}

    # -- loglikelihood ------------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: Sequence[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        pieces = []
        for (_, continuation), context_ids, continuation_ids in requests:
            if len(continuation_ids) > self.max_length:
                raise ConfigError("max_length", self.max_length,
                                  f"is shorter than a continuation to score ({len(continuation_ids)} tokens, "
                                  f"{continuation[:40]!r})", fix="raise max_length")
            whole = (list(context_ids) + list(continuation_ids))[-(self.max_length + 1) :]
            pieces.append((whole, len(whole) - len(continuation_ids)))

        def compute(batch: list[tuple[list[int], int]]) -> list[list[Any]]:
            scored = self._score([w for w, _ in batch], [s for _, s in batch])
            return [[t.total, all(t.greedy)] for t in scored]

        answers = self._cached("loglikelihood", pieces, compute, "Running loglikelihood requests", disable_tqdm)
        return [(float(lp), bool(greedy)) for lp, greedy in answers]

    def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            rolling = lm_utils.get_rolling_token_windows(token_list=self.tok_encode(string),
                                                         prefix_token=self.prefix_token_id,
                                                         max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(lm_utils.make_disjoint_window, rolling):
                whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
                windows.append((whole, len(whole) - len(continuation)))
                owners.append(index)

        def compute(batch: list[tuple[list[int], int]]) -> list[float]:
            return [t.total for t in self._score([w for w, _ in batch], [s for _, s in batch])]

        totals = self._cached("loglikelihood_rolling", windows, compute, "Running loglikelihood_rolling requests",
                              disable_tqdm)
        sums = [0.0] * len(requests)
        for index, total in zip(owners, totals, strict=True):
            sums[index] += float(total)
        return sums

    def _score(self, sequences: list[list[int]], starts: list[int]) -> list[Any]:
        self.backend_calls += 1
        return self.engine.score(sequences, starts)

    # -- generate_until -----------------------------------------------------------------------------------

    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        groups: dict[str, list[int]] = {}
        prepared = []
        for index, (context, gen_kwargs) in enumerate(req.args for req in requests):
            options, until = self._options(gen_kwargs, eos)
            if options["max_new_tokens"] >= self.max_length:
                raise ConfigError("max_gen_toks", options["max_new_tokens"],
                                  f"leaves no room for context within max_length ({self.max_length})",
                                  fix="lower max_gen_toks or raise max_length")
            # As lm-eval's hf model: the context keeps its last max_length - max_gen_toks tokens.
            ids = self.tok_encode(context, left_truncate_len=self.max_length - options["max_new_tokens"])
            # The EOS string is lm-eval's way of saying "stop at EOS": the engine's terminal ids already do.
            prepared.append((ids, options, [s for s in until if s and s != eos]))
            groups.setdefault(repr(sorted(options.items())) + repr(prepared[-1][2]), []).append(index)
        answers: list[str] = [""] * len(requests)
        bar = tqdm(total=len(requests), desc="Running generate_until requests", disable=disable_tqdm)
        for members in groups.values():
            _, options, stops = prepared[members[0]]
            work = [(prepared[i][0], options, stops) for i in members]
            for i, text in zip(members, self._cached("generate_until", work, self._generate, None, True),
                               strict=True):
                answers[i] = text
                bar.update(1)
        bar.close()
        if self.schema is not None:
            log.info("schema answers: %s", self.stats.as_dict())
        return answers

    def _options(self, gen_kwargs: Mapping[str, Any], eos: str) -> tuple[dict[str, Any], list[str]]:
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        options: dict[str, Any] = {"max_new_tokens": int(kwargs.pop("max_gen_toks"))}
        unknown = sorted(set(kwargs) - set(SAMPLING_KEYS))
        if unknown:
            raise ConfigError("gen_kwargs", ", ".join(unknown), "are not generation arguments the engine maps",
                              fix=f"use only until, max_gen_toks, {', '.join(SAMPLING_KEYS)}")
        sample = bool(kwargs.pop("do_sample", False)) and float(kwargs.get("temperature", 1.0)) > 0
        temperature = float(kwargs.pop("temperature", 1.0))
        options["temperature"] = temperature if sample else 0.0
        for key in SAMPLING_ONLY:  # sampling only, as HF's generate ignores them when greedy
            if key in kwargs and sample:
                options[key] = kwargs.pop(key)
            kwargs.pop(key, None)
        options.update(kwargs)  # seed, repetition_penalty, min_new_tokens, ignore_eos
        return options, until

    def _generate(self, work: list[tuple[list[int], dict[str, Any], list[str]]]) -> list[str]:
        """One group's answers (same options and stops): texts, or schema answers under ``on_invalid``."""
        _, options, stops = work[0]
        texts = self._complete([ids for ids, _, _ in work], options, stops)
        if self.schema is None:
            return texts
        answers: list[str | None] = [None] * len(texts)
        failures: dict[int, InvalidAnswer] = {}
        for i, text in enumerate(texts):
            try:
                answers[i] = self.schema.answer(text)
            except InvalidAnswer as failure:
                failures[i] = failure
        if self.on_invalid == "retry":
            for attempt in range(1, self.retries + 1):
                if not failures:
                    break
                retry = {**options, "temperature": self.retry_temperature, "seed": attempt}
                pending = sorted(failures)
                self.stats.retried += len(pending)
                again = self._complete([work[i][0] for i in pending], retry, stops)
                for i, text in zip(pending, again, strict=True):
                    try:
                        answers[i] = self.schema.answer(text)
                        self.stats.recovered_by_retry += 1
                        del failures[i]
                    except InvalidAnswer as failure:
                        failures[i] = failure
        self.stats.checked += len(texts)
        self.stats.valid += len(texts) - len(failures)
        for i, failure in failures.items():
            self.stats.record_failure(failure)
            log.warning("invalid schema answer (%s): %s; answer %r", self.on_invalid, failure, texts[i][:200])
            if self.on_invalid == "raise":
                raise InvalidAnswerError(f"a generate_until answer is not valid for the response schema: {failure}. "
                                         f"Answer: {texts[i][:200]!r}. Fix: use on_invalid=error_string, retry or "
                                         "raw to keep going, or constrained=true")
            answers[i] = texts[i] if self.on_invalid == "raw" else self.invalid_answer
        return [a if a is not None else self.invalid_answer for a in answers]

    def _complete(self, prompts: list[list[int]], options: Mapping[str, Any], stops: list[str]) -> list[str]:
        self.backend_calls += 1
        schema = self.schema.json_schema if self.constrained and self.schema is not None else None
        results = self.engine.complete(prompts, options=dict(options), stop={"strings": stops}, json_schema=schema)
        return [r.text for r in results]

    # -- the cache ----------------------------------------------------------------------------------------

    def _answer_context(self) -> dict[str, Any]:
        """Everything besides a request's own arguments that decides its answer (part of every cache key)."""
        config = self.engine.config
        return {
            "model": _model_identity(Path(config.model.path)),
            "backend": self.engine.backend.name,
            "engine": asdict(config),
            "max_length": self.max_length, "add_bos_token": self.add_bos_token,
            "schema": self.schema.hash if self.schema else None, "constrained": self.constrained,
            "on_invalid": [self.on_invalid, self.retries, self.retry_temperature, self.invalid_answer],
        }

    def _cached(self, kind: str, items: Sequence[Any], compute: Callable[[list[Any]], list[Any]],
                desc: str | None, disable_tqdm: bool) -> list[Any]:
        """Answers for ``items`` in order: from the cache where present, else ``compute``d in batches (longest
        first) and stored batch by batch."""
        keys = [cache_key(kind, item, self._cache_context) for item in items]
        found = self.cache.get_many(keys) if self.cache is not None else {}
        self.cache_hits += sum(1 for k in keys if k in found)
        missing = [i for i, k in enumerate(keys) if k not in found]
        self.cache_misses += len(missing) if self.cache is not None else 0
        missing.sort(key=lambda i: -_length(items[i]))
        bar = tqdm(total=len(missing), desc=desc, disable=disable_tqdm or desc is None)
        size = self.batch_size if kind != "generate_until" else max(len(missing), 1)
        for first in range(0, len(missing), size):
            chunk = missing[first : first + size]
            results = compute([items[i] for i in chunk])
            fresh = {keys[i]: r for i, r in zip(chunk, results, strict=True)}
            found.update(fresh)
            if self.cache is not None:
                self.cache.put_many(fresh, kind)
            bar.update(len(chunk))
        bar.close()
        return [found[k] for k in keys]


def _length(item: Any) -> int:
    return len(item[0]) if isinstance(item, (tuple, list)) and item and isinstance(item[0], list) else 0


def _check_int(name: str, value: Any, *, low: int, high: int | None = None, fix: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(name, value, f"must be an integer {span}", fix=fix or f"use an integer {span}")


def _model_identity(path: Path) -> dict[str, Any]:
    """The model's path and a fingerprint of its files (names, sizes, modification times; the small text files'
    content), so a rebuilt or replaced checkpoint never answers from an old cache."""
    digest = hashlib.sha256()
    files: Iterable[Path] = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else []
    for f in files:
        stat = f.stat()
        digest.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        if f.suffix == ".json" and stat.st_size < 4_000_000:
            digest.update(f.read_bytes())
    return {"path": str(path.resolve()), "files": digest.hexdigest()}


def _build_engine(config: str | None, backend: str | None, model: str | None, dtype: str | None,
                  device: str | None, batch_size: int | str | None) -> Any:
    from engine import GenerationEngine

    data: dict[str, Any] = {}
    if config:
        from engine.config.yaml_file import load_yaml

        EngineConfig.from_yaml(config)  # the file alone must be valid (errors name its keys)
        data = load_yaml(config, field="config")
    if backend:
        data["backend"] = backend
    model_section = dict(data.get("model") or {})
    if isinstance(data.get("model"), str):
        model_section = {"path": data["model"]}
    if model:
        model_section["path"] = model
    if dtype:
        model_section["dtype"] = dtype
    if device and device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise ConfigError("device", device, "is not a device the engine runs on", fix="use cpu or cuda")
    if device:
        model_section["device"] = device
    if not model_section.get("path"):
        raise ConfigError("pretrained", None, "is needed (the model folder)",
                          fix="give pretrained=PATH or config=ENGINE_YAML in --model_args")
    data["model"] = model_section
    data.setdefault("backend", "hf")
    from engine.backends.registry import SPECS

    setting = SPECS[data["backend"]].batch_size_setting if data["backend"] in SPECS else None
    if str(batch_size).isdigit() and setting is not None:  # HF: max_batch_size; vLLM batches by itself
        data[data["backend"]] = {**(data.get(data["backend"]) or {}), setting: int(str(batch_size))}
    return GenerationEngine(data)
