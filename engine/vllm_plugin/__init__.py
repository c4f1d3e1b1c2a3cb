"""The engine's guard inside the vLLM you already run: a logits-processor plugin for stock ``vllm serve``,
``trl vllm-serve`` and in-process engines (verl, OpenRLHF), on vLLM's V1 model runner and Model Runner V2.

Three ways to load it, one class (:data:`PROCESSOR`)::

    vllm serve MODEL --logits-processors engine.vllm_plugin:EngineGuard
    trl vllm-serve --model MODEL --logits-processors engine.vllm_plugin:EngineGuard   # passed through to vllm serve
    LLM(MODEL, logits_processors=["engine.vllm_plugin:EngineGuard"])                  # or AsyncEngineArgs(...)

Per request, the seeds' settings in ``vllm_xargs`` (``SamplingParams.extra_args`` in-process), checked at admission
(a bad value is a 400 naming the field, the value and the fix): :mod:`.settings`. Server-wide, the seeds' start-up
variables (``COORDEXP_ENABLE_VLLM_REPEAT_TERMINATE_INJECTION=1`` + ``..._CONFIG_JSON``), read when the engine starts:
:mod:`.activation`. A row the guard ended answers ``finish_reason "stop"``; which rows those were: :mod:`.replay`
(from the returned ids) and :mod:`.audit` (the engine core's log and an audit file).

This package is import-light; ``engine.vllm_plugin.EngineGuard`` imports vLLM on first access (vLLM resolves the
name with ``getattr`` on this module).

>>> PROCESSOR
'engine.vllm_plugin:EngineGuard'
"""

from __future__ import annotations

from typing import Any

PROCESSOR = "engine.vllm_plugin:EngineGuard"
"""The name to give ``--logits-processors`` / ``logits_processors=[...]``."""


def __getattr__(name: str) -> Any:
    if name == "EngineGuard":
        from engine.vllm_plugin.processor import EngineGuard

        return EngineGuard
    raise AttributeError(f"module 'engine.vllm_plugin' has no attribute {name!r}")
