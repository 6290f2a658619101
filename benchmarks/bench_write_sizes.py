"""Sequential writes of a new file in ``write(2)``s of one size, unbuffered
(``make bench-write-sizes``): what direct writes cost small writers and give large ones.

``python -m benchmarks.bench_write_sizes [--reps 3] [--base DIR] [--json OUT]``

For each size (4 KiB to 8 MiB) a new thread opens a new file ``O_CREAT|O_TRUNC``, writes
it with ``os.write`` calls of that size (32 MiB in all for 4 KiB, 256 MiB for the
others), closes and removes it, then does the same with a second file: MiB/s from the
open to the close, of the thread's **first** file and of its **next**, median of
``--reps``. Direct writes are chosen per thread from what it wrote before
(mtcfs/direct_writes.py): the first file of a thread is written direct whatever its
pieces, the next one through the page cache when those were small. On tmpfs, the no-op
FUSE ceiling (``noop_fs.py``: writeback cache, data discarded), mtcfs (direct writes on,
the default), mtcfs with ``direct_writes=no`` (through the page cache) and, with
``--base DIR``, ``mtcfs-base``: the code of another tree (a ``git worktree``) with its
default options. Why: docs/usage.md, "Direct writes"; figures in docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from benchmarks.common import (MiB, BenchResult, first_and_next, median, scratch_dir,
                               write_targets)

KiB = 1024
SIZES = ((4 * KiB, 32 * MiB), (64 * KiB, 256 * MiB), (128 * KiB, 256 * MiB),
         (256 * KiB, 256 * MiB), (512 * KiB, 256 * MiB), (MiB, 256 * MiB), (8 * MiB, 256 * MiB))


def one(path: Path, bs: int, total: int) -> float:
    """Seconds to write ``total`` bytes to new file ``path`` in ``bs``-byte write(2)s."""
    buf = os.urandom(bs)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(total // bs):
            os.write(fd, buf)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt


def run(reps: int, base: Path | None = None) -> BenchResult:
    res = BenchResult("write-sizes", f"New file, unbuffered write(2)s of one size, MiB/s, "
                      f"median of {reps}; a thread's first file, then its next",
                      ["target", "file"] + [f"{bs // KiB} KiB" for bs, _ in SIZES])
    with scratch_dir("/dev/shm", "wsizes") as root, contextlib.ExitStack() as stack:
        dirs, m = write_targets(stack, root, base, res.notes)
        for name, d in dirs.items():
            firsts, nexts = [name, "first"], [name, "next"]
            for bs, total in SIZES:
                pairs = [first_and_next(lambda _: one(d / "f", bs, total))
                         for _ in range(reps)]
                firsts.append(f"{total / MiB / median([p[0] for p in pairs]):.0f}")
                nexts.append(f"{total / MiB / median([p[1] for p in pairs]):.0f}")
            for row in (firsts, nexts):
                res.rows.append(row)
                print("  ".join(row), flush=True)
        res.notes.append(f"mtcfs: {m.status()['fuse']}")
    res.notes.append(f"load average {os.getloadavg()}")
    return res


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run import reps_base_main
    return reps_base_main(argv, "benchmarks.bench_write_sizes", __doc__, "write-sizes", run)


if __name__ == "__main__":
    sys.exit(main())
