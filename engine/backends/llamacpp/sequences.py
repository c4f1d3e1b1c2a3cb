"""A batch's rows as parallel sequences of one llama.cpp batch per step (llama.cpp's batch API).

``Llama.generate`` decodes one sequence; a batch of rows through it runs one row after another. Here every row is a
sequence (its own ``seq_id``) of a second llama.cpp context on the loaded model, whose KV cache is one unified pool
of ``n_ctx`` cells shared by up to ``n_seq`` rows: the rows' prompts are evaluated first (in chunks of ``n_batch``,
logits for each prompt's last token, from which the row's first token is drawn), then each step decodes one token of
every unfinished row in a single ``llama_decode``.
For each row the step applies the row's logits processor in place on the row's logits and draws with the row's own
sampler (:func:`~engine.backends.llamacpp.row.sampler_chain`, seeded with the row's seed), so rules, stops, seeds
and logprobs stay per row: a row decodes the same tokens whichever rows share its batch.

Rows are taken in groups that fit the pool: at most ``n_seq`` rows whose prompts and budgets add up to at most
``n_ctx`` cells (:func:`fit_groups`). Every group starts from an empty pool: no prompt prefix is kept from an earlier
group, so a group's tokens do not depend on what the engine decoded before it. (Kept cells made them depend on it:
the pool's cells are one unified buffer, and where a kept prefix and the freed holes around it lie changes the order
in which attention sums a row's cells; a seeded row then drew another token after an unrelated call, 9727 against
9729 at step 5 on SmolLM2. The prompts cost little to evaluate again.)

Every row, a batch of one included, decodes here: a row's tokens then do not depend on the batch it came in (the
batcher merges calls).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.backends.llamacpp.row import LlamaCppRow, sampler_chain


def fit_groups(needs: Sequence[int], n_seq: int, n_ctx: int) -> list[list[int]]:
    """Indices of consecutive rows, grouped so each group has at most ``n_seq`` rows and ``n_ctx`` cells in all.

    >>> fit_groups([10, 10, 10, 30, 5], n_seq=2, n_ctx=40)
    [[0, 1], [2, 3], [4]]
    """
    groups: list[list[int]] = []
    cells = 0
    for index, need in enumerate(needs):
        if need > n_ctx:
            raise ValueError(f"row {index} needs {need} KV cells, more than the pool's {n_ctx}")
        if not groups or len(groups[-1]) == n_seq or cells + need > n_ctx:
            groups.append([])
            cells = 0
        groups[-1].append(index)
        cells += need
    return groups


class ParallelSequences:
    """Decode rows as sequences of one llama.cpp batch, on a context of its own beside ``llm``'s.

    Built by :class:`~engine.backends.llamacpp.backend.LlamaCppBackend` at its first call (every call decodes here)::

        sequences = ParallelSequences(llm, n_seq=16, n_ctx=4096)
        sequences.decode(rows, seeds, closing=lambda: False)  # rows: LlamaCppRow, each takes its tokens
        sequences.close()
    """

    def __init__(self, llm: Any, *, n_seq: int, n_ctx: int) -> None:
        import llama_cpp
        from llama_cpp import _internals

        params = llama_cpp.llama_context_default_params()
        for name, _ in params._fields_:  # the one-row context's settings (threads, KV type, flash attention off)
            setattr(params, name, getattr(llm.context_params, name))
        params.n_ctx, params.n_seq_max, params.kv_unified = n_ctx, n_seq, True
        params.n_batch = max(params.n_batch, n_seq)  # a step holds one token of every row
        self.llm, self.n_seq, self.n_ctx, self.n_batch = llm, n_seq, n_ctx, llm.n_batch
        self.n_vocab = llm.n_vocab()
        self.context = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
        self.batch = llama_cpp.llama_batch_init(max(self.n_batch, n_seq), 0, 1)
        self.cached: list[list[int]] = [[] for _ in range(n_seq)]
        """Per sequence, the ids whose KV cells the pool holds (positions 0..): the next id's position."""

    def close(self) -> None:
        import llama_cpp

        if self.batch is not None:
            llama_cpp.llama_batch_free(self.batch)
            self.batch = None
        self.context.close()

    def use_adapter(self, adapter: Any) -> None:
        """Compute with LoRA adapter ``adapter`` (a loaded ``llama_adapter_lora_p``, scale 1: its GGUF's alpha over
        rank applies) from the next decode on; None: the base model. Every group starts from an empty pool, so no
        KV cell computed under another adapter is ever read."""
        import ctypes

        import llama_cpp

        from engine.errors import EngineError

        if adapter is None:
            code = llama_cpp.llama_set_adapters_lora(self.context.ctx, None, 0, None)
        else:
            adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(adapter)
            code = llama_cpp.llama_set_adapters_lora(self.context.ctx, adapters, 1, (ctypes.c_float * 1)(1.0))
        if code != 0:
            raise EngineError(f"llama.cpp refused to set the LoRA adapter on its context (code {code})")

    def decode(self, rows: Sequence[LlamaCppRow], seeds: Sequence[int], closing: Callable[[], bool]) -> None:
        """Decode ``rows`` (each at least one prompt token) until each is done or ``closing()`` says so."""
        for group in fit_groups([r.context_need for r in rows], self.n_seq, self.n_ctx):
            if closing():
                return
            self._decode_rows([rows[i] for i in group], [seeds[i] for i in group], closing)

    def _put(self, slot: int, token: int, position: int, seq: int, logits: bool) -> None:
        batch = self.batch
        batch.token[slot], batch.pos[slot], batch.n_seq_id[slot] = token, position, 1
        batch.seq_id[slot][0], batch.logits[slot] = seq, logits

    def _run(self, n_tokens: int) -> None:
        import llama_cpp

        from engine.errors import EngineError

        self.batch.n_tokens = n_tokens
        code = llama_cpp.llama_decode(self.context.ctx, self.batch)
        if code != 0:
            raise EngineError(f"llama_decode failed with {code} on a batch of {n_tokens} tokens (parallel sequences)")

    def forget(self) -> None:
        """Empty the pool (done before every group, so a group that failed leaves nothing behind either)."""
        import llama_cpp

        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.context.ctx), True)
        self.cached = [[] for _ in range(self.n_seq)]

    def _decode_rows(self, rows: list[LlamaCppRow], seeds: list[int], closing: Callable[[], bool]) -> None:
        self.forget()  # a group's tokens depend on the group only (the module's docstring says why)
        samplers = [sampler_chain(self.llm, row.greedy, seed) for row, seed in zip(rows, seeds, strict=True)]
        try:
            feed, finished = self._evaluate_prompts(rows, samplers)
            live = [seq for seq in range(len(rows)) if seq not in finished]  # sequence ids (positions in ``rows``)
            while live and not closing():
                for slot, seq in enumerate(live):
                    self._put(slot, feed[seq], len(self.cached[seq]), seq, True)
                    self.cached[seq].append(feed[seq])
                self._run(len(live))
                for slot, seq in enumerate(live):
                    feed[seq] = self._draw(rows[seq], samplers[seq], slot)
                    if rows[seq].take(feed[seq]):
                        finished.add(seq)
                live = [seq for seq in live if seq not in finished]
        finally:
            for sampler in samplers:
                sampler.close()

    def _evaluate_prompts(self, rows: list[LlamaCppRow], samplers: list[Any]) -> tuple[list[int], set[int]]:
        """Evaluate every row's prompt, ``n_batch`` tokens per decode, logits for its last token only, and draw each
        row's first token from them right after the decode that holds it (before the next one overwrites them): one
        decode fewer per group than evaluating the last prompt tokens as a step of their own (about 6 % of a
        16-token call of one short row). Returns each row's first token (the next step's feed) and the rows it ended."""
        feed, finished = [0] * len(rows), set()
        slot, drawn_here = 0, []  # (sequence, slot) of the last prompt tokens in the batch being filled
        for seq, row in enumerate(rows):
            ids = row.prompt.token_ids
            for position, token in enumerate(ids):
                last = position == len(ids) - 1
                self._put(slot, token, position, seq, last)
                self.cached[seq].append(token)
                if last:
                    drawn_here.append((seq, slot))
                slot += 1
                if slot == self.n_batch:
                    self._run(slot)
                    finished |= self._first_tokens(rows, samplers, drawn_here, feed)
                    slot, drawn_here = 0, []
        if slot:
            self._run(slot)
            finished |= self._first_tokens(rows, samplers, drawn_here, feed)
        return feed, finished

    def _first_tokens(self, rows: list[LlamaCppRow], samplers: list[Any], drawn: list[tuple[int, int]],
                      feed: list[int]) -> set[int]:
        """Draw the first token of each row in ``drawn`` ((sequence, slot) pairs); the rows it ended."""
        ended = set()
        for seq, slot in drawn:
            feed[seq] = self._draw(rows[seq], samplers[seq], slot)
            if rows[seq].take(feed[seq]):
                ended.add(seq)
        return ended

    def _draw(self, row: LlamaCppRow, sampler: Any, slot: int) -> int:
        """The row's next token from the logits of batch slot ``slot``: the row's step edits them in place, then its
        own sampler draws from the same buffer."""
        import llama_cpp
        import numpy as np

        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.context.ctx, slot), shape=(self.n_vocab,))
        row.step(row.ids(), logits)
        return int(sampler.sample(self.context, slot))
