"""1. Large sequential write, cold read and warm read: mtcfs vs tmpfs vs a no-op FUSE fs.

One file of ``size`` bytes written in 16 MiB ``os.write`` calls, then fsync and close
(timed together); then, after dropping the page cache, read front to back in 16 MiB
``readinto`` calls (cold); then read again (warm: the page cache). The three paths run in
turn, the order rotating each repeat, and the medians are compared:

- mtcfs write and cold read >= 85% of the no-op FUSE fs (the transport ceiling);
- mtcfs warm read >= 80% of tmpfs.

For mtcfs the cold read starts only once the file is sealed (hashed after close, in the
background); that close->sealed time is reported too. Before every timed write, 2x the
file size + 1 GiB of free RAM is touched (see ``common.prefault``) unless disabled.
On tmpfs "cold" is the same as warm: its pages are the storage and cannot be dropped.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from benchmarks.common import (GiB, SCRATCH_SHM, BenchResult, Check, UniqueData, cpu_seconds,
                               drop_caches, fmt, fmt_noise, gbps, human, log, median,
                               mtcfs_mount, mtcfs_state, noop_mount, prefault, read_ahead_kb,
                               read_file, scratch_dir, wait_until, write_file)

PATHS = ("mtcfs", "tmpfs", "noop-fuse")


def measure(f: Path, size: int, seed: int, touch: bool, can_drop: bool, sealed: bool,
            pid: int | None = None) -> dict[str, float | None]:
    """One pass over file ``f``: (prefault,) write ``size`` bytes of ``UniqueData(seed)`` in
    16 MiB writes + fsync + close, wait until sealed when ``sealed`` (an mtcfs file), read it
    cold (after drop_caches, when ``can_drop``) and warm. Returns ``write``, ``cold``,
    ``warm`` (GB/s), ``seal`` (close -> sealed, s; None unless ``sealed``) and, for the
    daemon ``pid``, its CPU seconds over each phase: ``cpu_write``, ``cpu_seal``,
    ``cpu_cold``, ``cpu_warm`` (None without ``pid``). The file is left in place."""
    out: dict[str, float | None] = {"seal": None, "cold": None, "cpu_seal": None,
                                    "cpu_cold": None}
    if touch:
        prefault(2 * size + GiB)
    c0 = cpu_seconds(pid)
    out["write"] = gbps(size, write_file(f, size, UniqueData(seed=seed)))
    c1 = cpu_seconds(pid)
    out["cpu_write"] = c1 - c0
    if sealed:
        out["seal"] = wait_until(lambda: mtcfs_state(f) in ("local", "backed-up"), 600,
                                 f"{f} to be sealed", interval=0.005)
        out["cpu_seal"] = cpu_seconds(pid) - c1
    if can_drop:
        drop_caches()
        c0 = cpu_seconds(pid)
        t_c, n = read_file(f)
        out["cpu_cold"] = cpu_seconds(pid) - c0
        assert n == size, (f, n, size)
        out["cold"] = gbps(size, t_c)
    c0 = cpu_seconds(pid)
    t_r, n = read_file(f)
    out["cpu_warm"] = cpu_seconds(pid) - c0
    assert n == size, (f, n, size)
    out["warm"] = gbps(size, t_r)
    if pid is None:
        for k in ("cpu_write", "cpu_seal", "cpu_cold", "cpu_warm"):
            out[k] = None
    return out


def run(size: int, reps: int = 3, touch: bool = True) -> BenchResult:
    res = BenchResult("io", f"1. Large sequential I/O: {human(size)} file, 16 MiB os.write/"
                      f"readinto, median of {reps}",
                      ["path", "write GB/s", "cold read GB/s", "warm read GB/s",
                       "close->sealed s"])
    samples: dict[str, dict[str, list]] = {p: {"write": [], "cold": [], "warm": [], "seal": []}
                                           for p in PATHS}
    can_drop = drop_caches()
    if not can_drop:
        res.notes.append("cannot write /proc/sys/vm/drop_caches (not root): cold reads skipped")
    with scratch_dir(SCRATCH_SHM, "io") as root:
        tmpfs_dir = root / "tmpfs"
        tmpfs_dir.mkdir()
        with mtcfs_mount(root / "mtcfs", {"size": "12G"}) as m, \
                noop_mount(root / "noop") as noop_mnt:
            ra = {"mtcfs": read_ahead_kb(m.mnt), "noop-fuse": read_ahead_kb(noop_mnt)}
            res.samples["read_ahead_kb"] = ra
            res.notes.append(f"read-ahead: mtcfs {ra['mtcfs']} KiB, no-op {ra['noop-fuse']} KiB")
            files = {"mtcfs": m.mnt / "bench-io.bin", "tmpfs": tmpfs_dir / "bench-io.bin",
                     "noop-fuse": noop_mnt / "data"}
            for rep in range(reps):
                order = PATHS[rep % len(PATHS):] + PATHS[:rep % len(PATHS)]
                for p in order:
                    f = files[p]
                    s = samples[p]
                    one = measure(f, size, 1000 * rep + 1, touch, can_drop, p == "mtcfs")
                    for k in ("write", "cold", "warm") + (("seal",) if p == "mtcfs" else ()):
                        s[k].append(one[k])
                    log(f"io rep {rep + 1}/{reps} {p:9s}: write {fmt(one['write'])} "
                        f"cold {fmt(one['cold'])} warm {fmt(one['warm'])} GB/s")
                    if p != "noop-fuse":
                        os.unlink(f)
                    else:
                        os.truncate(f, 0)  # drops the cached pages
                    time.sleep(0.5)
            res.samples["mtcfs_counters"] = m.status().get("counters")
    for p in PATHS:
        s = samples[p]
        res.rows.append([p, fmt_noise(s["write"]), fmt_noise(s["cold"]), fmt_noise(s["warm"]),
                         fmt_noise(s["seal"]) if s["seal"] else "-"])
    med = {p: {k: median(v) for k, v in samples[p].items()} for p in PATHS}

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    res.checks = [
        Check("mtcfs write / no-op FUSE write", ratio(med["mtcfs"]["write"],
                                                      med["noop-fuse"]["write"]), 0.85),
        Check("mtcfs cold read / no-op FUSE cold read", ratio(med["mtcfs"]["cold"],
                                                              med["noop-fuse"]["cold"]), 0.85),
        Check("mtcfs warm read / tmpfs warm read", ratio(med["mtcfs"]["warm"],
                                                         med["tmpfs"]["warm"]), 0.80),
    ]
    if touch:
        res.notes.append(f"{human(2 * size + GiB)} of RAM pre-touched before every write "
                         "(all paths alike; --no-prefault to skip)")
    res.samples.update({"size": size, "reps": reps, "prefault": touch, "gbps": samples,
                        "median": med})
    return res
