"""Sequential writes of a new file in ``write(2)``s of one size, unbuffered
(``make bench-write-sizes``): what direct writes cost small writers and give large ones.

``python -m benchmarks.bench_write_sizes [--reps 3] [--json OUT]``

For each size (4 KiB, 64 KiB, 1 MiB, 8 MiB) a new file is opened ``O_CREAT|O_TRUNC``,
written with ``os.write`` calls of that size (32 MiB in all for 4 KiB, 256 MiB for the
others), closed and removed; MiB/s from the open to the close, median of ``--reps``. On
tmpfs, the no-op FUSE ceiling (``noop_fs.py``: writeback cache, data discarded), mtcfs
with direct writes (the default: every such write(2) is a round trip to the daemon) and
mtcfs with ``direct_writes=no`` (through the page cache). Why: docs/usage.md, "Direct
writes"; figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

from benchmarks.common import (MiB, BenchResult, median, mtcfs_mount, scratch_dir,
                               served_mount)

SIZES = ((4096, 32 * MiB), (64 * 1024, 256 * MiB), (MiB, 256 * MiB), (8 * MiB, 256 * MiB))


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


def run(reps: int) -> BenchResult:
    res = BenchResult("write-sizes", f"New file, unbuffered write(2)s of one size, MiB/s, "
                      f"median of {reps}", ["target"] + [f"{bs // 1024} KiB" for bs, _ in SIZES])
    with scratch_dir("/dev/shm", "wsizes") as root, contextlib.ExitStack() as stack:
        dirs: dict[str, Path] = {"tmpfs": root / "tmpfs"}
        dirs["tmpfs"].mkdir()
        mnt = root / "noop"
        mnt.mkdir()
        stack.enter_context(served_mount([sys.executable, "-m", "benchmarks.noop_fs", str(mnt)],
                                         mnt, "noop_fs", ["fusermount3", "-u", str(mnt)]))
        dirs["noop"] = mnt
        m = stack.enter_context(mtcfs_mount(root / "direct", {"size": "4G"}))
        dirs["mtcfs"] = m.mnt
        res.notes.append(f"mtcfs direct writes: {m.status()['fuse'].get('direct_writes')}")
        mc = stack.enter_context(mtcfs_mount(root / "cached",
                                             {"size": "4G", "direct_writes": "no"}))
        dirs["mtcfs-cached"] = mc.mnt
        for name, d in dirs.items():
            row = [name]
            for bs, total in SIZES:
                row.append(f"{total / MiB / median([one(d / 'f', bs, total) for _ in range(reps)]):.0f}")
            res.rows.append(row)
            print("  ".join(row), flush=True)
    res.notes.append(f"load average {os.getloadavg()}")
    return res


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run import report
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_write_sizes",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="output file (default bench-results/write-sizes-<time>.json)")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    res = run(a.reps)
    res.seconds = time.monotonic() - t0
    report(res, "write-sizes", a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
