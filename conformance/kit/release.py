"""One release report: what changed in behaviour (two outputs records, ``conformance/kit/history.py``) and in speed
(two benchmark reports, ``python -m engine.report compare``) between the same two runs, on one page, with each gated
ratio plotted over every recorded benchmark run.

    python -m conformance.kit.release --outputs OLD NEW --benchmarks OLD.parquet NEW.parquet \\
        [--history reports/benchmark-*.parquet] [--out reports/release.html]

Exit status 1 when either side fails its own rule: a changed case no entry accepts, or a benchmark whose median wall
time grew beyond the threshold (``--threshold``, 5 % by default, as ``engine.report compare``).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conformance.kit.history import ACCEPTED, Comparison, compare, headline, read_accepted
from conformance.kit.history import page as outputs_page
from conformance.kit.outputs import read_all


def ratio_history(frames: Sequence[Any]) -> dict[str, list[tuple[str, float]]]:
    """Per gated ratio (``engine.report.gate``'s minimums, both tiers), its median over each run's cases: (run, value)
    in the runs' time order; runs without the ratio left out.

    >>> import pandas as pd
    >>> a = pd.DataFrame({"run_id": ["r1"] * 2, "timestamp": ["2026-12-01"] * 2, "engine_over_raw": [0.9, 1.0]})
    >>> b = pd.DataFrame({"run_id": ["r2"], "timestamp": ["2026-12-02"], "engine_over_raw": [0.97]})
    >>> ratio_history([b, a])["engine_over_raw"]
    [('r1', 0.95), ('r2', 0.97)]
    """
    from engine.report.gate import DEFAULT_MINIMUMS, FULL_TIER_MINIMUMS

    unique = {str(f["run_id"].iloc[0]): f for f in frames}  # the same run given twice (benchmark-latest) once
    runs = sorted(unique.values(), key=lambda f: str(f["timestamp"].iloc[0]))
    out: dict[str, list[tuple[str, float]]] = {}
    for name in {**DEFAULT_MINIMUMS, **FULL_TIER_MINIMUMS}:
        points = [(str(f["run_id"].iloc[0]), round(float(f[name].median()), 4)) for f in runs
                  if name in f and f[name].notna().any()]
        if points:
            out[name] = points
    return out


def ratio_plot(history: dict[str, list[tuple[str, float]]]) -> str:
    """The ratios over the runs as one PNG (base64), each with its minimum dashed; '' when there is nothing."""
    if not history:
        return ""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from engine.report.gate import DEFAULT_MINIMUMS, FULL_TIER_MINIMUMS

    minimums = {**DEFAULT_MINIMUMS, **FULL_TIER_MINIMUMS}
    fig, axes = plt.subplots(len(history), 1, figsize=(9, 2.1 * len(history)), squeeze=False)
    for ax, (name, points) in zip(axes[:, 0], history.items(), strict=True):
        ax.plot(range(len(points)), [v for _, v in points], marker="o", color="#1565c0")
        ax.axhline(minimums[name], color="#c62828", linestyle="--", linewidth=1, label=f"minimum {minimums[name]:g}")
        ax.set_xticks(range(len(points)), [run for run, _ in points], fontsize=6, rotation=20)
        ax.set_title(name, fontsize=9, loc="left")
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def speed(old: Path, new: Path, threshold: float) -> tuple[str, str, int]:
    """The benchmark comparison as text, its bar plot (base64 PNG), and how many benchmarks regressed."""
    import tempfile

    from engine.report.compare import compare_frames, format_comparison
    from engine.report.plot import plot_comparison
    from engine.report.writer import read

    result = compare_frames(read(old), read(new), threshold_pct=threshold)
    text = format_comparison(result, old.name, new.name)
    if not result.rows:
        return text, "", 0
    with tempfile.TemporaryDirectory() as folder:
        png = plot_comparison(result, Path(folder) / "speed.png", base=old.name, new=new.name)
        image = base64.b64encode(png.read_bytes()).decode()
    return text, image, len(result.regressions)


def image(data: str) -> str:
    """A base64 PNG as an inline image ('' data: a line that says there was nothing to plot)."""
    return f'<img alt="plot" src="data:image/png;base64,{data}">' if data else "<p>nothing to plot</p>"


def page(outputs: Comparison, speed_text: str, speed_png: str, ratios_png: str, regressed: int) -> str:
    """The release page: behaviour (the outputs comparison's own page body), speed, the gated ratios over time."""
    body = outputs_page(outputs)
    body = body[body.index("<h1>"):body.index("</body>")].replace("<h1>Outputs compared</h1>",
                                                                      "<h1>What changed in behaviour</h1>")
    verdict = f"{headline(outputs)}; speed: {regressed} benchmark(s) regressed"
    from conformance.kit.matrix import PAGE_STYLE

    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Release: {html.escape(verdict)}</title>
<style>
{PAGE_STYLE}</style></head><body>
<p><b>{html.escape(verdict)}</b></p>
{body}
<h1>What changed in speed</h1>
<pre>{html.escape(speed_text)}</pre>
{image(speed_png)}
<h1>Gated ratios over the recorded runs</h1>
{image(ratios_png)}
</body></html>
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.kit.release", description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", nargs=2, type=Path, required=True, metavar=("OLD", "NEW"),
                        help="the two runs' outputs records (conformance-outputs.parquet or their folders)")
    parser.add_argument("--benchmarks", nargs=2, type=Path, required=True, metavar=("OLD", "NEW"),
                        help="the same two runs' benchmark reports (reports/benchmark-*.parquet)")
    parser.add_argument("--history", nargs="*", type=Path, default=[],
                        help="every benchmark report to plot the gated ratios over (default: the two above)")
    parser.add_argument("--accepted", type=Path, default=ACCEPTED, help=f"accepted changes (default: {ACCEPTED})")
    parser.add_argument("--threshold", type=float, default=5.0, help="speed regression threshold, %% (default 5)")
    parser.add_argument("--out", type=Path, default=Path("reports") / "release.html")
    args = parser.parse_args(argv)
    from engine.report.writer import read

    old_run, old = read_all([args.outputs[0]])
    new_run, new = read_all([args.outputs[1]])
    outputs = compare(old, new, accepted=read_accepted(args.accepted), old_run=old_run, new_run=new_run)
    text, png, regressed = speed(*args.benchmarks, args.threshold)
    frames = [read(p) for p in (args.history or args.benchmarks)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page(outputs, text, png, ratio_plot(ratio_history(frames)), regressed))
    print(f"{headline(outputs)}; speed: {regressed} regressed -> {args.out}")
    return 1 if outputs.failing() or regressed else 0


if __name__ == "__main__":
    raise SystemExit(main())
