"""Benchmarks: each runs as ``python -m benchmarks.<name>`` and writes JSON to
benchmarks/results/."""
