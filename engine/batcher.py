"""``AsyncBatcher``: concurrent async callers of a synchronous backend (HF) share batched ``generate`` calls.

A batch starts once no submission came for ``wait_s`` and none is on its way (a server counts the requests it is
reading and preparing with :meth:`AsyncBatcher.arriving`), ``max_wait_s`` after its first submission at the latest,
or with ``max_batch_size`` prompts: a burst of clients, whose requests a server prepares a few milliseconds apart,
lands in one batch, and a lone request waits ``wait_s``. Prompts whose plans are equal run in one ``generate`` on a
single worker thread (the model is never used by two threads at once). Seeded calls merge
too: each row samples with its own seed (``Prompt.seed``, see ``engine.rules.seeding``), so a seed reproduces what
the same call gives in-process whatever it was merged with. When a merged
batch fails, each submission is retried alone, so one bad request does not fail its neighbours. A submission
whose caller went away (cancelled) before its batch started is dropped. A streaming submission (``on_token``)
hears each of its tokens on the caller's loop while the merged ``generate`` runs; a retry repeats the positions.
On a backend that hears each token (``streams_tokens``: HF, llama.cpp), the rows of a submission cancelled while
its batch runs end at their next token, whether it streams or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from engine.backends.base import BackendOutput, CallPlan, Prompt

TokenSink = Callable[[int, int, int], None]
"""``on_token(prompt_index, position, token_id)``: one token of one prompt of a submission."""


@dataclass
class _Job:
    prompts: Sequence[Prompt]
    plan: CallPlan
    future: asyncio.Future[list[BackendOutput]]
    on_token: TokenSink | None = None


def mergeable(a: CallPlan, b: CallPlan) -> bool:
    """Two submissions may share one ``generate``: the same plan, but for the call seed (each row carries its own,
    derived from its call's seed and its index there, ``Prompt.seed``).

    >>> from engine.config import GenerationOptions, StopPolicy
    >>> plan = lambda **o: CallPlan(GenerationOptions(**o), StopPolicy(), (2,))
    >>> mergeable(plan(), plan()), mergeable(plan(), plan(max_new_tokens=8))
    (True, False)
    >>> mergeable(plan(temperature=1.0, seed=3), plan(temperature=1.0, seed=4))
    True
    """
    return _unseeded(a) == _unseeded(b)


def _unseeded(plan: CallPlan) -> CallPlan:
    return dataclasses.replace(plan, options=dataclasses.replace(plan.options, seed=None))


class AsyncBatcher:
    """Batch concurrent ``submit`` calls into few ``backend.generate`` calls.

    Example (any object with ``generate(prompts, plan)`` works)::

        batcher = AsyncBatcher(hf_backend, max_batch_size=32, wait_s=0.005, max_wait_s=0.2)
        outputs = await batcher.submit(prompts, plan)      # from many tasks at once
    """

    def __init__(self, backend: Any, *, max_batch_size: int = 32, wait_s: float = 0.005,
                 max_wait_s: float | None = None) -> None:
        self.backend = backend
        self.max_batch_size = max_batch_size
        self.wait_s = wait_s
        self.max_wait_s = wait_s if max_wait_s is None else max(max_wait_s, wait_s)
        self.incoming = 0
        """Requests on their way to :meth:`submit` (see :meth:`arriving`)."""
        self.batches: list[int] = []
        """Prompts per ``generate`` call made, in order (for tests and metrics)."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-batcher")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[_Job] | None = None
        self._worker: asyncio.Task[None] | None = None

    async def submit(self, prompts: Sequence[Prompt], plan: CallPlan, *,
                     on_token: TokenSink | None = None) -> list[BackendOutput]:
        """The outputs for ``prompts``; ``on_token`` (needs a backend whose ``generate`` takes it, like HF's) is
        called on this loop for every token as it is sampled."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or a new loop (e.g. a second asyncio.run)
            self._loop, self._queue = loop, asyncio.Queue()
            self._worker = loop.create_task(self._work(), name="engine-batcher")
        assert self._queue is not None
        job = _Job(list(prompts), plan, loop.create_future(), on_token)
        await self._queue.put(job)
        return await job.future

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Around the reading and preparing of a request that will be submitted (on the batcher's loop): a batch
        about to start waits for it, up to ``max_wait_s`` after the batch's first submission."""
        self.incoming += 1
        try:
            yield
        finally:
            self.incoming -= 1

    async def run_exclusive(self, fn: Any) -> Any:
        """``fn()`` on the worker thread, between two ``generate`` calls (the model is never used by two threads at
        once): e.g. loading a learner's weights into it."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _work(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self._queue.get()]
            last = loop.time() + self.max_wait_s
            while sum(len(j.prompts) for j in jobs) < self.max_batch_size:
                remaining = last - loop.time()
                if remaining <= 0:
                    break
                try:
                    jobs.append(await asyncio.wait_for(self._queue.get(), min(self.wait_s, remaining)))
                except TimeoutError:
                    # quiet for wait_s, and no request on its way (one may have been queued as the wait timed out)
                    if not self.incoming and self._queue.empty():
                        break
            for group in self._groups([j for j in jobs if not j.future.done()]):
                await self._run(group, loop)

    def _groups(self, jobs: list[_Job]) -> list[list[_Job]]:
        groups: list[list[_Job]] = []
        for job in jobs:
            for group in groups:
                size = sum(len(j.prompts) for j in group) + len(job.prompts)
                if mergeable(group[0].plan, job.plan) and size <= self.max_batch_size:
                    group.append(job)
                    break
            else:
                groups.append([job])
        return groups

    async def _generate(self, group: list[_Job], loop: asyncio.AbstractEventLoop) -> list[BackendOutput]:
        prompts = [p for j in group for p in j.prompts]
        self.batches.append(len(prompts))
        # A backend that hears each token (HF, llama.cpp) always gets the fan-out: besides streaming, it ends the
        # rows of a submission whose caller went away, streamed or not, at their next token.
        hears = self.backend.streams_tokens or any(j.on_token for j in group)
        kwargs = {"on_token": _fan_out(group, loop)} if hears else {}
        return list(await loop.run_in_executor(self._executor,
                                               partial(self.backend.generate, prompts, group[0].plan, **kwargs)))

    async def _run_in_parts(self, job: _Job, loop: asyncio.AbstractEventLoop) -> None:
        """A submission of more than ``max_batch_size`` rows (an OpenAI ``n`` of 2048 is 2048 rows) runs
        ``max_batch_size`` rows at a time: what the model holds at once is one batch's, and a caller that went away
        ends the work at the next part (its rows in the running part end at their next token)."""
        outputs: list[BackendOutput] = []
        size = self.max_batch_size
        for start in range(0, len(job.prompts), size):
            if job.future.done():  # the caller went away: nothing more runs for it
                return
            sink = job.on_token
            part_sink = None if sink is None else partial(_shifted, sink, start)
            try:
                outputs.extend(await self._generate([_Job(job.prompts[start : start + size], job.plan, job.future,
                                                          part_sink)], loop))
            except Exception as err:
                _settle(job.future, error=err)
                return
        _settle(job.future, result=outputs)

    async def _run(self, group: list[_Job], loop: asyncio.AbstractEventLoop) -> None:
        if len(group) == 1 and len(group[0].prompts) > self.max_batch_size:
            await self._run_in_parts(group[0], loop)
            return
        try:
            outputs = await self._generate(group, loop)
        except Exception as err:
            if len(group) == 1:
                _settle(group[0].future, error=err)
                return
            for job in group:  # find the submission that fails; the others still get their answers
                await self._run([job], loop)
            return
        start = 0
        for job in group:
            _settle(job.future, result=list(outputs[start : start + len(job.prompts)]))
            start += len(job.prompts)


def _shifted(sink: TokenSink, start: int, row: int, position: int, token: int) -> None:
    """A part's row ``row`` is its submission's row ``start + row``."""
    sink(start + row, position, token)


def _fan_out(group: list[_Job], loop: asyncio.AbstractEventLoop) -> Callable[[int, int, int], bool]:
    """One ``on_token`` for a merged batch: each row's tokens go to its submission's sink, on the loop's thread.
    It answers True for rows whose submission was cancelled (its caller went away), so the backend ends them."""
    rows = [(job, i) for job in group for i in range(len(job.prompts))]

    def on_token(row: int, position: int, token: int) -> bool:
        job, index = rows[row]
        if job.future.done():  # cancelled: nobody waits for this row
            return True
        if job.on_token is not None:
            loop.call_soon_threadsafe(job.on_token, index, position, token)
        return False
    return on_token


def _settle(future: asyncio.Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
