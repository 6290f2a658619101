"""Beyond the FUSE ceiling: sequential I/O through FUSE passthrough (issue 18, docs/passthrough.md).

One file of each ``--sizes`` written in 1 MiB ``os.write`` calls, fsync and close (timed
together: "write"); then the time until the file is sealed (blake3 in 4 MiB chunks) is
added ("write+seal"); then, after dropping the page cache, read front to back in 1 MiB
``readinto`` calls ("cold") and again ("warm"). Targets, the order rotating each repeat:

- ``tmpfs``: a directory on /dev/shm; its seal is the same hashing (``hash_fd``, 4 MiB
  chunks) run here after close: what a daemon that hashes at release pays on top.
- ``passthrough``: :mod:`benchmarks.passthrough_fs`, a Python server on /dev/fuse whose
  OPEN/CREATE answer ``FOPEN_PASSTHROUGH``; it seals at RELEASE in a thread and records
  the time; close -> sealed is read from its ``seals.jsonl`` (same monotonic clock).
- ``devfuse``: the same server with ``--no-passthrough`` (READ/WRITE served by its
  single-threaded Python loop with pread/pwrite, no writeback cache).
- ``noop``: :mod:`benchmarks.noop_fs`, the pyfuse3 ceiling (writeback cache, keep_cache,
  4 MiB read-ahead; writes discarded, no seal).
- ``mtcfs``: today's one-node mount (store on /dev/shm); close -> sealed from
  ``user.mtcfs.state``.

Before every timed write, 2x the size + 1 GiB of RAM is touched (``common.prefault``).
The first repeat of the passthrough target checks the seal's hash against the bytes read
back through the mount. Needs root.

``python -m benchmarks.bench_passthrough [--sizes 256M,1G] [--reps 3] [--only ...]``
writes ``bench-results/passthrough-<timestamp>.json`` and prints a table in MiB/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import (GiB, MiB, REPO, SCRATCH_SHM, UniqueData, drop_caches, log,
                               machine_info, median, mtcfs_mount, mtcfs_state, noop_mount,
                               prefault, read_file, scratch_dir, served_mount, spread,
                               wait_until, write_file, write_json)
from mtcfs.base.chunking import hash_fd

TARGETS = ("tmpfs", "passthrough", "devfuse", "noop", "mtcfs")
IO = MiB
CHUNK = 4 * MiB


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": MiB, "G": GiB}
    return int(float(s[:-1]) * units[s[-1].upper()]) if s[-1].upper() in units else int(s)


@contextlib.contextmanager
def ptfs_mount(root: Path, passthrough: bool) -> Iterator[tuple[Path, Path, Path]]:
    """Mount :mod:`benchmarks.passthrough_fs`; yields (mountpoint, store, state dir)."""
    mnt, store, state = root / "mnt", root / "store", root / "state"
    for d in (mnt, store, state):
        d.mkdir(parents=True)
    cmd = [sys.executable, "-m", "benchmarks.passthrough_fs", str(store), str(mnt), str(state),
           "--max-seconds", "1500"] + ([] if passthrough else ["--no-passthrough"])
    with served_mount(cmd, mnt, "passthrough_fs", ["umount", str(mnt)]):
        yield mnt, store, state


def wait_seal(state: Path, name: str, n_before: int, timeout: float = 120) -> dict[str, Any]:
    """The seal record for ``name`` after the first ``n_before`` lines of seals.jsonl."""
    path = state / "seals.jsonl"
    found: dict[str, Any] = {}

    def done() -> bool:
        try:
            lines = path.read_text().splitlines()[n_before:]
        except FileNotFoundError:
            return False
        for ln in lines:
            rec = json.loads(ln)
            if rec.get("name") == name:
                found.update(rec)
                return True
        return False

    wait_until(done, timeout, f"seal of {name}", interval=0.002)
    if "error" in found:
        raise RuntimeError(f"seal failed: {found['error']}")
    return found


def count_lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except FileNotFoundError:
        return 0


def mibps(n: int, s: float | None) -> float | None:
    return None if not s else n / s / MiB


def run(sizes: list[int], reps: int, only: list[str], touch: bool) -> dict[str, Any]:
    can_drop = drop_caches()
    samples: dict[str, dict[str, dict[str, list[Any]]]] = {}
    notes: list[str] = []
    if not can_drop:
        notes.append("not root: cold reads skipped")
    with scratch_dir(SCRATCH_SHM, "pt") as root, contextlib.ExitStack() as stack:
        tdir = root / "tmpfs"
        tdir.mkdir()
        files: dict[str, Path] = {}
        states: dict[str, Path] = {}
        if "tmpfs" in only:
            files["tmpfs"] = tdir / "bench.bin"
        for t, pt in (("passthrough", True), ("devfuse", False)):
            if t in only:
                mnt, _store, state = stack.enter_context(ptfs_mount(root / t, pt))
                files[t], states[t] = mnt / "bench.bin", state
        if "noop" in only:
            files["noop"] = stack.enter_context(noop_mount(root / "noop")) / "data"
        mtcfs_m = None
        if "mtcfs" in only:
            mtcfs_m = stack.enter_context(mtcfs_mount(root / "mtcfs", {"size": "6G"}))
            files["mtcfs"] = mtcfs_m.mnt / "bench.bin"
        targets = [t for t in TARGETS if t in only]
        for size in sizes:
            key = f"{size // MiB}MiB"
            ss = samples[key] = {t: {"write": [], "sealed": [], "hash_s": [], "cold": [],
                                     "warm": []} for t in targets}
            for rep in range(reps):
                order = targets[rep % len(targets):] + targets[:rep % len(targets)]
                for t in order:
                    f, s = files[t], ss[t]
                    if touch:
                        prefault(2 * size + GiB)
                    n_before = count_lines(states[t] / "seals.jsonl") if t in states else 0
                    t_w = write_file(f, size, UniqueData(seed=1000 * rep + 7), io_size=IO)
                    t_closed = time.monotonic()
                    sealed: float | None = None
                    hash_s: float | None = None
                    seal_hash = None
                    if t == "tmpfs":
                        fd = os.open(f, os.O_RDONLY)
                        try:
                            seal_hash = hash_fd(fd, size, CHUNK, whole=True).file_hash
                        finally:
                            os.close(fd)
                        sealed = hash_s = time.monotonic() - t_closed
                    elif t in states:
                        rec = wait_seal(states[t], f.name, n_before)
                        sealed = max(0.0, rec["sealed"] - t_closed)
                        hash_s = rec["hash_s"]
                        seal_hash = rec["blake3"]
                        if rec["size"] != size:
                            raise RuntimeError(f"{t}: sealed {rec['size']} bytes, not {size}")
                    elif t == "mtcfs":
                        def is_sealed(path: Path = f) -> bool:
                            return mtcfs_state(path) in ("local", "backed-up")
                        sealed = wait_until(is_sealed, 300, f"{f} to be sealed")
                    s["write"].append(mibps(size, t_w))
                    s["sealed"].append(sealed)
                    s["hash_s"].append(hash_s)
                    cold = None
                    if can_drop:
                        drop_caches()
                        t_c, n = read_file(f, io_size=IO)
                        assert n == size, (t, n, size)
                        cold = mibps(size, t_c)
                    s["cold"].append(cold)
                    t_r, n = read_file(f, io_size=IO)
                    assert n == size, (t, n, size)
                    s["warm"].append(mibps(size, t_r))
                    if rep == 0 and seal_hash is not None and t in states:
                        fd = os.open(f, os.O_RDONLY)  # the bytes through the mount
                        try:
                            if hash_fd(fd, size, CHUNK, whole=True).file_hash != seal_hash:
                                raise RuntimeError(f"{t}: seal hash != bytes read back")
                        finally:
                            os.close(fd)
                    log(f"{key} rep {rep + 1}/{reps} {t:11s}: write {s['write'][-1]:.0f} "
                        f"sealed +{sealed if sealed is not None else 0:.2f}s cold "
                        f"{cold or 0:.0f} warm {s['warm'][-1]:.0f} MiB/s")
                    if t == "noop":
                        os.truncate(f, 0)
                    else:
                        os.unlink(f)
                    time.sleep(0.3)
        mtcfs_counters = mtcfs_m.status().get("counters") if mtcfs_m is not None else None
        stack.close()  # unmount all: the servers write their request counts on exit
        counts: dict[str, Any] = {"mtcfs": mtcfs_counters}
        for t, state in states.items():
            p = state / "counts.json"
            counts[t] = json.loads(p.read_text()) if p.exists() else None
    return {"samples": samples, "notes": notes, "daemon_requests": counts}


def table(result: dict[str, Any], sizes: list[int], reps: int) -> str:
    lines = []
    for size in sizes:
        key = f"{size // MiB}MiB"
        lines.append(f"\n{key}, 1 MiB writes/reads, median of {reps} (±half-spread):")
        lines.append("| target | write MiB/s | close->sealed s | write+seal MiB/s | "
                     "cold read MiB/s | warm read MiB/s |")
        lines.append("| --- | ---: | ---: | ---: | ---: | ---: |")
        for t, s in result["samples"][key].items():
            def cell(xs: list[Any], d: int = 0) -> str:
                m = median(xs)
                if m is None:
                    return "-"
                sp = spread(xs)
                return f"{m:.{d}f}" + ("" if sp is None else f" ±{sp * 50:.0f}%")
            ws = [None if w is None or c is None else size / MiB / (size / MiB / w + c)
                  for w, c in zip(s["write"], s["sealed"])]
            lines.append(f"| {t} | {cell(s['write'])} | {cell(s['sealed'], 2)} | "
                         f"{cell(ws) if any(c is not None for c in s['sealed']) else '-'} | "
                         f"{cell(s['cold'])} | {cell(s['warm'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_passthrough")
    p.add_argument("--sizes", default="256M,1G")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--only", default=",".join(TARGETS))
    p.add_argument("--no-prefault", action="store_true")
    p.add_argument("--out", type=Path, default=REPO / "bench-results")
    a = p.parse_args(argv)
    sizes = [parse_size(x) for x in a.sizes.split(",")]
    only = a.only.split(",")
    info = machine_info()
    log(f"kernel {info['kernel']}, load average {info['loadavg']}")
    t0 = time.time()
    res = run(sizes, a.reps, only, not a.no_prefault)
    res["machine"] = info
    res["seconds"] = round(time.time() - t0, 1)
    res["args"] = vars(a) | {"out": str(a.out)}
    out = a.out / f"passthrough-{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json(out, res)
    print(f"kernel {info['kernel']}, load average at start {info['loadavg']}, "
          f"{res['seconds']} s" + table(res, sizes, a.reps))
    for n in res["notes"]:
        print("note:", n)
    print(f"daemon requests: {json.dumps(res['daemon_requests'])}\nwritten {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
