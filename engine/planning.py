"""What a call runs with, decided before any generation: each decision of :class:`~engine.backends.base.CallPlan`
beside what it decides. ``GenerationEngine._plan`` composes them; each raises a typed error naming the field.

* :func:`plan_options`: the call's ``GenerationOptions`` (the config's, overridden) with the backend's seed or a
  drawn one for the portable sampler, refused where the backend cannot return logprobs, serves another logprobs
  mode, or cannot run the portable draw.
* :func:`plan_stop`: the stop policy, its token ids checked against the vocabulary and stop strings that are a
  special token's text turned into that token's id.
* :func:`plan_schema`: the JSON Schema, checked buildable and compiled for the model's tokenizer.
* :func:`plan_guard`: the repeat guard, the call's ``repeat_terminate`` laid over the engine's.
* :func:`plan_rules`: the row rules (the repeat guard, plugins' rules), refused beside ``ignore_eos``.

>>> from engine.config import GenerationOptions
>>> from engine.config.repeat import RepeatTerminateConfig
>>> plan_rules(RepeatTerminateConfig(), [], GenerationOptions(max_new_tokens=4), "hf", None)
()
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engine.errors import ConfigError, UnsupportedCapabilityError

if TYPE_CHECKING:
    from engine.backends.base import Backend
    from engine.config import GenerationOptions, StopPolicy
    from engine.config.repeat import RepeatTerminateConfig
    from engine.plugins import Plugin, PluginContext
    from engine.rules.base import RuleSpec


def plan_options(configured: GenerationOptions, overrides: Any, backend: Backend,
                 served_mode: str) -> GenerationOptions:
    """The call's options: ``configured`` with ``overrides``; the backend's default seed where the call gives none,
    and for an unseeded portable draw a seed drawn here (reported in each result's meta, so the call replays)."""
    opts = configured.merged(overrides)
    if opts.seed is None and backend.default_seed is not None:  # a backend-level seed for calls without one
        opts = dataclasses.replace(opts, seed=backend.default_seed)
    if opts.seed is None and opts.sampler != "native" and not opts.is_greedy:
        opts = dataclasses.replace(opts, seed=secrets.randbits(63))
    if opts.logprobs is not None and not backend.capabilities.logprobs:
        raise UnsupportedCapabilityError(f"backend {backend.name!r} cannot return logprobs; "
                                         "set generation.logprobs to null")
    if opts.logprobs_mode is not None and opts.logprobs_mode != served_mode:
        raise ConfigError("generation.logprobs_mode", opts.logprobs_mode, f"differs from the mode this engine "
                          f"serves ({served_mode!r}; fixed when it loads, as vLLM fixes it)",
                          fix=f"start the engine with model.logprobs_mode: {opts.logprobs_mode} (engine-serve "
                              f"--logprobs-mode {opts.logprobs_mode}), or expect {served_mode}")
    check_native_processing(opts, backend)
    if opts.sampler != "native" and not opts.is_greedy and backend.capabilities.rules_problem is not None:
        raise UnsupportedCapabilityError(f"backend {backend.name!r} cannot draw with the portable sampler here "
                                         f"(its row processor cannot run: {backend.capabilities.rules_problem}). "
                                         "Fix: set generation.sampler to 'native'")
    return opts


def check_native_processing(opts: GenerationOptions, backend: Backend) -> None:
    """Refuse, naming the field, a processing option the backend's own sampler lacks (``Capabilities.
    native_processing``) set away from its default in a call that samples natively."""
    from engine.rules.processing import Processing

    honoured = backend.capabilities.native_processing
    if honoured is None or opts.sampler != "native" or opts.is_greedy:
        return
    defaults = Processing()
    for name, value in Processing.of(opts).as_dict().items():
        if name not in honoured and value != getattr(defaults, name):
            raise ConfigError(f"generation.{name}", value, f"is not honoured by {backend.name}'s own sampler",
                              fix="leave it at its default, or set generation.sampler: portable (the shared draw "
                                  "runs it on every backend)")


def plan_stop(configured: StopPolicy, overrides: Any, vocab: Callable[[], int],
              specials: Mapping[str, int]) -> tuple[StopPolicy, tuple[tuple[str, int], ...]]:
    """The call's stop policy and the stop strings it turned into token ids: ``stop: ["<|im_end|>"]`` ends the row
    at that token on every backend alike (recorded in the result); a stop string that merely holds a special token's
    text is refused (no output contains it: special tokens are decoded away). ``vocab`` gives the vocabulary's size
    (asked only when the policy has stop ids).

    >>> from engine.config import StopPolicy
    >>> plan_stop(StopPolicy(), {"strings": ["<|end|>", "\\n"]}, lambda: 10, {"<|end|>": 3})
    (StopPolicy(strings=('\\n',), token_ids=(3,), include_stop_str=False), (('<|end|>', 3),))
    """
    from engine.rules.stop import special_stop

    policy = configured.merged(overrides)
    size = vocab() if policy.token_ids else 0
    for i, token_id in enumerate(policy.token_ids):
        if token_id >= size:
            raise ConfigError(f"stop.token_ids[{i}]", token_id, f"is not a token id of this model (its "
                              f"tokenizer has {size})", fix=f"give ids in [0, {size})")
    exact = tuple((text, specials[text]) for text in dict.fromkeys(policy.strings) if text in specials)
    if exact:
        policy = dataclasses.replace(policy, strings=tuple(t for t in policy.strings if t not in specials),
                                     token_ids=tuple(dict.fromkeys((*policy.token_ids, *(i for _, i in exact)))))
    found = special_stop(policy.strings, specials)
    if found is not None:
        i, text, token_id = found
        raise ConfigError(f"stop.strings[{i}]", policy.strings[i], f"holds the special token {text!r}, whose text "
                          "no output contains (special tokens are decoded away on every backend)",
                          fix=f"end rows at it with stop.token_ids: [{token_id}]")
    return policy, exact


def plan_schema(json_schema: Any, backend: Backend, tokenizer: Callable[[], Any]) -> str | None:
    """The call's JSON Schema in canonical form (None: free text), refused unless the backend constrains output and
    a grammar can be built from it and compiled for the model's tokenizer (``tokenizer()``;
    ``engine.rules.schema_check``). HF compiles with its own compiler here, so the batcher finds it ready; vLLM, which
    compiles in its engine core, is checked with one for the same tokenizer."""
    from engine.completion import canonical_schema
    from engine.rules.schema_check import check_schema, tokenizer_compile

    schema = canonical_schema(json_schema)
    if schema is None:
        return None
    if not backend.capabilities.structured_outputs:
        raise UnsupportedCapabilityError(f"backend {backend.name!r} cannot constrain output to a JSON Schema "
                                         "here. Fix: drop json_schema, or use a text model on hf or vllm")
    compile_schema = getattr(backend, "compile_schema", None)
    check_schema(schema, compile_schema or tokenizer_compile(tokenizer()))
    if compile_schema is not None:
        compile_schema(schema)  # kept by the backend (KEPT of them); compiled again here if it was dropped
    return schema


def plan_guard(configured: RepeatTerminateConfig, asked: Any, backend: Backend) -> RepeatTerminateConfig:
    """The call's repeat guard: the engine's subtree with the call's ``repeat_terminate`` laid over it
    (:meth:`~engine.config.repeat.RepeatTerminateConfig.overlaid`: the vLLM plugin's per-request rule), refused on a
    backend that cannot run it (the engine's own subtree was checked when it started)."""
    from engine.backends.guard import check_guard_can_run

    if asked is None:
        return configured
    guard = configured.overlaid(asked)
    check_guard_can_run(guard.enabled, backend.name, backend.capabilities.rules_problem)
    return guard


def plan_rules(guard: RepeatTerminateConfig, plugins: Sequence[Plugin], opts: GenerationOptions, backend_name: str,
               context: Callable[[], PluginContext] | None) -> tuple[RuleSpec, ...]:
    """The row rules of a call: the repeat guard when enabled (its thresholds know ``min_new_tokens``), then each
    plugin's rule on this backend (``context`` gives the plugins' tokenizer facts); refused beside ``ignore_eos``,
    since these rules end a row by forcing EOS."""
    from engine.rules.repeat import RepeatRule

    rules: list[RuleSpec] = []
    if guard.enabled:
        rules.append(RepeatRule.spec(guard.thresholds(opts.min_new_tokens)))
    if plugins:
        ctx = context() if context is not None else None
        rules += [spec for p in plugins if (spec := p.rule_spec(backend_name, ctx)) is not None]
    if opts.ignore_eos and rules:
        raise ConfigError("generation.ignore_eos", True, f"cannot run beside the row rule {rules[0].target!r}, "
                          "which ends a row by forcing EOS (ignore_eos would let the row go on)",
                          fix="leave ignore_eos out, or serve without the repeat guard and plugins")
    return tuple(rules)
