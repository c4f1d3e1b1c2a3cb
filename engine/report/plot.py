"""The comparison as a PNG: one bar per benchmark, its % change of median wall time, the threshold marked."""

from __future__ import annotations

from pathlib import Path

from engine.report.compare import Comparison

RED, GREEN, GREY = "#c0392b", "#27ae60", "#7f8c8d"


def plot_comparison(c: Comparison, path: Path, *, base: str, new: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import blended_transform_factory

    rows = list(reversed(c.rows))  # first benchmark on top
    fig, ax = plt.subplots(figsize=(11, max(3.0, 0.3 * len(rows) + 1.9)))
    y = list(range(len(rows)))
    changes = [r.change_pct for r in rows]
    # half the rounds' range, averaged over both runs: how far one round strays from the median
    noise = [(r.base_spread_pct + r.new_spread_pct) / 4 for r in rows]
    colors = [RED if r.regressed else (GREEN if r.change_pct < -c.threshold_pct else GREY) for r in rows]
    ax.barh(y, changes, xerr=noise, color=colors, ecolor="#2c3e50", capsize=2, height=0.65)
    ax.set_yticks(y, [r.label for r in rows], fontsize=8)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.axvline(c.threshold_pct, color=RED, linestyle="--", linewidth=1,
               label=f"regression threshold +{c.threshold_pct:g}%")
    right = blended_transform_factory(ax.transAxes, ax.transData)
    for yi, r, color in zip(y, rows, colors, strict=True):
        verdict = "REGRESSED" if r.regressed else ""
        ax.text(1.01, yi, f"{r.change_pct:+.1f}% {verdict}", transform=right, va="center", fontsize=8,
                color=color if r.regressed else "black")
    low = min([0.0, *changes]) - max(noise, default=0) - 1
    high = max([c.threshold_pct, *changes]) + max(noise, default=0) + 1
    ax.set_xlim(low, high)
    ax.set_xlabel("change of the median wall time, new vs base (%)   error bar: half the rounds' range")
    device = rows[0].device if rows else ""
    ax.set_title(f"new: {new}\nbase: {base}    device: {device}    "
                 f"{len(c.regressions)} of {len(c.rows)} regressed", fontsize=9, loc="left")
    ax.legend(loc="best", fontsize=8, framealpha=0.9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
