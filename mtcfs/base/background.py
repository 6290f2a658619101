"""The CPU budget of background work: the scheduling class, nice value and CPUs of the
threads that do what no request waits for.

Background work is what runs after a checkpoint's ``close(2)`` without the application
waiting for it: the seal's hashing (scope=node; in scope=job the close waits for it and it
is not background), replication of a step to peers (the sender's reads and, on the peer,
the receiver's hashing and writes), the upload to the backup tier (zstd and the HTTP
requests), the scrub and the replica store's gc. On a training host it competes with the
job for the CPUs; this module lets the operator give it a lower scheduling class
(``bg_sched=``: ``SCHED_IDLE`` by default, sched(7)), a nice value (``bg_nice=``) and a set
of CPUs of its own (``bg_cpus=``).

Latency-critical work never runs here: serving FUSE requests, a read waiting for a chunk,
a restore, the first-read verification, a peer's restore served from this node's replicas.

The policy is set once per thread, on threads that only ever do background work (the
executor pools marked ``background`` in base/pools.py, where ``pools.run_background``
sends a trio task's call), never
on trio's shared worker threads: a thread without ``CAP_SYS_NICE`` cannot raise its
priority back, so a worker that did background work once would stay slow for the
foreground work it did next. Threads a background thread starts inherit its policy
(pthread_create and clone copy the scheduling policy, the nice value and the affinity).

The priority inversion to know about: the GIL. A background thread preempted while it
holds the GIL holds up every thread of the daemon until it runs again, and at
``SCHED_IDLE`` that is when a CPU is idle. mtcfs's background threads hold the GIL for
microseconds between calls that release it (``preadv``, blake3, zstd, ``sendfile``,
socket I/O), and Linux's CFS/EEVDF gives an idle-class thread a small share of a busy CPU
all the same, so the wait is bounded; docs/benchmarks.md ("Background work") measures it.

Against the job's processes the daemon competes as a whole, not thread by thread: Linux
schedules groups first (sched(7), "The autogroup feature"; cgroups), and a thread's class
and nice value only order it among the threads of its own group. A daemon started from a
shell, fstab or ``mount`` is in an autogroup of its own (it calls ``setsid``), so
:func:`set_group_nice` (``daemon_nice=``) lowers that group's weight; under systemd or
Kubernetes the unit's ``CPUWeight=`` or the pod's CPU request decide instead
(docs/usage.md, "Background work").

State: the process-wide :class:`CpuPolicy` (:func:`configure`, once per daemon at start,
before the first background thread) and the native ids of the threads it was applied to
(:func:`stats` reads their CPU and run-queue times from ``/proc``).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

#: Scheduling classes of ``bg_sched=``.
SCHEDS = ("idle", "batch", "normal")
#: ``daemon_nice=``'s default: the daemon's autogroup at nice 0 (set by measurement,
#: docs/benchmarks.md "Background work").
DEFAULT_DAEMON_NICE = 0
#: The most CPUs ``bg_cpus=`` may name (a CPU number is below this).
MAX_CPU = 4096


@dataclass(frozen=True)
class CpuPolicy:
    """How background threads run.

    Attributes:
        sched: ``"idle"`` (``SCHED_IDLE``: runs only on CPUs no other thread wants, at
            ``nice`` 19's weight or less), ``"batch"`` (``SCHED_BATCH``: as normal, but
            never preempts a woken thread) or ``"normal"`` (``SCHED_OTHER``, as the rest
            of the daemon).
        nice: 0..19, the nice value of background threads (with ``batch`` and
            ``normal``; an idle-class thread's nice does not count).
        cpus: the CPUs background threads may run on; empty: those of the daemon.
    """

    sched: Literal["idle", "batch", "normal"] = "idle"
    nice: int = 0
    cpus: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.sched not in SCHEDS:
            raise ValueError(f"bg_sched must be one of {', '.join(SCHEDS)}, "
                             f"got {self.sched!r}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"bg_nice must be between 0 and 19, got {self.nice}")

    def describe(self) -> str:
        """One line for the log and ``mtcfs status``: ``idle, CPUs 1,3`` and the like."""
        how = self.sched if self.sched == "idle" or not self.nice \
            else f"{self.sched}, nice {self.nice}"
        return f"{how}, {'CPUs ' + format_cpus(self.cpus) if self.cpus else 'all CPUs'}"


def parse_cpus(text: str) -> frozenset[int]:
    """``"1"``, ``"0,2-3"`` -> the CPU numbers (a Linux cpulist, as taskset -c takes).

    Raises:
        ValueError: empty, not a list of numbers and ranges, a range backwards, or a CPU
            number of :data:`MAX_CPU` or more.
    """
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list (as taskset -c takes: 1,3-4): {text[:40]!r}")
        a, b = int(lo), int(hi) if sep else int(lo)
        if a > b:
            raise ValueError(f"CPU range {part!r} runs backwards")
        if b >= MAX_CPU:
            raise ValueError(f"CPU {b} is past the last CPU mtcfs knows ({MAX_CPU - 1})")
        out.update(range(a, b + 1))
    return frozenset(out)


def format_cpus(cpus: frozenset[int]) -> str:
    """The inverse of :func:`parse_cpus`: ``{0, 2, 3}`` -> ``"0,2-3"``."""
    runs: list[str] = []
    for c in sorted(cpus):
        if runs and runs[-1].split("-")[-1] == str(c - 1):
            runs[-1] = f"{runs[-1].split('-')[0]}-{c}"
        else:
            runs.append(str(c))
    return ",".join(runs)


_lock = threading.Lock()
_policy = CpuPolicy(sched="normal")  # until configure(): nothing changes
_threads: dict[int, str] = {}  # native id -> thread name, of threads the policy was set on
_error: str | None = None


def configure(policy: CpuPolicy) -> None:
    """Set the process's policy for background threads started from now on (the daemon,
    at start; a thread already started keeps what it had)."""
    global _policy, _error
    with _lock:
        _policy, _error = policy, None


def policy() -> CpuPolicy:
    """The policy :func:`configure` set."""
    return _policy


def enter() -> None:
    """Make the calling thread a background thread for the rest of its life (an executor's
    initializer). Never raises: a refusal (a CPU set the daemon may not use: EINVAL) is
    kept for :func:`stats` and the thread runs as it was."""
    global _error
    pol = _policy
    tid = threading.get_native_id()
    try:
        if pol.sched == "idle":
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        elif pol.sched == "batch":
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        if pol.nice and pol.sched != "idle":
            # PRIO_PROCESS of a thread id: on Linux the nice value is a thread's own.
            os.setpriority(os.PRIO_PROCESS, tid, max(pol.nice, os.getpriority(
                os.PRIO_PROCESS, tid)))
        if pol.cpus:
            os.sched_setaffinity(0, pol.cpus)
    except OSError as exc:
        with _lock:
            if _error is None:
                _error = f"background thread policy not applied ({pol.describe()}): {exc}"
    with _lock:
        _threads[tid] = threading.current_thread().name


def set_group_nice(nice: int, path: str = "/proc/self/autogroup") -> str:
    """Set the nice value of the daemon's autogroup (``daemon_nice=``, 0..19) and return
    what ``mtcfs status`` shows: ``"autogroup-N nice 10"``, or why it is not in effect.

    The autogroup counts only for processes in the root cgroup of the cpu controller (a
    bare host, a shell, ``mount``); under systemd or Kubernetes the value is set but the
    cgroup's weight decides. Only a daemon that leads its own session (it daemonized)
    changes it: in the foreground (``-f``) the autogroup is the caller's, maybe the job's.
    Never raises."""
    if nice and os.getsid(0) != os.getpid():
        return "not set (the daemon runs in the foreground, in its caller's session)"
    try:
        if nice:
            with open(path, "w") as f:
                f.write(str(nice))
        with open(path) as f:
            got = f.read().strip().lstrip("/")
    except OSError as exc:
        return f"not set ({exc.strerror or exc})"
    return got if _in_root_cpu_cgroup() else f"{got} (not in effect: the daemon is in a cgroup)"


def _in_root_cpu_cgroup() -> bool:
    """Whether this process is in the root cgroup of the cpu controller (v1) or of the
    unified hierarchy (v2): where Linux schedules by autogroup."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [ln.strip().split(":", 2) for ln in f if ln.strip()]
    except OSError:
        return False
    for _id, ctrls, path in lines:
        if "cpu" in ctrls.split(","):
            return path == "/"
    return all(path == "/" for _id, ctrls, path in lines if ctrls == "")


def _task_times(tid: int) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds waiting on a run queue) of one thread of this process
    (``/proc/self/task/TID/schedstat``, ns); None if it has ended."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            run, wait, _slices = f.read().split()[:3]
    except (OSError, ValueError):
        return None
    return int(run) / 1e9, int(wait) / 1e9


def stats() -> dict[str, Any]:
    """What ``mtcfs status`` shows under ``budget.cpu``: the policy (``sched``, ``nice``,
    ``cpus``: a cpulist or ``"all"``), ``threads`` (background threads alive),
    ``cpu_s`` (CPU seconds they used) and ``runqueue_wait_s`` (seconds they were ready to
    run and waited for a CPU: what the scheduling class held them back, with the run-queue
    wait any thread has on a busy host), ``error`` (why the policy could not be applied,
    or None). Seconds are since each thread started."""
    with _lock:
        tids = list(_threads)
    cpu = waited = 0.0
    alive = 0
    for tid in tids:
        t = _task_times(tid)
        if t is None:
            with _lock:
                _threads.pop(tid, None)
            continue  # (pools end their threads only at exit)
        alive += 1
        cpu += t[0]
        waited += t[1]
    pol = _policy
    return {"sched": pol.sched, "nice": pol.nice,
            "cpus": format_cpus(pol.cpus) if pol.cpus else "all",
            "threads": alive, "cpu_s": round(cpu, 3), "runqueue_wait_s": round(waited, 3),
            "error": _error}
