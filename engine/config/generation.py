"""Generation options and stop policy: what every backend receives, identically."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.config.validation import check_range, check_type, merge
from engine.errors import ConfigError

MAX_LOGPROBS = 20
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
"""vLLM's names (``--logprobs-mode``): what returned logprobs are. ``raw_*``: the model's own distribution (before
penalties, temperature, min-p, top-k, top-p, rule masks); ``processed_*``: the distribution the draw used (after all of
them; tokens outside the kept support are -inf). ``*_logprobs`` are log-softmaxed, ``*_logits`` are not."""
MIN_TEMPERATURE = 0.01
"""The smallest sampling temperature. vLLM raises anything in (0, 0.01) to 0.01 with a warning (below it logits
overflow to inf and sampling returns NaN); the engine refuses such values instead, so that no backend samples
another distribution than the one asked for."""
MAX_TEMPERATURE = 2.0
"""The largest sampling temperature, on every backend: vLLM's ``SamplingParams`` refuses anything above 2 (as the
OpenAI API does), so the engine refuses it before generation everywhere instead of letting one backend fail
mid-request and the others sample."""
SAMPLERS = ("native", "portable", "portable_fp64")
"""``generation.sampler``: the backend's own random stream (``native``, the default), or the counter-based draw of
``engine.rules.portable_sampler`` in float32 (``portable``) or float64 (``portable_fp64``)."""
MIN_REPETITION_PENALTY = 0.01
"""The smallest repetition penalty: below it the penalised logits overflow float32 (inf, then NaN when sampling)."""
SAMPLING_ONLY = ("sampler", "top_p", "min_p", "top_k")
"""The options that act only on a sampled draw: with temperature 0 (greedy) a value other than the default is refused
by name (one backend applying it and another dropping it would part silently). lm-eval's ``do_sample: false`` drops
them, as HF's ``generate`` ignores them when greedy."""


def check_temperature(path: str, value: Any) -> None:
    """The one temperature rule: a number, 0 (greedy) or in [:data:`MIN_TEMPERATURE`, :data:`MAX_TEMPERATURE`].

    >>> check_temperature("serve.chat.temperature", 2.5)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: serve.chat.temperature must be in [0, 2], got 2.5. Fix: use 0 for greedy decoding, ...
    """
    check_type(path, value, (int, float), "a number")
    check_range(path, value, low=0, high=MAX_TEMPERATURE,
                fix=f"use 0 for greedy decoding, or a value in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}] to sample "
                    "(vLLM and the OpenAI API refuse more)")
    if 0 < value < MIN_TEMPERATURE:
        raise ConfigError(path, value, f"must be 0 (greedy) or at least {MIN_TEMPERATURE} (smaller ones overflow the "
                          f"logits; vLLM would raise it to {MIN_TEMPERATURE})",
                          fix=f"use 0 for greedy decoding, or {MIN_TEMPERATURE} or more")


@dataclass(frozen=True)
class GenerationOptions:
    """Sampling and length options, mapped identically onto every backend.

    No backend default leaks in: the HF model's ``generation_config`` and vLLM's ``SamplingParams`` defaults
    (``max_tokens=16``) are replaced by exactly these values.

    >>> opts = GenerationOptions(max_new_tokens=32)
    >>> opts.is_greedy
    True
    >>> GenerationOptions(top_p=1.5)
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: generation.top_p must be in (0, 1], got 1.5. Fix: use a value such as 0.9.
    """

    max_new_tokens: int = 256
    """Most tokens generated per request, in [1, inf)."""
    temperature: float = 0.0
    """Sampling temperature: 0 (greedy decoding) or in [0.01, 2] (:data:`MIN_TEMPERATURE`, :data:`MAX_TEMPERATURE`)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables it. Only with temperature > 0."""
    top_k: int = 0
    """Keep the k most likely tokens, in [0, inf); 0 disables it. Only with temperature > 0."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the likeliest one (after the temperature, before top-k and top-p,
    as vLLM orders them), in [0, 1]; 0 disables it, 1 keeps only the likeliest. Only with temperature > 0."""
    seed: int | None = None
    """Sampling seed in [0, 2**63). With the ``native`` sampler reproducible per backend, not across backends; with
    ``portable`` the same rows on every backend. None: unseeded (``portable`` draws one and reports it in meta)."""
    sampler: str = "native"
    """How a sampled token is drawn from the processed distribution: ``native``, each backend's own random stream;
    ``portable`` (float32) or ``portable_fp64``, the counter-based draw of :mod:`engine.rules.portable_sampler`
    (vLLM Model Runner V2's arithmetic), which depends only on (row seed, position, token id), so a seeded row is the
    same on HF, vLLM and llama.cpp, whatever its batch. Only with temperature > 0."""
    repetition_penalty: float = 1.0
    """Penalty on prompt and output tokens (CTRL-style, as HF and vLLM define it), in [0.01, inf); 1 disables it."""
    min_new_tokens: int = 0
    """EOS and stop token ids are banned until this many tokens exist, in [0, max_new_tokens]."""
    logprobs: int | None = None
    """Return the top-k log-probabilities per generated token, k in [0, 20]; the chosen token is always included.
    Which distribution they come from is the engine's ``model.logprobs_mode`` (raw by default). None: no logprobs."""
    ignore_eos: bool = False
    """EOS does not end a row (vLLM's ``ignore_eos``, which ``vllm bench serve --ignore-eos`` sends: every row runs
    to ``max_new_tokens`` unless a stop ends it; an EOS drawn on the way is kept in ``token_ids`` and decoded away,
    as on vLLM). Rules that end rows by forcing EOS (the repeat guard, plugins) cannot run beside it."""
    logprobs_mode: str | None = None
    """The logprobs mode this request expects (``model.logprobs_mode``'s names); refused before generation when the
    engine serves another, so a learner that needs processed logprobs cannot silently get raw ones. None: any."""

    def __post_init__(self) -> None:
        p = "generation"
        check_type(f"{p}.max_new_tokens", self.max_new_tokens, int, "an integer")
        check_range(f"{p}.max_new_tokens", self.max_new_tokens, low=1, fix="ask for at least one token")
        check_temperature(f"{p}.temperature", self.temperature)
        check_type(f"{p}.top_p", self.top_p, (int, float), "a number")
        check_range(f"{p}.top_p", self.top_p, low=0, high=1, low_open=True, fix="use a value such as 0.9")
        check_type(f"{p}.top_k", self.top_k, int, "an integer")
        check_range(f"{p}.top_k", self.top_k, low=0, fix="use 0 to disable top-k")
        check_type(f"{p}.min_p", self.min_p, (int, float), "a number")
        check_range(f"{p}.min_p", self.min_p, low=0, high=1, fix="use a value such as 0.05, or 0 to disable min-p")
        if self.seed is not None:
            check_type(f"{p}.seed", self.seed, int, "an integer")
            check_range(f"{p}.seed", self.seed, low=0, high=2**63, high_open=True)
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"{p}.sampler", self.sampler, f"is not a sampler (one of {', '.join(SAMPLERS)})",
                              fix="use 'portable' to draw the same rows on every backend, or 'native'")
        check_type(f"{p}.repetition_penalty", self.repetition_penalty, (int, float), "a number")
        check_range(f"{p}.repetition_penalty", self.repetition_penalty, low=MIN_REPETITION_PENALTY,
                    fix="use 1.0 to disable the penalty (values below 0.01 overflow the penalised logits)")
        check_type(f"{p}.min_new_tokens", self.min_new_tokens, int, "an integer")
        check_range(f"{p}.min_new_tokens", self.min_new_tokens, low=0, high=self.max_new_tokens,
                    fix=f"keep it at most generation.max_new_tokens ({self.max_new_tokens})")
        if self.logprobs is not None:
            check_type(f"{p}.logprobs", self.logprobs, int, "an integer")
            check_range(f"{p}.logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        check_type(f"{p}.ignore_eos", self.ignore_eos, bool, "true or false")
        if self.logprobs_mode is not None and self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"{p}.logprobs_mode", self.logprobs_mode, f"must be one of {', '.join(LOGPROBS_MODES)}",
                              fix="name the mode the engine serves (model.logprobs_mode), or leave it null")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in SAMPLING_ONLY:
            value = getattr(self, name)
            if self.is_greedy and value != defaults[name]:
                raise ConfigError(f"{p}.{name}", value, "has no effect with temperature 0 (greedy)",
                                  fix=f"set generation.temperature > 0 to sample, or leave {name} at "
                                      f"{defaults[name]!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def merged(self, overrides: GenerationOptions | Mapping[str, Any] | None) -> GenerationOptions:
        """These options with ``overrides`` (a mapping of fields, or a whole options object) applied."""
        return merge(self, overrides, "generation")


@dataclass(frozen=True)
class StopPolicy:
    """When generation ends besides EOS and the token budget.

    Backends use their native mechanism to stop early (saving compute); the engine then cuts ``text`` at
    the earliest occurrence of any stop string, deterministically, so ``text`` is identical on every backend.

    >>> StopPolicy(strings=("\\n\\n",), token_ids=(13,)).strings
    ('\\n\\n',)
    >>> StopPolicy(strings=("",))
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: stop.strings[0] must be a non-empty string, got ''. Fix: remove it or give text.
    """

    strings: tuple[str, ...] = ()
    """Stop strings matched on the decoded text (special tokens skipped)."""
    token_ids: tuple[int, ...] = ()
    """Extra token ids that end a row (the tokenizer's EOS always does)."""
    include_stop_str: bool = False
    """Keep the matched stop string at the end of ``text``."""

    def __post_init__(self) -> None:
        for i, s in enumerate(self.strings):
            if not isinstance(s, str) or not s:
                raise ConfigError(f"stop.strings[{i}]", s, "must be a non-empty string", fix="remove it or give text")
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise ConfigError(f"stop.strings[{i}]", s, "holds a lone surrogate (not valid Unicode text)",
                                  fix="send the text as valid UTF-8") from None
        for i, t in enumerate(self.token_ids):
            check_type(f"stop.token_ids[{i}]", t, int, "an integer token id")
            check_range(f"stop.token_ids[{i}]", t, low=0)
        check_type("stop.include_stop_str", self.include_stop_str, bool, "true or false")

    def merged(self, overrides: StopPolicy | Mapping[str, Any] | None) -> StopPolicy:
        """This policy with ``overrides`` applied (a whole policy replaces it)."""
        return merge(self, overrides, "stop")
