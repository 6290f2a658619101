# Benchmarks of the one-node mount (see benchmarks/README.md). Needs root and /dev/fuse.
PYTHON ?= .venv/bin/python

.PHONY: bench bench-quick

# Full set: 2 GiB I/O, 1 GiB DCP and backup, 1 and 8 GiB RSS (about 6-7 minutes).
bench:
	$(PYTHON) -m benchmarks.run

# Small sizes, no 8 GiB run (under 2 minutes).
bench-quick:
	$(PYTHON) -m benchmarks.run --quick
