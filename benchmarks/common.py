"""Shared plumbing of the benchmarks: sizes, timing, data, mounts, results.

Every mount made here is torn down in a ``finally`` (clean unmount, then the forced one of
the test suite if the daemon hangs), and every scratch directory is removed.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from mtcfs.base.mountinfo import device_of  # noqa: E402
from tests.support.mount import Mount, force_unmount, is_mounted, remove_tree  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
IO_SIZE = 16 * MiB  # one os.write / readinto
SCRATCH_SHM = "/dev/shm"  # tmpfs: the stores and the tmpfs baseline
SCRATCH_DISK = "/var/tmp"  # a real disk: file:// backup targets


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return str(n)


def gbps(nbytes: int, seconds: float | None) -> float | None:
    """Decimal GB/s (10^9 bytes per second), as the reference figures are given."""
    if not seconds:
        return None
    return nbytes / seconds / 1e9


def median(xs: Sequence[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def spread(xs: list[float | None]) -> float | None:
    """(max - min) / median: how noisy the repeats were."""
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return None
    m = statistics.median(xs)
    return (max(xs) - min(xs)) / m if m else None


def log(msg: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- results

@dataclass
class Check:
    """One target: ``value`` (a ratio or a size) against ``threshold``."""

    name: str
    value: float | None
    threshold: float
    op: str = ">="  # ">=", "<=" or "<"
    detail: str = ""
    info: bool = False  # shown, but not a target: not counted as PASS/MISS

    @property
    def ok(self) -> bool | None:
        if self.value is None:
            return None
        if self.op == ">=":
            return self.value >= self.threshold
        if self.op == "<=":
            return self.value <= self.threshold
        return self.value < self.threshold

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "threshold": self.threshold,
                "op": self.op, "pass": None if self.info else self.ok,
                "within": self.ok, "info": self.info, "detail": self.detail}


@dataclass
class BenchResult:
    """What one benchmark reports: a table (columns, rows of strings), raw samples, checks."""

    key: str
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    samples: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"title": self.title, "columns": self.columns, "rows": self.rows,
                "samples": self.samples, "checks": [c.to_json() for c in self.checks],
                "notes": self.notes, "seconds": round(self.seconds, 1)}


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def fmt_noise(xs: list[float | None], digits: int = 2) -> str:
    """``median ±half-range%`` of the repeats."""
    m = median(xs)
    if m is None:
        return "-"
    s = spread(xs)
    return f"{m:.{digits}f}" + ("" if s is None else f" ±{s * 50:.0f}%")


# ---------------------------------------------------------------------- data and I/O

class UniqueData:
    """Incompressible bytes in which every 1 MiB piece is distinct.

    A 16 MiB random buffer is reused; each piece handed out gets a (seed, counter) stamp at
    every 1 MiB boundary, so no two 4 MiB chunks hash alike (no dedup, no compression),
    and two generators with the same seed produce the same byte stream.
    """

    def __init__(self, seed: int, size: int = IO_SIZE) -> None:
        import random
        self.seed = seed
        self.buf = bytearray(random.Random(seed).randbytes(size))
        self.counter = 0

    def next(self, n: int) -> memoryview:
        assert n <= len(self.buf)
        for off in range(0, n, MiB):
            struct.pack_into("<QQ", self.buf, off, self.seed, self.counter)
            self.counter += 1
        return memoryview(self.buf)[:n]


def write_file(path: str | os.PathLike[str], size: int, data: UniqueData,
               io_size: int = IO_SIZE) -> float:
    """Create/truncate ``path``, write ``size`` bytes in ``io_size`` os.write calls, fsync,
    close. Returns the seconds all of that took."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = size
        while left:
            view = data.next(min(io_size, left))
            while view:
                n = os.write(fd, view)
                view = view[n:]
                left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


_READ_BUF = None


def read_file(path: str | os.PathLike[str], io_size: int = IO_SIZE) -> tuple[float, int]:
    """Read ``path`` front to back with ``readinto`` of ``io_size`` into one reused buffer.
    Returns (seconds, bytes read)."""
    global _READ_BUF
    if _READ_BUF is None or len(_READ_BUF) != io_size:
        _READ_BUF = bytearray(io_size)
    mv = memoryview(_READ_BUF)
    total = 0
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            n = os.readv(fd, [mv])
            if n == 0:
                break
            total += n
    finally:
        os.close(fd)
    return time.perf_counter() - t0, total


def drop_caches() -> bool:
    """Drop clean page cache, dentries and inodes (root only). False if not allowed.

    tmpfs pages are the storage itself and stay; FUSE files lose their cached pages.
    """
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def prefault(nbytes: int) -> float:
    """Touch ``nbytes`` of free RAM (map them populated, then unmap them).

    On this kind of VM (Firecracker, nested, free page reporting on: see
    docs/benchmarks.md) guest memory that was handed back to the host costs a host-side
    fault on its next first touch: writing into long-unused memory runs ~4x slower once
    the warm free pool (a few GiB) is used up. A RAM-tier filesystem needs twice the memory
    of the data written (page cache + store) and would pay that more than tmpfs or a no-op
    FUSE fs. Calling this right before each timed write, for every path alike, takes the
    host out of the comparison. Returns the seconds it took.
    """
    t0 = time.perf_counter()
    try:
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                       | getattr(mmap, "MAP_POPULATE", 0))
    except OSError:
        return 0.0  # not that much free memory: skip
    mm.close()
    return time.perf_counter() - t0


def wait_until(pred: Callable[[], bool], timeout: float, what: str,
               interval: float = 0.01) -> float:
    """Poll ``pred`` until true; returns the seconds it took. Raises TimeoutError."""
    t0 = time.perf_counter()
    deadline = t0 + timeout
    while not pred():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
    return time.perf_counter() - t0


def dump_logs(c: Any) -> None:
    """Print the tail (3,000 characters) of every rank's mtcfs log of the cluster ``c``
    (tests.support.cluster.Cluster) to stderr: what a failed benchmark repeat shows."""
    for r in range(c.nodes):
        tail = c.node(r).log()[-3000:]
        if tail:
            print(f"--- mtcfs log of rank {r} ---\n{tail}", file=sys.stderr)


def mtcfs_state(path: str | os.PathLike[str]) -> str:
    return os.getxattr(path, "user.mtcfs.state").decode()


# ---------------------------------------------------------------------- scratch space

@contextlib.contextmanager
def scratch_dir(base: str, prefix: str) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix=f"mtcfs-bench-{prefix}-", dir=base))
    try:
        yield d
    finally:
        # (its stores' data tmpfs outlive their daemons: unmounted first, else each run
        # left them mounted, holding RAM, and rmtree failed on them)
        remove_tree(d)


def clear_dir(d: Path) -> None:
    """Remove everything inside ``d`` (not ``d`` itself)."""
    for p in d.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


# ---------------------------------------------------------------------- mounts

@contextlib.contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    """``env`` added to this process's environment (so to the daemons started meanwhile),
    the previous values put back on exit."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def loopback_etcd(root: Path) -> Iterator[Any]:
    """One etcd member on loopback (``tests.support.etcd.EtcdCluster``), its data under
    ``root`` (put it on /dev/shm); stopped on exit. ``.url`` is the ``coord=`` value."""
    from tests.support.etcd import EtcdCluster

    e = EtcdCluster(root, 1)
    try:
        e.start()
        yield e
    finally:
        e.stop()


@contextlib.contextmanager
def in_tree(tree: str | Path | None) -> Iterator[None]:
    """Work in directory ``tree`` (None: where we are), the previous one back on exit.
    ``python -m mtcfs`` puts its working directory first on sys.path, ahead of
    ``PYTHONPATH``: a daemon (or CLI) started here runs ``tree``'s code (give it
    ``PYTHONPATH=tree`` too)."""
    here = os.getcwd()
    if tree is not None:
        os.chdir(tree)
    try:
        yield
    finally:
        os.chdir(here)


@contextlib.contextmanager
def mtcfs_mount(root: Path, options: dict[str, str], job: str = "bench",
                env: dict[str, str] | None = None, tree: Path | None = None
                ) -> Iterator[Mount]:
    """Mount mtcfs with its store in ``root/store`` and mount point ``root/mnt``.

    ``env`` is added to the environment of the daemon (e.g. STORAGE_EMULATOR_HOST).
    ``tree``: the daemon runs the code of that tree (a ``git worktree`` of a commit to
    compare), started in it with ``PYTHONPATH`` set to it (``python -m mtcfs`` puts its
    working directory ahead of ``PYTHONPATH``). Unmounted (and the store removed) on
    exit, whatever happened.
    """
    m = Mount(root, job=job, options=options)
    if tree is not None:
        env = {**(env or {}), "PYTHONPATH": str(tree)}
    try:
        with in_tree(tree), environ(env or {}):
            m.start()
        yield m
    except BaseException:
        tail = m.log()[-3000:]
        if tail:
            print(f"--- mtcfs log tail ({m.store}/mtcfs.log) ---\n{tail}", file=sys.stderr)
        raise
    finally:
        try:
            m.cleanup()
        finally:
            force_unmount(str(m.mnt))
            shutil.rmtree(m.store, ignore_errors=True)


def first_and_next(fn: Callable[[int], float]) -> tuple[float, float]:
    """``fn(0)`` then ``fn(1)`` (each returns its seconds) in a new thread: the first and
    the next file of a thread mtcfs has not seen write (direct writes are chosen per
    thread, mtcfs/direct_writes.py).

    Raises:
        RuntimeError: ``fn`` raised in the thread (its traceback is printed there).
    """
    out: list[float] = []
    t = threading.Thread(target=lambda: out.extend(fn(i) for i in range(2)))
    t.start()
    t.join()
    if len(out) != 2:
        raise RuntimeError("the writer thread failed")
    return out[0], out[1]


def write_targets(stack: contextlib.ExitStack, root: Path, base: Path | None,
                  notes: list[str]) -> tuple[dict[str, Path], Mount]:
    """The targets of the direct-writes benchmarks (bench_write_sizes, bench_small_writers),
    mounted under ``root`` on ``stack`` (unmounted when it closes): ``tmpfs``, ``noop``
    (the FUSE ceiling), ``mtcfs`` (direct writes on, the default), ``mtcfs-cached``
    (``direct_writes=no``) and, with ``base``, ``mtcfs-base`` (the code of that tree with
    its default options; said in ``notes``). Returns {name: directory} and the mtcfs mount
    (for its status)."""
    dirs: dict[str, Path] = {"tmpfs": root / "tmpfs"}
    dirs["tmpfs"].mkdir()
    mnt = root / "noop"
    mnt.mkdir()
    stack.enter_context(served_mount([sys.executable, "-m", "benchmarks.noop_fs", str(mnt)],
                                     mnt, "noop_fs", ["fusermount3", "-u", str(mnt)]))
    dirs["noop"] = mnt
    m = stack.enter_context(mtcfs_mount(root / "direct", {"size": "4G"}))
    dirs["mtcfs"] = m.mnt
    dirs["mtcfs-cached"] = stack.enter_context(
        mtcfs_mount(root / "cached", {"size": "4G", "direct_writes": "no"})).mnt
    if base is not None:
        dirs["mtcfs-base"] = stack.enter_context(
            mtcfs_mount(root / "base", {"size": "4G"}, tree=base)).mnt
        notes.append(f"mtcfs-base: the code of {base} ({git_state(base)})")
    return dirs, m


@contextlib.contextmanager
def served_mount(cmd: list[str], mnt: Path, what: str,
                 unmount: list[str]) -> Iterator[subprocess.Popen[str]]:
    """Run FUSE server ``cmd`` (it prints ``ready`` once ``mnt`` is mounted), yield its
    process; on exit unmount with ``unmount`` and stop it: wait 20 s, then SIGTERM, then
    SIGKILL, and abort the FUSE connection if anything is still mounted.

    Raises:
        RuntimeError: the server did not print ``ready`` (its stderr is in the message).
    """
    proc = subprocess.Popen(cmd, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "ready":
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"{what} did not mount: {line!r} {err}")
        yield proc
    finally:
        if is_mounted(str(mnt)):
            subprocess.run(unmount, capture_output=True, timeout=30)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        force_unmount(str(mnt))


@contextlib.contextmanager
def noop_mount(mnt: Path, size: int = 0, xattrs: bool = False) -> Iterator[Path]:
    """Mount :mod:`benchmarks.noop_fs` at ``mnt`` in a subprocess; unmount on exit.
    ``xattrs``: its GETXATTR answers ENODATA, not ENOSYS (see that module)."""
    mnt.mkdir(parents=True, exist_ok=True)
    with served_mount([sys.executable, "-m", "benchmarks.noop_fs", str(mnt), "--size",
                       str(size)] + (["--xattrs"] if xattrs else []), mnt, "noop_fs",
                      ["fusermount3", "-u", str(mnt)]):
        yield mnt


def read_ahead_kb(mountpoint: Path) -> int | None:
    """The read-ahead (KiB) of the mount at ``mountpoint``, from its backing device info."""
    dev = device_of(mountpoint)
    try:
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def cpu_seconds(pid: int | None) -> float:
    """``utime + stime`` of process ``pid`` (all its threads), in seconds (clock-tick
    resolution); 0.0 for ``None`` (a target with no daemon, e.g. tmpfs)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_pid(m: Mount) -> int:
    return int(m.status()["pid"])


# ---------------------------------------------------------------------- memory

class RssSampler:
    """Samples VmRSS, RssAnon and RssShmem of one process in a thread; peaks per phase."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid = pid
        self.interval = interval
        self.phase = "idle"
        self.peaks: dict[str, dict[str, int]] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def read(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in self.FIELDS:
                    out[key] = int(rest.split()[0]) * KiB
        return out

    def _record(self) -> None:
        try:
            cur = self.read()
        except OSError:
            return
        peak = self.peaks.setdefault(self.phase, {})
        for k, v in cur.items():
            if v > peak.get(k, 0):
                peak[k] = v
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._record()
            self._stop.wait(self.interval)

    def set_phase(self, phase: str) -> None:
        self._record()
        self.phase = phase
        self._record()

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


# ---------------------------------------------------------------------- machine

def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"nproc": os.cpu_count(), "kernel": os.uname().release,
                            "hostname": os.uname().nodename}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["mem_total_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    try:
        st = os.statvfs("/dev/shm")
        info["dev_shm_gib"] = round(st.f_blocks * st.f_frsize / GiB, 1)
    except OSError:
        pass
    info["loadavg"] = os.getloadavg()
    info["git"] = git_state()
    info["python"] = sys.version.split()[0]
    try:
        import pyfuse3
        import torch
        info["torch"] = torch.__version__
        info["pyfuse3"] = pyfuse3.__version__
    except Exception:
        pass
    return info


def git_state(tree: Path = REPO) -> dict[str, Any]:
    """HEAD and the uncommitted changes under mtcfs/ and mtcfs/tiers/ of the git tree at
    ``tree`` (this repository by default; read-only git)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=tree, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    dirty = git("status", "--porcelain", "--", "mtcfs")
    return {"head": git("rev-parse", "--short", "HEAD") or None,
            "uncommitted_in_mtcfs_replication": len(dirty.splitlines()) if dirty else 0}


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    tmp.replace(path)
