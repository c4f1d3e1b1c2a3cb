"""Measure the llama.cpp backend's batch choice: rows one after another (the engine) vs parallel sequences.

The engine runs a batch's rows one after another through ``Llama.generate`` (and its ``logits_processor`` hook).
This script decodes the same greedy rows as parallel sequences instead (one llama.cpp batch per step, a sequence
id per row, llama.cpp's batch API through llama-cpp-python's low-level bindings), checks both give the same
greedy tokens, and prints the tokens/s of each at batch 1 and 8 (medians of interleaved rounds)::

    python -m benchmarks.llamacpp_parallel            # after python -m engine_fixtures build
"""

from __future__ import annotations

import statistics
import time
from typing import Any

NEW_TOKENS = 16
ROUNDS = 5


def parallel_context(llm: Any, n_seq: int) -> Any:
    """A second llama.cpp context on the loaded model that holds ``n_seq`` sequences in one unified KV cache."""
    import llama_cpp
    from llama_cpp import _internals

    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = llm.n_ctx(), llm.n_batch, llm.n_batch
    params.n_seq_max, params.kv_unified = n_seq, True
    params.n_threads = params.n_threads_batch = llm.context_params.n_threads
    params.type_k, params.type_v = llm.context_params.type_k, llm.context_params.type_v
    return _internals.LlamaContext(model=llm._model, params=params, verbose=False)


def decode_parallel(context: Any, n_vocab: int, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy ``new_tokens`` per prompt, every row one sequence of the same llama.cpp batch at each step."""
    import llama_cpp
    import numpy as np

    ctx = context.ctx
    memory = llama_cpp.llama_get_memory(ctx)
    llama_cpp.llama_memory_clear(memory, True)
    batch = llama_cpp.llama_batch_init(sum(len(p) for p in prompts) + len(prompts), 0, len(prompts))
    try:
        def put(slot: int, token: int, position: int, seq: int, want_logits: bool) -> None:
            batch.token[slot], batch.pos[slot], batch.n_seq_id[slot] = token, position, 1
            batch.seq_id[slot][0], batch.logits[slot] = seq, want_logits

        slot, last = 0, []
        for seq, prompt in enumerate(prompts):
            for position, token in enumerate(prompt):
                put(slot, token, position, seq, position == len(prompt) - 1)
                slot += 1
            last.append(slot - 1)
        batch.n_tokens = slot
        outputs: list[list[int]] = [[] for _ in prompts]
        positions = [len(p) for p in prompts]
        for step in range(new_tokens):
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for seq, index in enumerate(last):
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, index), shape=(n_vocab,))
                outputs[seq].append(int(logits.argmax()))
            if step == new_tokens - 1:
                break
            for seq, out in enumerate(outputs):
                put(seq, out[-1], positions[seq], seq, True)
                positions[seq] += 1
            batch.n_tokens, last = len(prompts), list(range(len(prompts)))
        return outputs
    finally:
        llama_cpp.llama_batch_free(batch)


def main() -> None:
    from benchmarks.workload import batch_messages, fixed_length
    from engine import GenerationEngine
    from engine_fixtures import ensure

    engine = GenerationEngine({"backend": "llamacpp",
                               "model": {"path": str(ensure("smollm2-135m-instruct-gguf")), "dtype": "float32"}})
    llm = engine.backend.llm
    context = parallel_context(llm, n_seq=8)
    for batch in (1, 8):
        messages, options = batch_messages(batch, "short"), fixed_length(NEW_TOKENS)
        rendered, _ = engine.prepare(messages, options=options)
        prompts = [list(r.token_ids) for r in rendered]
        # Free greedy rows (they may end early on EOS; the parallel decode runs on): equal up to their ends.
        sequential = [list(r.token_ids) for r in engine.generate(messages, options={"max_new_tokens": NEW_TOKENS})]
        parallel = decode_parallel(context, llm.n_vocab(), prompts, NEW_TOKENS)
        same = sum(a == b[: len(a)] for a, b in zip(sequential, parallel, strict=True))
        walls: dict[str, list[float]] = {"sequential": [], "parallel": []}
        for _ in range(ROUNDS):
            started = time.perf_counter()
            engine.generate(messages, options=options)
            walls["sequential"].append(time.perf_counter() - started)
            started = time.perf_counter()
            decode_parallel(context, llm.n_vocab(), prompts, NEW_TOKENS)
            walls["parallel"].append(time.perf_counter() - started)
        rate = {k: batch * NEW_TOKENS / statistics.median(v) for k, v in walls.items()}
        print(f"batch {batch}: identical rows {same}/{batch}; sequential (engine) {rate['sequential']:.1f} tok/s, "
              f"parallel sequences {rate['parallel']:.1f} tok/s, parallel/sequential "
              f"{rate['parallel'] / rate['sequential']:.2f}")
    engine.close()


if __name__ == "__main__":
    main()
