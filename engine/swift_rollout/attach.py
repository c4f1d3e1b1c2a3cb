"""Attach the engine's repeat guard to swift's ``GRPOVllmEngine``, the engine ``swift rollout`` builds in its workers.

Nothing of swift or vLLM is edited: :func:`install` wraps five methods of ``GRPOVllmEngine`` (not of swift's
``VllmEngine``, so ``swift infer`` and ``swift deploy`` stay as they are), each around swift's own:

- ``_prepare_engine``: before vLLM starts, asks vLLM which model runner it will use
  (:func:`engine.backends.vllm.runner.plan_for_config`) and registers the engine's row-rule processor of that runner
  (V1 or V2) and :class:`engine.swift_rollout.worker.GuardedWorker` (swift's weight-sync extension plus the rule
  events); refuses, as the engine does, when the guard cannot run on this vLLM;
- ``_add_request``: gives each request its rules in ``SamplingParams.extra_args`` (the engine's
  :func:`engine.backends.vllm.rules.request_args`: per-row EOS, no batch abort) under a fresh key;
- ``infer`` (swift's synchronous engine) and ``_infer_full_async`` (its async engine): collect the finished requests'
  rule events from the worker processes (``collective_rpc``, as the engine's vLLM backend does);
- ``infer`` and ``async_infer``: return each output as a
  :class:`~engine.swift_rollout.output.GuardedRolloutOutput` with the guard's report
  (:func:`engine.rules.events.repeat_meta`, the meta every engine result carries).

The same rule objects, thresholds and processor run here as in ``GenerationEngine`` on vLLM, so a guarded
``swift rollout`` ends rows where the engine does.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.config.repeat import RepeatTerminateConfig
from engine.config.validation import build
from engine.errors import BackendUnavailableError, ConfigError, RequestError
from engine.rules.base import RuleSpec
from engine.rules.events import events_within, repeat_meta
from engine.rules.repeat import RepeatRule
from engine.serve.activation import subtree_from_env

log = logging.getLogger(__name__)
_state: dict[str, Any] = {"installed": False, "guard": None}
PATCHED = ("_prepare_engine", "_add_request", "_infer_full_async", "infer", "async_infer")
"""The ``GRPOVllmEngine`` methods :func:`install` wraps."""
OFF = repeat_meta({})
"""The report of a row no rule ran on."""


@dataclass(frozen=True)
class Guard:
    """The validated ``repeat_terminate`` subtree the server's environment gives, and the variable it came from.

    >>> guard = Guard.from_environment({"COORDEXP_ENABLE_VLLM_REPEAT_TERMINATE_INJECTION": "1",
    ...     "COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON": '{"enabled": true, "ngram_size": 4, "ngram_repeats": 3}'})
    >>> guard.config.ngram_size, guard.source
    (4, 'env:COORDEXP_VLLM_REPEAT_TERMINATE_CONFIG_JSON')
    >>> Guard.from_environment({"ENGINE_REPEAT_TERMINATE_JSON": '{"enabled": true, "ngram_size": 1}'})
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: repeat_terminate.ngram_size ...
    >>> Guard.from_environment({}) is None
    True
    """

    config: RepeatTerminateConfig
    source: str

    @classmethod
    def from_environment(cls, environ: Any = None) -> Guard | None:
        """The guard ``environ`` (default ``os.environ``) asks for, validated; None when none of its variables is set
        (:mod:`engine.serve.activation` reads them, as ``python -m engine.serve`` does)."""
        chosen = subtree_from_env(os.environ if environ is None else environ)
        if chosen is None:
            return None
        subtree, source = chosen
        return cls(build(RepeatTerminateConfig, subtree, "repeat_terminate"), source)

    @property
    def specs(self) -> tuple[RuleSpec, ...]:
        """The rule every request carries (swift sends no min-length, so the guard's own ``min_new_tokens`` holds)."""
        return (RepeatRule.spec(self.config.thresholds()),) if self.config.enabled else ()


class Rows:
    """One engine's requests in flight: the rule key of each swift request id, and the reports of finished ones.

    Both maps are bounded (a request that errors out is never collected): past ``capacity`` the oldest go.
    """

    def __init__(self, specs: Sequence[RuleSpec], *, eos: int, terminal: Sequence[int], capacity: int = 65536) -> None:
        self.specs, self.eos, self.terminal, self.capacity = tuple(specs), eos, tuple(terminal), capacity
        self.keys: OrderedDict[str, str] = OrderedDict()
        self.reports: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def admit(self, request_id: str, params: Any) -> None:
        """Put the rules into ``params.extra_args`` (kept beside any other extra args) under a fresh key."""
        from engine.backends.vllm.rules import request_args

        n = getattr(params, "n", 1)
        if n != 1:
            raise RequestError("request_config.n", n, "must be 1 while the repeat guard is on (each sample needs its "
                               "own rule state, and vLLM fans n out with one set of arguments)",
                               fix="send n separate requests, as swift's GRPO trainer does")
        key = uuid.uuid4().hex
        terminal = dict.fromkeys((*self.terminal, *(getattr(params, "stop_token_ids", None) or ())))
        params.extra_args = {**(params.extra_args or {}),
                             **request_args(self.specs, key=key, eos_id=self.eos, terminal_ids=list(terminal))}
        _put(self.keys, request_id, key, self.capacity)

    def take_keys(self, outputs: Sequence[Any]) -> dict[str, tuple[str, int]]:
        """Rule key -> (swift request id, generated tokens) of each finished output whose rules ran here."""
        taken = {}
        for response in _responses(outputs):
            key = self.keys.pop(response.id, None)
            if key is not None:
                taken[key] = (response.id, int(response.usage.completion_tokens))
        return taken

    def file(self, taken: dict[str, tuple[str, int]], replies: Sequence[Any]) -> None:
        """File each request's report from the workers' replies to ``engine_rule_events``."""
        from engine.backends.vllm.rules import merge_worker_events

        events = merge_worker_events(replies)
        for key, (request_id, generated) in taken.items():
            report = repeat_meta(events_within(events.get(key, {}), generated=generated))
            _put(self.reports, request_id, report, self.capacity)

    def report(self, request_id: str) -> dict[str, Any]:
        return self.reports.pop(request_id, OFF)


def _put(store: OrderedDict, key: str, value: Any, capacity: int) -> None:
    store[key] = value
    while len(store) > capacity:
        store.popitem(last=False)


def _responses(outputs: Sequence[Any]) -> list[Any]:
    """The chat responses among ``outputs`` (``RolloutOutput``s or bare responses; errors and streams left out)."""
    found = []
    for out in outputs:
        response = getattr(out, "response", out)
        if hasattr(response, "id") and hasattr(response, "usage"):
            found.append(response)
    return found


def terminal_ids(tokenizer: Any, model_dir: str) -> tuple[int, ...]:
    """The tokenizer's EOS first, then the checkpoint's ``generation_config.json`` EOS ids (vLLM stops on both)."""
    from engine.config import ModelConfig
    from engine.loading import checkpoint_eos_ids

    ids = [int(tokenizer.eos_token_id)]
    if (Path(model_dir) / "generation_config.json").is_file():
        try:
            ids += checkpoint_eos_ids(ModelConfig(path=model_dir))
        except ConfigError as err:  # a file without eos ids: the tokenizer's EOS alone
            log.info("engine.swift_rollout: no EOS ids from %s/generation_config.json (%s)", model_dir, err)
    return tuple(dict.fromkeys(ids))


def _prepare_engine(original: Callable, guard: Guard) -> Callable:
    def prepare(self: Any) -> None:
        from engine.backends.guard import check_guard_can_run
        from engine.backends.vllm import runner as vllm_runner
        from engine.swift_rollout import WORKER_BASE_VARIABLE, WORKER_EXTENSION

        args = self.engine_args
        plan = vllm_runner.plan_for_config(replace(args).create_engine_config())  # a copy: swift's args stay as built
        check_guard_can_run(True, "vllm", plan.problem)
        base = args.worker_extension_cls
        if base and base != WORKER_EXTENSION:
            os.environ[WORKER_BASE_VARIABLE] = base  # the processes vLLM starts inherit it
        args.worker_extension_cls = WORKER_EXTENSION
        args.logits_processors = [*(args.logits_processors or []), plan.processor]
        original(self)
        started = vllm_runner.started_runner(self.engine.vllm_config)
        if started != plan.runner:
            raise BackendUnavailableError("vllm", f"vLLM was planned to run model runner {plan.runner} but started "
                                          f"{started}", "report this with your vLLM and ms-swift versions")
        self._engine_rows = Rows(guard.specs, eos=int(self.tokenizer.eos_token_id),
                                 terminal=terminal_ids(self.tokenizer, self.model_dir))
        log.info("engine.swift_rollout: repeat guard on (%s), model runner %s", guard.source, plan.runner)

    return prepare


def _add_request(original: Callable) -> Callable:
    def add_request(self: Any, inputs: Any, generation_config: Any, request_id: str, adapter_request: Any = None):
        self._engine_rows.admit(request_id, generation_config)
        return original(self, inputs, generation_config, request_id, adapter_request=adapter_request)

    return add_request


def _infer_full_async(original: Callable) -> Callable:
    async def infer_full(self: Any, *args: Any, **kwargs: Any) -> Any:
        from engine.backends.vllm.rules import EVENTS_METHOD

        response = await original(self, *args, **kwargs)
        rows = self._engine_rows
        taken = rows.take_keys([response])
        if taken:
            rows.file(taken, await self.engine.collective_rpc(EVENTS_METHOD, args=(list(taken),)))
        return response

    return infer_full


def _infer(original: Callable) -> Callable:
    def infer(self: Any, *args: Any, **kwargs: Any) -> Any:
        from engine.backends.vllm.rules import EVENTS_METHOD

        outputs = original(self, *args, **kwargs)
        rows = getattr(self, "_engine_rows", None)
        if rows is not None and (taken := rows.take_keys(outputs)):
            rows.file(taken, self.engine.collective_rpc(EVENTS_METHOD, args=(list(taken),)))
        return envelope_outputs(rows, outputs)

    return infer


def _async_infer(original: Callable) -> Callable:
    async def async_infer(self: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = await original(self, *args, **kwargs)
        return envelope_outputs(getattr(self, "_engine_rows", None), outputs)

    return async_infer


def envelope_outputs(rows: Rows | None, outputs: Any) -> Any:
    """Each ``RolloutOutput`` in ``outputs`` with its report (``OFF`` where no rule ran: ``rows`` None); anything
    else (a stream, an error of a non-strict batch) as it is."""
    from swift.infer_engine.protocol import RolloutOutput

    from engine.swift_rollout.output import enveloped

    if not isinstance(outputs, list):
        return outputs
    return [enveloped(out, rows.report(out.response.id) if rows is not None else OFF)
            if isinstance(out, RolloutOutput) else out for out in outputs]


def install(environ: Any = None) -> Guard | None:
    """Attach the guard the environment asks for to ``GRPOVllmEngine`` (once per process); returns it.

    None of the guard's variables set: swift is left as it is (logged). The guard off (``..._INJECTION=0`` or
    ``enabled: false``): only the envelope, saying 0. A bad subtree raises ``ConfigError`` here, before anything is
    served."""
    if _state["installed"]:
        return _state["guard"]
    guard = Guard.from_environment(environ)
    from engine.compat import torchvision as tv_compat

    tv_compat.install()  # swift's vLLM plugins import torchvision-backed modules; on CPU hosts torchvision is absent
    if guard is None:
        log.warning("engine.swift_rollout: no repeat_terminate variable is set; swift rollout runs unchanged")
        _state["installed"] = True
        return None
    from swift.infer_engine.grpo_vllm_engine import GRPOVllmEngine

    wrappers: dict[str, Callable] = {"infer": _infer, "async_infer": _async_infer}
    if guard.config.enabled:
        wrappers.update(_prepare_engine=lambda f: _prepare_engine(f, guard), _add_request=_add_request,
                        _infer_full_async=_infer_full_async)
    for name, wrap in wrappers.items():
        setattr(GRPOVllmEngine, name, wrap(getattr(GRPOVllmEngine, name)))
    _state.update(installed=True, guard=guard)
    log.info("engine.swift_rollout: attached (%s, guard %s)", guard.source, "on" if guard.config.enabled else "off")
    return guard
