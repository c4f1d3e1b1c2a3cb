"""Throughput and overhead benchmarks (``pytest benchmarks --benchmark``); see README "Benchmarks"."""
