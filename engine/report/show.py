"""One report as text: the run's metadata, then a line per benchmark variant with its medians and ratios."""

from __future__ import annotations

import math
from typing import Any

from engine.report.compare import spread_pct
from engine.report.schema import FIGURE_COLUMNS, RATIO_COLUMNS, RUN_COLUMNS


def _cell(name: str, value: float) -> str:
    """A ratio with three decimals; a figure with three significant digits (logprob deltas are tiny in fp32)."""
    if math.isnan(value):
        return ""
    return f"{value:.3f}" if name in RATIO_COLUMNS else f"{value:.3g}"


def format_report(frame: Any) -> str:
    lines = []
    for col in RUN_COLUMNS:
        values = sorted({str(v) for v in frame[col.name]})
        lines.append(f"{col.name:>21}: {', '.join(values)}")
    per_case = (*RATIO_COLUMNS, *FIGURE_COLUMNS)
    head = ("benchmark", "variant", "rounds", "median s", "spread", "tokens/s", *per_case)
    body = []
    for (bench, variant), g in frame.groupby(["benchmark", "variant"], sort=True):
        ratios = [g[name].iloc[0] for name in per_case] if g["role"].iloc[0] == "subject" else []
        body.append((bench, variant, str(len(g)), f"{g['wall_s'].median():.4f}", f"{spread_pct(g['wall_s']):.1f}%",
                     f"{g['tokens_per_s'].median():.1f}",
                     *(_cell(name, v) for name, v in zip(per_case, ratios or [math.nan] * len(per_case),
                                                         strict=True))))
    widths = [max(len(str(x[i])) for x in (head, *body)) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines += ["", fmt.format(*head), fmt.format(*("-" * w for w in widths)), *(fmt.format(*b) for b in body)]
    lines.append("\nratios: reference median wall time / subject median wall time, same requests, within this run "
                 "(> 1: the subject is faster); added_ms_per_step: what the subject adds per decode step of the batch; "
                 "rollout_vs_trainer: the rollout's logprobs against the trainer's rescoring (dlogprob_*, "
                 "importance_ratio_*)")
    return "\n".join(lines)
