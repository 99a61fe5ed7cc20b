"""Benchmarks: side-by-side comparisons in one process, never timed assertions."""
