"""Drive the three row-rule adapters (HF, vLLM V1, vLLM V2) on scripted token streams, without a model.

Each request has a prompt, a scripted output stream and rule specs (or none). Every step, each live request's
logits row is drawn from a generator seeded by (seed, request, output length), so every adapter sees the same
row for the same request at the same point whatever the batch layout. The adapter edits the rows; the request
then emits EOS if the edited row allows nothing else (a forced end), else its next scripted token. Recorded per
request: every edited row, the final output, and the rule events.

What each simulator reproduces of its runner (read in vLLM 0.32's sources):

* HF: one left-padded batch, all rows every step, finished rows padded with EOS (``HfRowRules``).
* V1: a persistent batch told through vLLM's own ``BatchUpdate``: requests added with a *live* output list,
  removed when they finish or are preempted, holes filled by moving the last row down (``UNIDIRECTIONAL``),
  random ``SWAP``\\ s; a preempted request comes back later with its output so far.
* V2: a fixed number of slots recycled through a free list (``add_request(slot, params)``, never told when a
  slot is freed), committed tokens in ``all_token_ids[slot, :total_len]``, batch order shuffled every step
  (``ctx.idx_mapping_np``), preemption re-adding the request with its partial output as prefill. vLLM's own
  ``LogitsProcRequestState`` and ``LogitsContext`` carry the state; their tensor fields are plain CPU tensors,
  because vLLM's ``StagedWriteTensor``/``UvaBackedTensor`` need pinned memory, which a CPU-only torch refuses.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from engine.backends.vllm.rules import EventStore, request_args
from engine.rules.base import RuleSpec

EOS = 0
VOCAB = 12


@dataclass
class Req:
    rid: int
    prompt: list[int]
    stream: list[int]
    specs: tuple[RuleSpec, ...]
    rows: list[Any] = field(default_factory=list)
    """The edited logits row at each output length."""
    output: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return (bool(self.output) and self.output[-1] == EOS) or len(self.output) >= len(self.stream)

    def key(self) -> str:
        return f"req-{self.rid}"

    def extra_args(self) -> dict | None:
        if not self.specs:
            return None
        return request_args(self.specs, key=self.key(), eos_id=EOS, terminal_ids=[EOS])


def logits_row(seed: int, rid: int, step: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + rid * 1009 + step)
    return torch.randn(VOCAB, generator=gen)


def advance(req: Req, edited: Any) -> int:
    """Record the edited row and emit the next token: EOS when it is the only finite choice."""
    import torch

    req.rows.append(edited.clone())
    finite = torch.isfinite(edited).nonzero().flatten().tolist()
    token = EOS if finite == [EOS] else req.stream[len(req.output)]
    req.output.append(token)
    return token


def run_hf(reqs: list[Req], seed: int, decode: Callable[[Sequence[int]], str]) -> dict[int, dict]:
    """All requests with the same specs in one HF batch (HfRowRules takes one spec list per batch)."""
    import torch

    from engine.backends.hf.rules import HfRowRules

    width = max(len(r.prompt) for r in reqs)
    ids = torch.tensor([[EOS] * (width - len(r.prompt)) + r.prompt for r in reqs])  # (batch, width)
    # vector_min_batch=1: the id-only repeat rules take the vectorized bank path even in these small batches.
    proc = HfRowRules(reqs[0].specs, prompt_len=width, eos_id=EOS, terminal_ids=[EOS], decode=decode,
                      vector_min_batch=1)
    while not all(r.done for r in reqs):
        step = ids.shape[1] - width
        scores = torch.stack([logits_row(seed, r.rid, step) for r in reqs])  # (batch, vocab)
        scores = proc(ids, scores)
        column = [advance(r, scores[i]) if not r.done else EOS for i, r in enumerate(reqs)]
        ids = torch.cat([ids, torch.tensor(column)[:, None]], dim=1)
    return {r.rid: proc.events(i) for i, r in enumerate(reqs)}


def run_v1(reqs: list[Req], seed: int, decode: Callable[[Sequence[int]], str], *, rng: random.Random,
           max_batch: int, preempt: float) -> EventStore:
    import torch
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from engine.backends.vllm import rules as vllm_rules
    from engine.backends.vllm.v1_rules import RowRulesV1

    store = EventStore()
    proc = RowRulesV1(SimpleNamespace(model_config=SimpleNamespace(tokenizer="unused")), "cpu", False)
    proc.decode = decode
    pending, batch = list(reqs), []  # batch: persistent batch index -> request
    outputs: dict[int, list[int]] = {}
    with _store(vllm_rules, store):
        while pending or batch:
            # vLLM's order: removed, then added (into the lowest holes first), then moved.
            removed = [i for i, r in enumerate(batch) if r.done or (len(batch) > 1 and rng.random() < preempt)]
            for i in removed:
                if not batch[i].done:
                    pending.append(batch[i])  # preempted: comes back later with its output so far
                batch[i] = None
            holes = sorted(removed)
            rng.shuffle(pending)
            added = []
            while pending and len([r for r in batch if r is not None]) < max_batch:
                r = pending.pop()
                index = holes.pop(0) if holes else len(batch)
                outputs[r.rid] = list(r.output)  # the request's live output list
                added.append((index, SamplingParams(extra_args=r.extra_args()), list(r.prompt), outputs[r.rid]))
                if index == len(batch):
                    batch.append(r)
                else:
                    batch[index] = r
            moved = []
            while holes:  # condense: the last live row moves into the lowest hole
                while batch and batch[-1] is None:
                    batch.pop()
                hole = holes.pop(0)
                if hole < len(batch):
                    moved.append((len(batch) - 1, hole, MoveDirectionality.UNIDIRECTIONAL))
                    batch[hole] = batch.pop()
            while batch and batch[-1] is None:
                batch.pop()
            if len(batch) > 1 and rng.random() < 0.3:
                a, b = rng.sample(range(len(batch)), 2)
                moved.append((a, b, MoveDirectionality.SWAP))
                batch[a], batch[b] = batch[b], batch[a]
            proc.update_state(BatchUpdate(batch_size=len(batch), removed=removed, added=added, moved=moved))
            if not batch:
                continue
            logits = torch.stack([logits_row(seed, r.rid, len(r.output)) for r in batch])
            logits = proc.apply(logits)
            for i, r in enumerate(batch):
                advance(r, logits[i])
                outputs[r.rid].append(r.output[-1])
    return store


def run_v2(reqs: list[Req], seed: int, decode: Callable[[Sequence[int]], str], *, rng: random.Random,
           slots: int, preempt: float) -> EventStore:
    import numpy as np
    import torch
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

    from engine.backends.vllm import rules as vllm_rules
    from engine.backends.vllm.v2_rules import RowRulesV2

    state = run_v2_state(slots=slots, width=max(len(r.prompt) + len(r.stream) for r in reqs) + 1)
    store = EventStore()
    proc = RowRulesV2(SimpleNamespace(model_config=SimpleNamespace(tokenizer="unused")), state)
    proc.decode = decode
    free, live = list(range(slots)), {}  # live: slot -> request
    pending = list(reqs)
    with _store(vllm_rules, store):
        while pending or live:
            for slot, r in list(live.items()):  # finished or preempted requests free their slot, unannounced
                if r.done or (len(live) > 1 and rng.random() < preempt):
                    del live[slot]
                    free.append(slot)
                    if not r.done:
                        pending.append(r)
            rng.shuffle(pending)
            while pending and free:
                r = pending.pop()
                slot = free.pop()
                prefill = r.prompt + r.output  # a resumed request comes back with its partial output
                state.all_token_ids.gpu[slot, : len(prefill)] = torch.tensor(prefill, dtype=torch.int32)
                state.prompt_len.np[slot] = len(r.prompt)
                state.prefill_len.np[slot] = len(prefill)
                state.total_len.gpu[slot] = len(prefill)
                proc.add_request(slot, SamplingParams(extra_args=r.extra_args()))
                live[slot] = r
            if not live:
                continue
            order = list(live)
            rng.shuffle(order)  # rows are reordered every step
            mapping = torch.tensor(order)
            logits = torch.stack([logits_row(seed, live[s].rid, len(live[s].output)) for s in order])
            ctx = LogitsContext(expanded_idx_mapping=mapping, idx_mapping=mapping,
                                idx_mapping_np=np.array(order, dtype=np.int32),
                                expanded_local_pos=torch.zeros(len(order), dtype=torch.int64),
                                input_ids=torch.zeros(len(order), dtype=torch.int64),
                                pos=torch.zeros(len(order), dtype=torch.int64),
                                seq_lens_upper_bound_np=np.zeros(len(order), dtype=np.int32))
            logits = proc.apply(logits, ctx)
            for i, slot in enumerate(order):
                r = live[slot]
                token = advance(r, logits[i])
                total = int(state.total_len.gpu[slot])
                state.all_token_ids.gpu[slot, total] = token
                state.total_len.gpu[slot] = total + 1
    return store


def run_v2_state(*, slots: int, width: int) -> Any:
    """vLLM's ``LogitsProcRequestState`` over plain CPU tensors (``.gpu`` / ``.np`` fields as vLLM's buffers)."""
    import numpy as np
    import torch
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState

    return LogitsProcRequestState(
        device=torch.device("cpu"), max_num_reqs=slots, vocab_size=VOCAB,
        all_token_ids=SimpleNamespace(gpu=torch.zeros(slots, width, dtype=torch.int32)),
        prompt_len=SimpleNamespace(np=np.zeros(slots, dtype=np.int32)),
        prefill_len=SimpleNamespace(np=np.zeros(slots, dtype=np.int32)),
        total_len=SimpleNamespace(gpu=torch.zeros(slots, dtype=torch.int32)),
    )


class _store:
    """Swap the process-wide event store for a private one while a simulator runs."""

    def __init__(self, module: Any, store: EventStore) -> None:
        self.module, self.store = module, store

    def __enter__(self) -> None:
        self.saved, self.module.EVENTS = self.module.EVENTS, self.store

    def __exit__(self, *exc: object) -> None:
        self.module.EVENTS = self.saved
