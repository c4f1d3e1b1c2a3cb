"""``python -m engine.report show|compare|gate``: read benchmark reports (see engine/report/__init__.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.report.gate import TIERS
from engine.report.schema import RATIO_COLUMNS, ReportSchemaError

EXIT_OK, EXIT_REGRESSED, EXIT_UNUSABLE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.report", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print one report: run metadata and per-benchmark medians and ratios")
    show.add_argument("report", type=Path)
    cmp_ = sub.add_parser("compare", help="compare two reports like with like; exit 1 on a regression")
    cmp_.add_argument("base", type=Path)
    cmp_.add_argument("new", type=Path)
    cmp_.add_argument("--threshold", type=float, default=5.0,
                      help="regression threshold: %% growth of a median wall time (default: 5)")
    cmp_.add_argument("--plot", type=Path, default=None,
                      help="PNG to write (default: compare-<base>-vs-<new>.png next to NEW)")
    gate = sub.add_parser("gate", help="check the ratios measured within one run; exit 1 below a minimum")
    gate.add_argument("report", type=Path)
    gate.add_argument("--min", action="append", default=[], metavar="RATIO=NUMBER",
                      help=f"minimum for a ratio ({', '.join(RATIO_COLUMNS)}); replaces that ratio's default")
    gate.add_argument("--only", action="store_true", help="check only the ratios given with --min")
    gate.add_argument("--tier", default="full", choices=TIERS,
                      help="the benchmark run's tier: quick (CI) leaves out the full tier's groups and their minimums "
                           "(default: full)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from engine.report.writer import read

    try:
        if args.command == "show":
            from engine.report.show import format_report

            print(format_report(read(args.report)))
            return EXIT_OK
        if args.command == "compare":
            return _compare(args, read(args.base), read(args.new))
        return _gate(args, read(args.report))
    except (FileNotFoundError, ReportSchemaError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_UNUSABLE


def _compare(args: argparse.Namespace, base: object, new: object) -> int:
    from engine.report.compare import compare_frames, format_comparison
    from engine.report.plot import plot_comparison

    result = compare_frames(base, new, threshold_pct=args.threshold)
    print(format_comparison(result, str(args.base), str(args.new)))
    if not result.rows:
        devices = {name: sorted(set(frame["device"])) for name, frame in (("base", base), ("new", new))}
        print(f"error: nothing comparable (devices {devices}); fix: compare runs of the same device, model, "
              "dtype and sizes", file=sys.stderr)
        return EXIT_UNUSABLE
    plot = args.plot or args.new.parent / f"compare-{args.base.stem}-vs-{args.new.stem}.png"
    plot_comparison(result, plot, base=args.base.name, new=args.new.name)
    print(f"plot: {plot}")
    return EXIT_REGRESSED if result.regressions else EXIT_OK


def _gate(args: argparse.Namespace, frame: object) -> int:
    from engine.report.gate import format_gate, gate, minimums_for, parse_minimum

    given = dict(parse_minimum(m) for m in args.min)
    minimums = given if args.only else {**minimums_for(args.tier), **given}
    if not minimums:
        raise ValueError("gate: no minimum to check; fix: pass --min RATIO=NUMBER or drop --only")
    result = gate(frame, minimums)
    print(format_gate(result))
    return EXIT_OK if result.passed else EXIT_REGRESSED


if __name__ == "__main__":
    sys.exit(main())
