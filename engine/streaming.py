"""``ResultStream``: one request's answer as text deltas while it is generated, then its ``GenerationResult``.

Built by ``GenerationEngine.astream`` after the request, options and plugins were validated (nothing generated
yet). The token ids so far come from the backend as they are sampled: vLLM's ``AsyncLLM`` stream
(``vllm.async_engine``), or the HF backend's per-token hook through the engine's request batcher (so a streamed
request shares its ``generate`` with concurrent ones). A backend with neither (the offline ``vllm.LLM``) yields
the whole text as one delta at the end. The text deltas come from :class:`engine.rules.stream.TextStream`: never
text that stop truncation or a post-decode step would take back, so the deltas concatenate to ``result.text``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.backends.base import Backend, BackendOutput, CallPlan, Prompt, TokenStreaming, prompts_of
from engine.results import ResultBuilder
from engine.rules.stream import TextStream
from engine.types import GenerationResult

if TYPE_CHECKING:
    from engine.plugins import Plugin
    from engine.templates import RenderedPrompt

Update = tuple[int, ...] | BackendOutput
"""What a token source yields: the ids generated so far (growing), then the final output once."""


@dataclass(frozen=True)
class StreamChunk:
    """A text delta; the last chunk of a stream also carries the whole ``GenerationResult``.

    >>> StreamChunk("Par").result is None
    True
    """

    delta: str
    result: GenerationResult | None = None
    num_generated_tokens: int = 0
    """Tokens generated when this chunk was cut (for time-to-first-token and tokens/s figures)."""


class ResultStream:
    """``async for chunk in engine.astream(request): ...`` -- deltas, then the final result (``chunk.result``).

    Example (needs a built model; any backend)::

        stream = engine.astream([{"role": "user", "content": "Hi"}], options={"max_new_tokens": 16})
        text = ""
        async for chunk in stream:
            text += chunk.delta
        assert text == chunk.result.text

    Iterate it once. Breaking out of the loop (or cancelling the task) stops the request's generation.
    """

    def __init__(self, results: ResultBuilder, backend: Backend, batcher: Callable[[], Any], rendered: RenderedPrompt,
                 plan: CallPlan, plugins: list[Plugin]) -> None:
        self.results = results
        self.backend = backend
        self.batcher = batcher
        """The engine's shared :class:`~engine.batcher.AsyncBatcher`, made on first need."""
        self.rendered = rendered
        self.plan = plan
        self.plugins = plugins
        self.text = TextStream(stops=plan.stop.strings, include_stop=plan.stop.include_stop_str,
                               post=[p.stream_prefix for p in plugins])
        self._iterator: AsyncIterator[StreamChunk] | None = None

    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        if self._iterator is not None:
            raise RuntimeError("a ResultStream can be iterated only once")
        self._iterator = self._chunks()
        return self._iterator

    async def _chunks(self) -> AsyncIterator[StreamChunk]:
        plan = self.plan
        prompt = prompts_of([self.rendered], plan)[0]
        final: BackendOutput | None = None
        async for update in token_updates(self.backend, self.batcher, prompt, plan):
            if isinstance(update, BackendOutput):
                final = update
                break
            text, min_end = self.results.visible_text(update, plan, partial=True)
            delta = self.text.feed(text, min_end=min_end)
            if delta:
                yield StreamChunk(delta, num_generated_tokens=len(update))
        if final is None:
            raise RuntimeError("the backend's stream ended without a final output")
        result = self.results.finish(self.backend.name, [self.rendered], [final], plan, fallback=None,
                                     plugins=self.plugins)[0]
        yield StreamChunk(self.text.finish(result.text), result, num_generated_tokens=len(result.token_ids))


async def token_updates(backend: Backend, batcher_of: Callable[[], Any], prompt: Prompt,
                        plan: CallPlan) -> AsyncIterator[Update]:
    """The backend's growing token ids for ``prompt``, then its final output (see the module doc)."""
    if isinstance(backend, TokenStreaming):
        async for update in backend.astream(prompt, plan):
            yield update
        return
    batcher = batcher_of()
    if not backend.streams_tokens:
        yield (await batcher.submit([prompt], plan))[0]
        return
    queue: asyncio.Queue[tuple[int, ...] | None] = asyncio.Queue()
    ids: list[int] = []

    def on_token(_: int, position: int, token: int) -> None:
        del ids[position:]  # a retried batch repeats positions from 0
        ids.append(token)
        queue.put_nowait(tuple(ids))

    task = asyncio.ensure_future(batcher.submit([prompt], plan, on_token=on_token))
    task.add_done_callback(lambda _: queue.put_nowait(None))  # after every token: they were scheduled first
    try:
        while (update := await queue.get()) is not None:
            yield update
        yield task.result()[0]
    finally:
        task.cancel()
