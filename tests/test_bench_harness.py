"""The benchmark harness's own rules: warm-up rounds dropped, order alternated, ratios from medians."""

from __future__ import annotations

import pytest

from benchmarks.harness import Answered, Rounds, Variant
from benchmarks.workload import SIZES, batch_messages


def make_rounds(calls: list[str], warmup: int = 1) -> Rounds:
    def variant(name: str, role: str, tokens: int) -> Variant:
        def run() -> int:
            calls.append(name)
            return tokens
        return Variant(name, role, run)

    return Rounds([variant("raw", "reference", 4), variant("engine", "subject", 4)], warmup=warmup, total=3,
                  progress=lambda line: calls.append(f"progress: {line}"), label="case")


def test_warmup_rounds_run_but_are_not_kept_and_order_alternates():
    calls: list[str] = []
    rounds = make_rounds(calls)
    for _ in range(4):  # 1 warm-up + 3 measured
        rounds()
    order = [c for c in calls if not c.startswith("progress")]
    assert order == ["raw", "engine", "engine", "raw", "raw", "engine", "engine", "raw"]
    assert [len(rounds.samples[n]) for n in ("raw", "engine")] == [3, 3]
    assert "warm-up" in calls[2] and "round 3/3" in calls[-1]
    rows = rounds.rows()
    assert len(rows) == 6 and {r["role"] for r in rows} == {"reference", "subject"}
    assert rounds.tokens("engine") == {4}


def test_speed_ratio_is_reference_median_over_subject_median():
    rounds = make_rounds([])
    rounds.samples = {"raw": [(1.0, 4), (9.0, 4), (2.0, 4)], "engine": [(4.0, 4), (2.5, 4), (2.0, 4)]}
    assert rounds.speed_ratio("engine", "raw") == pytest.approx(2.0 / 2.5)  # medians, not means


def test_timed_requests_give_latency_percentiles_per_measured_round():
    answers = iter([Answered(8, (9.0, 9.0)),  # warm-up: dropped
                    Answered(8, (0.1, 0.3)), Answered(8, tuple(float(i) for i in range(101)))])
    rounds = Rounds([Variant("served", "subject", lambda: next(answers))], warmup=1, total=2,
                    progress=lambda line: None, label="case")
    for _ in range(3):
        rounds()
    first, second = rounds.rows()
    assert (first["requests"], first["p50_latency_ms"], first["p99_latency_ms"]) == (2, pytest.approx(200.0),
                                                                                      pytest.approx(298.0))
    assert (second["requests"], second["p50_latency_ms"], second["p99_latency_ms"]) == (101, 50_000.0, 99_000.0)
    assert rounds.tokens("served") == {8} and len(rounds.latencies["served"]) == 2


def test_smoke_measures_engine_vs_raw_at_every_batch_and_full_adds_lengths():
    smoke, full = SIZES["smoke"], SIZES["full"]
    assert smoke.batches == (1, 8, 64) and "none" in smoke.guard_sets
    assert {"repeat", "min_length"} <= set(smoke.guard_sets) and smoke.guard_batches
    assert len(full.prompt_lens) > 1 and len(full.new_tokens) > 1 and full.rounds >= smoke.rounds
    assert smoke.served_concurrency == full.served_concurrency == (1, 8, 64)


def test_smoke_trims_only_what_no_gate_reads_and_full_keeps_every_round():
    smoke, full = SIZES["smoke"], SIZES["full"]
    assert 1 <= smoke.ungated_rounds < smoke.rounds and smoke.rounds >= 3, "gated ratios keep a median of rounds"
    assert smoke.warmup >= 1 and smoke.ungated_warmup == 0, "only the reported-only groups skip the warm-up"
    assert full.ungated_rounds == full.rounds and full.warmup >= 1 and full.ungated_warmup == full.warmup


def test_batches_cycle_prompts_and_long_prompts_carry_the_context():
    short, long = batch_messages(64, "short"), batch_messages(64, "long")
    assert len(short) == len(long) == 64
    assert all(len(lo[-1]["content"]) > len(sh[-1]["content"]) + 500 for sh, lo in zip(short, long, strict=True))
    with pytest.raises(ValueError, match="short or long"):
        batch_messages(1, "medium")


def test_a_missed_gate_is_confirmed_with_more_interleaved_rounds_judged_on_all_of_them():
    calls: list[str] = []
    rounds = make_rounds(calls)
    for _ in range(4):
        rounds()
    rounds.samples = {"raw": [(1.0, 4)] * 3, "engine": [(1.0, 4), (1.0, 4), (1.25, 4)]}
    gates = {"engine_over_raw": ("engine", "raw")}
    assert rounds.missed(gates, {"engine_over_raw": 0.9}) == []
    rounds.samples["engine"] = [(1.25, 4), (1.2, 4), (1.0, 4)]  # median 1.2: 0.833
    assert rounds.missed(gates, {"engine_over_raw": 0.9}) == ["engine_over_raw 0.833 < 0.9"]
    assert rounds.missed(gates, {"guard_on_over_off": 0.8}) == []  # a ratio with no minimum is never missed
    calls.clear()
    rounds.more(4)
    assert [c for c in calls if not c.startswith("progress")] == ["raw", "engine", "engine", "raw"] * 2
    assert "round 7/7" in calls[-1] and rounds.added == 4
    assert [len(rounds.samples[n]) for n in ("raw", "engine")] == [7, 7]
    rounds.samples = {"raw": [(1.0, 4)] * 7, "engine": [(1.25, 4), (1.2, 4), (1.0, 4)] + [(1.0, 4)] * 4}
    assert rounds.speed_ratio("engine", "raw") == pytest.approx(1.0)  # judged on all 7: one slow pair outvoted
    assert [r["round"] for r in rounds.rows() if r["variant"] == "engine"] == list(range(7))


def test_every_size_can_confirm_a_missed_gate_with_more_rounds_than_it_first_measured():
    for size in SIZES.values():
        assert size.confirm_rounds >= size.rounds
