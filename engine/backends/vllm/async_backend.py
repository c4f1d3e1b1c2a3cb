"""The vLLM backend over ``AsyncLLM`` (``vllm.async_engine: true``; the served engine's choice).

Every prompt is its own vLLM request, so concurrent callers share the engine's continuous batching instead of
waiting behind one another. ``AsyncLLM`` lives on an event loop of its own (a daemon thread), so it can be
reached from any thread or loop: ``agenerate`` from an asyncio server, ``generate`` from plain code. Its engine
core always runs in a child process; rule events come back through ``collective_rpc`` as for ``vllm.LLM``.
The engine arguments, sampling parameters and output conversion are the ones :mod:`engine.backends.vllm.backend` uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from engine.backends.base import BackendBase, BackendOutput, CallPlan, Prompt, TokenScores
from engine.backends.host import has_cuda
from engine.backends.vllm.backend import (
    SPEC,
    add_adapter,
    backend_output,
    capabilities,
    checked_runner,
    engine_input,
    import_vllm,
    prepare_environment,
    prompt_scores,
    request_params,
    sampling_params,
    score_params,
    start_arguments,
)
from engine.config import ModelConfig, VllmConfig
from engine.errors import BackendUnavailableError

T = TypeVar("T")


class AsyncVllmBackend(BackendBase, backend="vllm"):
    """Generate with ``vllm.v1.engine.async_llm.AsyncLLM``, one vLLM request per prompt.

    Usually built by ``GenerationEngine`` with ``vllm: {async_engine: true}``::

        engine = GenerationEngine({"backend": "vllm", "model": ".fixtures/smollm2-135m-instruct",
                                   "vllm": {"async_engine": True}})
        results = await engine.agenerate([[{"role": "user", "content": "Hi"}]])   # or engine.generate(...)
    """

    def __init__(self, model: ModelConfig, settings: VllmConfig, tokenizer: Any, processor: Any = None,
                 repeat_terminate: Any = None) -> None:
        from engine.backends.vllm.lora import LoraRequests

        self.lora = LoraRequests(model, settings, cpu=not has_cuda())  # adapters checked before vLLM starts
        self.env = prepare_environment(settings)
        self.model_path = model.path
        vllm = import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        self.tokenizer = tokenizer
        self._final_only = RequestOutputKind.FINAL_ONLY
        self._cumulative = RequestOutputKind.CUMULATIVE
        kwargs, plan = start_arguments(model, settings, processor, repeat_terminate, self.lora)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-async-vllm", daemon=True)
        self._thread.start()

        async def start() -> Any:  # built on its own loop, where its output handler will run
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

        try:
            self.llm = self._call(start())
        except BaseException:
            self._stop_loop()
            raise
        self.version = vllm.__version__
        self.load_decisions = {"runner": checked_runner(self, self.llm.vllm_config, plan)}
        self.rules_problem = plan.problem
        self.capabilities = capabilities(self.llm.model_config, settings, plan, self.lora)

    # -- the loop the engine lives on -----------------------------------------------------------------

    def _call(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` on the engine's loop and wait for it (from any thread but that loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def close(self) -> None:
        """Shut the engine core down and stop the loop."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            async def shutdown() -> None:
                llm.shutdown()

            self._call(shutdown())
        self._stop_loop()
        self.lora.close()

    # -- adapters ---------------------------------------------------------------------------------------

    def load_adapter(self, name: str, path: str, *, replace: bool = False) -> None:
        """As ``VllmBackend.load_adapter``, on ``AsyncLLM``."""
        adapter, request, old = self.lora.admit(name, path, replace=replace)
        add_adapter(lambda: self._call(self.llm.add_lora(request)), adapter)
        self.lora.keep(adapter)
        if old is not None:
            self._call(self.llm.remove_lora(old.id))
            self._call(self.llm.reset_prefix_cache())
        self.capabilities = dataclasses.replace(self.capabilities, adapters=self.lora.names)

    def unload_adapter(self, name: str) -> None:
        old = self.lora.drop(name)
        self._call(self.llm.remove_lora(old.id))
        self._call(self.llm.reset_prefix_cache())
        self.capabilities = dataclasses.replace(self.capabilities, adapters=self.lora.names)

    # -- generation ------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], plan: CallPlan) -> list[BackendOutput]:
        return self._call(self._generate(prompts, plan))

    async def agenerate(self, prompts: Sequence[Prompt], plan: CallPlan) -> list[BackendOutput]:
        """``generate`` for a caller on another event loop. Cancelling the caller aborts its vLLM requests."""
        future = asyncio.run_coroutine_threadsafe(self._generate(prompts, plan), self._loop)
        return await asyncio.wrap_future(future)

    async def _generate(self, prompts: Sequence[Prompt], plan: CallPlan) -> list[BackendOutput]:
        if not prompts:
            return []
        base = sampling_params(plan, output_kind=self._final_only)
        keys = [uuid.uuid4().hex for _ in prompts]
        finals = await asyncio.gather(*(self._one(engine_input(p, plan), request_params(base, p, plan, key), key,
                                                  self.lora.request(p.adapter))
                                         for p, key in zip(prompts, keys, strict=True)))
        events = await self.rule_events(keys) if plan.rules or plan.draws_portably else {}
        return [backend_output(out, plan, events.get(key, {})) for key, out in zip(keys, finals, strict=True)]

    async def _one(self, prompt: Any, params: Any, key: str, lora: Any = None) -> Any:
        final = None
        # vLLM aborts the request if we are cancelled
        async for out in self.llm.generate(prompt, params, request_id=key, lora_request=lora):
            final = out
        if final is None or not final.finished:
            raise BackendUnavailableError(SPEC.name, f"AsyncLLM ended request {key} without a final output",
                                          "check the server log for an engine-core error")
        return final

    # -- scoring ---------------------------------------------------------------------------------------

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
              top: int | None = None) -> list[TokenScores]:
        """As ``VllmBackend.score``: prompt log-probs, one request per sequence."""
        return self._call(self._score(sequences, starts, top))

    async def ascore(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
                     top: int | None = None) -> list[TokenScores]:
        """``score`` for a caller on another event loop, sharing the engine's batching with generation."""
        future = asyncio.run_coroutine_threadsafe(self._score(sequences, starts, top), self._loop)
        return await asyncio.wrap_future(future)

    async def _score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
                     top: int | None) -> list[TokenScores]:
        from vllm.inputs import TokensPrompt

        params = score_params(top, output_kind=self._final_only)
        keys = [uuid.uuid4().hex for _ in sequences]
        outs = await asyncio.gather(*(self._one(TokensPrompt(prompt_token_ids=list(seq)), params, key,
                                                self.lora.request(None))
                                      for seq, key in zip(sequences, keys, strict=True)))
        return [prompt_scores(out, seq, start, top) for seq, start, out in zip(sequences, starts, outs, strict=True)]

    async def astream(self, prompt: Prompt, plan: CallPlan) -> AsyncIterator[tuple[int, ...] | BackendOutput]:
        """One prompt's token ids so far after every engine step (cumulative), then its final ``BackendOutput``.

        Runs on the caller's loop; the request runs on the engine's. Closing the iterator, or cancelling the
        caller, aborts the vLLM request."""
        caller = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        key = uuid.uuid4().hex
        params = request_params(sampling_params(plan, output_kind=self._cumulative), prompt, plan, key)

        def send(kind: str, value: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's loop is gone: nobody is listening
                caller.call_soon_threadsafe(queue.put_nowait, (kind, value))

        async def produce() -> None:
            try:
                final = None
                async for out in self.llm.generate(engine_input(prompt, plan), params, request_id=key,
                                                   lora_request=self.lora.request(prompt.adapter)):
                    final = out
                    send("ids", tuple(out.outputs[0].token_ids))
                if final is None or not final.finished:
                    raise BackendUnavailableError(SPEC.name, f"AsyncLLM ended request {key} without a final output",
                                                  "check the server log for an engine-core error")
                events = await self.rule_events([key]) if plan.rules or plan.draws_portably else {}
                send("done", backend_output(final, plan, events.get(key, {})))
            except Exception as err:  # handed to the caller, who raises it
                send("error", err)

        future = asyncio.run_coroutine_threadsafe(produce(), self._loop)
        try:
            while True:
                kind, value = await queue.get()
                if kind == "error":
                    raise value
                yield value
                if kind == "done":
                    return
        finally:
            future.cancel()  # vLLM aborts the request when its generator is cancelled

    # -- weight sync (engine.weights.sync): every worker of the engine core receives and loads ----------------------

    def open_weights(self, host: str, port: int, world_size: int, transport: str, timeout_s: float = 300.0, *,
                     learner_rank: int | None = None, packed: dict[str, Any] | None = None,
                     secret: str | None = None) -> None:
        self._call(self.llm.collective_rpc("engine_open_weights", args=(host, port, world_size, transport, timeout_s,
                                                                        learner_rank, packed, secret)))

    def check_announced(self, announced: dict[str, Any]) -> None:
        """Names are checkpoint names here (vLLM fuses q, k and v when loading): each announced tensor against the
        served checkpoint's own (``engine.weights.description``), before anything is received: a name vLLM's loader
        does not know or a wrong shape raised inside the engine core's reload, which left it dead."""
        from engine.weights.sync import announced_tensors

        self.weights_description().check(announced_tensors(announced))

    def weights_description(self) -> Any:
        """The served model's tensors by checkpoint name, read once from its safetensors headers."""
        described = getattr(self, "_described", None)
        if described is None:
            from engine.weights.description import ModelWeights

            described = self._described = ModelWeights.of_checkpoint(self.model_path)
        return described

    @property
    def dead_reason(self) -> str | None:
        """Why the engine core cannot generate any more (it died), or None while it can."""
        if getattr(self.llm, "errored", False):
            return f"vLLM's engine core is dead: {getattr(self.llm, 'dead_error', None) or 'it exited'}"
        return None

    def load_weights(self, announced: dict[str, Any], within_s: float = 300.0) -> int:
        return int(self._call(self.llm.collective_rpc("engine_load_weights", args=(announced, within_s)))[0])

    def receive_adapter(self, announced: dict[str, Any], folder: str, config: dict[str, Any],
                        within_s: float = 300.0) -> int:
        """Received in the engine core's workers (the learner's group is theirs), saved there by the first."""
        return int(self._call(self.llm.collective_rpc("engine_receive_adapter",
                                                      args=(announced, folder, config, within_s)))[0])

    def load_checkpoint(self, path: str) -> int:
        """Every tensor of the folder, checked by its headers (names, shapes, whole fused layers, dtypes) before the
        engine core reads it: a failed reload there leaves no old weights to serve."""
        from pathlib import Path

        from engine.weights.checkpoint import check_checkpoint_values, checkpoint_description

        headers = checkpoint_description(Path(path))
        self.weights_description().check([("model_path", name, shape) for name, (shape, _) in headers.items()],
                                         whole=True)
        check_checkpoint_values(Path(path))
        return int(self._call(self.llm.collective_rpc("engine_load_checkpoint", args=(path,)))[0])

    def finish_weights(self) -> None:
        self._call(self.llm.collective_rpc("engine_finish_weights"))

    def close_weights(self) -> None:
        self._call(self.llm.collective_rpc("engine_close_weights"))

    def state_keys(self) -> list[str]:
        return list(self._call(self.llm.collective_rpc("engine_state_keys"))[0])

    def reset_cache(self, kind: str, attempts: int = 50) -> None:
        """Reset vLLM's ``kind`` cache. The served engine calls it with no row in flight, but the engine core frees a
        finished row's blocks a step after its answer left: a refused prefix reset (vLLM keeps blocks a row holds,
        and says so only by returning False) is tried again, every 0.1 s, ``attempts`` times at most."""
        for _ in range(attempts):
            if self._call(getattr(self.llm, f"reset_{kind}_cache")()) is not False:
                return
            time.sleep(0.1)
        raise RuntimeError(f"vLLM did not reset its {kind} cache: requests still hold its blocks")

    async def rule_events(self, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The rule events of finished requests, from the engine-core process where the processor ran."""
        from engine.backends.vllm import rules as vllm_rules

        replies = await self.llm.collective_rpc(vllm_rules.EVENTS_METHOD, args=(list(keys),))
        return vllm_rules.merge_worker_events(replies)
