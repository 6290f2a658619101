"""How long the FUSE loop stops while a large file's data is freed (``make bench-free``).

``python -m benchmarks.bench_free --tree before=DIR --tree after=. [--size 2048] [--reps 3]``

Per tree (one mount each, its daemon running the code in ``DIR`` through ``PYTHONPATH``):
a file of ``--size`` MiB is written and sealed; a thread then reads 1 byte of another file
of the mount in a loop (its cached page dropped first, so each read reaches the daemon)
while the large file is unlinked.
Reported: the unlink's wall time and the longest a probe waited during it (ms).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import threading
import time
from pathlib import Path

from benchmarks.common import (SCRATCH_SHM, UniqueData, mtcfs_mount, mtcfs_state, scratch_dir,
                               wait_until, write_file)

MiB = 1 << 20


def probe_loop(path: Path, stop: threading.Event, worst: list[float]) -> None:
    """Read 1 byte of ``path`` (its cached pages dropped first) until ``stop``; record the
    longest open+read in ``worst[0]`` (seconds)."""
    while not stop.is_set():
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.pread(fd, 1, 0)
        finally:
            os.close(fd)
        worst[0] = max(worst[0], time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, metavar="LABEL=DIR")
    ap.add_argument("--size", type=int, default=2048, help="MiB")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    trees = {}
    for spec in args.tree:
        label, _, d = spec.partition("=")
        trees[label] = str(Path(d).resolve())
    os.chdir("/")
    rows = {t: {"unlink": [], "worst": []} for t in trees}
    with scratch_dir(SCRATCH_SHM, "free") as root, contextlib.ExitStack() as stack:
        mounts = {t: stack.enter_context(mtcfs_mount(root / f"m{i}", {"size": "6G"},
                                                     env={"PYTHONPATH": d}))
                  for i, (t, d) in enumerate(trees.items())}
        for m in mounts.values():
            (m.mnt / "small").write_bytes(b"x" * 4096)
        for rep in range(args.reps):
            for t, m in mounts.items():
                big = m.mnt / "big"
                write_file(big, args.size * MiB, UniqueData(seed=rep))
                wait_until(lambda: mtcfs_state(big) in ("local", "backed-up"), 300, "sealed")
                time.sleep(0.5)
                stop, worst = threading.Event(), [0.0]
                th = threading.Thread(target=probe_loop, args=(m.mnt / "small", stop, worst))
                th.start()
                time.sleep(0.2)
                worst[0] = 0.0
                t0 = time.perf_counter()
                os.unlink(big)
                dt = time.perf_counter() - t0
                time.sleep(0.3)
                stop.set()
                th.join()
                rows[t]["unlink"].append(dt * 1000)
                rows[t]["worst"].append(worst[0] * 1000)
                print(f"rep {rep + 1} {t}: unlink {dt * 1000:.1f} ms, longest probe "
                      f"{worst[0] * 1000:.1f} ms", flush=True)
    print(f"\nunlink of a sealed {args.size} MiB file, median of {args.reps}")
    for t, r in rows.items():
        print(f"{t:<10} unlink {statistics.median(r['unlink']):8.1f} ms   longest probe "
              f"{statistics.median(r['worst']):8.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
