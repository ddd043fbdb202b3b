"""Benchmarks of DistributedMuon against the field's baselines (python -m benchmarks; docs/benchmarks.md).

Never part of `make test`; tests/test_benchmarks_smoke.py runs the same code at a tiny size."""
