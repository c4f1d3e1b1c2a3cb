"""Benchmark reports: schema, writer, and the ``show`` / ``compare`` / ``gate`` commands.

``python -m engine.report show reports/benchmark-latest.parquet``
    run metadata and a line per benchmark variant (median wall time, spread, tokens/s, ratios).
``python -m engine.report compare BASE NEW [--threshold 5] [--plot out.png]``
    like-with-like table and PNG; exit 1 when a median wall time grew beyond the threshold, 2 when the
    reports are unreadable or share nothing comparable. Absolute times: for dedicated runners.
``python -m engine.report gate REPORT [--min engine_over_raw=0.9 ...]``
    ratios measured within one run against minimums; exit 1 below one. This is what CI gates on.

Needs pandas and pyarrow (and matplotlib for the plot): ``pip install 'xbackend-engine[report]'``.
Nothing here is imported by ``import engine``.
"""
