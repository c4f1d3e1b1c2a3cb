"""The benchmark report schema: one Parquet row per measured round, versioned.

A report is one run of ``pytest benchmarks --benchmark``. Every row carries the run's metadata, the case's
shape, the variant measured and the round's numbers; the ratio columns repeat the case's median ratio on
every row of that case (NaN where the ratio does not apply). A ratio is a speed ratio on the same requests:
the reference variant's median wall time / the subject's, i.e. the token-throughput ratio whenever both
generate the same tokens (asserted for every fixed-length case); above 1 means the subject is faster.
Bump :data:`SCHEMA_VERSION` on any change of a column's name, type or meaning, and say so in
``reports/README.md``.

>>> [c.name for c in COLUMNS][:3]
['schema_version', 'run_id', 'timestamp']
>>> sorted(RATIO_COLUMNS)
['adapter_ours_over_stock', 'adapter_over_base', 'adapter_over_plain', 'batch_over_single', \
'constrained_over_free', 'engine_over_raw', 'engine_over_raw_cached', 'fast_over_reference', \
'guard_on_over_off', 'llamacpp_over_hf', 'llamacpp_over_vllm', 'ours_over_native', 'ours_over_stock', \
'pattern_c_over_chat', 'plugin_idle_over_without', 'portable_over_native', 'served_over_inprocess', \
'streamed_over_plain', 'trainer_agreement']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 16


@dataclass(frozen=True)
class Column:
    name: str
    dtype: str  # pandas dtype name
    doc: str


RUN_COLUMNS = (
    Column("schema_version", "int64", "this schema's version"),
    Column("run_id", "string", "unique id of the run (UTC timestamp + short git sha)"),
    Column("timestamp", "string", "run start, ISO 8601 UTC"),
    Column("git_sha", "string", "commit of the code measured ('' outside a git checkout)"),
    Column("git_dirty", "bool", "uncommitted changes were present"),
    Column("host", "string", "host name"),
    Column("device", "string", "GPU name (torch.cuda.get_device_name) or the CPU model name"),
    Column("device_kind", "string", "cuda or cpu"),
    Column("python_version", "string", "Python version"),
    Column("torch_version", "string", "torch version ('' if absent)"),
    Column("transformers_version", "string", "transformers version ('' if absent)"),
    Column("vllm_version", "string", "vllm version ('' if absent)"),
    Column("size", "string", "benchmark size: smoke or full"),
)
CASE_COLUMNS = (
    Column("benchmark", "string", "case id: group[backend-bN-prompt-oN-guard]; the comparison key with variant"),
    Column("group", "string", "throughput, repeat_vs_native, rule_cost, served, served_vs_vllm_serve, chat_stream, "
                              "pattern_c, constrained, backends, rollout_vs_trainer, sampler_cost, adapter_cost or "
                              "adapter_vs_vllm_serve"),
    Column("backend", "string", "hf, vllm or llamacpp (backends: llamacpp, the subject of every ratio of the case)"),
    Column("model", "string", "model name (fixture name or folder name)"),
    Column("dtype", "string", "model dtype"),
    Column("batch", "int64", "requests per call; served: concurrent clients, each posting one request at a time "
                             "(the in-process variant calls generate with batches of this size)"),
    Column("prompt_len", "string", "prompt length class: short, long, or the prompt set's name"),
    Column("prompt_tokens", "int64", "prompt tokens over the whole batch (served: over the round's requests)"),
    Column("new_tokens", "int64", "output budget per row (max_new_tokens)"),
    Column("fixed_length", "bool", "EOS was suppressed so every row generates exactly new_tokens"),
    Column("guard_set", "string", "none, repeat or min_length (what the subject variant adds); rule_cost: the rule "
                                  "measured (repeat_ids, repeat_keys, min_length, json_boundary); constrained: "
                                  "json_schema; sampler_cost: none"),
    Column("variant", "string", "what ran: raw, engine, engine+repeat, engine+min_length, raw+native_repetition; "
                                "rule_cost: decode+rowwise (reference path) or table+vectorized (fast path); "
                                "backends: hf, vllm, llamacpp (engines), llamacpp-raw (Llama.generate after "
                                "Llama.reset) or llamacpp-raw-cached (Llama.generate keeping its prefix); "
                                "sampler_cost: native or portable (generation.sampler)"),
    Column("role", "string", "reference or subject of the case's ratio, or context (measured alongside, in no ratio)"),
    Column("confirm_rounds", "int64", "measured rounds added because a gated ratio missed its minimum after the "
                                      "size's rounds (its ratios are then medians over all the case's rounds); 0: "
                                      "none were needed"),
)
ROUND_COLUMNS = (
    Column("round", "int64", "measured round (warm-up rounds are not written)"),
    Column("wall_s", "float64", "wall time of the call, device synchronized before and after"),
    Column("output_tokens", "int64", "generated tokens over the whole batch"),
    Column("requests", "int64", "requests answered in the round (the batch, or the served round's requests)"),
    Column("requests_per_s", "float64", "requests / wall_s"),
    Column("p50_latency_ms", "float64", "median request latency in the round, issue to answer (NaN where requests "
                                        "are not timed one by one: every request of a batched call takes its wall)"),
    Column("p99_latency_ms", "float64", "99th percentile of the request latencies in the round (NaN as above)"),
    Column("p50_ttft_ms", "float64", "median time to first token in the round: a streamed request's issue to its "
                                     "first content delta, a non-streamed one's issue to its answer (NaN where "
                                     "requests are not timed one by one)"),
    Column("tokens_per_s", "float64", "output_tokens / wall_s"),
    Column("us_per_token", "float64", "wall_s / output_tokens in microseconds; rule_cost: per token per row"),
)
RATIO_COLUMNS = {
    "engine_over_raw": "engine speed / raw backend call's, same prompt ids and settings",
    "engine_over_raw_cached": "backends: speed of the engine on llama.cpp / of a raw Llama.generate that keeps the "
                              "prompt prefix its context holds from the round before (the engine evaluates every "
                              "call's prompts from an empty KV pool, for history independence); not gated",
    "guard_on_over_off": "speed with the guard / without it, both through the engine",
    "ours_over_native": "speed with our repeat guard (engine) / with vLLM's native repetition_detection (raw LLM)",
    "served_over_inprocess": "served: speed of the engine behind python -m engine.serve (concurrent clients, one "
                             "request per post to /infer/) / in-process generate in batches of that size, same "
                             "requests",
    "streamed_over_plain": "chat_stream: speed of streamed /v1/chat/completions requests (SSE) / non-streamed ones, "
                           "same requests, fixed length, concurrent clients",
    "pattern_c_over_chat": "pattern_c: tokens/s of Pattern C /chat requests (min-length rule + cleanup) / of plain "
                           "/v1/chat/completions requests, same prompts, sampling and concurrency (a token-rate "
                           "ratio: Pattern C answers are longer by design; per-request latency is in p50_latency_ms)",
    "constrained_over_free": "constrained: speed of schema-constrained generation (xgrammar on HF, structured "
                             "outputs on vLLM) / free generation, same prompts and the same number of decode steps",
    "llamacpp_over_hf": "backends: speed of the engine on llama.cpp (F32 GGUF twin) / on HF, same requests, fixed "
                        "length, interleaved rounds",
    "llamacpp_over_vllm": "backends: speed of the engine on llama.cpp / on vLLM, same requests and rounds",
    "batch_over_single": "backends: speed of the engine on llama.cpp given the batch's rows in one call (parallel "
                         "sequences) / given them one call per row, same rows and tokens",
    "plugin_idle_over_without": "vllm_plugin: speed of a bare vllm.LLM with the guard's plugin loaded but not asked "
                                "(engine.vllm_plugin) / of the same LLM without it, fixed length; gated at 0.99 by the "
                                "full tier's gate",
    "ours_over_stock": "served_vs_vllm_serve: speed of python -m engine.serve on vLLM / of stock vllm serve, same "
                       "model, settings, executor layout and fixed-length greedy chat requests (official openai "
                       "client, concurrent clients); gated at 0.97 by the full tier's gate",
    "trainer_agreement": "rollout_vs_trainer: the worst token importance weight exp(trainer - rollout) folded below 1 "
                         "(min over tokens of min(w, 1/w)) with the trainer re-scoring as the rollout reports (raw, or "
                         "processed with engine.score's processing); float32 cases only: 1 when the trainer sees "
                         "exactly what the rollout drew",
    "fast_over_reference": "rule_cost: speed of a rule's fast path (byte table, vectorized ids) / its reference "
                           "path (decode per token, per-row Python), same token stream",
    "adapter_over_base": "adapter_cost: speed of the engine's rows with a LoRA adapter (smollm2-lora r16) / the same "
                         "rows on the base model, one loaded engine, greedy, fixed length",
    "adapter_over_plain": "adapter_cost: speed of the rows with the adapter / the same rows on the run's plain engine "
                          "(no LoRA loaded), greedy, fixed length",
    "adapter_ours_over_stock": "adapter_vs_vllm_serve: speed of python -m engine.serve on vLLM with a LoRA adapter "
                               "(smollm2-lora r16, named by the model field) / of stock vllm serve --enable-lora with "
                               "the same adapter, same requests as ours_over_stock; gated at 0.97 by the full tier's "
                               "gate",
    "portable_over_native": "sampler_cost: speed of the engine sampling with generation.sampler portable (the "
                            "counter-based Gumbel draw, engine.rules.portable_sampler) / with the backend's own "
                            "sampler, same seeded requests, fixed length",
}
# Per-case figures other than ratios, repeated on every row of the case like the ratios (NaN where not measured).
FIGURE_COLUMNS = {
    "added_ms_per_step": "what the subject adds per decode step of the whole batch, in ms: guard and constrained "
                         "cases (subject median - reference median) / new_tokens; rule_cost: the subject's median / "
                         "steps",
    "dlogprob_mean": "rollout_vs_trainer: mean over the sampled tokens of the absolute difference between the "
                     "rollout's logprob and the trainer's teacher-forced one (the trainer: HF in the case's dtype, "
                     "engine.score)",
    "dlogprob_p99": "rollout_vs_trainer: 99th percentile of the same per-token absolute difference",
    "dlogprob_max": "rollout_vs_trainer: largest per-token absolute difference",
    "importance_ratio_min": "rollout_vs_trainer: smallest sequence importance ratio exp(sum trainer - sum rollout "
                            "logprobs) over the case's sequences (1: the trainer sees exactly what the rollout drew)",
    "importance_ratio_max": "rollout_vs_trainer: largest sequence importance ratio",
    "k3_kl": "rollout_vs_trainer: ms-swift's rollout_correction/k3_kl of the matched pairing "
             "(engine.trainer.correction)",
    "chi2_token": "rollout_vs_trainer: ms-swift's rollout_correction/chi2_token of the matched pairing",
    "is_weight_mean": "rollout_vs_trainer: ms-swift's token_truncate is_weight_mean (threshold 2) of the matched "
                      "pairing",
    "ess": "rollout_vs_trainer: ms-swift's effective sample size (token_truncate, threshold 2) of the matched "
           "pairing",
    "temp_only_weight_mean": "rollout_vs_trainer: mean token weight when the trainer re-scores with the temperature "
                             "only, full vocabulary (ms-swift's trainer), whatever the rollout's mode",
    "added_us_per_token": "sampler_cost: what the portable sampler adds per generated token per row, in us "
                          "((subject median - reference median) / (batch x new_tokens)); adapter_cost: what the "
                          "adapter adds, alike",
    "temp_only_outside_frac": "rollout_vs_trainer: fraction of tokens whose weight against the temperature-only "
                              "trainer is outside [0.9, 1.1]",
}
COLUMNS = (*RUN_COLUMNS, *CASE_COLUMNS, *ROUND_COLUMNS,
           *(Column(name, "float64", doc) for name, doc in {**RATIO_COLUMNS, **FIGURE_COLUMNS}.items()))

# Rows are compared only when all of these agree: same device, model, dtype and shapes.
LIKE_FOR_LIKE = ("benchmark", "variant", "device", "backend", "model", "dtype", "batch", "prompt_tokens",
                 "new_tokens", "guard_set")


ADDED_IN: dict[int, tuple[str, ...]] = {
    2: ("us_per_token", "fast_over_reference"),
    3: ("added_ms_per_step",),
    4: ("requests", "requests_per_s", "p50_latency_ms", "p99_latency_ms", "served_over_inprocess"),
    5: ("p50_ttft_ms", "streamed_over_plain", "pattern_c_over_chat"),
    6: ("constrained_over_free",),
    7: ("llamacpp_over_hf", "llamacpp_over_vllm"),
    8: ("dlogprob_mean", "dlogprob_p99", "dlogprob_max", "importance_ratio_min", "importance_ratio_max"),
    9: ("confirm_rounds",),
    10: ("trainer_agreement", "k3_kl", "chi2_token", "is_weight_mean", "ess", "temp_only_weight_mean",
         "temp_only_outside_frac"),
    11: ("batch_over_single", "ours_over_stock"),
    12: ("plugin_idle_over_without",),
    13: ("portable_over_native", "added_us_per_token"),
    14: ("engine_over_raw_cached",),
    15: ("adapter_over_base", "adapter_over_plain"),
    16: ("adapter_ours_over_stock",),
}
"""The columns each version added (every change so far added columns; none was renamed or retyped), so a report of
any earlier version reads as this one: what it lacks is absent (NaN, '' or 0 rounds confirmed), never invented.
One variant changed meaning: before 14 ``llamacpp-raw`` kept the prompt prefix its context held; an older report's
rows of it read as ``llamacpp-raw-cached``, the name 14 gives that call, so they compare like with like."""
OLDEST_READABLE = 1
DEFAULTS = {"float64": float("nan"), "string": "", "int64": 0, "bool": False}
"""What a column an older version did not have holds once read (``confirm_rounds`` 0: none were added then)."""


class ReportSchemaError(ValueError):
    """A report file does not match this schema version (missing columns or another version)."""


def upgrade(frame: Any, *, source: str = "report") -> Any:
    """``frame`` as this schema version: a report written by an older one gains the columns added since (see
    :data:`ADDED_IN`), with their :data:`DEFAULTS`; ``frame.attrs["read_from_versions"]`` keeps the versions it was
    written with. A newer version's report is refused (this tool cannot know its columns).

    >>> import pandas as pd
    >>> old = pd.DataFrame({"schema_version": [8], "wall_s": [1.0]})
    >>> new = upgrade(old)
    >>> int(new["schema_version"][0]), int(new["confirm_rounds"][0]), new.attrs["read_from_versions"]
    (16, 0, [8])
    >>> bool(pd.isna(new["trainer_agreement"][0])), "dlogprob_mean" in new  # added in 10; 8 already had it
    (True, False)
    >>> upgrade(pd.DataFrame({"schema_version": [13], "variant": ["llamacpp-raw"]}))["variant"].tolist()
    ['llamacpp-raw-cached']
    """
    if "schema_version" not in frame.columns or len(frame) == 0:
        return frame
    versions = sorted(set(int(v) for v in frame["schema_version"]))
    if versions[-1] > SCHEMA_VERSION:
        raise ReportSchemaError(f"{source}: schema_version {versions}, newer than this tool's {SCHEMA_VERSION}; fix: "
                                "upgrade xbackend-engine to read it")
    if versions[0] < OLDEST_READABLE:
        raise ReportSchemaError(f"{source}: schema_version {versions}; this tool reads {OLDEST_READABLE} to "
                                f"{SCHEMA_VERSION}")
    if versions == [SCHEMA_VERSION]:
        return frame
    types = {c.name: c.dtype for c in COLUMNS}
    out = frame.copy()
    for version in range(versions[0] + 1, SCHEMA_VERSION + 1):
        for name in ADDED_IN.get(version, ()):
            if name not in out.columns:
                out[name] = DEFAULTS[types[name]]
                out[name] = out[name].astype(types[name])
    if versions[0] < 14:  # before 14, llamacpp-raw kept its prefix: the name 14 gives that call
        old = (out["schema_version"] < 14) & (out["variant"] == "llamacpp-raw") if "variant" in out else None
        if old is not None and old.any():
            out.loc[old, "variant"] = "llamacpp-raw-cached"
    out["schema_version"] = SCHEMA_VERSION
    order = [c.name for c in COLUMNS if c.name in out.columns]
    out = out[order + [name for name in out.columns if name not in order]]  # this version's column order
    out.attrs["read_from_versions"] = versions
    return out


def check(frame: Any, *, source: str = "report") -> None:
    """Raise :class:`ReportSchemaError` unless ``frame`` holds every column of this schema version."""
    missing = [c.name for c in COLUMNS if c.name not in frame.columns]
    if missing:
        raise ReportSchemaError(f"{source}: missing columns {missing}; fix: write it with this version's "
                                f"benchmarks (schema_version {SCHEMA_VERSION})")
    versions = sorted(set(int(v) for v in frame["schema_version"]))
    if versions != [SCHEMA_VERSION]:
        raise ReportSchemaError(f"{source}: schema_version {versions}, this tool reads {SCHEMA_VERSION}; fix: "
                                "re-run the benchmarks with this version, or compare with the matching tool")
    if len(frame) == 0:
        raise ReportSchemaError(f"{source}: no rows; fix: run the benchmarks (pytest benchmarks --benchmark)")


def markdown_table() -> str:
    """The schema as a markdown table (kept in ``reports/README.md``; a test checks they agree)."""
    lines = ["| column | type | meaning |", "|---|---|---|"]
    lines += [f"| `{c.name}` | {c.dtype} | {c.doc} |" for c in COLUMNS]
    return "\n".join(lines)
