"""Compare two benchmark reports like with like: median wall time per benchmark, spread, % change, verdict.

Rows are paired on :data:`~engine.report.schema.LIKE_FOR_LIKE` (same benchmark and variant on the same
device, model, dtype and shapes); anything without a partner is listed, never compared. A benchmark
regressed when its median wall time grew by more than ``threshold_pct``.

>>> import pandas as pd
>>> base = pd.DataFrame({"benchmark": ["b"] * 3, "variant": ["engine"] * 3, "wall_s": [1.0, 1.1, 0.9]})
>>> new = base.assign(wall_s=base.wall_s * 1.2)
>>> c = compare_frames(base, new, threshold_pct=5.0, key=("benchmark", "variant"))
>>> [(r.label, round(r.change_pct, 1), r.regressed) for r in c.rows]
[('b engine', 20.0, True)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.report.schema import LIKE_FOR_LIKE


@dataclass(frozen=True)
class Compared:
    """One benchmark variant in both reports."""

    label: str
    device: str
    base_median_s: float
    base_spread_pct: float
    new_median_s: float
    new_spread_pct: float
    change_pct: float  # of the median wall time; positive = slower
    regressed: bool


@dataclass
class Comparison:
    rows: list[Compared]
    threshold_pct: float
    only_base: list[str] = field(default_factory=list)
    only_new: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[Compared]:
        return [r for r in self.rows if r.regressed]


def spread_pct(values: Any) -> float:
    """(max - min) / median, in percent: how far apart the rounds of one side were."""
    med = float(values.median())
    return float((values.max() - values.min()) / med * 100.0) if med > 0 else 0.0


def _label(key: tuple[Any, ...], names: Sequence[str]) -> str:
    parts = dict(zip(names, key, strict=True))
    return f"{parts['benchmark']} {parts['variant']}"


def compare_frames(base: Any, new: Any, *, threshold_pct: float = 5.0,
                   key: Sequence[str] = LIKE_FOR_LIKE) -> Comparison:
    """Pair the rows of two reports on ``key`` and judge each pair against ``threshold_pct``."""
    if threshold_pct < 0:
        raise ValueError(f"threshold_pct must be >= 0, got {threshold_pct}; fix: pass e.g. 5 for 5 %")
    key = list(key)
    groups_base = {k if isinstance(k, tuple) else (k,): g["wall_s"] for k, g in base.groupby(key, sort=True)}
    groups_new = {k if isinstance(k, tuple) else (k,): g["wall_s"] for k, g in new.groupby(key, sort=True)}
    rows = []
    for k in sorted(groups_base.keys() & groups_new.keys(), key=repr):
        b, n = groups_base[k], groups_new[k]
        b_med, n_med = float(b.median()), float(n.median())
        change = (n_med - b_med) / b_med * 100.0
        device = str(dict(zip(key, k, strict=True)).get("device", ""))
        rows.append(Compared(_label(k, key), device, b_med, spread_pct(b), n_med, spread_pct(n), change,
                             change > threshold_pct))
    return Comparison(rows, threshold_pct,
                      only_base=sorted(_label(k, key) for k in groups_base.keys() - groups_new.keys()),
                      only_new=sorted(_label(k, key) for k in groups_new.keys() - groups_base.keys()))


def format_comparison(c: Comparison, base_name: str, new_name: str) -> str:
    """A plain-text table, one line per compared benchmark, then what could not be compared."""
    head = ("benchmark", "base median s", "spread", "new median s", "spread", "change", "verdict")
    body = [(r.label, f"{r.base_median_s:.4f}", f"{r.base_spread_pct:.1f}%", f"{r.new_median_s:.4f}",
             f"{r.new_spread_pct:.1f}%", f"{r.change_pct:+.1f}%",
             "REGRESSED" if r.regressed else ("faster" if r.change_pct < -c.threshold_pct else "ok"))
            for r in c.rows]
    widths = [max(len(str(x[i])) for x in (head, *body)) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [f"base: {base_name}", f"new:  {new_name}",
             f"threshold: median wall time +{c.threshold_pct:g}% (spread = (max-min)/median of the rounds)", "",
             fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in body]
    for title, names in (("only in base (not compared)", c.only_base), ("only in new (not compared)", c.only_new)):
        if names:
            lines += ["", f"{title}: {len(names)}", *(f"  {n}" for n in names)]
    lines += ["", f"{len(c.rows)} compared, {len(c.regressions)} regressed beyond {c.threshold_pct:g}%"]
    return "\n".join(lines)
