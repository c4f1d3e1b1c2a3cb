"""``GenerationEngine``: the one pipeline every request goes through, whatever the backend.

validate requests and options (fail before any generation) -> render the chat template once
(thinking disabled, recorded fallback) -> backend generates token ids (native stops attached) ->
decode ``raw_text`` (special tokens kept) and ``text`` (skipped) -> deterministic stop truncation ->
``GenerationResult`` with finish reason, stop reason and per-request meta.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.backends import backend_class
from engine.backends.base import (
    AdapterLoading,
    AsyncGenerating,
    AsyncScoring,
    Backend,
    CallPlan,
    Prompt,
    Scoring,
    TokenScores,
    prompts_of,
)
from engine.backends.guard import check_guard_can_run
from engine.backends.registry import spec
from engine.completion import PromptLike, check_scored, plain_prompts
from engine.config import EngineConfig, GenerationOptions, PixelBudget, StopPolicy
from engine.config.generation import MAX_LOGPROBS
from engine.config.repeat import RepeatTerminateConfig
from engine.errors import ConfigError, PluginCompatibilityError, RequestError, UnsupportedCapabilityError
from engine.loading import load_processor, load_tokenizer
from engine.planning import plan_guard, plan_options, plan_rules, plan_schema, plan_stop
from engine.plugins import POST_DECODE, Plugin, PluginContext, create_plugins
from engine.results import ResultBuilder
from engine.rules.min_length import is_sentence_end_token
from engine.rules.processing import Processing
from engine.streaming import ResultStream
from engine.templates import RenderedPrompt, render_prompt
from engine.types import ChatRequest, GenerationResult
from engine.vision import VisionRequest, check_unresized

log = logging.getLogger(__name__)

RequestLike = ChatRequest | Sequence[Mapping[str, Any]]
VisionRequestLike = VisionRequest | Sequence[Mapping[str, Any]]
OptionsLike = GenerationOptions | Mapping[str, Any] | None
StopLike = StopPolicy | Mapping[str, Any] | None
PluginsLike = Sequence[Plugin | Mapping[str, Any]] | None
RepeatLike = RepeatTerminateConfig | Mapping[str, Any] | None
SchemaLike = Mapping[str, Any] | str | None

ProcessingLike = Processing | GenerationOptions | Mapping[str, Any] | None


def processing_of(processing: ProcessingLike) -> Processing | None:
    """The processing steps ``score`` re-scores with: generation options (validated as ``generation``'s) or
    :class:`~engine.rules.processing.Processing`; None when they change nothing (the raw distribution)."""
    if processing is None:
        return None
    if isinstance(processing, Mapping):
        processing = GenerationOptions().merged(processing)
    steps = processing if isinstance(processing, Processing) else Processing.of(processing)
    return None if steps.is_identity else steps


REQUEST_SECTIONS = ("generation", "stop", "vision", "repeat_terminate", "plugins", "serve")
"""Config sections that shape requests, not the loaded backend: :meth:`GenerationEngine.derive` may change them."""


class GenerationEngine:
    """Batch-first chat generation with one contract on every backend.

    Example (needs a built model; ``python -m engine_fixtures build``)::

        from engine_fixtures import fixture_path
        engine = GenerationEngine({"backend": "hf", "model": str(fixture_path("smollm2-135m-instruct")),
                                   "generation": {"max_new_tokens": 16}})
        [r.text for r in engine.generate([[{"role": "user", "content": "What is the capital of France?"}]])]
        # ['The capital of France is Paris.']
    """

    def __init__(self, config: EngineConfig | Mapping[str, Any] | str | Path) -> None:
        self._set_up(self._load_config(config), source=None)
        # Engine-wide plugins are checked against the hooks the backend declares before it starts ...
        declared = spec(self.config.backend).hooks
        self._check_plugins(self.plugins, self.config.backend, declared, kinds=None)
        self.backend = self._create_backend(self.config.backend)
        # ... and against what it really offers once started (e.g. vLLM's model runner).
        self._check_plugins(self.plugins, self.backend.name, self.backend.capabilities.hooks, kinds=None)

    def _set_up(self, config: EngineConfig, source: GenerationEngine | None) -> None:
        """Every attribute an engine has, set in one place for ``__init__`` and :meth:`derive`: a new engine
        (``source`` None) loads its processor and tokenizer (``__init__`` starts its backend next); a derived one
        shares ``source``'s loaded parts, its backend included, which it never closes."""
        self.config = config
        self.plugins = self._plugins(None)  # unknown names and bad parameters fail before anything is loaded
        if source is None:
            self.processor = load_processor(config.model)
            self.tokenizer, self.load_info = load_tokenizer(config.model, self.processor)
            self.results = ResultBuilder(self.tokenizer, self.load_info)
        else:
            self.processor, self.tokenizer, self.load_info = source.processor, source.tokenizer, source.load_info
            self.results = source.results
            self.backend: Backend = source.backend
        self._fallback: Backend | None = None
        self._batcher: Any = None
        self._context: PluginContext | None = source._context if source else None
        self._specials: dict[str, int] | None = source._specials if source else None
        self._token_chars: int | None = source._token_chars if source else None
        self._owns_backend = source is None

    def _derived_model(self, sections: dict[str, Any]) -> dict[str, Any]:
        """``sections`` with a ``model`` section that changes only ``logprobs_mode`` turned into this engine's model
        config in that mode, where the backend reads the mode per call (HF, llama.cpp; vLLM fixes it at load)."""
        if "model" not in sections:
            return sections
        from engine.backends.registry import SPECS

        asked = sections["model"]
        changes = dict(asked) if isinstance(asked, Mapping) else {}
        mode = changes.pop("logprobs_mode", None)
        if changes or mode is None or SPECS[self.config.backend].logprobs_mode_at_load:
            why = ("vLLM fixes model.logprobs_mode when it starts" if mode is not None and not changes else
                   "belongs to the loaded backend")
            raise ConfigError("model", asked, f"{why}; derive() changes only {', '.join(REQUEST_SECTIONS)} (and "
                              "model.logprobs_mode on backends that read it per call)",
                              fix="build a new GenerationEngine for another model or model setting")
        return {**sections, "model": dataclasses.replace(self.config.model, logprobs_mode=mode)}

    def derive(self, **sections: Any) -> GenerationEngine:
        """A new engine over this one's loaded backend (and tokenizer), with other request-level config sections.

        Only :data:`REQUEST_SECTIONS` may change (``repeat_terminate``, ``generation``, ``stop``, ``vision``,
        ``plugins``, ``serve``), and ``model={"logprobs_mode": ...}`` where the backend reads it per call (HF,
        llama.cpp); each is a mapping or a config object, validated like the config file's, and
        replaces this engine's section whole. Nothing is loaded: comparing guard settings costs no second model.
        The derived engine's results equal those of an engine built from the merged config; closing it leaves
        the shared backend to this one. Example (needs a built model; ``python -m engine_fixtures build``)::

            plain = GenerationEngine({"backend": "hf", "model": str(fixture_path("tiny-looper"))})
            guarded = plain.derive(repeat_terminate={"enabled": True, "max_consecutive_token_repeats": 4})
            guarded.backend is plain.backend  # True
        """
        known = [f.name for f in dataclasses.fields(EngineConfig)]
        sections = self._derived_model(sections)
        for name, value in sections.items():
            if name not in REQUEST_SECTIONS and name != "model":
                problem = "is not a known key" if name not in known else "belongs to the loaded backend"
                raise ConfigError(name, value, f"{problem}; derive() changes only {', '.join(REQUEST_SECTIONS)}",
                                  fix="build a new GenerationEngine for another backend, model or backend setting")
        config = EngineConfig.from_dict({**{n: getattr(self.config, n) for n in known}, **sections})
        check_guard_can_run(config.repeat_terminate.enabled, self.backend.name,
                            self.backend.capabilities.rules_problem)
        derived = object.__new__(type(self))
        derived._set_up(config, source=self)
        derived._check_plugins(derived.plugins, self.backend.name, self.backend.capabilities.hooks, kinds=None)
        return derived

    @staticmethod
    def _load_config(config: EngineConfig | Mapping[str, Any] | str | Path) -> EngineConfig:
        if isinstance(config, EngineConfig):
            return config
        if isinstance(config, (str, Path)):
            return EngineConfig.from_yaml(config)
        return EngineConfig.from_dict(dict(config))

    def _create_backend(self, name: str) -> Backend:
        from engine.backends.registry import settings_section

        settings = getattr(self.config, settings_section(name))
        cls = backend_class(name, settings)  # e.g. vLLM's async_engine picks AsyncLLM's class
        return cls(self.config.model, settings, self.tokenizer, processor=self.processor,
                   repeat_terminate=self.config.repeat_terminate)

    def close(self) -> None:
        """Release the backends' models and engines (an engine made by ``derive`` leaves the shared backend open)."""
        if self._batcher is not None:
            self._batcher.close()
        if self._owns_backend:
            self.backend.close()
        if self._fallback is not None:
            self._fallback.close()

    def __enter__(self) -> GenerationEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plugins -----------------------------------------------------------------------------------------

    def _plugins(self, plugins: PluginsLike) -> list[Plugin]:
        """Per-call plugins replace the engine's when given; None keeps the engine's."""
        return create_plugins(self.config.plugins if plugins is None else plugins)

    @staticmethod
    def _check_plugins(plugins: list[Plugin], backend: str, hooks: frozenset[str], kinds: str | None) -> None:
        """Every hook and request kind a plugin needs must exist; raises before any generation."""
        for plugin in plugins:
            if kinds is not None and kinds not in plugin.request_kinds:
                raise PluginCompatibilityError(
                    f"plugin {plugin.name!r} does not support {kinds} requests (it supports "
                    f"{', '.join(sorted(plugin.request_kinds))}). Fix: drop it for these requests")
            missing = sorted(plugin.hooks(backend) - hooks - {POST_DECODE})
            if missing:
                raise PluginCompatibilityError(
                    f"plugin {plugin.name!r} needs {', '.join(missing)}, which backend {backend!r} does not "
                    f"offer (it offers: {', '.join(sorted(hooks)) or 'none'}). "
                    "Fix: use another backend, another plugin setting, or drop the plugin")

    def _chars_per_token(self) -> int:
        """An upper bound on the characters one token decodes to: its vocabulary string's length (byte-level BPE
        and SentencePiece spell each decoded byte or space with at least one character), plus one for a decoder
        that joins tokens with a space. Cached; derived engines share it."""
        if self._token_chars is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._token_chars = max(map(len, vocab), default=0) + 1 if vocab else None
        return self._token_chars or 0

    def _check_size(self, checked: Sequence[ChatRequest]) -> None:
        """Refuse a conversation that cannot fit the context even at the longest token, before tokenizing it (a
        50 MB message would otherwise be tokenized whole, taking gigabytes, only to be refused after)."""
        for i, r in enumerate(checked):
            self.check_conversation(f"requests[{i}].messages", r.messages)

    def check_conversation(self, field: str, messages: Sequence[Mapping[str, Any]]) -> None:
        """Refuse a checked conversation that cannot fit the context, before the template or the tokenizer sees it:
        its text (:meth:`check_chars`), or more messages than the context has tokens (every chat template writes
        at least one token per message: its role's marker)."""
        limit = self.backend.capabilities.max_model_len
        if limit is not None and len(messages) > limit:
            raise RequestError(field, f"{len(messages)} messages", f"cannot fit the model's context length ({limit} "
                               "tokens; each message renders at least one); refused before rendering",
                               fix="send fewer messages")
        self.check_chars(field, sum(len(m["content"]) for m in messages), fix="shorten the conversation")

    def check_chars(self, field: str, chars: int, *, fix: str = "send a shorter text") -> None:
        """Refuse ``chars`` characters of text (``field``: what holds them) that cannot fit the model's context even
        at the longest token, before anything tokenizes them: every route that tokenizes a client's text asks this
        first (a 15 MB prompt would otherwise be tokenized whole, taking a gigabyte and seconds, only to be refused
        after)."""
        limit, per = self.backend.capabilities.max_model_len, self._chars_per_token()
        if limit is not None and per and chars > limit * per:
            raise RequestError(field, f"{chars} characters", f"cannot fit the model's context length ({limit} tokens "
                               f"of at most {per} characters each); refused before tokenizing", fix=fix)

    def _special_texts(self) -> dict[str, int]:
        """Special tokens' texts and ids: what ``skip_special_tokens`` decoding drops (cached)."""
        if self._specials is None:
            tok = self.tokenizer
            found = {str(t.content): int(i) for i, t in getattr(tok, "added_tokens_decoder", {}).items() if t.special}
            found.update({str(t): int(tok.convert_tokens_to_ids(t)) for t in tok.all_special_tokens})
            self._specials = found
        return self._specials

    def _plugin_context(self, plugins: Sequence[Plugin]) -> PluginContext:
        """Tokenizer facts for plugins; the vocabulary scan for sentence ends runs once, when first needed."""
        wants_ends = any(p.needs_sentence_ends for p in plugins)
        if self._context is None or (wants_ends and not self._context.sentence_end_ids):
            ends: tuple[int, ...] = ()
            if wants_ends:
                decode = self.tokenizer.decode
                ends = tuple(i for i in range(len(self.tokenizer)) if is_sentence_end_token(decode([i])))
            self._context = PluginContext(eos_token_id=self.load_info.eos_token_ids[0], sentence_end_ids=ends)
        return self._context

    # -- validation and rendering (nothing generated) --------------------------------------------------

    def _plan(self, options: OptionsLike, stop: StopLike, pixels: PixelBudget | Mapping[str, Any] | None,
              backend: Backend, plugins: Sequence[Plugin] = (), json_schema: SchemaLike = None,
              repeat_terminate: RepeatLike = None) -> CallPlan:
        """The call's plan, every decision made before generation (``engine.planning``: one function each)."""
        schema = plan_schema(json_schema, backend, lambda: self.tokenizer)
        served_mode = self.config.model.logprobs_mode
        opts = plan_options(self.config.generation, options, backend, served_mode)
        policy, exact = plan_stop(self.config.stop, stop, lambda: len(self.tokenizer), self._special_texts())
        budget = self.config.vision.merged(pixels)
        guard = plan_guard(self.config.repeat_terminate, repeat_terminate, backend)
        rules = plan_rules(guard, plugins, opts, backend.name,
                           lambda: self._plugin_context(plugins))
        return CallPlan(options=opts, stop=policy, eos_token_ids=self.load_info.eos_token_ids, pixels=budget,
                            rules=rules, json_schema=schema, logprobs_mode=served_mode, special_stops=exact)

    def prepare(self, requests: Sequence[RequestLike], *, options: OptionsLike = None, stop: StopLike = None,
                plugins: PluginsLike = None, json_schema: SchemaLike = None,
                repeat_terminate: RepeatLike = None,
                adapter: str | None = None) -> tuple[list[RenderedPrompt], CallPlan]:
        """Validate text requests, options and plugins and render prompts; raises before any generation.
        ``adapter`` (a ``model.adapters`` name) is the LoRA adapter of every request that names none."""
        active = self._plugins(plugins)
        self._check_plugins(active, self.backend.name, self.backend.capabilities.hooks, kinds="text")
        plan = self._plan(options, stop, None, self.backend, active, json_schema, repeat_terminate)
        checked = [ChatRequest.of(r, index=i) for i, r in enumerate(requests)]
        self._check_size(checked)
        self.check_adapter(adapter, "adapter")
        for i, r in enumerate(checked):
            self.check_adapter(r.adapter, f"requests[{i}].adapter")
        rendered = [dataclasses.replace(render_prompt(self.tokenizer, r.messages, thinking=r.thinking), seed=r.seed,
                                        adapter=r.adapter or adapter)
                    for r in checked]
        limit = self.backend.capabilities.max_model_len
        for i, r in enumerate(rendered):
            if limit is not None and len(r.token_ids) >= limit:
                raise RequestError(f"requests[{i}].messages", f"{len(r.token_ids)} prompt tokens",
                                   f"leave no room to generate within the model's context length ({limit} tokens)",
                                   fix="shorten the conversation, or raise model.max_model_len if the model allows")
        return rendered, plan

    def _vlm_backend(self) -> tuple[Backend, dict[str, Any] | None]:
        """The backend that serves VLM requests, and the fallback record when it is not the configured one."""
        if self.backend.capabilities.supports_vlm:
            return self.backend, None
        reason = (f"backend {self.backend.name!r} cannot serve image requests for model "
                  f"{self.config.model.path!r} (supports_vlm is False)")
        if self.config.fallback_backend is None:
            raise UnsupportedCapabilityError(f"{reason}. Fix: use a backend that supports it, or set "
                                             "fallback_backend (e.g. 'hf') to run such requests there, recorded")
        if self._fallback is None:
            log.warning("%s; loading fallback backend %r for them", reason, self.config.fallback_backend)
            self._fallback = self._create_backend(self.config.fallback_backend)
        if not self._fallback.capabilities.supports_vlm:
            raise UnsupportedCapabilityError(f"{reason}, and fallback backend {self._fallback.name!r} cannot either")
        log.warning("VLM requests fall back from %r to %r: %s", self.backend.name, self._fallback.name, reason)
        return self._fallback, {"from": self.backend.name, "to": self._fallback.name, "reason": reason}

    # -- generation ------------------------------------------------------------------------------------

    def generate(self, requests: Sequence[RequestLike], *, options: OptionsLike = None, stop: StopLike = None,
                 plugins: PluginsLike = None, json_schema: SchemaLike = None,
                 repeat_terminate: RepeatLike = None, adapter: str | None = None) -> list[GenerationResult]:
        """Generate one result per text request, in order. ``options``/``stop`` override the config's fields;
        ``plugins`` (a list of ``{name: ..., <params>}``) replaces the engine's plugins for this call;
        ``json_schema`` (a JSON Schema object) constrains every output to it by construction;
        ``repeat_terminate`` (the guard's fields) is laid over the config's guard for this call
        (:meth:`~engine.config.repeat.RepeatTerminateConfig.overlaid`: a threshold turns it on, ``{"enabled": false}``
        off)."""
        rendered, plan = self.prepare(requests, options=options, stop=stop, plugins=plugins, json_schema=json_schema,
                                      repeat_terminate=repeat_terminate, adapter=adapter)
        return self._run(self.backend, prompts_of(rendered, plan), rendered, plan, fallback=None,
                         plugins=self._plugins(plugins))

    def complete(self, prompts: Sequence[PromptLike], *, options: OptionsLike = None, stop: StopLike = None,
                 plugins: PluginsLike = None, json_schema: SchemaLike = None,
                 repeat_terminate: RepeatLike = None, adapter: str | None = None) -> list[GenerationResult]:
        """Continue plain prompts, no chat template: text (tokenized as is, no special tokens added) or token ids.
        Everything else is ``generate``'s pipeline (stops, guards, plugins, ``json_schema``)."""
        rendered, plan = self.prepare_plain(prompts, options=options, stop=stop, plugins=plugins,
                                            json_schema=json_schema, repeat_terminate=repeat_terminate,
                                            adapter=adapter)
        return self._run(self.backend, prompts_of(rendered, plan), rendered, plan, fallback=None,
                         plugins=self._plugins(plugins))

    def prepare_plain(self, prompts: Sequence[PromptLike], *, options: OptionsLike = None, stop: StopLike = None,
                      plugins: PluginsLike = None, json_schema: SchemaLike = None,
                      repeat_terminate: RepeatLike = None,
                      adapter: str | None = None) -> tuple[list[RenderedPrompt], CallPlan]:
        """``prepare`` for plain prompts (``complete``'s): validate and tokenize; raises before any generation.
        ``adapter``: the LoRA adapter of every prompt (None: the base model)."""
        active = self._plugins(plugins)
        self._check_plugins(active, self.backend.name, self.backend.capabilities.hooks, kinds="text")
        plan = self._plan(options, stop, None, self.backend, active, json_schema, repeat_terminate)
        self.check_adapter(adapter, "adapter")
        rendered = plain_prompts(self.tokenizer, prompts, self.backend.capabilities.max_model_len)
        if adapter is not None:
            rendered = [dataclasses.replace(r, adapter=adapter) for r in rendered]
        return rendered, plan

    def load_adapter(self, name: str, path: str, *, replace: bool = False) -> None:
        """Load LoRA adapter ``name`` from ``path`` while the engine runs (vLLM's ``/v1/load_lora_adapter``): checked
        as ``model.adapters`` are (rank, shapes; the engine must have started with LoRA on: ``model.adapters`` or
        ``model.max_lora_rank``), then loaded on the backend; requests may name it from then on. ``replace`` loads
        it in place of the one of that name (vLLM's ``load_inplace``), no cached block of the old one reused."""
        if not isinstance(self.backend, AdapterLoading):
            raise UnsupportedCapabilityError(f"backend {self.backend.name!r} cannot load LoRA adapters")
        self.backend.load_adapter(name, path, replace=replace)

    def unload_adapter(self, name: str) -> None:
        """Unload adapter ``name`` (a ``RequestError`` naming ``lora_name`` when none is loaded by that name)."""
        if not isinstance(self.backend, AdapterLoading):
            raise UnsupportedCapabilityError(f"backend {self.backend.name!r} cannot load LoRA adapters")
        self.backend.unload_adapter(name)

    def check_adapter(self, name: Any, at: str) -> None:
        """Refuse a LoRA adapter name the backend did not load (``engine.adapters``), naming ``at``."""
        from engine.adapters import check_adapter_name

        check_adapter_name(name, tuple(getattr(self.backend.capabilities, "adapters", ())), at)

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
              top: int | None = None, processing: ProcessingLike = None) -> list[TokenScores]:
        """The model's log-probability of every token of ``sequences[i][starts[i]:]`` given the tokens before
        it, and whether it was the argmax there (the parts of lm-eval's loglikelihood); with ``top``, the ``top``
        likeliest tokens at each of those positions too (an echoed prompt's logprobs).

        ``processing`` (generation options such as ``{"temperature": 0.7, "top_p": 0.9}``) re-scores under the
        distribution a sampled rollout was drawn from (``engine.rules.processing``: penalty, temperature, min-p,
        top-k, top-p; not the rule masks): what ``processed_logprobs`` rollouts match, token for token. Each score
        then carries its kept mass; ``{"temperature": T}`` alone is ms-swift's trainer-side re-scoring."""
        steps = self.check_scoring(sequences, starts, top, processing)
        if not sequences:
            return []
        if steps is None:
            return self.backend.score(sequences, starts, top)  # type: ignore[union-attr]
        return self.backend.score(sequences, starts, top, steps)  # type: ignore[union-attr]

    async def ascore(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
                     top: int | None = None) -> list[TokenScores]:
        """``score`` for asyncio callers: on vLLM's ``AsyncLLM`` beside its generation, otherwise in turn with the
        :class:`~engine.batcher.AsyncBatcher`'s batches. Validation raises first, in the caller."""
        self.check_scoring(sequences, starts, top)
        if not sequences:
            return []
        if isinstance(self.backend, AsyncScoring):
            return await self.backend.ascore(sequences, starts, top)
        backend = self.backend
        return await self.batcher().run_exclusive(lambda: backend.score(sequences, starts, top))  # type: ignore

    def check_scoring(self, sequences: Sequence[Sequence[int]], starts: Sequence[int], top: int | None,
                      processing: ProcessingLike = None) -> Processing | None:
        """Refuse what ``score`` cannot do here (the capability, the sequences, ``top``, ``processing``); nothing
        runs. Returns the processing steps to re-score with (None: the raw distribution)."""
        caps = self.backend.capabilities
        if caps.scoring_problem is not None:
            raise UnsupportedCapabilityError(f"backend {self.backend.name!r} cannot score sequences here: "
                                             f"{caps.scoring_problem}")
        if not caps.scoring or not isinstance(self.backend, Scoring):
            raise UnsupportedCapabilityError(f"backend {self.backend.name!r} cannot score sequences here. Fix: use "
                                             "hf or vllm, on a text model (vllm in a *_logprobs mode)")
        steps = processing_of(processing)
        if steps is not None and not caps.rescoring:
            raise UnsupportedCapabilityError(f"backend {self.backend.name!r} cannot re-score under sampling "
                                             "processing (it returns no full-vocabulary logits). Fix: re-score with "
                                             "an hf engine on the same model, or leave processing unset")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS):
            raise RequestError("top", top, f"must be an integer in [0, {MAX_LOGPROBS}]",
                               fix="ask for fewer alternatives")
        check_scored(sequences, starts, caps.max_model_len)
        return steps

    async def agenerate(self, requests: Sequence[RequestLike], *, options: OptionsLike = None, stop: StopLike = None,
                        plugins: PluginsLike = None, json_schema: SchemaLike = None,
                        repeat_terminate: RepeatLike = None, adapter: str | None = None,
                        prepared: tuple[list[RenderedPrompt], CallPlan] | None = None) -> list[GenerationResult]:
        """``generate`` for asyncio callers: concurrent calls share the backend (vLLM's ``AsyncLLM`` with
        ``vllm.async_engine``; otherwise an :class:`~engine.batcher.AsyncBatcher` over the backend's batches).
        Validation happens first, in the caller, and raises before anything is generated; ``prepared`` (what
        :meth:`prepare` gave for these very arguments, e.g. in a worker thread) skips doing it again."""
        rendered, plan = prepared or self.prepare(requests, options=options, stop=stop, plugins=plugins,
                                                  json_schema=json_schema, repeat_terminate=repeat_terminate,
                                                  adapter=adapter)
        return await self._arun(rendered, plan, plugins)

    async def acomplete(self, prompts: Sequence[PromptLike], *, options: OptionsLike = None, stop: StopLike = None,
                        plugins: PluginsLike = None, json_schema: SchemaLike = None,
                        repeat_terminate: RepeatLike = None, adapter: str | None = None,
                        prepared: tuple[list[RenderedPrompt], CallPlan] | None = None) -> list[GenerationResult]:
        """``complete`` for asyncio callers, batched as ``agenerate``. Validation raises first, in the caller;
        ``prepared`` (what :meth:`prepare_plain` gave for these very arguments) skips doing it again."""
        rendered, plan = prepared or self.prepare_plain(prompts, options=options, stop=stop, plugins=plugins,
                                                        json_schema=json_schema, repeat_terminate=repeat_terminate,
                                                        adapter=adapter)
        return await self._arun(rendered, plan, plugins)

    async def _arun(self, rendered: list[RenderedPrompt], plan: CallPlan,
                    plugins: PluginsLike) -> list[GenerationResult]:
        prompts = prompts_of(rendered, plan)
        if not prompts:
            return []
        if isinstance(self.backend, AsyncGenerating):
            outputs = await self.backend.agenerate(prompts, plan)
        else:
            outputs = await self.batcher().submit(prompts, plan)
        return self.results.finish(self.backend.name, rendered, outputs, plan, fallback=None,
                                   plugins=self._plugins(plugins))

    def astream(self, request: RequestLike, *, options: OptionsLike = None, stop: StopLike = None,
                plugins: PluginsLike = None, json_schema: SchemaLike = None, repeat_terminate: RepeatLike = None,
                adapter: str | None = None,
                prepared: tuple[list[RenderedPrompt], CallPlan] | None = None) -> ResultStream:
        """One text request as a stream of text deltas, the last carrying the ``GenerationResult``
        (see :class:`~engine.streaming.ResultStream`). Validation happens here, before anything is generated;
        the deltas concatenate to the result's ``text`` (the same text ``generate`` gives). ``prepared`` as in
        :meth:`agenerate` (of ``[request]``)."""
        rendered, plan = prepared or self.prepare([request], options=options, stop=stop, plugins=plugins,
                                                  json_schema=json_schema, repeat_terminate=repeat_terminate,
                                                  adapter=adapter)
        return ResultStream(self.results, self.backend, self.batcher, rendered[0], plan, self._plugins(plugins))

    def astream_complete(self, prompt: PromptLike, *, options: OptionsLike = None, stop: StopLike = None,
                         plugins: PluginsLike = None, json_schema: SchemaLike = None,
                         repeat_terminate: RepeatLike = None, adapter: str | None = None,
                         prepared: tuple[list[RenderedPrompt], CallPlan] | None = None) -> ResultStream:
        """``astream`` for one plain prompt (``complete``'s): its deltas concatenate to ``complete``'s text;
        ``prepared`` as in :meth:`acomplete` (of ``[prompt]``)."""
        rendered, plan = prepared or self.prepare_plain([prompt], options=options, stop=stop, plugins=plugins,
                                                        json_schema=json_schema, repeat_terminate=repeat_terminate,
                                                        adapter=adapter)
        return ResultStream(self.results, self.backend, self.batcher, rendered[0], plan, self._plugins(plugins))

    def batcher(self) -> Any:
        """The :class:`~engine.batcher.AsyncBatcher` that async callers of a synchronous backend share."""
        if self._batcher is None:
            from engine.batcher import AsyncBatcher

            serve = self.config.serve
            self._batcher = AsyncBatcher(self.backend, max_batch_size=serve.max_batch_size,
                                         wait_s=serve.batch_wait_ms / 1000, max_wait_s=serve.batch_wait_max_ms / 1000)
        return self._batcher

    def generate_vlm(self, requests: Sequence[VisionRequestLike], *, options: OptionsLike = None,
                     stop: StopLike = None, pixels: PixelBudget | Mapping[str, Any] | None = None,
                     plugins: PluginsLike = None, repeat_terminate: RepeatLike = None) -> list[GenerationResult]:
        """Generate for chat requests that carry exactly one image each (see :class:`VisionRequest`).

        ``pixels`` overrides the configured pixel budget for this call; the rest as in :meth:`generate`.
        """
        checked = [VisionRequest.of(r, index=i) for i, r in enumerate(requests)]
        backend, fallback = self._vlm_backend()
        active = self._plugins(plugins)
        self._check_plugins(active, backend.name, backend.capabilities.hooks, kinds="vlm")
        plan = self._plan(options, stop, pixels, backend, active, repeat_terminate=repeat_terminate)
        if self.processor is None:
            raise UnsupportedCapabilityError(f"model {self.config.model.path!r} is not a vision-language model")
        if not plan.pixels.do_resize:
            grid = self._vision_grid()
            for i, c in enumerate(checked):
                check_unresized(c.image, index=i, grid=grid, min_pixels=plan.pixels.min_pixels,
                                max_pixels=plan.pixels.max_pixels)
        rendered = [render_prompt(self.processor, r.messages, tokenizer=self.tokenizer) for r in checked]
        prompts = prompts_of(rendered, plan, images=[c.image for c in checked])
        return self._run(backend, prompts, rendered, plan, fallback=fallback, plugins=active)

    def _vision_grid(self) -> int:
        """Pixels per merged patch side (patch size x merge size) of the image processor."""
        proc = self.processor.image_processor
        patch, merge = getattr(proc, "patch_size", None), getattr(proc, "merge_size", None)
        if not isinstance(patch, int) or not isinstance(merge, int):
            raise UnsupportedCapabilityError(f"vision.do_resize false needs an image processor with patch_size and "
                                             f"merge_size (Qwen2-VL family); {type(proc).__name__} has neither. "
                                             "Fix: set vision.do_resize true")
        return patch * merge

    def _run(self, backend: Backend, prompts: list[Prompt], rendered: list[RenderedPrompt], plan: CallPlan,
             fallback: dict[str, Any] | None, plugins: list[Plugin]) -> list[GenerationResult]:
        if not prompts:
            return []
        return self.results.finish(backend.name, rendered, backend.generate(prompts, plan), plan, fallback, plugins)
