"""Benchmark reports: schema round trip, like-with-like comparison and its exit codes, the ratio gate."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd  # the 'report' extra; nox -s tests installs it
import pytest

from engine.report import __main__ as cli
from engine.report.compare import compare_frames
from engine.report.gate import gate, parse_minimum
from engine.report.metadata import run_metadata
from engine.report.schema import COLUMNS, RUN_COLUMNS, ReportSchemaError, check, markdown_table
from engine.report.writer import ReportWriter, read

ROOT = Path(__file__).resolve().parents[1]


def make_report(tmp_path: Path, name: str, *, scale: float = 1.0, device: str = "cpu-x",
                engine_over_raw: float = 0.97) -> Path:
    run = {**run_metadata("smoke", root=ROOT), "run_id": name, "device": device}
    w = ReportWriter(run)
    for batch in (1, 8):
        case = {"benchmark": f"throughput[hf-b{batch}]", "group": "throughput", "backend": "hf", "model": "m",
                "dtype": "float32", "batch": batch, "prompt_len": "short", "prompt_tokens": 30 * batch,
                "new_tokens": 16, "fixed_length": True, "guard_set": "none"}
        for variant, role, base in (("raw", "reference", 1.0), ("engine", "subject", 1.02)):
            rounds = [{"variant": variant, "role": role, "round": i, "wall_s": (base + 0.01 * i) * batch * scale,
                       "output_tokens": 16 * batch} for i in range(3)]
            w.add_case({**case}, rounds, {"engine_over_raw": engine_over_raw} if role == "subject" else {})
    tmp_path.mkdir(parents=True, exist_ok=True)
    return w.write(tmp_path)


def test_written_report_has_every_column_with_its_type(tmp_path):
    path = make_report(tmp_path, "r1")
    frame = read(path)
    assert list(frame.columns) == [c.name for c in COLUMNS]
    assert {c.name: str(frame[c.name].dtype) for c in COLUMNS} == {c.name: c.dtype for c in COLUMNS}
    assert len(frame) == 2 * 2 * 3  # batches x variants x rounds: one row per round
    assert (tmp_path / "benchmark-latest.parquet").read_bytes() == path.read_bytes()
    row = frame[(frame.variant == "engine") & (frame.batch == 8)].iloc[0]
    assert row.tokens_per_s == pytest.approx(row.output_tokens / row.wall_s)
    assert row.engine_over_raw == pytest.approx(0.97) and pd.isna(row.guard_on_over_off)


def test_run_metadata_fills_every_run_column():
    meta = run_metadata("smoke", root=ROOT)
    assert set(meta) == {c.name for c in RUN_COLUMNS}
    assert meta["device_kind"] in ("cpu", "cuda") and meta["device"]
    assert re.fullmatch(r"\d{8}T\d{6}Z-\w+", meta["run_id"])


def test_schema_check_names_what_is_wrong(tmp_path):
    frame = read(make_report(tmp_path, "r1"))
    with pytest.raises(ReportSchemaError, match="missing columns \\['wall_s'\\]"):
        check(frame.drop(columns=["wall_s"]))
    with pytest.raises(ReportSchemaError, match="schema_version \\[99\\]"):
        check(frame.assign(schema_version=99))


def test_an_older_report_reads_and_compares_with_a_new_one(tmp_path, capsys):
    """A version-8 baseline (no confirm_rounds, no trainer figures: what version 8 wrote) reads as this version and
    compares like with like; a newer version than this tool's is refused by name."""
    from engine.report.schema import ADDED_IN, SCHEMA_VERSION

    frame = read(make_report(tmp_path / "new", "new"))
    later = [name for version, names in ADDED_IN.items() if version > 8 for name in names]
    old = frame.drop(columns=later).assign(schema_version=8)
    old_path = tmp_path / "old.parquet"
    old.to_parquet(old_path, index=False)
    upgraded = read(old_path)
    assert list(upgraded.columns) == [c.name for c in COLUMNS] and upgraded.attrs["read_from_versions"] == [8]
    assert (upgraded.confirm_rounds == 0).all() and upgraded.trainer_agreement.isna().all()
    pd.testing.assert_series_equal(upgraded.engine_over_raw, frame.engine_over_raw)  # what it measured is kept
    assert cli.main(["compare", str(old_path), str(tmp_path / "new" / "benchmark-latest.parquet")]) == 0
    assert "4 compared" in capsys.readouterr().out
    newer = tmp_path / "newer.parquet"
    frame.assign(schema_version=SCHEMA_VERSION + 1).to_parquet(newer, index=False)
    with pytest.raises(ReportSchemaError, match="newer than this tool's"):
        read(newer)


def test_every_column_an_older_version_lacks_is_listed_with_the_version_that_added_it():
    from engine.report.schema import ADDED_IN, SCHEMA_VERSION

    added = [name for names in ADDED_IN.values() for name in names]
    assert len(added) == len(set(added)) and set(added) <= {c.name for c in COLUMNS}
    assert max(ADDED_IN) == SCHEMA_VERSION  # a version bump lists what it added


def test_reports_readme_documents_this_schema_version():
    readme = (ROOT / "reports" / "README.md").read_text()
    assert markdown_table() in readme
    from engine.report.schema import SCHEMA_VERSION

    assert f"Schema version: {SCHEMA_VERSION}" in readme


def test_compare_flags_a_planted_20_percent_slowdown_and_draws_the_plot(tmp_path, capsys):
    base = make_report(tmp_path / "a", "base")
    new = make_report(tmp_path / "b", "new", scale=1.2)
    plot = tmp_path / "cmp.png"
    assert cli.main(["compare", str(base), str(new), "--plot", str(plot)]) == cli.EXIT_REGRESSED
    out = capsys.readouterr().out
    assert out.count("REGRESSED") == 4 and "+20.0%" in out and "4 compared, 4 regressed" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    # the threshold is configurable: 25 % tolerates it
    assert cli.main(["compare", str(base), str(new), "--threshold", "25", "--plot", str(plot)]) == cli.EXIT_OK


def test_compare_of_equal_runs_passes(tmp_path, capsys):
    base = make_report(tmp_path / "a", "base")
    new = make_report(tmp_path / "b", "new", scale=1.03)  # inside the 5 % default
    assert cli.main(["compare", str(base), str(new), "--plot", str(tmp_path / "p.png")]) == cli.EXIT_OK
    assert "0 regressed" in capsys.readouterr().out


def test_compare_only_pairs_like_with_like(tmp_path, capsys):
    base = make_report(tmp_path / "a", "base", device="gpu-1")
    new = make_report(tmp_path / "b", "new", device="gpu-2", scale=2.0)
    assert cli.main(["compare", str(base), str(new), "--plot", str(tmp_path / "p.png")]) == cli.EXIT_UNUSABLE
    captured = capsys.readouterr()
    assert "nothing comparable" in captured.err and "gpu-1" in captured.err and "only in base" in captured.out
    b, n = read(base), read(new)
    partial = compare_frames(b, pd.concat([n, b[b.batch == 1]]))  # one shape present on both sides
    assert len(partial.rows) == 2 and not partial.regressions


def test_gate_fails_below_a_minimum_and_when_nothing_was_measured(tmp_path, capsys):
    ok = make_report(tmp_path / "a", "ok", engine_over_raw=0.95)
    slow = make_report(tmp_path / "b", "slow", engine_over_raw=0.85)
    assert cli.main(["gate", str(ok), "--only", "--min", "engine_over_raw=0.9"]) == cli.EXIT_OK
    assert cli.main(["gate", str(slow), "--only", "--min", "engine_over_raw=0.9"]) == cli.EXIT_REGRESSED
    assert "FAIL  engine_over_raw" in capsys.readouterr().out
    # the default minimums include guard_on_over_off, which this report never measured: that fails too
    assert cli.main(["gate", str(ok)]) == cli.EXIT_REGRESSED
    assert "guard_on_over_off: no case" in capsys.readouterr().out
    result = gate(read(slow), {"engine_over_raw": 0.8})
    assert result.passed and len(result.verdicts) == 2  # one verdict per case, not per row


@pytest.mark.parametrize("text", ["engine_over_raw", "speed=0.9", "engine_over_raw=fast", "engine_over_raw=0"])
def test_bad_minimums_are_refused_with_the_fix(text, tmp_path, capsys):
    with pytest.raises(ValueError, match="--min"):
        parse_minimum(text)
    assert cli.main(["gate", str(make_report(tmp_path, "r")), "--min", text]) == cli.EXIT_UNUSABLE
    assert "--min" in capsys.readouterr().err


def test_show_prints_metadata_and_one_line_per_variant(tmp_path, capsys):
    assert cli.main(["show", str(make_report(tmp_path, "r"))]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "run_id: r" in out and "throughput[hf-b8]" in out
    assert len([line for line in out.splitlines() if line.startswith("throughput[")]) == 4


def test_missing_report_is_a_usage_error(tmp_path, capsys):
    assert cli.main(["show", str(tmp_path / "none.parquet")]) == cli.EXIT_UNUSABLE
    assert "nox -s benchmark" in capsys.readouterr().err


def test_writer_refuses_rows_that_lack_a_schema_column(tmp_path):
    w = ReportWriter({**run_metadata("smoke", root=ROOT)})
    w.add_case({"benchmark": "b", "variant": "engine"}, [{"round": 0, "wall_s": 1.0, "output_tokens": 4}], {})
    with pytest.raises(ValueError, match=r"lack the schema columns .*'backend'"):
        w.write(tmp_path)


def test_per_case_figures_are_written_on_the_case_rows_and_unknown_names_refused():
    w = ReportWriter({"run_id": "r"})
    w.add_case({"benchmark": "g"}, [{"round": k, "wall_s": 1.0, "output_tokens": 4} for k in range(2)],
               {"guard_on_over_off": 0.98, "added_ms_per_step": 0.25})
    w.add_case({"benchmark": "e"}, [{"round": 0, "wall_s": 1.0, "output_tokens": 4}], {"engine_over_raw": 1.0})
    assert [r["added_ms_per_step"] for r in w.rows[:2]] == [0.25, 0.25]
    assert math.isnan(w.rows[2]["added_ms_per_step"])
    with pytest.raises(ValueError, match="unknown ratio or figure columns \\['ms_added'\\]"):
        w.add_case({"benchmark": "x"}, [], {"ms_added": 1.0})


def test_the_gate_says_when_a_case_was_confirmed_with_more_rounds(tmp_path, capsys):
    path = make_report(tmp_path, "confirmed", engine_over_raw=0.93)
    frame = read(path)
    frame.loc[frame["benchmark"] == "throughput[hf-b8]", "confirm_rounds"] = 6
    verdicts = {v.benchmark: v.confirm_rounds for v in gate(frame, {"engine_over_raw": 0.9}).verdicts}
    assert verdicts == {"throughput[hf-b1]": 0, "throughput[hf-b8]": 6}
    assert read(make_report(tmp_path / "plain", "plain"))["confirm_rounds"].eq(0).all()  # the writer's default
    from engine.report.gate import format_gate

    lines = format_gate(gate(frame, {"engine_over_raw": 0.9})).splitlines()
    assert "6 more rounds measured" in lines[1] and "more rounds" not in lines[0]


def test_the_full_tier_gate_needs_its_own_groups_and_the_quick_tier_leaves_them_out(tmp_path, capsys):
    from engine.report.gate import DEFAULT_MINIMUMS

    frame = read(make_report(tmp_path, "r"))
    measured = {ratio: 5.0 for ratio in DEFAULT_MINIMUMS}  # every default ratio measured and passing
    frame = frame.assign(**measured)
    path = tmp_path / "all-default.parquet"
    frame.to_parquet(path)
    assert cli.main(["gate", str(path), "--tier", "quick"]) == cli.EXIT_OK
    assert "ours_over_stock" not in capsys.readouterr().out
    assert cli.main(["gate", str(path)]) == cli.EXIT_REGRESSED  # the default tier is full: its ratio is missing
    assert "FAIL  ours_over_stock: no case" in capsys.readouterr().out
    frame.assign(ours_over_stock=0.96).to_parquet(path)
    assert cli.main(["gate", str(path), "--tier", "full"]) == cli.EXIT_REGRESSED  # below 0.97
    assert "FAIL  ours_over_stock" in capsys.readouterr().out
    frame.assign(ours_over_stock=0.98).to_parquet(path)
    assert cli.main(["gate", str(path), "--tier", "full"]) == cli.EXIT_REGRESSED  # plugin_idle_over_without missing
    frame.assign(ours_over_stock=0.98, plugin_idle_over_without=0.985).to_parquet(path)
    assert cli.main(["gate", str(path), "--tier", "full"]) == cli.EXIT_REGRESSED  # below 0.99
    assert "FAIL  plugin_idle_over_without" in capsys.readouterr().out
    frame.assign(ours_over_stock=0.98, plugin_idle_over_without=0.995).to_parquet(path)
    assert cli.main(["gate", str(path), "--tier", "full"]) == cli.EXIT_REGRESSED  # portable_over_native missing
    frame.assign(ours_over_stock=0.98, plugin_idle_over_without=0.995, portable_over_native=0.45).to_parquet(path)
    assert cli.main(["gate", str(path), "--tier", "full"]) == cli.EXIT_REGRESSED  # below 0.5
    assert "FAIL  portable_over_native" in capsys.readouterr().out
    frame.assign(ours_over_stock=0.98, plugin_idle_over_without=0.995, portable_over_native=0.6).to_parquet(path)
    assert cli.main(["gate", str(path), "--tier", "full"]) == cli.EXIT_REGRESSED  # adapter_ours_over_stock missing
    assert "FAIL  adapter_ours_over_stock: no case" in capsys.readouterr().out
    frame.assign(ours_over_stock=0.98, plugin_idle_over_without=0.995, portable_over_native=0.6,
                 adapter_ours_over_stock=0.95).to_parquet(path)
    assert cli.main(["gate", str(path), "--tier", "full"]) == cli.EXIT_REGRESSED  # below 0.97
    assert "FAIL  adapter_ours_over_stock" in capsys.readouterr().out
    frame.assign(ours_over_stock=0.98, plugin_idle_over_without=0.995, portable_over_native=0.6,
                 adapter_ours_over_stock=0.99).to_parquet(path)
    assert cli.main(["gate", str(path), "--tier", "full"]) == cli.EXIT_REGRESSED  # trainer_agreement missing
    assert "FAIL  trainer_agreement: no case" in capsys.readouterr().out
    frame.assign(ours_over_stock=0.98, plugin_idle_over_without=0.995, portable_over_native=0.6,
                 adapter_ours_over_stock=0.99, trainer_agreement=0.98).to_parquet(path)
    assert cli.main(["gate", str(path), "--tier", "full"]) == cli.EXIT_REGRESSED  # below 0.99
    assert "FAIL  trainer_agreement" in capsys.readouterr().out
    frame.assign(ours_over_stock=0.98, plugin_idle_over_without=0.995, portable_over_native=0.6,
                 adapter_ours_over_stock=0.99, trainer_agreement=1.0).to_parquet(path)
    assert cli.main(["gate", str(path), "--tier", "full"]) == cli.EXIT_OK
