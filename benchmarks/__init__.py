"""Benchmarks of one mtcfs mount against its baselines; run with ``make bench``."""
