"""6. Metadata operations per second: tmpfs, one mtcfs mount, a 4-node ``scope=job`` namespace
ordered by etcd (issue 13; the home-made log it replaced was measured in the same run as
etcd before it was removed: docs/benchmarks.md, 6c).

``python -m benchmarks.bench_namespace [--ops 500] [--listings 20] [--reps 3]
[--only TARGETS] [--json OUT]`` (or ``make bench-namespace``). Each
repeat runs five phases, one after the other, in a fresh step directory (``step_<n>``) and
times each as operations per second:

``create``   create + write 4 KiB + close of ``--ops`` files (``f000000``, ...; every file's
             bytes differ, so nothing deduplicates)
``stat``     ``os.stat`` of each file
``readdir``  ``os.listdir`` of the directory, ``--listings`` times (listings per second)
``rename``   each file to a new name in the same directory
``unlink``   each renamed file

on these targets (the order rotates each repeat):

``tmpfs``       a directory under /dev/shm
``noop``        benchmarks/noop_fs.py: the FUSE ceiling (answers each op with no work)
``noop-x``      the same with ``--xattrs``: its GETXATTR answers ENODATA as mtcfs's does,
                so it also gets the GETXATTR the kernel sends before every write(2)
                (it does not ask for FUSE_HANDLE_KILLPRIV_V2; mtcfs does)
``node``        one mtcfs daemon (scope=node)
``node-base``   the same running the code of another tree (``--base DIR``, a ``git
                worktree`` of the commit to compare): a before/after pair in one run
``etcd-rank0``, ``etcd-member``, ``etcd-4x``, ``etcd-8w``
                4 daemons with ``scope=job,replicas=1,coord=etcd://...``:
                the namespace is ordered by a 1-member etcd this benchmark starts on
                loopback (data on /dev/shm, one etcd for the whole run). There is no leader:
                ``etcd-rank0`` is rank 0's mount, ``etcd-member`` rank 3's. Each repeat is a
                fresh 4-node cluster under its own job name, hence its own key prefix
                (``/mtcfs/<job>/``) in the same etcd. A change is a create-if-absent txn in
                etcd that returns once the node's watch has delivered (and applied) it; a
                lookup waits for one linearizable read barrier.

``etcd-4x``: 4 processes at once, one per node, each in its own step directory with
``--ops / 4`` files (aggregate ops/s over the time from the first start to the last end);
``etcd-8w``: 8 processes, 2 per node. ``--only`` picks targets by name.

Besides ops/s, the JSON and the second table give, per op, the CPU seconds each daemon
spent (``utime + stime`` from ``/proc``), for the etcd targets etcd's own CPU too, and how
many namespace-log ops it took: the ``seq`` of rank 0's namespace status, which is the etcd revision of the last op it applied,
so "log ops" there counts etcd revisions (every write to the job's keys, ops and anything
else). The JSON also has the log position each phase started at. Medians of ``--reps``
repeats. Everything goes to ``bench-results/namespace-<timestamp>.json`` unless ``--json``
names another file.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import multiprocessing
import os
import shutil
import struct
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    SCRATCH_SHM,
    BenchResult,
    KiB,
    cpu_seconds,
    fmt,
    fmt_noise,
    git_state,
    log,
    loopback_etcd,
    machine_info,
    median,
    mtcfs_mount,
    noop_mount,
    scratch_dir,
    wait_until,
    write_json,
)

JOB = "bench"
NODES = 4
JOB_OPTIONS = {"scope": "job", "replicas": 1}
FILE_SIZE = 4 * KiB
ETCD_TARGETS = ("etcd-rank0", "etcd-member", "etcd-4x", "etcd-8w")
TARGETS = ("tmpfs", "noop", "noop-x", "node", "node-base") + ETCD_TARGETS
ENGINES = {"etcd": ETCD_TARGETS}
WRITERS_PER_NODE_8W = 2
BARRIER_TIMEOUT_S = 600.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_BLOCK = os.urandom(FILE_SIZE)


# ---------------------------------------------------------------------- the phases

@dataclass(frozen=True)
class Work:
    """What one process does in one repeat: ``n`` files in ``dir``, ``listings`` listings."""

    dir: Path
    n: int
    listings: int
    seed: int  # makes the files' bytes unique to this repeat and process


def _old(w: Work, i: int) -> Path:
    return w.dir / f"f{i:06d}"


def _new(w: Work, i: int) -> Path:
    return w.dir / f"g{i:06d}"


def create(w: Work) -> int:
    """Create, write 4 KiB into and close each file (no fsync)."""
    for i in range(w.n):
        fd = os.open(_old(w, i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, struct.pack("<QQ", w.seed, i) + _BLOCK[16:])
        finally:
            os.close(fd)
    return w.n


def stat(w: Work) -> int:
    for i in range(w.n):
        os.stat(_old(w, i))
    return w.n


def readdir(w: Work) -> int:
    """List the directory ``listings`` times; each listing must show every file."""
    for _ in range(w.listings):
        names = os.listdir(w.dir)
        if len(names) != w.n:
            raise RuntimeError(f"{w.dir}: listed {len(names)} names, expected {w.n}")
    return w.listings


def rename(w: Work) -> int:
    for i in range(w.n):
        os.rename(_old(w, i), _new(w, i))
    return w.n


def unlink(w: Work) -> int:
    for i in range(w.n):
        os.unlink(_new(w, i))
    return w.n


def _sub(w: Work, i: int) -> Path:
    return w.dir / f"d{i:06d}"


def mkdir(w: Work) -> int:
    for i in range(w.n):
        os.mkdir(_sub(w, i))
    return w.n


def rmdir(w: Work) -> int:
    for i in range(w.n):
        os.rmdir(_sub(w, i))
    return w.n


PHASES: dict[str, Callable[[Work], int]] = {
    "create": create, "stat": stat, "readdir": readdir, "rename": rename, "unlink": unlink,
    "mkdir": mkdir, "rmdir": rmdir}

#: phase -> (start, end, ops) on the time.monotonic clock (one clock for every process).
Spans = dict[str, tuple[float, float, int]]


def run_phases(w: Work, sync: Callable[[], None]) -> Spans:
    """Make ``w.dir``, run every phase (``sync()`` before each one and after the last),
    remove ``w.dir``. Returns the span of each phase."""
    w.dir.mkdir()
    spans: Spans = {}
    for name, phase in PHASES.items():
        sync()
        t0 = time.monotonic()
        ops = phase(w)
        spans[name] = (t0, time.monotonic(), ops)
    sync()
    w.dir.rmdir()
    return spans


# ---------------------------------------------------------------------- observing the daemons

@dataclass
class Meter:
    """Marks taken between phases: the CPU seconds of each daemon (and of etcd, when there
    is one) and the job's log seq."""

    pids: list[int]
    seq: Callable[[], int] | None = None
    etcd_pid: int | None = None
    marks: list[tuple[list[float], int | None, float | None]] = field(default_factory=list)

    def mark(self) -> None:
        self.marks.append(([cpu_seconds(p) for p in self.pids],
                           self.seq() if self.seq else None,
                           cpu_seconds(self.etcd_pid) if self.etcd_pid else None))

    def phase(self, i: int) -> tuple[list[float], int | None, float | None]:
        """CPU seconds per daemon, log ops and etcd's CPU seconds between mark ``i`` and
        mark ``i + 1``."""
        (c0, s0, e0), (c1, s1, e1) = self.marks[i], self.marks[i + 1]
        cpu = [b - a for a, b in zip(c0, c1)]
        return (cpu, (s1 - s0 if s0 is not None and s1 is not None else None),
                (e1 - e0 if e0 is not None and e1 is not None else None))


# ---------------------------------------------------------------------- targets

@dataclass
class Target:
    """Where one measurement runs: one directory per process, the daemons to watch."""

    key: str
    label: str
    bases: list[Path]          # one per process; each repeat makes a step dir in each
    pids: list[int]            # daemons whose CPU is counted, in rank order
    seq: Callable[[], int] | None = None
    etcd_pid: int | None = None  # etcd's process, counted apart from the daemons


def ns_status(mount: Any) -> dict[str, Any]:
    return mount.status().get("namespace") or {}


def etcd_targets(cluster: Any, etcd_pid: int) -> list[Target]:
    """The same four ways on a namespace ordered by etcd (no leader: rank 0 and rank 3).
    "log ops" is rank 0's ``seq``: the etcd revision of the last op it applied."""
    mounts = [cluster.node(r) for r in range(cluster.nodes)]
    pids = [m.pid for m in mounts]
    member = cluster.nodes - 1
    wait_until(lambda: ns_status(mounts[0]).get("engine") == "etcd", 60,
               "the job namespace to be on etcd", interval=0.2)

    def seq() -> int:
        return int(ns_status(mounts[0])["seq"])

    w8 = WRITERS_PER_NODE_8W
    return [Target("etcd-rank0", "etcd, rank 0", [mounts[0].mnt], pids, seq, etcd_pid),
            Target("etcd-member", f"etcd, rank {member}", [mounts[member].mnt], pids, seq,
                   etcd_pid),
            Target("etcd-4x", f"etcd, {cluster.nodes} ranks at once",
                   [m.mnt for m in mounts], pids, seq, etcd_pid),
            Target("etcd-8w", f"etcd, {w8 * cluster.nodes} writers ({w8} per rank)",
                   [m.mnt for m in mounts for _ in range(w8)], pids, seq, etcd_pid)]


@contextlib.contextmanager
def local_targets(root: Path, keys: list[str], base: Path | None = None
                  ) -> Iterator[list[Target]]:
    """tmpfs and the one-node mounts, as ``keys`` ask, below ``root``; unmounted on exit.
    ``node-base`` runs the code of the tree at ``base``."""
    with contextlib.ExitStack() as stack:
        out: list[Target] = []
        if "tmpfs" in keys:
            d = root / "tmpfs"
            d.mkdir()
            out.append(Target("tmpfs", "tmpfs", [d], []))
        if "noop" in keys:
            log("mounting the no-op FUSE filesystem (benchmarks/noop_fs.py)")
            mnt = stack.enter_context(noop_mount(root / "noop"))
            out.append(Target("noop", "no-op FUSE", [mnt], []))
        if "noop-x" in keys:
            log("mounting the no-op FUSE filesystem with xattrs (noop_fs.py --xattrs)")
            mnt = stack.enter_context(noop_mount(root / "noop-x", xattrs=True))
            out.append(Target("noop-x", "no-op, xattrs", [mnt], []))
        if "node" in keys:
            log("mounting one mtcfs daemon (scope=node)")
            m = stack.enter_context(mtcfs_mount(root / "node", {}, job=JOB))
            out.append(Target("node", "mtcfs, one node", [m.mnt], [m.pid]))
        if "node-base" in keys and base is not None:
            log(f"mounting one mtcfs daemon (scope=node) running the code in {base}")
            m = stack.enter_context(mtcfs_mount(root / "node-base", {}, job=JOB, tree=base))
            out.append(Target("node-base", f"mtcfs, {git_state(base)['head'] or base.name}",
                              [m.mnt], [m.pid]))
        yield out


@contextlib.contextmanager
def job_cluster(root: Path, keys: list[str], etcd: Any = None) -> Iterator[list[Target]]:
    """A fresh scope=job cluster at ``root`` and its targets among ``keys`` (none if no
    target of its engine is asked for); unmounted and removed on exit. With ``etcd`` (a
    started ``tests.support.etcd.EtcdCluster``) the namespace is ordered by it
    (``coord=``), under a job name of its own, so a key prefix no earlier repeat used.

    Fresh each repeat, so every repeat starts from an empty namespace.
    """
    if etcd is None or not any(k in ETCD_TARGETS for k in keys):
        yield []
        return
    from tests.support.cluster import Cluster

    job = f"{JOB}-{uuid.uuid4().hex[:8]}"
    options = {**JOB_OPTIONS, "coord": etcd.url, "coord_prefix": f"/mtcfs-bench/{job}"}
    log(f"mounting {NODES} daemons with scope=job on etcd (/mtcfs-bench/{job}/)")
    c = Cluster(root, NODES, job=job, options=options)
    try:
        c.start()
        targets = etcd_targets(c, etcd.procs[0].pid)
        yield [t for t in targets if t.key in keys]
    finally:
        c.cleanup()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def etcd_server(root: Path, keys: list[str]) -> Iterator[Any]:
    """One etcd member on loopback, data under ``root`` (on /dev/shm), if an etcd target is
    asked for (else None); stopped and removed on exit."""
    if not any(k in ETCD_TARGETS for k in keys):
        yield None
        return
    log("starting a 1-member etcd on loopback")
    with loopback_etcd(root) as e:
        yield e


# ---------------------------------------------------------------------- one measurement

def _worker(w: Work, barrier: Any, results: Any, slot: int) -> None:
    """A process of ``job-4x``: every phase starts when all processes (and the parent,
    which marks the meter in between) are ready."""
    def sync() -> None:
        barrier.wait(BARRIER_TIMEOUT_S)  # everyone has finished the last phase
        barrier.wait(BARRIER_TIMEOUT_S)  # the parent has taken its mark: go

    try:
        results.put((slot, run_phases(w, sync), None))
    except BaseException as exc:  # noqa: BLE001 (reported to the parent)
        barrier.abort()
        results.put((slot, None, f"{type(exc).__name__}: {exc}"))


def run_parallel(works: list[Work], meter: Meter) -> list[Spans]:
    """``works`` in one process each, phase by phase in step; the parent marks ``meter``
    while every process waits between phases."""
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(len(works) + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(w, barrier, results, i), daemon=True)
             for i, w in enumerate(works)]
    for p in procs:
        p.start()
    failure: Exception | None = None
    try:
        for _ in range(len(PHASES) + 1):
            barrier.wait(BARRIER_TIMEOUT_S)
            meter.mark()
            barrier.wait(BARRIER_TIMEOUT_S)
    except threading.BrokenBarrierError:
        pass  # a worker failed: its message says why
    except Exception as exc:  # noqa: BLE001 (the mark failed: release the workers)
        barrier.abort()
        failure = exc
    got = sorted(results.get(timeout=BARRIER_TIMEOUT_S) for _ in procs)
    for p in procs:
        p.join(30)
    if failure is not None:
        raise failure
    errors = [err for _, _, err in got if err]
    if errors:
        raise RuntimeError("; ".join(errors))
    return [spans for _, spans, _ in got]


def summarize(all_spans: list[Spans], meter: Meter) -> dict[str, dict[str, Any]]:
    """Per phase: ops, seconds (first start to last end), ops/s, CPU per daemon, log ops,
    and the log position (``seq``) it started at."""
    out = {}
    for i, name in enumerate(PHASES):
        ops = sum(s[name][2] for s in all_spans)
        secs = max(s[name][1] for s in all_spans) - min(s[name][0] for s in all_spans)
        cpu, log_ops, etcd_cpu = meter.phase(i)
        out[name] = {"ops": ops, "seconds": secs, "ops_per_s": ops / secs if secs else None,
                     "daemon_cpu_s": cpu, "etcd_cpu_s": etcd_cpu, "log_ops": log_ops,
                     "log_seq_start": meter.marks[i][1]}
    return out


def measure(t: Target, step: int, n: int, listings: int) -> dict[str, dict[str, Any]]:
    """One repeat on ``t``: ``n`` files split over its processes, each in its own step dir
    ``step_<step + i>``."""
    per = max(1, n // len(t.bases))
    works = [Work(b / f"step_{step + i}", per, listings, seed=step + i)
             for i, b in enumerate(t.bases)]
    meter = Meter(t.pids, t.seq, t.etcd_pid)
    if len(works) == 1:
        spans = [run_phases(works[0], meter.mark)]
    else:
        spans = run_parallel(works, meter)
    return summarize(spans, meter)


@dataclass
class Runs:
    """The measurements of every target, by key, and what failed."""

    keys: list[str]
    labels: dict[str, str] = field(default_factory=dict)
    runs: dict[str, list[dict]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def record(self, t: Target, fn: Callable[[], dict]) -> None:
        """Run one measurement of ``t``; a target that fails is reported and not run
        again."""
        if t.key in self.errors:
            return
        self.labels[t.key] = t.label
        try:
            self.runs.setdefault(t.key, []).append(fn())
        except Exception as exc:  # noqa: BLE001 (report; the other targets go on)
            traceback.print_exc()
            self.errors[t.key] = f"{type(exc).__name__}: {str(exc)[:2000]}"

    def shown(self) -> list[tuple[str, str]]:
        """(key, label) of the targets that have results, in TARGETS order."""
        return [(k, self.labels[k]) for k in self.keys if self.runs.get(k)]


def _rotate(xs: list[Target], k: int) -> list[Target]:
    k = k % len(xs) if xs else 0
    return xs[k:] + xs[:k]


def run_all(root: Path, keys: list[str], n: int, listings: int, reps: int,
            base: Path | None = None) -> Runs:
    """Every target ``reps`` times; the job clusters (one on our log, then one on etcd) are
    new each repeat, one at a time; etcd is one server for the whole run. The order of the
    local targets, and of each cluster's targets (which share its log), rotates each
    repeat."""
    out = Runs(keys)
    with local_targets(root, keys, base) as local, etcd_server(root / "etcd", keys) as etcd:
        for rep in range(reps):
            j = 0
            for t in _rotate(local, rep):
                out.record(t, functools.partial(measure, t, 1000 * (rep + 1) + 10 * j, n,
                                                listings))
                j += 1
            for name, server in (("etcdjob", etcd),):
                with job_cluster(root / f"{name}{rep}", keys, server) as jobs:
                    for t in _rotate(jobs, rep):
                        step = 1000 * (rep + 1) + 10 * j
                        out.record(t, functools.partial(measure, t, step, n, listings))
                        j += 1
            log(f"rep {rep + 1}/{reps}: " + ", ".join(
                f"{key} create {fmt(v[-1]['create']['ops_per_s'], 0)}/s"
                for key, v in out.runs.items() if v))
    return out


# ---------------------------------------------------------------------- tables

def _phase_values(runs: list[dict], phase: str, fn: Callable[[dict], float | None]) -> list:
    return [fn(r[phase]) for r in runs]


def throughput_table(r: Runs, n: int, listings: int, reps: int) -> BenchResult:
    ratios = [(x, k) for x in ("node", "node-base") for k in ("noop", "noop-x")
              if r.runs.get(k) and r.runs.get(x)]
    ceilings = [k for x, k in ratios if x == "node"]
    res = BenchResult("ops", f"6a. Metadata ops/s: {n} files of 4 KiB, {listings} listings, "
                      f"median of {reps} (higher is better)",
                      ["phase"] + [label for _, label in r.shown()]
                      + [f"{'node' if x == 'node' else 'base'} / "
                         f"{'no-op' if k == 'noop' else 'no-op-x'}" for x, k in ratios])
    for phase in PHASES:
        row = [phase] + [
            fmt_noise(_phase_values(r.runs[key], phase, lambda p: p["ops_per_s"]), 0)
            for key, _ in r.shown()]
        for x, k in ratios:
            node, noop = (median(_phase_values(r.runs[y], phase, lambda p: p["ops_per_s"]))
                          for y in (x, k))
            row.append(fmt(node / noop if node and noop else None, 2))
        res.rows.append(row)
    res.notes.append("create = open(O_CREAT|O_TRUNC) + write 4 KiB + close; readdir counts "
                     "listings of the whole directory; mkdir/rmdir: as many empty "
                     "directories as files")
    res.notes.append("no-op FUSE: benchmarks/noop_fs.py, an in-memory namespace that stores "
                     "nothing (the FUSE ceiling); node / no-op: the ratio of medians "
                     "(issue 18's target: >= 0.5 for each operation)")
    if "noop-x" in ceilings:
        res.notes.append("no-op-x: the same with --xattrs (GETXATTR answers ENODATA, as "
                         "mtcfs's must, so the kernel asks security.capability before "
                         "each write(2)); not the issue's ceiling, shown beside it")
    res.notes.append(f"etcd-4x: {NODES} processes at once, one per node, each with "
                     f"{max(1, n // NODES)} files in its own directory (its listings are of "
                     f"that smaller directory); aggregate ops/s")
    w = WRITERS_PER_NODE_8W * NODES
    res.notes.append(f"etcd-8w: {w} processes at once, {WRITERS_PER_NODE_8W} per "
                     f"node, each with {max(1, n // w)} files in its own directory; "
                     f"aggregate ops/s")
    res.notes.append("etcd-*: ordered by a 1-member etcd on loopback (coord=etcd://...)")
    return res


def _per_op_ms(phase: dict[str, Any], rank: int | None = None) -> float:
    cpu = phase["daemon_cpu_s"]
    return 1000 * (sum(cpu) if rank is None else cpu[rank]) / phase["ops"]


def cost_table(r: Runs) -> BenchResult:
    """Daemon CPU and namespace-log ops per op, per target and phase (no tmpfs)."""
    watched = [key for key, _ in r.shown() if r.runs[key][0]["create"]["daemon_cpu_s"]]
    ranks = max((len(r.runs[key][0]["create"]["daemon_cpu_s"]) for key in watched), default=0)
    with_etcd = any(r.runs[key][0]["create"].get("etcd_cpu_s") is not None
                    for key in watched)
    res = BenchResult("cost", "6b. Cost per op: wall ms (1 / ops/s), daemon CPU ms summed "
                      "and per rank, " + ("etcd's CPU ms, " if with_etcd else "")
                      + "namespace-log ops",
                      ["target / phase", "wall ms", "CPU ms"]
                      + [f"rank {i}" for i in range(ranks)]
                      + (["etcd ms"] if with_etcd else []) + ["log ops"])
    for key in watched:
        rs = r.runs[key]
        nodes = len(rs[0]["create"]["daemon_cpu_s"])
        for phase in PHASES:
            ops_s = median(_phase_values(rs, phase, lambda p: p["ops_per_s"]))
            log_ops = median(_phase_values(
                rs, phase, lambda p: p["log_ops"] / p["ops"] if p["log_ops"] is not None
                else None))
            per_rank = [fmt(median(_phase_values(rs, phase, lambda p, i=i: _per_op_ms(p, i))))
                        for i in range(nodes)]
            etcd_ms = median(_phase_values(
                rs, phase, lambda p: 1000 * p["etcd_cpu_s"] / p["ops"]
                if p.get("etcd_cpu_s") is not None else None))
            res.rows.append([f"{key} {phase}", fmt(1000 / ops_s if ops_s else None, 3),
                             fmt(median(_phase_values(rs, phase, _per_op_ms)))]
                            + per_rank + ["-"] * (ranks - len(per_rank))
                            + ([fmt(etcd_ms)] if with_etcd else []) + [fmt(log_ops)])
    res.notes.append("CPU is utime+stime of each daemon process over the phase (clock-tick "
                     "resolution); the benchmark's own processes and the kernel's FUSE work "
                     "in them are not counted; 'CPU ms' sums the daemons, 'etcd ms' is the "
                     "etcd server's apart")
    res.notes.append("log ops: rank 0's seq, the etcd revision of the last op it applied "
                     "(etcd revisions per op)")
    return res


# ---------------------------------------------------------------------- command

def parse_engines(text: str) -> list[str]:
    keys = [k for k in text.replace(" ", ",").split(",") if k]
    bad = [k for k in keys if k not in ENGINES]
    if bad or not keys:
        raise argparse.ArgumentTypeError(f"--engines takes {','.join(ENGINES)}, got {text!r}")
    return keys


def parse_targets(text: str) -> list[str]:
    keys = [k for k in text.replace(" ", ",").split(",") if k]
    bad = [k for k in keys if k not in TARGETS]
    if bad or not keys:
        raise argparse.ArgumentTypeError(f"--only takes {','.join(TARGETS)}, got {text!r}")
    return [k for k in TARGETS if k in keys]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_namespace",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, default=500, help="files per process (default 500)")
    p.add_argument("--listings", type=int, default=20,
                   help="os.listdir calls in the readdir phase (default 20)")
    p.add_argument("--reps", type=int, default=3, help="repeats per target (median)")
    p.add_argument("--only", type=parse_targets, default=list(TARGETS),
                   help=f"comma-separated targets: {','.join(TARGETS)} (default all)")
    p.add_argument("--engines", type=parse_engines, default=list(ENGINES),
                   help="job namespace engines to measure: etcd (etcd-*; the default)")
    p.add_argument("--base", type=Path, help="a tree whose code the node-base target runs "
                   "(a git worktree of the commit to compare; adds node-base)")
    p.add_argument("--json", type=Path, help="results file (default "
                   "bench-results/namespace-<timestamp>.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run import render

    a = parse_args(argv)
    if a.base is not None:
        if not (a.base / "mtcfs" / "__main__.py").is_file():
            print(f"--base {a.base}: not an mtcfs tree", file=sys.stderr)
            return 2
        a.base = a.base.resolve()
        if "node-base" not in a.only:
            a.only = [k for k in TARGETS if k in a.only or k == "node-base"]
    else:
        a.only = [k for k in a.only if k != "node-base"]
    dropped = {k for e, ks in ENGINES.items() if e not in a.engines for k in ks}
    a.only = [k for k in a.only if k not in dropped]
    if not a.only:
        print("no target left after --engines", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = a.json or REPO / "bench-results" / f"namespace-{stamp}.json"
    info = machine_info()
    print(f"mtcfs namespace benchmark: {','.join(a.only)}, {a.ops} files, {a.listings} "
          f"listings, {a.reps} repeats, {info.get('nproc')} CPUs, load "
          f"{', '.join(f'{x:.2f}' for x in info['loadavg'])}, git {info['git']['head']}",
          flush=True)
    doc: dict[str, Any] = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), "-m",
                             "benchmarks.bench_namespace"]
                            + (argv if argv is not None else sys.argv[1:])),
        "ops": a.ops, "listings": a.listings, "reps": a.reps, "file_size": FILE_SIZE,
        "nodes": NODES, "job_options": JOB_OPTIONS, "engines": a.engines, "machine": info,
        "base": str(a.base) if a.base else None,
        "base_git": git_state(a.base) if a.base else None,
        "results": {},
        "errors": {}}
    t0 = time.perf_counter()
    with scratch_dir(SCRATCH_SHM, "ns") as root:
        r = run_all(root, a.only, a.ops, a.listings, a.reps, a.base)
    doc["targets"], doc["errors"] = r.labels, r.errors
    for res in (throughput_table(r, a.ops, a.listings, a.reps), cost_table(r)):
        res.seconds = time.perf_counter() - t0
        if res.key == "ops":
            res.samples["runs"] = r.runs
        res.notes += [f"{k} FAILED: {v.splitlines()[0][:300]}" for k, v in doc["errors"].items()]
        doc["results"][res.key] = res.to_json()
        print(render(res), flush=True)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    doc["machine"]["loadavg_end"] = os.getloadavg()
    doc["machine"]["git_end"] = git_state()
    write_json(out_path, doc)
    print(f"\n{len(doc['errors'])} target(s) failed in {doc['seconds']:.0f}s; results in "
          f"{out_path}", flush=True)
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
