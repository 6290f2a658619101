"""Background work against training on the same host: how much mtcfs's work after a
checkpoint's close() slows a real training loop (issue "Background work that never slows
training").

    python -m benchmarks.bench_interference [--size 1.5G] [--reps 2]
        [--settings none,default,nice,pinned,rate] [--options k=v,...] [--png PATH]

(or ``make bench-interference ARGS="..."``). Everything goes to
``bench-results/interference-<timestamp>.json`` (``--json`` names another file) and the plot
to the ``.png`` beside it (``--png``).

The trainer is a process of its own (this file with ``--trainer``): torch on one thread
(``set_num_threads(1)``, ``set_num_interop_threads(1)``), a 3-layer MLP (``--width``, 512
by default) with Adam on one fixed batch (``--batch``); a step is forward, backward and
``optimizer.step()``, about 15-20 ms on the 2-core machine, and the trainer records every
step's monotonic start and end. It also holds a "state" tensor of ``--size`` random bytes
(made before anything is measured; zstd cannot shrink it) and, when the harness says so,
saves ``torch.save({"model", "optim", "state"})`` into ``<mount>/step-100/ckpt.pt`` and
commits the step with ``commit_success.txt`` (a commit marker mtcfs recognises); the save
is not a step. The harness talks to it over its stdin and stdout.

Per setting and repeat, on fresh mounts: two daemons on loopback
(``tests.support.cluster.Cluster``, the process's shared etcd, ``replicas=1``, stores on
/dev/shm), rank 0 also with ``backup=file://<dir on /var/tmp>,backup_interval=1ckpt``; the
setting's options (and ``--options``) on both. The trainer starts beside them, warms up
(``--warmup-s``), runs the ``idle`` phase (``--idle-s``: mtcfs mounted, nothing to do),
saves one checkpoint, and keeps training through the ``background`` window, from the
save's end until the step is sealed, replicated 1/1 to rank 1 and backed up; then
``--tail-s`` more, and stops.

The tiers are watched without costing the trainer much: ``user.mtcfs.state`` of the step
directory and of ``ckpt.pt`` (one FUSE getxattr each) at ``--poll-hz`` (5), and the new lines
of rank 0's log (a file on /dev/shm) for its ``replicated to rank`` and ``backed up`` lines,
whose millisecond timestamps are the times reported for those two tiers (the getxattr
poll's when a line is missing; ``backed-up`` hides ``replicated k/R`` in the xattr).
The window ends when the poll has seen the step complete and ``ckpt.pt`` no longer
``writing`` and both lines are there. ``sealed`` is reported as the close of ``ckpt.pt``
plus rank 0's ``seal_seconds`` histogram sum (the seal, from the file's release; the
commit marker's seal adds a millisecond), read with one ``mtcfs status`` after the trainer
stopped, and never later than the poll that saw it (which alone is late by up to one poll
interval). No ``mtcfs status`` runs while the trainer is measured (each one is a CLI
process).

Settings (``--settings``, a comma list; each one's options go to both daemons):

``none``     ``bg_sched=normal``: background work at the trainer's priority (no budget)
``default``  no options: the shipped budget
``nice``     ``bg_sched=normal,bg_nice=19``
``pinned``   the trainer on CPU 0 (``sched_setaffinity``), the daemons ``bg_cpus=1``
``rate``     ``replicate_rate=200M,backup_rate=200M``
``plain``    no options at all (the same mounts as ``default``; for trees without the budget)
``tmpfs``    a control without mtcfs: the save goes to a directory on /dev/shm and the
             window is ``--control-window-s`` long: what the save itself does to the next
             steps (cache, allocator), with no background work at all
``hog``      a control without mtcfs: as ``tmpfs``, the trainer on CPU 0, and through the
             window one thread hashing 256 MiB over and over with blake3 on CPU 1: what
             work on the *other* CPU costs the trainer on this machine (shared caches,
             memory bandwidth, the host), whatever its scheduling class

A setting whose mount is refused for its options (exit 2: an option this tree does not
know) is skipped with a ``SKIP`` line. The settings run interleaved, their order reversed
every other repeat; the table shows medians across repeats, ``±x%`` half the spread
(max-min) over the median.

Noise: before each run the harness waits (``--quiet-wait``, 120 s at most) until the
machine's CPUs are quiet, and it flags a run (a ``WARNING`` line) whose idle phase had more
than 0.15 cores of other work (the machine's busy time less that of the run's processes:
trainer, daemons, etcd, harness). A second table puts the idle phase beside the tail (the
trainer without background work, before and after), with those cores.

Reported per setting: the trainer's median and p99 step time (ms) in the idle phase and in
the background window, their ratios (background / idle), the steps in the window, the
seconds from the save's end to sealed / replicated / backed up, and the CPU seconds of both
daemons over the window (from the harness hearing of the save's end to its seeing the last
tier). The JSON also has the tail phase, the daemons' CPU in the idle phase and the save,
etcd's CPU, the machine's busy share per phase, every state change seen, and each run's step
times.

Needs root and /dev/fuse; at the default 1.5 GiB about 6 GiB of /dev/shm and RAM and 1.5 GiB
of /var/tmp, and 30-60 s per setting and repeat.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import queue
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (the trainer, or by hand): find the repo
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    REPO, SCRATCH_DISK, SCRATCH_SHM, GiB, MiB, cpu_seconds, fmt, fmt_noise, git_state, log,
    machine_info, median, mtcfs_state, prefault, scratch_dir, spread, write_json,
)
from tests.support.mount import remove_tree  # noqa: E402

JOB = "bench-interference"
STEP = "step-100"
CKPT = "ckpt.pt"
COMMIT = "commit_success.txt"
EVENT = "@@ "  # the trainer's event lines on stdout start with this
DEFAULT_SETTINGS = "none,default,nice,pinned,rate"
TIERS = ("sealed", "replicated", "backed_up")
#: cores of other processes in an idle phase above which a run is flagged as not clean
OTHERS_WARN = 0.15


# ====================================================================== the trainer

def trainer_main(a: argparse.Namespace) -> int:
    """The training loop, in its own process; commands on stdin, events on stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness ends it (stop, EOF, kill)
    if a.trainer_cpu is not None:
        os.sched_setaffinity(0, {a.trainer_cpu})

    def emit(event: str, **kw: Any) -> None:
        sys.stdout.write(EVENT + json.dumps({"event": event, **kw}) + "\n")
        sys.stdout.flush()

    import torch
    from torch import nn
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    torch.manual_seed(1234)
    w = a.width
    model = nn.Sequential(nn.Linear(512, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                          nn.Linear(w, 512))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(a.batch, 512)
    y = torch.sin(3 * x)

    t0 = time.monotonic()
    big = torch.empty(a.size, dtype=torch.uint8)  # random bytes: zstd cannot shrink them
    n8 = a.size // 8 * 8
    g = torch.Generator().manual_seed(a.seed)
    if n8:
        big[:n8].view(torch.int64).random_(-(1 << 63), (1 << 63) - 1, generator=g)
    if a.size > n8:
        big[n8:] = torch.randint(0, 256, (a.size - n8,), dtype=torch.uint8, generator=g)
    gen_s = time.monotonic() - t0

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(5):  # the first steps allocate Adam's state
        step()
    emit("ready", pid=os.getpid(), gen_s=round(gen_s, 3),
         cpus=sorted(os.sched_getaffinity(0)), params=sum(p.numel() for p in model.parameters()))

    starts, ends = array("d"), array("d")
    pending = b""
    fd = sys.stdin.fileno()
    while True:
        s = time.monotonic()
        step()
        e = time.monotonic()
        starts.append(s)
        ends.append(e)
        if not select.select([fd], [], [], 0)[0]:
            continue
        data = os.read(fd, 65536)
        if not data:
            return 0  # the harness is gone
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            cmd, _, arg = line.decode().strip().partition(" ")
            if cmd == "save":
                d = Path(arg)
                t_s = time.monotonic()
                d.mkdir()
                torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                            "state": big}, d / CKPT)
                t_c = time.monotonic()  # ckpt.pt is closed: its seal starts
                cfd = os.open(d / COMMIT, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.write(cfd, b"Checkpoint commit was successful")
                finally:
                    os.close(cfd)
                t_e = time.monotonic()
                emit("saved", start=t_s, closed=t_c, end=t_e,
                     bytes=(d / CKPT).stat().st_size)
            elif cmd == "stop":
                emit("done", starts=list(starts), ends=list(ends))
                return 0
            else:
                emit("error", message=f"unknown command {line!r}")


# ====================================================================== the harness


@dataclass(frozen=True)
class Setting:
    name: str
    options: dict[str, str | None]
    cpu: int | None = None  # the trainer's CPU (sched_setaffinity)
    control: bool = False  # no mtcfs: save to a tmpfs directory
    hog_cpu: int | None = None  # (control) a blake3 loop on this CPU through the window
    what: str = ""


SETTINGS = {
    "none": Setting("none", {"bg_sched": "normal", "daemon_nice": "0"},
                    what="no budget (as before it)"),
    "default": Setting("default", {}, what="the shipped budget"),
    "nice": Setting("nice", {"bg_sched": "normal", "bg_nice": "19"}, what="nice 19"),
    "pinned": Setting("pinned", {"bg_cpus": "1"}, cpu=0,
                      what="trainer on CPU 0, background on CPU 1"),
    "rate": Setting("rate", {"replicate_rate": "200M", "backup_rate": "200M"},
                    what="200 MB/s to the peer and the backup"),
    "plain": Setting("plain", {}, what="no options"),
    "group10": Setting("group10", {"daemon_nice": "10"},
                       what="bg_sched=idle, the daemons' autogroups at nice 10"),
    "group19": Setting("group19", {"daemon_nice": "19"},
                       what="bg_sched=idle, the daemons' autogroups at nice 19"),
    "tmpfs": Setting("tmpfs", {}, control=True, what="control: no mtcfs, save to tmpfs"),
    "hog": Setting("hog", {}, cpu=0, control=True, hog_cpu=1,
                   what="control: no mtcfs, trainer on CPU 0, a blake3 loop on CPU 1"),
}

#: The ``hog`` control's other process: one thread hashing the same 256 MiB with blake3
#: on its CPU for as many seconds as its stdin says, once it has said ``ready``.
HOG = r"""
import os, sys, time, blake3
os.sched_setaffinity(0, {int(sys.argv[2])})
buf = memoryview(os.urandom(min(int(sys.argv[1]), 256 << 20)))
print("ready", flush=True)
seconds = float(sys.stdin.readline())
end = time.monotonic() + seconds
n = 0
while time.monotonic() < end:
    for off in range(0, len(buf), 16 << 20):
        blake3.blake3(buf[off:off + (16 << 20)]).digest()
        n += min(16 << 20, len(buf) - off)
        if time.monotonic() >= end:
            break
print(n, flush=True)
"""


@contextlib.contextmanager
def hog(size: int, cpu: int, dl: Deadline) -> Any:
    """The ``HOG`` process, ready (its bytes made); yields it; killed on exit."""
    proc = subprocess.Popen([sys.executable, "-c", HOG, str(size), str(cpu)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        got: list[str] = []
        t = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
        t.start()
        t.join(max(1.0, min(60.0, dl.left())))
        if not got or got[0].strip() != "ready":
            raise RuntimeError(f"the hog process did not start ({proc.poll()}): {got}")
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _hog_bytes(proc: subprocess.Popen[str]) -> int | None:
    """The bytes the hog hashed (its last line), or None if it says nothing within 10 s."""
    got: list[str] = []
    out = proc.stdout
    assert out is not None
    t = threading.Thread(target=lambda: got.append(out.readline()), daemon=True)
    t.start()
    t.join(10)
    try:
        return int(got[0])
    except (IndexError, ValueError):
        return None


class SkipSetting(Exception):
    """The mount refused the setting's options (exit 2): this tree does not have them."""


class Deadline:
    """One setting's overall deadline; every wait asks it."""

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds = seconds
        self.what = what
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def check(self, waiting_for: str) -> None:
        if self.left() <= 0:
            raise TimeoutError(f"{self.what}: still waiting for {waiting_for} at the "
                               f"{self.seconds:.0f} s deadline (--timeout)")

    def sleep_until(self, t: float, waiting_for: str) -> None:
        if t > self.end:
            raise TimeoutError(f"{self.what}: {waiting_for} would end past the "
                               f"{self.seconds:.0f} s deadline (--timeout)")
        while (d := t - time.monotonic()) > 0:
            time.sleep(min(d, 0.5))


class Trainer:
    """The trainer subprocess: stdin for commands, a thread reading its event lines."""

    def __init__(self, a: argparse.Namespace, cpu: int | None, stderr: Path) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--trainer",
               "--size", str(a.size), "--width", str(a.width), "--batch", str(a.batch),
               "--seed", str(a.seed)]
        if cpu is not None:
            cmd += ["--trainer-cpu", str(cpu)]
        self.stderr_path = stderr
        self._err = open(stderr, "w")
        self.proc = subprocess.Popen(cmd, cwd=str(REPO), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     bufsize=1)
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="trainer-events",
                                        daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(EVENT):
                self.events.put(json.loads(line[len(EVENT):]))
            elif line.strip():
                log(f"trainer: {line.rstrip()}")
        self.events.put(None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait(self, event: str, dl: Deadline) -> dict[str, Any]:
        while True:
            dl.check(f"the trainer's {event!r}")
            try:
                ev = self.events.get(timeout=max(0.05, min(1.0, dl.left())))
            except queue.Empty:
                continue
            if ev is None:
                rc = self.proc.wait(10)
                raise RuntimeError(f"the trainer exited ({rc}) before {event!r}: "
                                   f"{self.stderr_tail()}")
            if ev["event"] == "error":
                raise RuntimeError(f"the trainer: {ev['message']}")
            if ev["event"] == event:
                return ev

    def stderr_tail(self) -> str:
        try:
            return self.stderr_path.read_text()[-2000:].strip() or "(no stderr)"
        except OSError:
            return "(no stderr)"

    def close(self) -> None:
        """End it, whatever state it is in (never raises)."""
        try:
            if self.proc.poll() is None:
                try:
                    self.proc.stdin.close()  # type: ignore[union-attr]
                except OSError:
                    pass
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
        except BaseException:  # noqa: BLE001 (cleanup)
            with contextlib.suppress(BaseException):
                self.proc.kill()
        finally:
            self._err.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- watching the tiers

_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
_LOG_REPLICATED = re.compile(r" (\S+) replicated to rank \d+ \((\d+)/(\d+)[;)]")
_LOG_BACKED_UP = re.compile(r" backed up (\S+): \d+ bytes")
_STATE_REPLICATED = re.compile(r"^replicated (\d+)/(\d+)$")


class LogTail:
    """The lines appended to a log file since this was made (read incrementally)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.offset = path.stat().st_size
        except OSError:
            self.offset = 0
        self.partial = b""

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        return [ln.decode(errors="replace") for ln in lines]


def log_time(line: str, wall_minus_mono: float) -> float | None:
    """The monotonic time of a log line (its local-time timestamp, milliseconds)."""
    m = _LOG_TIME.match(line)
    if not m:
        return None
    wall = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
    return wall - wall_minus_mono


def _state(path: Path) -> str | None:
    try:
        return mtcfs_state(path)
    except OSError:
        return None


@dataclass
class TierWatch:
    """When each tier was reached: from the getxattr poll and from rank 0's log."""

    polled: dict[str, float] = field(default_factory=dict)
    logged: dict[str, float] = field(default_factory=dict)
    states: list[tuple[float, str | None, str | None]] = field(default_factory=list)

    def at(self, tier: str) -> float | None:
        t = self.logged.get(tier, self.polled.get(tier))
        if t is not None and tier == "sealed":  # sealing comes before either copy
            later = [self.at(x) for x in ("replicated", "backed_up")]
            t = min([t] + [x for x in later if x is not None])
        return t

    def source(self, tier: str) -> str:
        if tier == "sealed" and tier in self.logged:
            return "close + seal_seconds"
        return "log" if tier in self.logged else "xattr poll"

    def done(self) -> bool:
        return all(self.at(t) is not None for t in TIERS)


def watch_tiers(mnt: Path, logpath: Path, dl: Deadline, poll_s: float) -> TierWatch:
    """Poll until ``STEP`` on rank 0 is sealed, replicated 1/1 and backed up."""
    tw = TierWatch()
    tail = LogTail(logpath)
    tail.offset = 0  # (the step's lines may be there already; the step name is unique)
    offset = time.time() - time.monotonic()
    d, f = mnt / STEP, mnt / STEP / CKPT
    last: tuple[str | None, str | None] | None = None
    while True:
        now = time.monotonic()
        ds, fs = _state(d), _state(f)
        if (ds, fs) != last:
            tw.states.append((now, ds, fs))
            last = (ds, fs)
        if "sealed" not in tw.polled and ds not in (None, "incomplete") \
                and fs not in (None, "writing"):
            tw.polled["sealed"] = now
        m = _STATE_REPLICATED.match(ds or "")
        if m and int(m.group(1)) >= int(m.group(2)) and "replicated" not in tw.polled:
            tw.polled["replicated"] = now
        if ds == "backed-up" and "backed_up" not in tw.polled:
            tw.polled["backed_up"] = now
        for line in tail.new_lines():
            m = _LOG_REPLICATED.search(line)
            if m and m.group(1) == STEP and int(m.group(2)) >= int(m.group(3)):
                t = log_time(line, offset)
                if t is not None:
                    tw.logged.setdefault("replicated", t)
            m = _LOG_BACKED_UP.search(line)
            if m and m.group(1) == STEP:
                t = log_time(line, offset)
                if t is not None:
                    tw.logged.setdefault("backed_up", t)
        if tw.done():
            return tw
        missing = [t for t in TIERS if tw.at(t) is None]
        dl.check(f"{STEP} to be {' and '.join(missing)} (state {ds!r}, {CKPT} {fs!r})")
        time.sleep(poll_s)


# ---------------------------------------------------------------------- one run

def _busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs so far (/proc/stat)."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


def _busy_share(a: tuple[int, int], b: tuple[int, int]) -> float:
    return round((b[0] - a[0]) / max(1, b[1] - a[1]), 3)


def wait_quiet(max_s: float) -> float:
    """Wait, at most ``max_s``, until the machine's CPUs are quiet (under ``OTHERS_WARN``
    cores busy over a second: nothing of a run is running then but the shared etcd).
    Returns the cores busy at the last look."""
    end = time.monotonic() + max_s
    ncpu = os.cpu_count() or 1
    said = False
    while True:
        b0 = _busy()
        time.sleep(1.0)
        cores = _busy_share(b0, _busy()) * ncpu
        if cores < OTHERS_WARN or time.monotonic() >= end:
            if said:
                log(f"the machine is {'quiet' if cores < OTHERS_WARN else 'still busy'} "
                    f"({cores:.2f} cores busy)")
            return cores
        if not said:
            log(f"the machine is busy ({cores:.2f} cores of other work): waiting up to "
                f"{max_s:.0f} s (--quiet-wait) before the next run")
            said = True


def _cpus(pids: dict[str, int | None]) -> dict[str, float]:
    out = {}
    for k, pid in pids.items():
        try:
            out[k] = cpu_seconds(pid)
        except OSError:
            out[k] = float("nan")
    return out


def _delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: round(b[k] - a[k], 3) for k in a}


def pct(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``xs`` by nearest rank (p99 of 50 samples: the largest)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def phase(starts: list[float], ends: list[float], t0: float, t1: float) -> dict[str, Any]:
    """Step times (ms) of the steps that started at or after ``t0`` and ended by ``t1``."""
    ms = [(e - s) * 1e3 for s, e in zip(starts, ends) if s >= t0 and e <= t1]
    return {"n": len(ms), "seconds": round(t1 - t0, 3),
            "median_ms": statistics.median(ms) if ms else None, "p99_ms": pct(ms, 0.99),
            "mean_ms": statistics.fmean(ms) if ms else None, "max_ms": max(ms, default=None)}


def _refused(exc: BaseException) -> str | None:
    """The mount's one-line option error when ``exc`` is a mount that exited 2."""
    m = re.search(r"mount failed \(2\): ([^\n]+)", str(exc))
    return m.group(1).strip() if m else None


def store_size(a: argparse.Namespace) -> str:
    """``size=`` of each node: the step (rank 0) and its replica within replica_quota, which
    is size / 2 with replicas=1 (rank 1), with 1 GiB to spare; at least 4 GiB."""
    if a.store_size:
        return a.store_size
    return f"{max(4, math.ceil((2 * a.size + GiB) / GiB))}G"


def run_setting(s: Setting, rep: int, a: argparse.Namespace, root: Path,
                bkroot: Path) -> dict[str, Any]:
    """One setting, one repeat, on fresh mounts. Raises SkipSetting, TimeoutError, ..."""
    from tests.support.cluster import Cluster
    from tests.support.etcd import shared_etcd

    dl = Deadline(a.timeout, f"{s.name} (rep {rep})")
    work = root / f"{s.name}-{rep}"
    work.mkdir()
    bk = bkroot / f"{s.name}-{rep}"
    options = {**s.options, **a.extra_options}
    cpu = s.cpu if s.cpu is not None else a.trainer_cpu
    c = None
    hog_bytes = None
    with contextlib.ExitStack() as stack:
        stack.callback(remove_tree, work)  # (last: after the mounts below it are gone)
        stack.callback(shutil.rmtree, bk, True)
        if s.control:
            mnt = work / "tmpfs"
            mnt.mkdir()
            pids: dict[str, int | None] = {}
        else:
            bk.mkdir()
            c = stack.enter_context(Cluster(
                work / "c", 2, job=JOB, tls=a.tls, test_faults=False,
                options={"size": store_size(a), "replicas": "1", **options},
                per_rank_options={0: {"backup": f"file://{bk}", "backup_interval": "1ckpt"}}))
            try:
                c.start(timeout=max(5.0, min(90.0, dl.left())))
            except RuntimeError as exc:
                why = _refused(exc)
                if why:
                    raise SkipSetting(why) from None
                raise
            mnt = c.node(0).mnt
            pids = {"rank0": c.node(0).pid, "rank1": c.node(1).pid}
        etcd = {}
        with contextlib.suppress(Exception):
            if c is not None:
                etcd = {"etcd": shared_etcd().procs[0].pid}
        try:
            if a.prefault:
                # the save, the replica, the backup's page cache and the trainer's state
                prefault(4 * a.size + GiB)
            hogger = None if s.hog_cpu is None else stack.enter_context(
                hog(a.size, s.hog_cpu, dl))
            tr = stack.enter_context(Trainer(a, cpu, work / "trainer.stderr"))
            ready = tr.wait("ready", dl)
            t_ready = time.monotonic()
            # every process of this run, for what the rest of the machine did meanwhile
            ours = {**pids, **etcd, "trainer": ready["pid"], "harness": os.getpid(),
                    **({} if hogger is None else {"hog": hogger.pid})}
            dl.sleep_until(t_ready + a.warmup_s, "the warm-up")
            t_idle0, cpu_idle0, busy_idle0 = time.monotonic(), _cpus(ours), _busy()
            dl.sleep_until(t_idle0 + a.idle_s, "the idle phase")
            t_idle1, cpu_idle1, busy_idle1 = time.monotonic(), _cpus(ours), _busy()
            tr.send(f"save {mnt / STEP}")
            saved = tr.wait("saved", dl)
            cpu_w0, busy_w0 = _cpus(ours), _busy()
            t_save_end = saved["end"]
            if s.control:
                if hogger is not None:
                    hogger.stdin.write(f"{t_save_end + a.control_window_s - time.monotonic()}\n")
                    hogger.stdin.flush()
                dl.sleep_until(t_save_end + a.control_window_s, "the control window")
                if hogger is not None:
                    hog_bytes = _hog_bytes(hogger)
                tw = None
                t_bg_end = t_save_end + a.control_window_s
            else:
                tw = watch_tiers(mnt, c.node(0).store / "mtcfs.log", dl, 1 / a.poll_hz)
                t_bg_end = max(tw.at(t) for t in TIERS)  # type: ignore[type-var]
            cpu_w1, busy_w1 = _cpus(ours), _busy()
            t_seen = time.monotonic()
            dl.sleep_until(max(t_seen, t_bg_end + a.tail_s), "the tail")
            t_stop = time.monotonic()
            tr.send("stop")
            done = tr.wait("done", dl)
            seal_hist = None
            if c is not None:  # (a CLI call: only now, with the trainer stopped)
                with contextlib.suppress(Exception):
                    seal_hist = c.node(0).status()["histograms"]["seal_seconds"]
        except Exception:
            if c is not None:
                for r in range(2):
                    logtail = c.node(r).log()[-3000:]
                    if logtail:
                        print(f"--- mtcfs log of rank {r} ({s.name}, rep {rep}) ---\n"
                              f"{logtail}", file=sys.stderr)
            raise
    starts, ends = done["starts"], done["ends"]
    seal_in_daemon = None
    if tw is not None and seal_hist and seal_hist.get("count"):
        # rank 0 sealed ckpt.pt and the tiny commit marker: the sum is ckpt.pt's seal
        # (from the release after its close) within milliseconds; never after the poll
        seal_in_daemon = seal_hist["sum"]
        tw.logged["sealed"] = min(saved["closed"] + seal_in_daemon, tw.polled["sealed"])
    idle = phase(starts, ends, t_idle0, t_idle1)
    bg = phase(starts, ends, t_save_end, t_bg_end)
    tail = phase(starts, ends, t_bg_end, t_stop)

    def ratio(k: str) -> float | None:
        return bg[k] / idle[k] if bg[k] and idle[k] else None

    rel = [(round((e - t_save_end) * 1e3, 2), round((e - s_) * 1e3, 3))
           for s_, e in zip(starts, ends) if s_ >= t_idle0 and e <= t_stop]
    daemons = set(pids)
    window = {k: v for k, v in _delta(cpu_w0, cpu_w1).items() if k in daemons}

    def others(c0: dict[str, float], c1: dict[str, float], b0: tuple[int, int],
               b1: tuple[int, int], seconds: float) -> float:
        """Cores used by processes not of this run (kernel threads included: writeback,
        softirqs) over a phase: the machine's busy CPU time less ours, per second."""
        busy_s = (b1[0] - b0[0]) / os.sysconf("SC_CLK_TCK")
        return round((busy_s - sum(_delta(c0, c1).values())) / max(seconds, 1e-3), 3)
    return {
        "setting": s.name, "rep": rep, "options": options, "trainer_cpu": cpu,
        "trainer": {k: ready[k] for k in ("gen_s", "cpus", "params")},
        "save_s": round(saved["end"] - saved["start"], 3), "save_bytes": saved["bytes"],
        "idle": idle, "bg": bg, "tail": tail,
        "ratio_median": ratio("median_ms"), "ratio_p99": ratio("p99_ms"),
        "tiers_s": {t: (None if tw is None else round(tw.at(t) - t_save_end, 3))
                    for t in TIERS},
        "tier_source": {} if tw is None else {t: tw.source(t) for t in TIERS},
        "sealed_poll_s": None if tw is None else round(tw.polled["sealed"] - t_save_end, 3),
        "seal_in_daemon_s": seal_in_daemon, "seal_histogram": seal_hist,
        "ckpt_closed_before_save_end_s": round(t_save_end - saved["closed"], 4),
        "window_s": round(t_bg_end - t_save_end, 3),
        "hog_gb_per_s": None if hog_bytes is None else round(
            hog_bytes / 1e9 / a.control_window_s, 3),
        "window_seen_late_s": round(t_seen - t_bg_end, 3),
        "daemon_cpu_s": {"idle": {k: v for k, v in _delta(cpu_idle0, cpu_idle1).items()
                                  if k in daemons},
                         "save": {k: v for k, v in _delta(cpu_idle1, cpu_w0).items()
                                  if k in daemons},
                         "window": window, "window_total": round(sum(window.values()), 3)},
        "cpu_s": {"idle": _delta(cpu_idle0, cpu_idle1), "save": _delta(cpu_idle1, cpu_w0),
                  "window": _delta(cpu_w0, cpu_w1)},  # every process of the run
        # the CPU the trainer got: 1.0 = all of one core; less = it waited to run
        "trainer_cores": {
            "idle": round(_delta(cpu_idle0, cpu_idle1)["trainer"] / (t_idle1 - t_idle0), 3),
            "window": round(_delta(cpu_w0, cpu_w1)["trainer"] / max(t_seen - t_save_end, 1e-3),
                            3)},
        "machine_busy": {"idle": _busy_share(busy_idle0, busy_idle1),
                         "window": _busy_share(busy_w0, busy_w1)},
        "other_cores": {"idle": others(cpu_idle0, cpu_idle1, busy_idle0, busy_idle1,
                                       t_idle1 - t_idle0),
                        "window": others(cpu_w0, cpu_w1, busy_w0, busy_w1, t_seen - t_save_end)},
        "states": [] if tw is None else [(round(t - t_save_end, 3), ds, fs)
                                         for t, ds, fs in tw.states],
        "steps_ms": rel,  # (step end after the save's end, step time), both ms
    }


# ---------------------------------------------------------------------- report

COLUMNS = ["setting", "idle median ms", "bg median ms", "ratio", "idle p99", "bg p99",
           "ratio p99", "steps", "sealed s", "replicated s", "backed up s", "daemon CPU s"]


def _rows(runs: dict[str, list[dict[str, Any]]], names: list[str],
          cells: Callable[[Callable[..., str], list[dict[str, Any]]], list[str]]
          ) -> list[list[str]]:
    """One row per setting that ran: its name, then ``cells(col, runs)``, where
    ``col(get, digits=2)`` is the median of ``get(run)`` over its runs with its noise."""
    rows = []
    for name in names:
        rs = runs.get(name) or []
        if rs:
            rows.append([name, *cells(
                lambda get, digits=2: fmt_noise([get(r) for r in rs], digits), rs)])
    return rows


def table_rows(runs: dict[str, list[dict[str, Any]]], names: list[str]) -> list[list[str]]:
    return _rows(runs, names, lambda col, rs: [
            col(lambda r: r["idle"]["median_ms"], 1), col(lambda r: r["bg"]["median_ms"], 1),
            col(lambda r: r["ratio_median"]), col(lambda r: r["idle"]["p99_ms"], 1),
            col(lambda r: r["bg"]["p99_ms"], 1), col(lambda r: r["ratio_p99"]),
            fmt(median([r["bg"]["n"] for r in rs]), 0),
            col(lambda r: r["tiers_s"]["sealed"]), col(lambda r: r["tiers_s"]["replicated"]),
            col(lambda r: r["tiers_s"]["backed_up"]),
            col(lambda r: r["daemon_cpu_s"]["window_total"])])


NOISE_COLUMNS = ["setting", "idle median ms", "tail median ms", "tail/idle", "idle p99",
                 "tail p99", "tail/idle p99", "save s", "window s", "trainer idle, cores",
                 "trainer window, cores", "daemons idle, cores", "others idle, cores",
                 "others window, cores"]


def noise_rows(runs: dict[str, list[dict[str, Any]]], names: list[str]) -> list[list[str]]:
    """The trainer on its own: the idle phase against the tail after the window (no
    background work in either), and what the machine did meanwhile."""
    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None
    return _rows(runs, names, lambda col, rs: [
            col(lambda r: r["idle"]["median_ms"], 1),
            col(lambda r: r["tail"]["median_ms"], 1),
            col(lambda r: div(r["tail"]["median_ms"], r["idle"]["median_ms"])),
            col(lambda r: r["idle"]["p99_ms"], 1), col(lambda r: r["tail"]["p99_ms"], 1),
            col(lambda r: div(r["tail"]["p99_ms"], r["idle"]["p99_ms"])),
            col(lambda r: r["save_s"]), col(lambda r: r["window_s"]),
            col(lambda r: r["trainer_cores"]["idle"]), col(lambda r: r["trainer_cores"]["window"]),
            col(lambda r: div(sum(r["daemon_cpu_s"]["idle"].values()) or None,
                              r["idle"]["seconds"]), 3),
            col(lambda r: r["other_cores"]["idle"]), col(lambda r: r["other_cores"]["window"])])


def render(title: str, rows: list[list[str]], columns: list[str] = COLUMNS) -> str:
    out = [f"\n{title}\n", "| " + " | ".join(columns) + " |", "| --- " * len(columns) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    if not rows:
        out.append("(no setting ran)")
    return "\n".join(out)


def plot(runs: dict[str, list[dict[str, Any]]], names: list[str], path: Path,
         title: str) -> str:
    """Step time against time since the save's end, the first run of each setting, the
    tiers' arrival marked. Returns what was done, for the output."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        return "plot: skipped (matplotlib is not importable)"
    fig, ax = plt.subplots(figsize=(12, 6))
    styles = {"sealed": ":", "replicated": "--", "backed_up": "-."}
    tops = []
    for i, name in enumerate(n for n in names if runs.get(n)):
        r = runs[name][0]
        color = f"C{i}"
        label = (f"{name} (bg/idle median {fmt(r['ratio_median'])}, p99 "
                 f"{fmt(r['ratio_p99'])})")
        for part in ([p for p in r["steps_ms"] if p[0] <= 0],  # before the save,
                     [p for p in r["steps_ms"] if p[0] > 0]):  # after it
            t = [p[0] / 1e3 for p in part]
            v = [p[1] for p in part]
            ax.plot(t, v, ".", ms=2, alpha=0.25, color=color)
            k = 9  # rolling median, for the eye
            smooth = [statistics.median(v[max(0, j - k // 2):j + k // 2 + 1])
                      for j in range(len(v))]
            ax.plot(t, smooth, "-", lw=1.2, color=color, label=label)
            label = None
        for tier, ls in styles.items():
            x = r["tiers_s"].get(tier)
            if x is not None:
                ax.axvline(x, ls=ls, color=color, lw=1)
        tops.append(max(r["idle"]["p99_ms"] or 0, r["bg"]["p99_ms"] or 0))
    if tops:
        ax.set_ylim(0, max(tops) * 1.5)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel("seconds since the save's end (the save itself: the gap before 0)")
    ax.set_ylabel("trainer step time, ms (dots: steps; line: rolling median of 9)")
    ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=10)
    first = ax.legend(loc="upper left", fontsize=8)
    ax.add_artist(first)
    ax.legend([Line2D([0], [0], color="k", ls=ls, lw=1) for ls in styles.values()],
              ["sealed", "replicated 1/1", "backed up"], loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


# ---------------------------------------------------------------------- main

def parse_options(text: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        k, eq, v = item.partition("=")
        out[k] = v if eq else None
    return out


def _size(text: str) -> int:
    from mtcfs.options import parse_size
    try:
        return parse_size(text)
    except Exception as exc:  # noqa: BLE001
        raise argparse.ArgumentTypeError(str(exc)) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_interference",
                                description=__doc__.split("\n\n")[0].replace("\n", " "),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=_size, default=int(1.5 * GiB),
                   help="bytes of the trainer's state tensor in the checkpoint (1.5G)")
    p.add_argument("--reps", type=int, default=2, help="repeats of every setting (2)")
    p.add_argument("--settings", default=DEFAULT_SETTINGS,
                   help=f"comma list of {', '.join(SETTINGS)} (default {DEFAULT_SETTINGS})")
    p.add_argument("--options", default="", help="k=v,... mount options for every setting")
    p.add_argument("--warmup-s", type=float, default=3.0,
                   help="training before the idle phase, seconds (3)")
    p.add_argument("--idle-s", type=float, default=8.0,
                   help="the idle phase: mounted, nothing to do, seconds (8)")
    p.add_argument("--tail-s", type=float, default=3.0,
                   help="training after the last tier, seconds (3)")
    p.add_argument("--control-window-s", type=float, default=5.0,
                   help="the window of the tmpfs control (5)")
    p.add_argument("--poll-hz", type=float, default=5.0,
                   help="getxattr polls of the step's state per second (5)")
    p.add_argument("--quiet-wait", type=float, default=120.0,
                   help="before each run, wait at most this long (seconds) for other work "
                        "on the machine to stop (120; 0: do not wait)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="deadline of each setting and repeat, seconds (300)")
    p.add_argument("--trainer-cpu", type=int, help="pin the trainer to this CPU in every "
                   "setting (pinned: CPU 0 whatever this says)")
    p.add_argument("--width", type=int, default=512, help="the MLP's hidden width (512)")
    p.add_argument("--batch", type=int, default=128, help="the fixed batch's rows (128)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--store-size", help="size= of each node (default: 2 x --size + 1G, "
                   "at least 4G)")
    p.add_argument("--tls", action="store_true", help="the peers speak mutual TLS")
    p.add_argument("--no-prefault", dest="prefault", action="store_false",
                   help="do not touch RAM before each run (common.prefault)")
    p.add_argument("--json", type=Path,
                   help="results file (default bench-results/interference-<timestamp>.json)")
    p.add_argument("--png", type=Path, help="the plot (default: the JSON's name, .png); "
                   "'-' for none")
    p.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("interrupted: every mount, daemon and scratch directory of this run was "
              "cleaned up", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if a.trainer:
        return trainer_main(a)
    names = [n.strip() for n in a.settings.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or not names:
        p.error(f"unknown setting(s) {', '.join(unknown) or '(none given)'}: "
                f"choose from {', '.join(SETTINGS)}")
    if len(set(names)) != len(names):
        p.error("a setting is named twice in --settings")
    if a.reps < 1 or a.size < MiB or a.poll_hz <= 0 or a.timeout <= 0:
        p.error("--reps >= 1, --size >= 1M, --poll-hz > 0 and --timeout > 0, please")
    cpus = sorted(os.sched_getaffinity(0))
    if a.trainer_cpu is not None and a.trainer_cpu not in cpus:
        p.error(f"--trainer-cpu {a.trainer_cpu}: this process may run on CPUs {cpus}")
    a.extra_options = parse_options(a.options)

    def on_term(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_json = a.json or REPO / "bench-results" / f"interference-{stamp}.json"
    out_png = None if a.png == Path("-") else (a.png or out_json.with_suffix(".png"))
    info = machine_info()
    print(f"mtcfs background interference: settings {','.join(names)}, state "
          f"{a.size / GiB:.3g} GiB, {a.reps} repeat(s), {info.get('nproc')} CPUs, load "
          f"{', '.join(f'{x:.2f}' for x in info['loadavg'])}, git {info['git']['head']}",
          flush=True)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    skipped: dict[str, str] = {}
    errors: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with scratch_dir(SCRATCH_SHM, "interference") as root, \
            scratch_dir(SCRATCH_DISK, "interference-backup") as bkroot:
        for rep in range(a.reps):
            for name in (names if rep % 2 == 0 else names[::-1]):
                if name in skipped:
                    continue
                s = SETTINGS[name]
                log(f"{name} rep {rep}: {s.what}; options "
                    f"{({**s.options, **a.extra_options}) or '-'}"
                    + ("" if s.cpu is None else f", trainer on CPU {s.cpu}"))
                quiet = wait_quiet(a.quiet_wait)
                try:
                    r = run_setting(s, rep, a, root, bkroot)
                except SkipSetting as exc:
                    skipped[name] = str(exc)
                    print(f"SKIP {name}: its mount was refused: {exc}", flush=True)
                    continue
                except (TimeoutError, RuntimeError, OSError) as exc:
                    msg = str(exc).strip()
                    errors.append({"setting": name, "rep": rep,
                                   "error": f"{type(exc).__name__}: {msg}"})
                    print(f"ERROR {name} rep {rep}: {type(exc).__name__}: "
                          f"{msg.splitlines()[0][:300] if msg else ''}", flush=True)
                    continue
                r["busy_cores_before"] = round(quiet, 3)
                runs[name].append(r)
                ts = r["tiers_s"]
                log(f"{name} rep {rep}: idle {fmt(r['idle']['median_ms'], 1)}/"
                    f"{fmt(r['idle']['p99_ms'], 1)} ms (median/p99, {r['idle']['n']} steps), "
                    f"background {fmt(r['bg']['median_ms'], 1)}/{fmt(r['bg']['p99_ms'], 1)} ms "
                    f"({r['bg']['n']} steps in {r['window_s']:.2f} s), tail "
                    f"{fmt(r['tail']['median_ms'], 1)} ms; save {r['save_s']:.2f} s; sealed "
                    f"{fmt(ts['sealed'])} replicated {fmt(ts['replicated'])} backed up "
                    f"{fmt(ts['backed_up'])} s; daemon CPU {r['daemon_cpu_s']['window']}")
                os.sync()  # the backup tier's dirty pages: not in the next run's idle phase
    title = (f"trainer step time, idle vs while mtcfs seals, replicates and backs up a "
             f"{a.size / GiB:.3g} GiB torch.save (2 nodes on loopback, replicas=1, file:// "
             f"backup, 1ckpt); median of {a.reps}")
    rows = table_rows(runs, names)
    print(render(title, rows))
    nrows = noise_rows(runs, names)
    if nrows:
        print(render("the trainer without background work: the idle phase against the "
                     "tail (after the last tier); trainer: the CPU it got (1.00: a whole "
                     "core); others: cores busy with processes not of this run (kernel "
                     "threads included)", nrows, NOISE_COLUMNS))
    notes = []
    for name, why in skipped.items():
        notes.append(f"{name}: SKIPPED, the mount refused its options: {why}")
    for e in errors:
        notes.append(f"{e['setting']} rep {e['rep']}: FAILED: "
                     f"{e['error'].splitlines()[0][:300]}")
    all_runs = [r for rs in runs.values() for r in rs]
    busy = [f"{r['setting']} rep {r['rep']} ({r['other_cores']['idle']:.2f} cores)"
            for r in all_runs if r["other_cores"]["idle"] > OTHERS_WARN]
    if busy:
        notes.append("WARNING: other work ran beside the benchmark in the idle phase of "
                     + ", ".join(busy) + ": those runs are not clean")
    idle_medians = [r["idle"]["median_ms"] for r in all_runs]
    if len(idle_medians) > 1:
        notes.append(f"idle median across all runs: {fmt(min(idle_medians), 1)}-"
                     f"{fmt(max(idle_medians), 1)} ms (spread "
                     f"{fmt((spread(idle_medians) or 0) * 100, 0)}%)")
    if all_runs:
        late = [r["tier_source"].get(t) for r in all_runs for t in ("replicated", "backed_up")]
        if any(x and x != "log" for x in late):
            notes.append("some replicated/backed-up times come from the xattr poll "
                         f"(1/{a.poll_hz:g} s resolution), not from the log")
    for n in notes:
        print(n)
    doc = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), "-m",
                             "benchmarks.bench_interference"]
                            + (argv if argv is not None else sys.argv[1:])),
        "title": title, "columns": COLUMNS, "rows": rows, "notes": notes,
        "noise_columns": NOISE_COLUMNS, "noise_rows": nrows,
        "settings": {n: {"options": SETTINGS[n].options, "trainer_cpu": SETTINGS[n].cpu,
                         "control": SETTINGS[n].control, "what": SETTINGS[n].what}
                     for n in names},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "store_size": store_size(a), "skipped": skipped, "errors": errors, "runs": runs,
        "machine": info, "git": git_state(),
        "seconds": round(time.monotonic() - t0, 1),
    }
    doc["machine"]["loadavg_end"] = os.getloadavg()
    write_json(out_json, doc)
    print(f"results: {out_json}")
    if out_png is not None and all_runs:
        print(plot(runs, names, out_png, title))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
