"""Throughput and overhead benchmarks (``pytest benchmarks --benchmark``); see docs/benchmarks.md."""
