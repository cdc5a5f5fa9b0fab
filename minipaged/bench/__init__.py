"""Benchmarks: ``python -m minipaged.bench NAME``. Ratios against a same-run baseline, never timed tests."""
