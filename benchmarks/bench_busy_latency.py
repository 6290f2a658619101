"""FUSE request latency on a host whose CPUs are all busy, while a large file is sealed:
what a budget setting costs the requests the daemon serves (issue 45, docs/benchmarks.md
"Background work against a training loop").

    python -m benchmarks.bench_busy_latency [SIZE_MIB] [SPINNERS] ["opts;opts;..."] [REPS]
    make bench-busy-latency ARGS="1024 2 'daemon_nice=0;daemon_nice=10' 2"

Per setting (``;``-separated mount option strings) and repeat: one mount on /dev/shm,
SPINNERS processes spinning (``while True: pass``; default 2, one per core here), a file of
SIZE_MIB (default 1024) written, then until it is sealed (``user.mtcfs.state`` no longer
``writing``, at most 120 s): a stat plus an open and close of a small file on the mount,
every 5 ms, each timed. Prints median, p99 and max in ms and the seal's seconds per run,
and the JSON of all runs at the end. Cleans up its mounts, the store's data tmpfs and the
spinners.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, UniqueData, write_file

MTCFS = [sys.executable, "-m", "mtcfs"]


def one(opts: str, size: int, spinners: int, seed: int) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="mtcfs-bench-busy-", dir="/dev/shm"))
    mnt = root / "mnt"
    mnt.mkdir()
    spin: list[subprocess.Popen[bytes]] = []
    subprocess.run(MTCFS + ["bench", str(mnt), "-o", f"store={root}/store,size={size * 3}"
                            + (f",{opts}" if opts else "")], check=True, cwd=REPO)
    try:
        (mnt / "small").write_bytes(b"x")
        spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(spinners)]
        time.sleep(0.5)
        write_file(mnt / "big", size, UniqueData(seed))
        t0 = time.monotonic()
        lat: list[float] = []
        state = b"writing"
        while state in (b"writing", b"incomplete") and time.monotonic() - t0 < 120:
            a = time.perf_counter()
            os.stat(mnt / "small")
            os.close(os.open(mnt / "small", os.O_RDONLY))
            lat.append((time.perf_counter() - a) * 1e3)
            state = os.getxattr(mnt / "big", "user.mtcfs.state")
            time.sleep(0.005)
        lat.sort()
        return {"options": opts, "n": len(lat), "median_ms": round(statistics.median(lat), 2),
                "p99_ms": round(lat[int(len(lat) * 0.99)], 2), "max_ms": round(lat[-1], 2),
                "seal_s": round(time.monotonic() - t0, 2), "state": state.decode()}
    finally:
        for p in spin:
            p.kill()
            p.wait()
        subprocess.run(MTCFS + ["umount", str(mnt)], cwd=REPO)
        subprocess.run(["umount", str(root / "store" / "data")], stderr=subprocess.DEVNULL)
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str]) -> int:
    size = (int(argv[0]) if argv else 1024) << 20
    spinners = int(argv[1]) if len(argv) > 1 else 2
    settings = argv[2].split(";") if len(argv) > 2 else ["bg_sched=normal", "", "daemon_nice=10"]
    reps = int(argv[3]) if len(argv) > 3 else 2
    runs = []
    for rep in range(reps):
        for opts in settings:
            r = one(opts, size, spinners, rep)
            print(f"{opts or '(default)'} rep {rep}: {r}", flush=True)
            runs.append(r)
    print(json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
