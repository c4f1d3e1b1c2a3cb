"""Evaluate transformers' own continuous batching (``model.generate_batch``, transformers 5.x) against the HF
engine on the same rows (issue 49, point 2): tokens per second and greedy tokens, batch by batch.

The HF engine runs a batch through ``model.generate`` with its per-row logits processors (the rules, min-length,
the repeat guard, per-row seeds); ``generate_batch`` schedules requests into a paged cache and takes per request only
what its continuous-batching processors support (temperature, top-k, top-p; others are dropped unless
``drop_unsupported_processors=False``). This script measures what the engine would gain by moving to it, on
fixed-length greedy rows (EOS does not end a row on either side)::

    python -m benchmarks.hf_continuous_batching --batches 8 64 --rounds 3   # in the stack venv, fixtures built

It prints, per batch, the medians of interleaved rounds and how many rows came out token-identical.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def cb_rows(model: Any, ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuous batching: each row's generated ids, in request order."""
    import transformers

    config = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # A KV cache sized for the rows (its default takes a share of free memory: 12 GB of this host's 23 GiB) and
    # no warm-up pass (CUDA graphs; none on CPU). EOS is off (-1), so every row runs to new_tokens.
    blocks = len(ids) * (1 + (max(map(len, ids)) + new_tokens) // 256)
    batching = transformers.ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=4096,
                                                     max_requests_per_batch=len(ids))
    out = model.generate_batch(ids, generation_config=config, continuous_batching_config=batching,
                               progress_bar=False, warmup=False)
    ordered = sorted(out.values(), key=lambda o: int(o.request_id.split("_")[-1]))
    return [list(o.generated_tokens)[:new_tokens] for o in ordered]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.workload import batch_messages
    from engine import GenerationEngine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=16)
    args = p.parse_args(argv)
    engine = GenerationEngine({"backend": "hf", "model": str(ROOT / ".fixtures" / "smollm2-135m-instruct")})
    # EOS does not end a row on either side: ignore_eos here, EOS id -1 there (min_new_tokens would ban EOS instead).
    model, options = engine.backend.model, {"max_new_tokens": args.new_tokens, "ignore_eos": True}
    for batch in args.batches:
        messages = batch_messages(batch, "short")
        rendered, _ = engine.prepare(messages, options=options)
        ids = [list(r.token_ids) for r in rendered]
        ours = [list(r.token_ids) for r in engine.generate(messages, options=options)]
        theirs = cb_rows(model, ids, args.new_tokens)  # also the warm-up of both
        same = sum(a == b for a, b in zip(ours, theirs, strict=True))
        walls: dict[str, list[float]] = {"engine": [], "generate_batch": []}
        runs = {"engine": lambda m=messages: engine.generate(m, options=options),
                "generate_batch": lambda i=ids: cb_rows(model, i, args.new_tokens)}
        for r in range(args.rounds):
            for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
                began = time.perf_counter()
                runs[name]()
                walls[name].append(time.perf_counter() - began)
        rate = {k: batch * args.new_tokens / statistics.median(v) for k, v in walls.items()}
        print(f"batch {batch}: engine {rate['engine']:.1f} tok/s, generate_batch {rate['generate_batch']:.1f} tok/s "
              f"(generate_batch / engine {rate['generate_batch'] / rate['engine']:.2f}); greedy rows identical "
              f"{same}/{batch}", flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
