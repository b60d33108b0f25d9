"""The benchmark harness's parts, one job each (see benchmarks/harness.py)."""
