"""The guard as a vLLM logits processor: :class:`EngineGuard`, one class for both of vLLM's model runners.

vLLM loads custom logits processors by name (``--logits-processors engine.vllm_plugin:EngineGuard``,
``LLM(logits_processors=[...])``, ``AsyncEngineArgs(logits_processors=[...])``) and constructs them in the worker
with the runner's own arguments: ``(vllm_config, device, is_pin_memory)`` under the V1 model runner (vLLM's CPU build,
``VLLM_USE_V2_MODEL_RUNNER=0``), ``(vllm_config, req_states)`` under Model Runner V2 (the default on CUDA since 0.32).
:class:`EngineGuard` subclasses both interfaces (so each loader accepts it) and hands the work to the engine's own
runner adapter of the runner that built it (:class:`GuardV1` or :class:`GuardV2`, the engine's ``RowRulesV1`` /
``RowRulesV2`` reading the user's settings instead of the engine's request arguments). The rules are the engine's
(:mod:`engine.rules`): no second implementation.

Importing this module imports vLLM (the interfaces it subclasses); :mod:`engine.vllm_plugin` itself does not.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.sample.logits_processor import LogitsProcessor as V1Interface

from engine.backends.vllm.rules import Row, RowArgs
from engine.backends.vllm.v1_rules import RowRulesV1
from engine.vllm_plugin.activation import server_guard
from engine.vllm_plugin.audit import AUDIT
from engine.vllm_plugin.rows import row_args
from engine.vllm_plugin.settings import SUBTREES

try:  # Model Runner V2's interface (vLLM >= 0.31); import-light, so the frontend can load it to validate
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2Interface

    from engine.backends.vllm.v2_rules import RowRulesV2
except ImportError:  # an older vLLM: the V1 runner only
    V2Interface, RowRulesV2 = None, None  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)


class _Plugin:
    """What both runner adapters do differently as the plugin: the rows' rules come from the user's settings, rows
    are not kept for collection (nobody collects them), and each row a rule ends goes to the audit."""

    tracks_events = False
    tokenizer: str | None = None

    @classmethod
    def row_args(cls, params: Any, *, check: bool) -> RowArgs | None:
        return row_args(params, check=check, tokenizer=cls.tokenizer)

    def ended(self, rows: list[Row]) -> None:
        for row in rows:
            if not row.reported:
                row.reported = True
                AUDIT.record(row.events())


class GuardV1(_Plugin, RowRulesV1):
    """The plugin under vLLM's V1 model runner."""


if RowRulesV2 is not None:
    class GuardV2(_Plugin, RowRulesV2):
        """The plugin under Model Runner V2."""
else:
    GuardV2 = None  # type: ignore[assignment,misc]


def _check_server_guard() -> None:
    """The server-wide guard, read and validated when the engine starts (a bad value stops it here)."""
    guard = server_guard()
    log.info("engine.vllm_plugin: guard loaded; server-wide repeat_terminate %s",
             guard.as_dict() if guard is not None and guard.enabled else "off (per request only)")


_bases = (V1Interface,) if V2Interface is None else (V1Interface, V2Interface)


class EngineGuard(*_bases):  # type: ignore[misc]
    """The engine's guard (repeat-aware termination, min-length control) inside any vLLM engine.

    Per request, the seeds' settings in ``extra_args`` / ``vllm_xargs`` (:mod:`engine.vllm_plugin.settings`);
    server-wide, the seeds' start-up variables (:mod:`engine.vllm_plugin.activation`). A row the guard ends gets EOS
    as its next token: vLLM answers ``finish_reason "stop"``, ``stop_reason null``, as for the model's own EOS
    (:func:`engine.vllm_plugin.replay.guard_report` tells them apart from the returned ids).

    Example (vLLM's CPU build, the fixture looper)::

        from vllm import LLM, SamplingParams
        llm = LLM(model, logits_processors=["engine.vllm_plugin:EngineGuard"])
        llm.generate(prompts, SamplingParams(max_tokens=64, extra_args={
            "repeat_terminate.max_consecutive_token_repeats": 4}))

    The loaders' interfaces, checked without an engine:

    >>> from vllm.v1.sample.logits_processor import LogitsProcessor
    >>> issubclass(EngineGuard, LogitsProcessor)
    True
    """

    def __init__(self, vllm_config: Any, *runner_args: Any) -> None:
        _check_server_guard()
        _Plugin.tokenizer = vllm_config.model_config.tokenizer
        if len(runner_args) == 2:  # V1: (device, is_pin_memory)
            self._impl: Any = GuardV1(vllm_config, *runner_args)
        elif GuardV2 is not None:  # V2: (req_states,)
            self._impl = GuardV2(vllm_config, *runner_args)
        else:
            raise TypeError(f"EngineGuard was built with {len(runner_args) + 1} arguments, which no model runner of "
                            "this vLLM passes")

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        row_args(sampling_params, check=True)

    def is_argmax_invariant(self) -> bool:
        return False  # it forces and bans EOS, so it changes greedy rows too

    def update_state(self, batch_update: Any) -> None:  # V1
        self._impl.update_state(batch_update)

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:  # V2
        return bool(self._impl.add_request(req_idx, sampling_params))

    def apply(self, logits: Any, ctx: Any = None) -> Any:  # V1: (logits); V2: (logits, ctx)
        return self._impl.apply(logits) if ctx is None else self._impl.apply(logits, ctx)


__all__ = ["SUBTREES", "EngineGuard", "GuardV1", "GuardV2", "row_args"]
