"""Which vLLM model runner an engine will use, decided before ``vllm.LLM`` is built.

vLLM 0.32 runs Model Runner V2 by default wherever Triton works (CUDA hosts) and the V1 runner elsewhere (its
CPU build); each has its own logits-processor interface, and the frontend rejects a processor class of the
other interface at start. So the engine asks vLLM's own decision (``EngineArgs(...).create_engine_config()
.use_v2_model_runner``, the path ``LLM`` takes) and registers the matching processor class.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from engine.backends.vllm.rules import INTERFACES, PROCESSORS, V1, V2


@dataclass(frozen=True)
class RunnerPlan:
    """The runner vLLM will use and whether our row-rule processor can run on it.

    >>> RunnerPlan(runner="v2", problem=None).processor
    'engine.backends.vllm.v2_rules:RowRulesV2'
    """

    runner: str
    """"v1" or "v2"."""
    problem: str | None
    """Why row rules cannot run on this engine (the processor is then not registered), or None."""

    @property
    def processor(self) -> str:
        return PROCESSORS[self.runner]


def interface_problem(runner: str) -> str | None:
    """Why this vLLM lacks ``runner``'s logits-processor interface, or None."""
    try:
        module = importlib.import_module(INTERFACES[runner])
        module.LogitsProcessor  # noqa: B018 - the attribute must exist
    except (ImportError, AttributeError) as err:
        return f"this vLLM has no {runner.upper()} logits-processor interface ({INTERFACES[runner]}: {err})"
    return None


def plan_for_config(vllm_config: Any) -> RunnerPlan:
    """The plan for a built ``vllm.config.VllmConfig``."""
    runner = V2 if vllm_config.use_v2_model_runner else V1
    if getattr(vllm_config, "speculative_config", None) is not None:
        return RunnerPlan(runner, "speculative decoding is configured; row rules see committed tokens only and "
                                  "do not support draft rows")
    return RunnerPlan(runner, interface_problem(runner))


def plan_runner(llm_kwargs: dict[str, Any]) -> RunnerPlan:
    """Build the ``VllmConfig`` that ``vllm.LLM(**llm_kwargs)`` would build (about 0.6 s) and plan from it."""
    from vllm.engine.arg_utils import EngineArgs

    return plan_for_config(EngineArgs(**llm_kwargs).create_engine_config())


def started_runner(vllm_config: Any) -> str:
    """The runner a started engine (``LLM.llm_engine.vllm_config``, ``AsyncLLM.vllm_config``) really uses."""
    return V2 if vllm_config.use_v2_model_runner else V1
