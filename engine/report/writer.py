"""Collect benchmark rounds and write them as one Parquet report (schema in :mod:`engine.report.schema`)."""

from __future__ import annotations

import math
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.report.schema import COLUMNS, FIGURE_COLUMNS, RATIO_COLUMNS, check, upgrade


class ReportWriter:
    """Rows of one run; ``write`` puts them in ``<dir>/benchmark-<run_id>.parquet`` and ``benchmark-latest``.

    >>> w = ReportWriter({"run_id": "r1"})
    >>> w.add_case({"benchmark": "b"}, [{"round": 0, "wall_s": 2.0, "output_tokens": 10}], {"engine_over_raw": 1.0})
    >>> w.rows[0]["tokens_per_s"], w.rows[0]["guard_on_over_off"]
    (5.0, nan)
    """

    def __init__(self, run: Mapping[str, Any]) -> None:
        self.run = dict(run)
        self.rows: list[dict[str, Any]] = []

    def add_case(self, case: Mapping[str, Any], rounds: Sequence[Mapping[str, Any]],
                 ratios: Mapping[str, float]) -> None:
        """``ratios``: the case's ratio columns and per-case figures (``FIGURE_COLUMNS``); the others are NaN."""
        known = {*RATIO_COLUMNS, *FIGURE_COLUMNS}
        unknown = set(ratios) - known
        if unknown:
            raise ValueError(f"unknown ratio or figure columns {sorted(unknown)}; known: {sorted(known)}")
        for r in rounds:
            row = {"requests": case.get("batch"), "p50_latency_ms": math.nan, "p99_latency_ms": math.nan,
                   "p50_ttft_ms": math.nan,
                   "confirm_rounds": 0, **self.run, **case, **r}
            row["tokens_per_s"] = r["output_tokens"] / r["wall_s"]
            row["requests_per_s"] = row["requests"] / r["wall_s"] if row["requests"] is not None else math.nan
            row["us_per_token"] = r["wall_s"] / r["output_tokens"] * 1e6 if r["output_tokens"] else math.nan
            for name in known:
                row[name] = float(ratios.get(name, math.nan))
            self.rows.append(row)

    def frame(self) -> Any:
        import pandas as pd

        frame = pd.DataFrame(self.rows)
        missing = [c.name for c in COLUMNS if c.name not in frame.columns]
        if missing:
            raise ValueError(f"rows lack the schema columns {missing}; fix: give them in the run metadata or the "
                             "case passed to add_case")
        frame = frame[[c.name for c in COLUMNS]].astype({c.name: c.dtype for c in COLUMNS})
        check(frame, source="report being written")
        return frame

    def write(self, out_dir: Path) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"benchmark-{self.run['run_id']}.parquet"
        tmp = path.with_suffix(".tmp")
        self.frame().to_parquet(tmp, index=False)
        tmp.replace(path)
        shutil.copyfile(path, out_dir / "benchmark-latest.parquet")
        return path


def read(path: Path | str) -> Any:
    """Load a report (of this schema version, or an older one upgraded: ``schema.upgrade``) and check its schema."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"report {str(path)!r} does not exist; fix: run `nox -s benchmark` (writes "
                                "reports/benchmark-<run>.parquet) or pass an existing file")
    frame = upgrade(pd.read_parquet(path), source=str(path))
    check(frame, source=str(path))
    return frame

