"""Benchmark harness: device ceilings, roofline accounting, per-op timings (``python -m dsv4_rocm bench``)."""
