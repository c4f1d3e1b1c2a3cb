"""The contract every backend implements, and what it receives and returns.

A backend turns prompt token ids into generated token ids. It knows nothing of chat templates, stop
truncation or decoding: the engine renders prompts once, hands every backend the same ids and the same
:class:`CallPlan`, and classifies and decodes what comes back with shared rules.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from engine.config.generation import GenerationOptions, StopPolicy
from engine.config.vision import PixelBudget
from engine.rules.base import RuleSpec
from engine.rules.processing import Processing


@dataclass(frozen=True)
class Capabilities:
    """What a loaded backend can do; the engine validates requests against it before generating.

    >>> Capabilities(name="hf", logprobs=True).supports_vlm
    False
    """

    name: str
    logprobs: bool = True
    """Returns per-token top-k logprobs."""
    supports_vlm: bool = False
    """Accepts image inputs for the loaded model."""
    hooks: frozenset[str] = field(default_factory=frozenset)
    """Generation-time hooks it offers plugins (e.g. "hf_logits_processor", "vllm_logits_processor")."""
    max_model_len: int | None = None
    """Context length (prompt + output) of the loaded model; a prompt must be shorter. None: unknown."""
    scoring: bool = False
    """Scores given token sequences (``score``: per-token log-probs and is-greedy, for log-likelihoods)."""
    scoring_problem: str | None = None
    """Why a backend that scores elsewhere cannot here, with the fix (None: no such reason)."""
    rescoring: bool = False
    """Re-scores under sampling processing (``score(..., processing=...)``: penalty, temperature, min-p, top-k,
    top-p, as the draw used them), with the kept mass per token."""
    structured_outputs: bool = False
    """Constrains generation to a JSON Schema (``CallPlan.json_schema``)."""
    rules_problem: str | None = None
    """Why the backend cannot run the engine's row rules (repeat guard, rule plugins) here; None: it can."""
    adapters: tuple[str, ...] = ()
    """The LoRA adapters it loaded (``model.adapters``' names): what a request's ``adapter`` may name."""
    native_processing: frozenset[str] | None = None
    """The fields of the call's processing (``CallPlan.processing``) its own sampler honours with ``generation.sampler:
    native``; None: every one (it runs the shared steps, ``engine.rules.processing``). Planning refuses another field
    set away from its default, naming it (the portable draw runs the shared steps on every backend)."""


@dataclass(frozen=True)
class Prompt:
    """One rendered request: the engine's token ids, the rendered text, and the image on the VLM path.

    On the VLM path ``token_ids`` hold one image placeholder token; each backend's processor expands it
    to the image's token count under the plan's pixel budget.
    """

    token_ids: tuple[int, ...]
    text: str
    image: Any = None
    seed: int | None = None
    """This row's own sampling seed (``engine.rules.seeding``: from the call's seed and the row's index in its
    call); None: greedy, or unseeded sampling. Backends sample each row with a generator of its own."""
    adapter: str | None = None
    """The LoRA adapter this row runs with (a name of ``model.adapters``, checked); None: the base model."""


@dataclass(frozen=True)
class CallPlan:
    """One call as planned before generation (``engine/planning.py``): everything a backend needs to generate it,
    identical for every backend: the options, the stop policy, the EOS ids, the pixel budget, the row rules, the seeds.

    ``terminal_token_ids`` are the ids that end a row: the tokenizer's EOS ids (unless ``ignore_eos``) plus
    ``stop.token_ids``.
    """

    options: GenerationOptions
    stop: StopPolicy
    eos_token_ids: tuple[int, ...]
    pixels: PixelBudget = field(default_factory=PixelBudget)
    rules: tuple[RuleSpec, ...] = ()
    """Generation-time row rules (the repeat guard, plugins), applied per row by each backend's adapter."""
    json_schema: str | None = None
    """A JSON Schema (canonical JSON text) every row's output must follow, by construction: xgrammar on HF,
    structured outputs on vLLM. None: unconstrained."""
    special_stops: tuple[tuple[str, int], ...] = ()
    """Stop strings that were exactly a special token's text (``stop: ["<|im_end|>"]``, as every ChatML client
    sends), each with the token id it became in ``stop.token_ids``: output is decoded with special tokens skipped on
    every backend, so the token ends the row instead; results report them (``meta["stop_strings_as_token_ids"]``)."""
    logprobs_mode: str = "raw_logprobs"
    """What ``options.logprobs`` returns (``model.logprobs_mode``; vLLM was started with it): the raw model
    distribution, or the processed one the draw used (``engine.rules.processing``)."""
    processing: Processing = field(init=False)
    """The sampling distribution's processing, built once from ``options`` (:class:`~engine.rules.processing.
    Processing`): what every backend, the portable draw and the processed logprobs read, never the options' fields
    one by one."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "processing", Processing.of(self.options))

    @property
    def draws_portably(self) -> bool:
        """Whether rows draw with the portable sampler (``generation.sampler``, sampled calls only)."""
        return self.options.sampler != "native" and not self.options.is_greedy

    @property
    def terminal_token_ids(self) -> tuple[int, ...]:
        """The ids that end a row: EOS (unless ``options.ignore_eos``) and ``stop.token_ids``."""
        eos = () if self.options.ignore_eos else self.eos_token_ids
        return tuple(dict.fromkeys((*eos, *self.stop.token_ids)))


def prompts_of(rendered: Sequence[Any], plan: CallPlan, images: Sequence[Any] | None = None) -> list[Prompt]:
    """The backend prompts of one call's rendered prompts (anything with ``token_ids`` and ``text``), each with its
    row's sampling seed (``engine.rules.seeding``) when the call samples with a seed."""
    from engine.rules.seeding import row_seeds

    opts = plan.options
    seeds = row_seeds(None if opts.is_greedy else opts.seed, len(rendered))
    if not opts.is_greedy:  # a request's own seed (ChatRequest.seed) in place of its index's
        own = [getattr(r, "seed", None) for r in rendered]
        seeds = [s if mine is None else mine for mine, s in zip(own, seeds, strict=True)]
    pictures = images if images is not None else [None] * len(rendered)
    return [Prompt(token_ids=tuple(r.token_ids), text=r.text, image=image, seed=seed,
                   adapter=getattr(r, "adapter", None))
            for r, image, seed in zip(rendered, pictures, seeds, strict=True)]


@dataclass(frozen=True)
class BackendOutput:
    """One row's generated ids (up to and including the one that ended it) and optional logprobs.

    ``prompt_token_ids`` is the prompt as the model saw it when the backend expanded it (VLM path).
    ``events`` are what the row's guards reported, e.g. ``{"repeat_terminate": (reason, index)}``.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    events: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenScores:
    """The model's log-probability of each scored token of a sequence, whether it was the argmax there, and (when
    asked for) the best alternatives at each position.

    >>> TokenScores(logprobs=(-0.5, -1.0), greedy=(True, False)).total
    -1.5
    """

    logprobs: tuple[float, ...]
    greedy: tuple[bool, ...]
    top: tuple[dict[int, float], ...] | None = None
    """Per scored token, ``top`` best token ids -> log-probability plus the scored token itself (the shape of a
    generated token's logprobs); None unless ``score(..., top=k)`` asked for them."""
    kept_mass: tuple[float, ...] | None = None
    """Per scored token, the probability its position's kept support held before truncation (after the penalty and
    temperature; ``engine.rules.processing.kept_mass``); None unless ``score(..., processing=...)`` asked."""

    @property
    def total(self) -> float:
        return float(sum(self.logprobs))


@runtime_checkable
class Backend(Protocol):
    """A generation backend: batch in, one output per prompt out, in order.

    Beyond these, a backend may implement :class:`AsyncGenerating`, :class:`TokenStreaming` and :class:`Scoring`;
    the engine checks for them with ``isinstance``.
    """

    name: str
    declared_hooks: frozenset[str]
    """Hooks the backend offers when everything works (checked before it starts; its spec's ``hooks``)."""
    capabilities: Capabilities
    streams_tokens: bool
    """Whether ``generate`` calls an ``on_token`` hook per sampled token (the engine's batcher streams through it)."""
    default_seed: int | None
    """The seed of calls that give none (a backend-level setting), or None."""

    def generate(self, prompts: Sequence[Prompt], plan: CallPlan) -> list[BackendOutput]:
        """Generate for every prompt under ``plan``; return outputs in prompt order."""
        ...

    def close(self) -> None:
        """Release the model and any engine resources."""
        ...


class BackendBase:
    """What every backend class shares: its name and declared hooks from its registry spec (``backend=`` in the
    class statement), and the protocol's defaults (no per-token hook, no backend-level seed, nothing decided at load).

    >>> class Echo(BackendBase, backend="llamacpp"):
    ...     pass
    >>> Echo.name, sorted(Echo.declared_hooks), Echo.streams_tokens
    ('llamacpp', ['llamacpp_logits_processor'], False)
    """

    name: str
    declared_hooks: frozenset[str]
    streams_tokens: bool = False
    default_seed: int | None = None
    load_decisions: Mapping[str, str] = MappingProxyType({})
    """What the backend decided for itself at load that /health and the suite's header name (vLLM: its model
    ``runner``, "v1" or "v2"); empty where it decides nothing."""

    def __init_subclass__(cls, *, backend: str, **kwargs: Any) -> None:
        from engine.backends.registry import spec

        super().__init_subclass__(**kwargs)
        cls.name, cls.declared_hooks = spec(backend).name, spec(backend).hooks


@runtime_checkable
class WeightLoading(Protocol):
    """A backend that takes a learner's weights while it serves (``engine.weights.sync``); the served engine calls
    these off its event loop, one at a time, never during a ``generate`` of a backend that batches through it."""

    def open_weights(self, host: str, port: int, world_size: int, transport: str, timeout_s: float = 300.0, *,
                     learner_rank: int | None = None, packed: dict[str, Any] | None = None,
                     secret: str | None = None) -> None:
        """Start joining the learner's group without holding generation back; the join (``timeout_s`` at most)
        completes, or fails, at the next ``load_weights``. The learner is the group's last rank (swift's layout),
        or ``learner_rank`` 0 with the workers after it (vLLM's); ``packed`` (vLLM's packed NCCL broadcasts) holds
        the buffer geometry the trainer sends with; ``secret`` (the ``tcp`` transport) names and seals every value
        the group's store carries (:mod:`engine.weights.channel`)."""
        ...

    def check_announced(self, announced: dict[str, Any]) -> None:
        """Refuse, before anything is received, tensors the model cannot take (names, shapes, dtypes), by field."""
        ...

    def load_weights(self, announced: dict[str, Any], within_s: float = 300.0) -> int:
        """Receive what ``announced`` describes (joined and arrived within ``within_s``) and load it into the model;
        the number of tensors loaded."""
        ...

    def receive_adapter(self, announced: dict[str, Any], folder: str, config: dict[str, Any],
                        within_s: float = 300.0) -> int:
        """Receive what ``announced`` describes (a LoRA adapter's ``lora_A``/``lora_B`` tensors, pushed alone) and
        save it with ``config`` into ``folder`` as PEFT saves an adapter (``engine.adapters.write_adapter``), for
        ``AdapterLoading.load_adapter`` to load through the one admission rule; the number of tensors received."""
        ...

    def load_checkpoint(self, path: str) -> int:
        """Load every tensor of a saved checkpoint folder (``engine.weights.checkpoint``) into the model, in effect
        at once; the number of tensors loaded."""
        ...

    def finish_weights(self) -> None:
        """End a push session: every loaded weight is in effect (called before the next generation)."""
        ...

    def close_weights(self) -> None:
        ...

    def state_keys(self) -> list[str]:
        """The model's parameter names, as it takes them."""
        ...

    def reset_cache(self, kind: str) -> None:
        """Drop a cache computed with the old weights: ``prefix`` (KV blocks of prompt prefixes), ``encoder``
        (vision encoder outputs) or ``mm`` (processed multimodal inputs)."""
        ...


@runtime_checkable
class AdapterLoading(Protocol):
    """A backend that loads and unloads LoRA adapters while it runs (``engine.adapters.AdapterSet`` checks each as
    ``model.adapters`` are; ``capabilities.adapters`` follows). The served engine calls these off its event loop,
    never during a ``generate`` of a backend that batches through it."""

    def load_adapter(self, name: str, path: str, *, replace: bool = False) -> None:
        ...

    def unload_adapter(self, name: str) -> None:
        ...


@runtime_checkable
class AsyncGenerating(Protocol):
    """A backend with its own asyncio batching (vLLM's ``AsyncLLM``): concurrent calls share it directly, no
    engine-side batcher."""

    async def agenerate(self, prompts: Sequence[Prompt], plan: CallPlan) -> list[BackendOutput]:
        ...


@runtime_checkable
class AsyncScoring(Protocol):
    """A :class:`Scoring` backend with its own asyncio batching (vLLM's ``AsyncLLM``): scoring shares it with
    generation instead of waiting behind the engine-side batcher."""

    async def ascore(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
                     top: int | None = None) -> list[TokenScores]:
        ...


@runtime_checkable
class TokenStreaming(Protocol):
    """A backend that streams one request's growing token ids itself, then yields its final ``BackendOutput``."""

    def astream(self, prompt: Prompt, plan: CallPlan) -> AsyncIterator[tuple[int, ...] | BackendOutput]:
        ...


@runtime_checkable
class Scoring(Protocol):
    """A backend that scores given sequences (lm-eval's loglikelihood, a completion's echoed prompt):
    log-probabilities, argmax flags and, with ``top``, the ``top`` best alternatives at every scored position."""

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
              top: int | None = None, processing: Any = None) -> list[TokenScores]:
        ...
