"""Close -> sealed of a large file against blake3's own rate (issue 40): with FUSE
passthrough the daemon sees no write, and the seal after the last close is what a save
waits for before its checkpoint is safe in the RAM tier.

    python -m benchmarks.bench_seal --sizes 1G,4G --threads 1,4 --reps 2

For each size and thread count N, on the same bytes (UniqueData, incompressible, no two
chunks alike), in one run:

- ``blake3``: blake3's own hash of a tmpfs file with ``max_threads=N`` (``update_mmap``),
  the baseline the issue names;
- ``blake3-read``: blake3 with ``max_threads=N`` fed the file in 16 MiB ``preadv`` pieces
  (no page faults of a mapping: on tmpfs often faster than ``update_mmap``), a second,
  stricter baseline;
- ``hash_fd``: mtcfs's chunk hashing (``mtcfs.base.chunking.hash_fd``, 4 MiB chunks, N
  threads, each byte read once with preadv, no whole-file hash) over the same file;
- ``hash_fd+whole``: the same, also computing the whole-file blake3 in the same pass (each
  byte hashed twice: the option the seal no longer takes, measured for the record);
- ``sealed``: the file written through a one-node mtcfs (store on /dev/shm, mount option
  ``hash_threads=N``), from the close(2) until ``user.mtcfs.state`` says ``local``
  (polled every 5 ms); ``seal-in-daemon`` is the part of it the daemon's seal took (its
  ``seal_seconds`` histogram: from the start of the seal task to the recorded row).

Prints a table (seconds, median of the repeats, and GB/s) and each one's ratio to the
``blake3`` baseline; the target is sealed / blake3 <= 1.3 (also shown against the stricter
``blake3-read``). Also as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import blake3

from benchmarks.common import (SCRATCH_SHM, UniqueData, log, machine_info, median,
                               mtcfs_mount, mtcfs_state, scratch_dir, wait_until,
                               write_file)
from mtcfs.base.chunking import DEFAULT_CHUNK_SIZE, hash_fd
from mtcfs.options import parse_size

TARGET = 1.3  # issue 40: close -> sealed within 1.3x of blake3's own time, same threads


def _blake3(path: Path, threads: int) -> float:
    t0 = time.perf_counter()
    h = blake3.blake3(max_threads=threads)
    h.update_mmap(str(path))
    h.hexdigest()
    return time.perf_counter() - t0


def _blake3_read(path: Path, size: int, threads: int) -> float:
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        h = blake3.blake3(max_threads=threads)
        for off in range(0, size, len(buf)):
            n = os.preadv(fd, [view], off)
            h.update(view[:n])
        h.hexdigest()
        return time.perf_counter() - t0
    finally:
        view.release()
        os.close(fd)


def _hash_fd(path: Path, size: int, threads: int, whole: bool) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        hash_fd(fd, size, DEFAULT_CHUNK_SIZE, threads=threads, whole=whole)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _sealed(root: Path, size: int, threads: int, seed: int) -> tuple[float, float]:
    """(close -> sealed, the daemon's own seal seconds)."""
    opts = {"size": str(size + (1 << 30)), "hash_threads": str(threads)}
    with mtcfs_mount(root, opts) as m:
        f = m.mnt / "model.bin"
        write_file(f, size, UniqueData(seed))  # ends with fsync and close(2)
        t_closed = time.perf_counter()
        wait_until(lambda: mtcfs_state(f) == "local", 600, "the seal", interval=0.005)
        took = time.perf_counter() - t_closed
        hist = m.status()["histograms"]["seal_seconds"]
        return took, hist["sum"]


def run(size: int, threads: int, reps: int, base: Path) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"blake3": [], "blake3-read": [], "hash_fd": [],
                                     "hash_fd+whole": [], "sealed": [], "seal-in-daemon": []}
    src = base / "src"
    for rep in range(reps):
        write_file(src, size, UniqueData(seed=rep + 1))
        times["blake3"].append(_blake3(src, threads))
        times["blake3-read"].append(_blake3_read(src, size, threads))
        times["hash_fd"].append(_hash_fd(src, size, threads, whole=False))
        times["hash_fd+whole"].append(_hash_fd(src, size, threads, whole=True))
        src.unlink()  # the mount's store needs the room
        sealed, in_daemon = _sealed(base / "m", size, threads, seed=rep + 1)
        times["sealed"].append(sealed)
        times["seal-in-daemon"].append(in_daemon)
        log(f"{size >> 20} MiB, {threads} threads, rep {rep + 1}/{reps}: "
            + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1G,4G", help="comma-separated sizes (1G, 4G, 512M)")
    ap.add_argument("--threads", default="1,4", help="comma-separated thread counts")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the results as JSON too")
    a = ap.parse_args()
    info = machine_info()
    out: list[dict] = []
    with scratch_dir(SCRATCH_SHM, "seal") as base:
        for size in (parse_size(s) for s in a.sizes.split(",")):
            for threads in (int(t) for t in a.threads.split(",")):
                times = run(size, threads, a.reps, base)
                med = {k: median(v) or 0.0 for k, v in times.items()}
                out.append({"size": size, "threads": threads, "reps": a.reps,
                            "seconds": med, "runs": times,
                            "ratio": {k: round(v / med["blake3"], 2) for k, v in med.items()}})
    info["loadavg_after"] = os.getloadavg()
    print(f"\nmachine: {info.get('cpu_model')}, {info['nproc']} CPUs, load average "
          f"{info['loadavg'][0]:.2f} at start, {info['loadavg_after'][0]:.2f} at end")
    print(f"{'size':>6} {'N':>3} | " + " | ".join(f"{k:>24}" for k in out[0]["seconds"])
          + " | sealed/blake3 | sealed/blake3-read")
    for r in out:
        gb = r["size"] / 1e9
        cells = [f"{s:6.2f}s {gb / s:5.2f}GB/s x{r['ratio'][k]:<5}"
                 for k, s in r["seconds"].items()]
        ok = "ok" if r["ratio"]["sealed"] <= TARGET else f"over {TARGET}"
        strict = round(r["seconds"]["sealed"] / r["seconds"]["blake3-read"], 2)
        print(f"{r['size'] >> 20:>5}M {r['threads']:>3} | " + " | ".join(cells)
              + f" | {r['ratio']['sealed']} ({ok}) | {strict}")
    if a.json:
        print(json.dumps({"machine": info, "results": out}, indent=1))


if __name__ == "__main__":
    main()
