"""``GenerationEngine``: the one pipeline every request goes through, whatever the backend.

validate requests and options (fail before any generation) -> render the chat template once
(thinking disabled, recorded fallback) -> backend generates token ids (native stops attached) ->
decode ``raw_text`` (special tokens kept) and ``text`` (skipped) -> deterministic stop truncation ->
``GenerationResult`` with finish reason, stop reason and per-request meta.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.backends import Backend, BackendOutput, SamplingPlan, backend_class
from engine.config import EngineConfig, GenerationOptions, StopPolicy
from engine.errors import UnsupportedCapabilityError
from engine.loading import load_tokenizer
from engine.rules.stop import finish_reason, truncate_at_stop
from engine.templates import RenderedPrompt, render_prompt
from engine.types import ChatRequest, GenerationResult

log = logging.getLogger(__name__)

RequestLike = ChatRequest | Sequence[Mapping[str, Any]]


class GenerationEngine:
    """Batch-first chat generation with one contract on every backend.

    Example (needs a built model; ``python -m fixtures build``)::

        from fixtures import fixture_path
        engine = GenerationEngine({"backend": "hf", "model": str(fixture_path("smollm2-135m-instruct")),
                                   "generation": {"max_new_tokens": 16}})
        [r.text for r in engine.generate([[{"role": "user", "content": "What is the capital of France?"}]])]
        # ['The capital of France is Paris.']
    """

    def __init__(self, config: EngineConfig | Mapping[str, Any] | str | Path) -> None:
        self.config = self._load_config(config)
        self.tokenizer, self.load_info = load_tokenizer(self.config.model)
        self.backend: Backend = self._create_backend()

    @staticmethod
    def _load_config(config: EngineConfig | Mapping[str, Any] | str | Path) -> EngineConfig:
        if isinstance(config, EngineConfig):
            return config
        if isinstance(config, (str, Path)):
            return EngineConfig.from_yaml(config)
        return EngineConfig.from_dict(dict(config))

    def _create_backend(self) -> Backend:
        cls = backend_class(self.config.backend)
        settings = getattr(self.config, self.config.backend)
        return cls(self.config.model, settings, self.tokenizer)

    def close(self) -> None:
        """Release the backend's model and engine."""
        self.backend.close()

    def __enter__(self) -> GenerationEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the pipeline --------------------------------------------------------------------------------

    def prepare(
        self,
        requests: Sequence[RequestLike],
        *,
        options: GenerationOptions | Mapping[str, Any] | None = None,
        stop: StopPolicy | Mapping[str, Any] | None = None,
    ) -> tuple[list[RenderedPrompt], SamplingPlan]:
        """Validate everything and render prompts; nothing is generated. Raises before any generation."""
        opts = self.config.generation.merged(dict(options) if isinstance(options, Mapping) else options)
        policy = self.config.stop.merged(dict(stop) if isinstance(stop, Mapping) else stop)
        if opts.logprobs is not None and not self.backend.capabilities.logprobs:
            raise UnsupportedCapabilityError(f"backend {self.backend.name!r} cannot return logprobs; "
                                             "set generation.logprobs to null")
        checked = [ChatRequest.of(r, index=i) for i, r in enumerate(requests)]
        rendered = [render_prompt(self.tokenizer, r.messages) for r in checked]
        plan = SamplingPlan(options=opts, stop=policy, eos_token_ids=self.load_info.eos_token_ids)
        return rendered, plan

    def generate(
        self,
        requests: Sequence[RequestLike],
        *,
        options: GenerationOptions | Mapping[str, Any] | None = None,
        stop: StopPolicy | Mapping[str, Any] | None = None,
    ) -> list[GenerationResult]:
        """Generate one result per request, in order. ``options``/``stop`` override the config's fields."""
        rendered, plan = self.prepare(requests, options=options, stop=stop)
        if not rendered:
            return []
        outputs = self.backend.generate([r.token_ids for r in rendered], plan)
        return [self._result(r, o, plan) for r, o in zip(rendered, outputs, strict=True)]

    def _result(self, prompt: RenderedPrompt, out: BackendOutput, plan: SamplingPlan) -> GenerationResult:
        ids = list(out.token_ids)
        decode = self.tokenizer.decode
        raw_text = decode(ids, skip_special_tokens=False)
        # A terminal stop token id belongs to no text (as in vLLM) unless the policy keeps stops.
        ends_on_stop_id = bool(ids) and ids[-1] in plan.terminal_token_ids and not plan.stop.include_stop_str
        full_text = decode(ids[:-1] if ends_on_stop_id else ids, skip_special_tokens=True)
        min_new = plan.options.min_new_tokens
        min_end = len(decode(ids[:min_new], skip_special_tokens=True)) if min_new else 0
        text, matched = truncate_at_stop(full_text, plan.stop.strings, include_stop=plan.stop.include_stop_str,
                                         min_end=min_end)
        reason, stop_reason = finish_reason(ids, stop_token_ids=plan.terminal_token_ids, matched_stop=matched)
        meta = {
            "backend": self.backend.name,
            "chat_template_fallback": prompt.fallback,
            "pad_token_fallback": self.load_info.pad_token_fallback,
            "num_prompt_tokens": len(prompt.token_ids),
            "num_generated_tokens": len(ids),
        }
        return GenerationResult(text=text, raw_text=raw_text, token_ids=tuple(ids),
                                prompt_token_ids=prompt.token_ids, finish_reason=reason, stop_reason=stop_reason,
                                logprobs=out.logprobs, meta=meta)


