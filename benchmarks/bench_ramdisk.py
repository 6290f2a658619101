"""RAM-disk speed (issue 40, "Measured"): every figure of the issue in one run, each against
its baseline measured in the same run, as a ratio with the issue's target.

``python -m benchmarks.bench_ramdisk [--sizes 1G,4G] [--reps 3] [--only ...]`` as root
(``make bench-ramdisk``). Three targets, their order rotating each repeat, all on /dev/shm:

- ``tmpfs``: a directory on /dev/shm (the baseline: GKE's RAM tier is a tmpfs);
- ``mtcfs``: one node, ``scope=node``, its store on /dev/shm, passthrough on (the default:
  the kernel reads and writes the store's data files itself);
- ``mtcfs-daemon``: the same with ``passthrough=no``: every byte through the daemon (the
  "before" of the issue).

Row groups (``--only``, comma-separated):

- ``seq``: per ``--sizes``, one file written in 16 MiB ``os.write`` + fsync + close, read
  after drop_caches (cold) and again (warm): ``bench_io.measure``. GB/s; target mtcfs >=
  0.9 of tmpfs. The daemon's CPU over each phase (``/proc/PID/stat`` utime + stime) gives
  the CPU rows (seconds per GiB written, sealed, read cold), both mounts.
- ``first``: the first read of a ``--first-size`` file after a daemon restart: write, wait
  until sealed (``user.mtcfs.state`` ``local``), clean unmount, mount the same store
  again, drop_caches, read it whole (first-read verification included). Baseline: the same
  bytes on tmpfs read after drop_caches. Target >= 0.5. Timed from the open (the row the
  target is on) and from the mount's ready (``, from ready``: drop_caches and the read,
  on tmpfs too), since the daemon's verification at start begins at the ready and the
  open races it; the start pass's own seconds are shown.
- ``seal``: close -> sealed of a ``--seal-size`` file (from close() returning until
  ``user.mtcfs.state`` is ``local``, polled every 2 ms), against blake3's own time over
  the same bytes in a tmpfs file: ``blake3.blake3(max_threads=N)`` fed 16 MiB ``preadv``
  pieces, N the mount's ``hash_threads`` (4 where this tree has no such option: said in the
  notes). Target: seal time <= 1.3x blake3's.
- ``reopen``: what a checkpoint library does right after it closes a file (DCP stats and
  renames, a loader opens): a ``--reopen-size`` file (32 MiB) written and closed, then at
  once ``stat(2)`` + ``open(2)`` + ``close(2)`` of it, timed, ``REOPENS`` files per repeat.
  Milliseconds, median and worst of a repeat; shown beside tmpfs, no target (the mounts
  answer each call in a FUSE round trip or two, which tmpfs does not have; what this row
  watches is the seal started by the close delaying those round trips).
- ``torch`` (``torch.save`` of ``--torch-size`` of fp32 tensors), ``st`` (safetensors
  ``save_file`` of ``--st-size``), ``dcp`` (``dcp.save`` of the model and Adam state of
  examples/demo.py, ``--dcp-width``, a few saves per sample as it is small), ``orbax``
  (``orbax.checkpoint.StandardCheckpointer`` save of a dict of jax arrays of
  ``--orbax-size``, until ``wait_until_finished``): seconds on mtcfs / on tmpfs; target
  <= 1.1. On the mounts the files are sealed (untimed) before the next sample.
- ``fio``: the issue's four jobs and the project's verified random-write job
  (``bench_random``'s), each with ``--verify=crc32c --end_fsync=1``: psync random writes
  4k-1m 512M; the same as 4 jobs x 128M; the mmap engine, 4k-1m 256M; randrw 4k-256k 512M
  (read and write); bench_random's 2 x 512M. MiB/s as fio reports it; target >= 0.8.
  ``--fio-scale`` multiplies every size (for a short run).

Before every timed write, about twice its bytes + 1 GiB of RAM is touched
(``common.prefault``; ``--no-prefault`` skips it). Prints one table (baseline, mtcfs, ratio,
mtcfs passthrough=no, ratio, target, PASS/MISS) and writes
``bench-results/ramdisk-<timestamp>.json`` (machine, load, every raw sample, medians,
checks). A row group that fails is reported in the notes and the JSON ``errors``; the
others still run, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import bench_io
from benchmarks.bench_random import FIO_RANDOM_WRITE, fio_job, st_save, state_dict, torch_save
from benchmarks.common import (GiB, IO_SIZE, MiB, SCRATCH_SHM, BenchResult, Check, UniqueData,
                               cpu_seconds, drop_caches, gbps, human, log, median, mtcfs_mount,
                               mtcfs_state, prefault, read_file, scratch_dir, wait_until,
                               write_file)
from tests.support.mount import Mount

TARGETS = ("tmpfs", "mtcfs", "mtcfs-daemon")
MOUNTED = ("mtcfs", "mtcfs-daemon")
GROUPS = ("seq", "first", "seal", "reopen", "torch", "st", "dcp", "orbax", "fio")
SEALED = ("local", "backed-up")
REOPENS = 8  # files per repeat of the reopen group
DCP_SAVES = 5  # dcp.save calls per sample: the demo model is ~13 MiB
ORBAX_LEAF = 32 * MiB


@dataclass
class Target:
    name: str
    dir: Path
    mount: Mount | None = None

    @property
    def pid(self) -> int | None:
        return self.mount.pid if self.mount else None


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": MiB, "G": GiB}
    t = text.strip()
    return int(float(t[:-1]) * units[t[-1].upper()]) if t[-1].upper() in units else int(t)


def hash_threads(given: int | None) -> tuple[int, dict[str, str], str]:
    """(N for the blake3 baseline, mount options to add, a note): the mount's
    ``hash_threads`` where this tree knows the option, else 4."""
    from dataclasses import MISSING

    from mtcfs.options import MountOptions
    field = MountOptions.__dataclass_fields__.get("hash_threads")
    if field is None:
        return (given or 4, {},
                f"hash_threads is not an option of this tree: blake3 baseline with "
                f"{given or 4} threads; the mount seals with its own threading")
    if given is not None:
        return given, {"hash_threads": str(given)}, f"mounts with hash_threads={given}"
    n = field.default if field.default is not MISSING else 4
    return int(n), {}, f"mounts with their default hash_threads ({n})"


def blake3_file(path: Path, threads: int, piece: int = IO_SIZE) -> tuple[float, str]:
    """Seconds for blake3 (``max_threads=threads``) over ``path``, read in ``piece``-byte
    ``preadv`` calls into one buffer; and the digest."""
    import blake3
    mv = memoryview(bytearray(piece))
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        h = blake3.blake3(max_threads=threads)
        off = 0
        while n := os.preadv(fd, [mv], off):
            h.update(mv[:n])
            off += n
        digest = h.hexdigest()
        return time.perf_counter() - t0, digest
    finally:
        os.close(fd)


def settle(t: Target, path: Path, timeout: float = 600) -> None:
    """On a mount, wait (untimed) until ``path`` (a file or a step directory) is no longer
    being written, so its seal does not overlap the next sample."""
    if t.mount is not None:
        wait_until(lambda: mtcfs_state(path) not in ("writing", "incomplete"), timeout,
                   f"{path} to be sealed", interval=0.02)


def remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()


# ---------------------------------------------------------------------- library saves

def demo_dcp_state(width: int) -> dict[str, Any]:
    """Model + Adam state + step of examples/demo.py's PyTorch job after one step."""
    from examples.demo import TorchJob
    job = TorchJob(width)
    st = job.init()
    job.train_step(st, 0)
    return job._sd(st, 1)


def dcp_saves(d: Path, sd: dict[str, Any]) -> float:
    """``DCP_SAVES`` ``dcp.save`` calls into ``d/step_<i>``; seconds per save."""
    import torch.distributed.checkpoint as dcp
    d.mkdir()
    t0 = time.perf_counter()
    for i in range(DCP_SAVES):
        dcp.save(sd, checkpoint_id=str(d / f"step_{i}"))
    return (time.perf_counter() - t0) / DCP_SAVES


def orbax_state(nbytes: int) -> dict[str, Any]:
    """A dict of fp32 jax arrays of 32 MiB each, ``nbytes`` in all (at least one)."""
    import jax.numpy as jnp
    import numpy as np
    rng = np.random.default_rng(40)
    return {f"layer{i}": {"kernel": jnp.asarray(rng.standard_normal(
        (ORBAX_LEAF // 4 // 1024, 1024), dtype=np.float32))}
        for i in range(max(1, nbytes // ORBAX_LEAF))}


def orbax_save(path: Path, state: dict[str, Any]) -> float:
    """Seconds of ``StandardCheckpointer().save(path, state)`` + ``wait_until_finished``."""
    import orbax.checkpoint as ocp
    ck = ocp.StandardCheckpointer()
    try:
        t0 = time.perf_counter()
        ck.save(path, state)
        ck.wait_until_finished()
        return time.perf_counter() - t0
    finally:
        ck.close()


# ---------------------------------------------------------------------- fio

def fio_jobs(scale: float) -> list[tuple[str, str, list[str]]]:
    """(key, label, fio workload options) of the issue's four jobs and bench_random's."""
    def mb(n: int) -> str:
        return f"{max(4, int(n * scale))}M"
    rw = ["--rw=randwrite", "--bsrange=4k-1m"]
    return [
        ("psync", f"fio randwrite 4k-1m psync {mb(512)}",
         rw + [f"--size={mb(512)}", "--ioengine=psync"]),
        ("4jobs", f"fio the same, 4 jobs x {mb(128)}",
         rw + [f"--size={mb(128)}", "--numjobs=4", "--ioengine=psync"]),
        ("mmap", f"fio randwrite 4k-1m mmap {mb(256)}",
         rw + [f"--size={mb(256)}", "--ioengine=mmap"]),
        ("randrw", f"fio randrw 4k-256k psync {mb(512)}",
         ["--rw=randrw", "--bsrange=4k-256k", f"--size={mb(512)}", "--ioengine=psync"]),
        ("project", f"fio bench_random's job, 2 x {mb(512)}",
         FIO_RANDOM_WRITE + [f"--size={mb(512)}", "--numjobs=2"]),
    ]


# ---------------------------------------------------------------------- the run

class Run:
    """The targets, the raw samples (``samples[row][target] -> list``) and the groups."""

    def __init__(self, a: argparse.Namespace, targets: list[Target], threads: int) -> None:
        self.a = a
        self.targets = targets
        self.threads = threads
        self.touch = not a.no_prefault
        self.can_drop = drop_caches()
        self.samples: dict[str, dict[str, list[float | None]]] = {}

    def add(self, row: str, target: str, value: float | None) -> None:
        self.samples.setdefault(row, {}).setdefault(target, []).append(value)

    def med(self, row: str, target: str) -> float | None:
        return median(self.samples.get(row, {}).get(target, []))

    def order(self, rep: int, names: tuple[str, ...] = TARGETS) -> list[Target]:
        ts = [t for t in self.targets if t.name in names]
        k = rep % len(ts)
        return ts[k:] + ts[:k]

    # -- groups

    def seq(self) -> None:
        for size in self.a.sizes:
            gib = size / GiB
            for rep in range(self.a.reps):
                for t in self.order(rep):
                    f = t.dir / "seq.bin"
                    one = bench_io.measure(f, size, 4000 + rep, self.touch, self.can_drop,
                                           t.mount is not None, t.pid)
                    for k, label in (("write", "write"), ("cold", "cold read"),
                                     ("warm", "warm read")):
                        self.add(f"seq {label} {human(size)}", t.name, one[k])
                    if t.mount is not None:
                        for k in ("write", "seal", "cold"):
                            c = one[f"cpu_{k}"]
                            self.add(f"cpu {k} {human(size)}", t.name,
                                     None if c is None else c / gib)
                        self.add(f"seq write, then close->sealed {human(size)}", t.name,
                                 one["seal"])
                    log(f"seq {human(size)} rep {rep + 1} {t.name:12s}: write "
                        f"{one['write']:.2f} cold {one['cold'] or 0:.2f} warm "
                        f"{one['warm']:.2f} GB/s")
                    f.unlink()
                    time.sleep(0.3)

    def first(self) -> None:
        size = self.a.first_size
        row = f"first read {human(size)}"
        for rep in range(self.a.reps):
            for t in self.order(rep):
                f = t.dir / "first.bin"
                if self.touch:
                    prefault(2 * size + GiB)
                write_file(f, size, UniqueData(seed=5000 + rep))
                if t.mount is not None:
                    wait_until(lambda: mtcfs_state(f) in SEALED, 600, f"{f} to be sealed")
                    t.mount.stop()
                    t.mount.start()  # the restart: every chunk in RAM now unverified
                ready = time.perf_counter()  # (the daemon's verification at start begins)
                drop_caches()
                c0 = cpu_seconds(t.pid)
                dt, n = read_file(f)
                cpu = cpu_seconds(t.pid) - c0
                since_ready = time.perf_counter() - ready
                assert n == size, (t.name, n, size)
                self.add(row, t.name, gbps(size, dt))
                # From the mount's ready to the last byte, drop_caches included (on tmpfs:
                # drop_caches and the cold read): a trainer that opens at once, racing
                # the verification at start, instead of one that starts in seconds.
                self.add(f"{row}, from ready", t.name, gbps(size, since_ready))
                if t.mount is not None:
                    self.add(f"cpu first read {human(size)}", t.name, cpu / (size / GiB))
                    st = t.mount.status()
                    fuse = (st.get("fuse") or {})
                    self.add("first read: passthrough read opens", t.name,
                             fuse.get("passthrough_opens_read"))
                    self.add("first read: verification at start, s", t.name,
                             (st.get("scrub") or {}).get("start_seconds"))
                log(f"first read rep {rep + 1} {t.name:12s}: {gbps(size, dt):.2f} GB/s")
                f.unlink()
                time.sleep(0.3)

    def seal(self) -> None:
        size = self.a.seal_size
        row = f"close->sealed {human(size)}"
        for rep in range(self.a.reps):
            for t in self.order(rep):
                f = t.dir / "seal.bin"
                if self.touch:
                    prefault(2 * size + GiB)
                write_file(f, size, UniqueData(seed=6000 + rep))
                if t.mount is None:  # the baseline: blake3 over the same bytes
                    dt, _ = blake3_file(f, self.threads)
                    self.add(row, "blake3", dt)
                else:
                    c0 = cpu_seconds(t.pid)
                    dt = wait_until(lambda: mtcfs_state(f) in SEALED, 600,
                                    f"{f} to be sealed", interval=0.002)
                    self.add(row, t.name, dt)
                    self.add(f"cpu seal {human(size)}", t.name,
                             (cpu_seconds(t.pid) - c0) / (size / GiB))
                log(f"seal {human(size)} rep {rep + 1} {t.name:12s}: {dt:.3f} s")
                f.unlink()
                time.sleep(0.3)

    def reopen(self) -> None:
        size = self.a.reopen_size
        row = f"stat+open right after a close {human(size)}"
        for rep in range(self.a.reps):
            for t in self.order(rep):
                times: list[float] = []
                for i in range(REOPENS):
                    f = t.dir / f"reopen-{i}.bin"
                    write_file(f, size, UniqueData(seed=7000 + rep * REOPENS + i))
                    t0 = time.perf_counter()
                    os.stat(f)
                    os.close(os.open(f, os.O_RDONLY))
                    times.append((time.perf_counter() - t0) * 1e3)
                    if t.mount is not None:
                        settle(t, f)
                    time.sleep(0.1)
                mid, worst = statistics.median(times), max(times)
                self.add(f"{row}, median", t.name, mid)
                self.add(f"{row}, worst of {REOPENS}", t.name, worst)
                log(f"reopen {human(size)} rep {rep + 1} {t.name:12s}: median {mid:.2f} worst "
                    f"{worst:.2f} ms")
                for i in range(REOPENS):
                    (t.dir / f"reopen-{i}.bin").unlink()

    def saves(self, key: str) -> None:
        warnings.filterwarnings("ignore")
        if key == "torch":
            sd = state_dict(self.a.torch_size)
            nbytes = sum(x.numel() * 4 for x in sd.values())
            fn: Callable[[Path], float] = lambda p: torch_save(p, sd)  # noqa: E731
            row = f"torch.save {human(nbytes)}"
        elif key == "st":
            sd = state_dict(self.a.st_size)
            nbytes = sum(x.numel() * 4 for x in sd.values())
            fn = lambda p: st_save(p, sd)  # noqa: E731
            row = f"save_file {human(nbytes)}"
        elif key == "dcp":
            sd = demo_dcp_state(self.a.dcp_width)
            import torch
            nbytes = sum(x.numel() * x.element_size() for x in _tensors(sd, torch))
            fn = lambda p: dcp_saves(p, sd)  # noqa: E731
            row = f"dcp.save demo {human(nbytes)}"
        else:
            st = orbax_state(self.a.orbax_size)
            nbytes = sum(v["kernel"].nbytes for v in st.values())
            fn = lambda p: orbax_save(p, st)  # noqa: E731
            row = f"orbax save {human(nbytes)}"
        for rep in range(self.a.reps):
            for t in self.order(rep):
                p = t.dir / f"{key}-{rep}"
                if self.touch:
                    prefault(2 * nbytes + GiB)
                c0 = cpu_seconds(t.pid)
                dt = fn(p)
                self.add(row, t.name, dt)
                if t.mount is not None:
                    self.add(f"cpu {row.split(' ')[0]}", t.name,
                             (cpu_seconds(t.pid) - c0) / (nbytes / GiB))
                    for q in ([p] if p.is_file() else [p, *p.rglob("*")]):
                        settle(t, q)
                log(f"{row} rep {rep + 1} {t.name:12s}: {dt:.3f} s")
                remove(p)
                time.sleep(0.3)

    def fio(self) -> None:
        for key, label, args in fio_jobs(self.a.fio_scale):
            for rep in range(self.a.reps):
                for t in self.order(rep):
                    if self.touch:
                        prefault(2 * GiB)
                    r = fio_job(t.dir, args, verify=True)
                    if key == "randrw":
                        self.add(f"{label} read", t.name, r["read"])
                        self.add(f"{label} write", t.name, r["write"])
                    else:
                        self.add(label, t.name, r["write"])
                    log(f"{label} rep {rep + 1} {t.name:12s}: write {r['write']:.0f} read "
                        f"{r['read']:.0f} MiB/s")
                    time.sleep(0.3)


def _tensors(obj: Any, torch: Any) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v, torch)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v, torch)]
    return []


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def table(r: Run, res: BenchResult) -> None:
    """Rows and checks from the medians: (row prefix, unit, baseline target, op, target,
    higher is better)."""
    def f(x: float | None, d: int) -> str:
        return "-" if x is None else f"{x:.{d}f}"

    def line(row: str, unit: str, base: str, op: str, thr: float | None, digits: int) -> None:
        b = r.med(row, base)
        pt, dp = r.med(row, "mtcfs"), r.med(row, "mtcfs-daemon")
        rp, rd = _ratio(pt, b), _ratio(dp, b)
        verdict = ""
        if thr is not None:
            c = Check(f"{row}: mtcfs / {base}", rp, thr, op=op,
                      detail=f"passthrough=no: {f(rd, 2)}")
            res.checks.append(c)
            verdict = {True: "PASS", False: "MISS", None: "n/a"}[c.ok]
        res.rows.append([row, unit, f"{base} {f(b, digits)}", f(pt, digits), f(rp, 2),
                         f(dp, digits), f(rd, 2), "info" if thr is None else f"{op} {thr}",
                         verdict])

    for row in r.samples:
        if row.startswith("seq ") and not row.startswith("seq write, then"):
            line(row, "GB/s", "tmpfs", ">=", 0.9, 2)
        elif row.startswith("first read ") and "opens" not in row:
            line(row, "GB/s", "tmpfs", ">=", 0.5, 2)
        elif row.startswith("first read: verification"):
            line(row, "s", "tmpfs", "", None, 3)
        elif row.startswith("close->sealed") and "blake3" in r.samples[row]:
            line(row, "s", "blake3", "<=", 1.3, 3)
        elif row.startswith("stat+open right after"):
            line(row, "ms", "tmpfs", "", None, 2)
        elif row.split(" ")[0] in ("torch.save", "save_file", "dcp.save", "orbax"):
            line(row, "s", "tmpfs", "<=", 1.1, 3)
        elif row.startswith("fio "):
            line(row, "MiB/s", "tmpfs", ">=", 0.8, 0)
    for row in r.samples:  # the daemon's CPU: passthrough against passthrough=no
        if row.startswith(("cpu ", "seq write, then")):
            pt, dp = r.med(row, "mtcfs"), r.med(row, "mtcfs-daemon")
            unit = "CPU s/GiB" if row.startswith("cpu") else "s"
            res.rows.append([f"daemon {row}" if row.startswith("cpu") else row, unit, "-",
                             f(pt, 3), "-", f(dp, 3), f(_ratio(pt, dp), 2) + " (pt/no)",
                             "info", ""])


def run(a: argparse.Namespace) -> tuple[BenchResult, bool]:
    threads, extra, thread_note = hash_threads(a.hash_threads)
    largest = max([*a.sizes, a.first_size, a.seal_size, a.torch_size, a.st_size,
                   a.orbax_size])
    store_size = a.store_size or f"{max(8, 2 * -(-largest // GiB) + 2)}G"
    res = BenchResult("ramdisk", f"RAM-disk speed (issue 40): tmpfs, mtcfs (passthrough), mtcfs "
                      f"passthrough=no; median of {a.reps}",
                      ["row", "unit", "baseline", "mtcfs", "ratio", "pt=no", "ratio", "target",
                       ""])
    failed = False
    errors: dict[str, str] = {}
    with scratch_dir(SCRATCH_SHM, "ramdisk") as root, contextlib.ExitStack() as stack:
        (root / "tmpfs").mkdir()
        opts = {"size": store_size, **extra}
        pt = stack.enter_context(mtcfs_mount(root / "pt", opts))
        dp = stack.enter_context(mtcfs_mount(root / "dp", {**opts, "passthrough": "no"}))
        targets = [Target("tmpfs", root / "tmpfs"), Target("mtcfs", pt.mnt, pt),
                   Target("mtcfs-daemon", dp.mnt, dp)]
        fuse = {t.name: (t.mount.status().get("fuse") or {}) for t in targets if t.mount}
        res.samples["fuse_at_start"] = fuse
        if not fuse["mtcfs"].get("passthrough"):
            res.notes.append("WARNING: passthrough is OFF on the mtcfs mount: "
                             f"{fuse['mtcfs'].get('passthrough_off') or '?'}; its figures are "
                             "the daemon path's")
        r = Run(a, targets, threads)
        if not r.can_drop:
            res.notes.append("cannot drop the page cache (not root): cold reads are warm")
        log(f"store size={store_size}, daemon pids mtcfs {pt.pid}, mtcfs-daemon {dp.pid}; "
            f"load {os.getloadavg()}")
        for g in a.only:
            log(f">>> {g}")
            t0 = time.perf_counter()
            try:
                if g in ("torch", "st", "dcp", "orbax"):
                    r.saves(g)
                else:
                    getattr(r, g)()
            except Exception as exc:  # report it; the other groups still run
                failed = True
                traceback.print_exc()
                errors[g] = f"{type(exc).__name__}: {exc}"
                res.notes.append(f"{g} FAILED: {errors[g]}")
                for t in targets:  # a group may have left files or a stopped mount
                    if t.mount is not None and not t.mount.pid:
                        t.mount.start()
                    for p in t.dir.iterdir():
                        with contextlib.suppress(OSError):
                            remove(p)
            res.samples.setdefault("group_seconds", {})[g] = round(time.perf_counter() - t0, 1)
        res.samples["fuse_at_end"] = {t.name: (t.mount.status().get("fuse") or {})
                                      for t in targets if t.mount}
        res.samples["counters_at_end"] = {t.name: t.mount.status().get("counters")
                                          for t in targets if t.mount}
    table(r, res)
    for name, fz in res.samples["fuse_at_end"].items():
        res.notes.append(
            f"{name}: passthrough {'on' if fz.get('passthrough') else 'off'}"
            + (f" ({fz.get('passthrough_off')})" if fz.get("passthrough_off") else "")
            + f", opens passed through read {fz.get('passthrough_opens_read')} write "
            f"{fz.get('passthrough_opens_write')}, daemon path {fz.get('daemon_path_opens')}")
    res.notes.append(thread_note)
    res.notes.append(f"store size={store_size} on /dev/shm; sizes {', '.join(map(human, a.sizes))}"
                     f"; prefault {'on' if r.touch else 'off'}; fio scale {a.fio_scale}")
    res.notes.append("ratio: mtcfs / baseline (times: lower is better); the daemon rows' last "
                     "ratio is passthrough / passthrough=no")
    res.samples.update({"raw": r.samples, "errors": errors, "hash_threads": threads,
                        "median": {row: {t: median(v) for t, v in d.items()}
                                   for row, d in r.samples.items()},
                        "args": {k: v for k, v in vars(a).items()}})
    return res, failed


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run import report
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_ramdisk", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1G,4G", help="sequential file sizes (1G,4G)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--only", default=",".join(GROUPS),
                   help=f"comma-separated row groups: {','.join(GROUPS)}")
    p.add_argument("--no-4g", action="store_true",
                   help="leave out sizes of 4 GiB and more (the seal file becomes 1 GiB)")
    p.add_argument("--first-size", type=parse_size, default=GiB)
    p.add_argument("--seal-size", type=parse_size, help="default: the largest of --sizes")
    p.add_argument("--reopen-size", type=parse_size, default=32 * MiB)
    p.add_argument("--torch-size", type=parse_size, default=500 * MiB)
    p.add_argument("--st-size", type=parse_size, default=332 * MiB)
    p.add_argument("--orbax-size", type=parse_size, default=256 * MiB)
    p.add_argument("--dcp-width", type=int, default=1024,
                   help="hidden width of examples/demo.py's model (its default, 1024)")
    p.add_argument("--fio-scale", type=float, default=1.0,
                   help="multiply every fio size (0.25 for a short run)")
    p.add_argument("--hash-threads", type=int,
                   help="mount option hash_threads and the blake3 baseline's threads "
                        "(default: the mount's default; 4 where the option is unknown)")
    p.add_argument("--store-size", help="size= of both mounts (default: from the sizes)")
    p.add_argument("--no-prefault", action="store_true")
    p.add_argument("--json", help="output file (default bench-results/ramdisk-<time>.json)")
    a = p.parse_args(argv)
    a.sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    if a.no_4g:
        a.sizes = [s for s in a.sizes if s < 4 * GiB] or [GiB]
    if a.seal_size is None:
        a.seal_size = min(max(a.sizes), GiB) if a.no_4g else max(a.sizes)
    a.only = [g for g in a.only.split(",") if g]
    bad = [g for g in a.only if g not in GROUPS]
    if bad:
        p.error(f"unknown row groups {bad}; choose from {','.join(GROUPS)}")
    if os.geteuid() != 0:
        print("note: not root: cold reads (drop_caches) are not cold", file=sys.stderr)
    load0 = os.getloadavg()
    print(f"load average {load0}", flush=True)
    t0 = time.monotonic()
    res, failed = run(a)
    res.seconds = time.monotonic() - t0
    res.notes.append(f"load average at start {tuple(round(x, 2) for x in load0)}, at end "
                     f"{tuple(round(x, 2) for x in os.getloadavg())}")
    report(res, "ramdisk", a.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
