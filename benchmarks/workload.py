"""What the benchmarks run: sizes, prompts, guard settings. One place to read or change the matrix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine_fixtures import load_prompts


@dataclass(frozen=True)
class Size:
    """One benchmark size: the matrix of cases and how many rounds each gets."""

    batches: tuple[int, ...]
    prompt_lens: tuple[str, ...]
    new_tokens: tuple[int, ...]
    guard_sets: tuple[str, ...]
    guard_batches: tuple[int, ...]  # batch sizes at which guard sets other than "none" are measured
    native_budget: int  # output budget of the repeat-vs-native cases
    served_concurrency: tuple[int, ...]  # concurrent clients of the served cases (= in-process batch size)
    served_requests: int  # requests per round of a served case, at least (the concurrency when larger)
    chat_concurrency: tuple[int, ...]  # concurrent clients of the streamed-vs-plain chat cases
    chat_requests: int  # requests per round of a chat case, at least (the concurrency when larger)
    rounds: int  # measured rounds of a gated case (its ratios decide the release gate)
    warmup: int  # warm-up rounds (run, not kept) of a gated case
    ungated_rounds: int  # measured rounds of a case whose ratios are reported, not gated
    ungated_warmup: int  # warm-up rounds of a case whose ratios are reported, not gated
    confirm_rounds: int  # rounds a gated case adds when a gated ratio missed its minimum (see BenchSession.measure)
    rollout_tokens: int  # sampled tokens per row of the rollout_vs_trainer cases
    vllm_compiled: bool  # vLLM's defaults (torch.compile); False: eager engines and torch.compile off


SIZES = {
    # Fits CPU CI in a few minutes (2 cores): short prompts, 16 new tokens, engine vs raw at every batch size,
    # the guards at batch 8; served vs in-process at 1, 8 and 64 concurrent clients. The gated ratios get 3 rounds
    # after a warm-up; the reported-only groups one round and no warm-up: on CPU CI they prove that every group runs,
    # asserts its fixed lengths and writes its rows (their warm-ups took 162 s of a 648 s run), and their
    # figures are indicative only; GPU runners measure them at full size. vLLM runs eager with torch.compile off:
    # each of the run's four vLLM engines (engine, raw LLM, server, bfloat16 engine) compiled for 40-100 s on this
    # CPU, and the gated ratios do not depend on it (eager, one run: engine_over_raw 0.986 / 0.982 / 1.019 at
    # batch 1 / 8 / 64, guard_on_over_off 0.992 and 1.037).
    "smoke": Size(batches=(1, 8, 64), prompt_lens=("short",), new_tokens=(16,),
                  guard_sets=("none", "repeat", "min_length"), guard_batches=(8,), native_budget=96,
                  served_concurrency=(1, 8, 64), served_requests=8, chat_concurrency=(1, 16), chat_requests=8,
                  rounds=3, warmup=1, ungated_rounds=1, ungated_warmup=0, confirm_rounds=6, rollout_tokens=32,
                  vllm_compiled=False),
    # For GPU runners: both prompt lengths, short and long outputs, batch 256 too, more rounds.
    "full": Size(batches=(1, 8, 64, 256), prompt_lens=("short", "long"), new_tokens=(64, 256),
                 guard_sets=("none", "repeat", "min_length"), guard_batches=(1, 8, 64, 256), native_budget=256,
                 served_concurrency=(1, 8, 64), served_requests=128, chat_concurrency=(1, 16), chat_requests=64,
                 rounds=5, warmup=1, ungated_rounds=5, ungated_warmup=1, confirm_rounds=10, rollout_tokens=128,
                 vllm_compiled=True),
}

# The repeat guard under test; thresholds that never fire on the healthy prompts, and catch SmolLM2's
# "30 fruits" loop (a 5-token n-gram repeated back to back).
REPEAT_GUARD = {"enabled": True, "max_consecutive_token_repeats": 8, "ngram_size": 5, "ngram_repeats": 4}
# vLLM's native detector set to the nearest equivalent: periods 1..5, four copies.
NATIVE_REPETITION = {"min_pattern_size": 1, "max_pattern_size": 5, "min_count": 4}
# min_chars far beyond any output: the plugin watches (and holds EOS back) on every step.
MIN_LENGTH = [{"name": "min_length", "min_chars": 100_000}]

# A fixed passage that turns a short prompt into a long one: about 600 more tokens with SmolLM2's tokenizer
# (the first chat prompt renders to 633 tokens with it, 37 without).
_FACTS = ["the red kettle sits on the third shelf", "the library opens at nine on weekdays",
          "a blue bicycle is locked by the north gate", "the garden has eleven rows of tomatoes",
          "the clock in the hall runs four minutes fast", "the ferry leaves the harbour every hour"]
LONG_CONTEXT = "Background notes:\n" + "\n".join(
    f"{i + 1}. In district {i % 7 + 1}, {_FACTS[i % len(_FACTS)]} (record {1000 + 37 * i})." for i in range(24))


def healthy_messages() -> list[list[dict[str, str]]]:
    """SmolLM2 prompts with no repetition loop (the guard never fires on them)."""
    return [p["messages"] for p in load_prompts("chat") + load_prompts("lists")]


def batch_messages(batch: int, prompt_len: str) -> list[list[dict[str, str]]]:
    """``batch`` chat requests, cycling the healthy prompts; ``long`` prefixes each with LONG_CONTEXT."""
    if prompt_len not in ("short", "long"):
        raise ValueError(f"prompt_len must be short or long, got {prompt_len!r}")
    base = healthy_messages()
    picked = [base[i % len(base)] for i in range(batch)]
    if prompt_len == "short":
        return picked
    return [[{**m, "content": f"{LONG_CONTEXT}\n\n{m['content']}"} if m["role"] == "user" else m for m in msgs]
            for msgs in picked]


def looping_messages() -> list[list[dict[str, str]]]:
    """A batch of 8 where SmolLM2 loops on one row ("30 fruits") and the others end on their own."""
    by_id = {p["id"]: p["messages"] for p in load_prompts("json")}
    return [by_id["json-30-fruits"], *healthy_messages()[:7]]


def fixed_length(new_tokens: int) -> dict[str, Any]:
    """Generation options that make every row generate exactly ``new_tokens`` (EOS held back by min tokens)."""
    return {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
