"""Benchmarks: ``python -m raylm.bench NAME --output FILE.json``.

Each benchmark measures raylm and a baseline in the same run, on the same inputs, and writes
JSON with both raw figures and ``ratio`` (raylm / baseline, higher is better).
"""
