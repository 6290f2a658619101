"""A seeded chaos run: several real mtcfs daemons on loopback, a DCP-style save loop, faults.

One engine for the short form in the test suite (``tests/t7_chaos_test.py``) and the long
form (``examples/chaos.py``, ``make chaos``); what it does and the figures of one long run
are in docs/reliability.md.

* **Nodes**: a :class:`support.cluster.Cluster` of ``nodes`` daemons (``scope=node`` or
  ``scope=job``, ``replicas=1``, ``chunk_size=1M``, ``backup_interval=1ckpt``) with a
  ``file://`` backup tier (or ``gs://`` on the gcp-storage-emulator behind a
  :class:`support.gcs.FlakyProxy`).
* **Save loop**, as PyTorch DCP writes: each rank writes ``step_N/__<rank>_0.distcp``
  (deterministic pseudo-random bytes of ``(seed, step, rank)``) through its own node's
  mount. scope=job: rank 0 makes the directory and writes ``.metadata`` last (the commit);
  scope=node: every rank writes its own step directory and commits it with ``.metadata`` or
  ``commit_success.txt``. A step is *committed* when every commit call returned. As a
  trainer's ``keep_last_n`` does, steps older than the newest ``retain`` committed ones are
  deleted through the mounts.
* **Faults**, from a plan drawn from ``random.Random`` seeded by ``(seed, fault index)``
  (the first ``len(kinds)`` faults cover every kind once, in a seeded order): see
  :data:`FAULT_KINDS`. One fault at a time; a timed fault is healed by a timer thread, so a
  save or read blocked by it can never keep it from healing.
* **Readers**: after each committed step and around each fault, files are read back and
  compared with the bytes that were written: through OTHER nodes (scope=job), through the
  node itself (scope=node), through a replacement, through the survivors while a node is
  dead. Every read (and every other call into a mount) goes through :meth:`Chaos._guarded`:
  a thread with a deadline of :data:`READ_BOUND_S`. A read still waiting at the bound is a
  violation; the reading node's FUSE connection is then aborted (mtcfs.base.mountinfo's
  ``force_unmount``) so the thread returns, and the node is restarted on its store.
* **Invariants** (a breach is a *violation*; the run must end with none):

  1. no read returns bytes that differ from what was written;
  2. no read (or other call into a mount) waits longer than :data:`READ_BOUND_S`;
  3. every step whose commit returned, unless the app deleted it or the chaos itself
     destroyed it (a chunk corrupted in every tier, or its only complete copies on a node
     that was lost before it was replicated or backed up), is read back bit-exact at the
     end (scope=job: through every node; scope=node: through its rank's node, or, for an
     older step a replacement did not bring back, found complete in a replica store or the
     backup tier);
  4. a step the daemon called durable (``user.mtcfs.state`` ``replicated k/R`` or
     ``backed-up``) still has a complete copy off the node when that node is lost;
  5. ``mtcfs verify`` reports a chunk corrupted in a node's RAM tier;
  6. after every fault healed, a new step is saved, replicated and backed up;
  7. every daemon not killed answers ``mtcfs status`` (after each fault and at the end);
  8. nothing is left mounted or running when the run ends.

  A read that fails with EIO is not a violation by itself: it is recorded with its reason
  (no tier holds a good copy; the good copies were on unreachable nodes; the node's
  namespace was unavailable; or unexplained). Local reads of a file whose chunk was
  corrupted in that same node's RAM tier are skipped (mtcfs does not re-hash its own RAM on
  read, by design; ``mtcfs verify`` is the check, invariant 5), unless ``strict_local_ram``.

Use::

    res = run_chaos(ChaosConfig(seed=7, scope="job", nodes=4, faults=12), root=tmpdir)
    print(res.table())
    assert res.violations == []
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtcfs import control
from mtcfs.base.chunking import chunk_hash
from mtcfs.core.faultin import FETCH_DEADLINE_S, REFETCH_AFTER_S
from mtcfs.base.manifest import StepManifest
from mtcfs.base.mountinfo import force_unmount

from .cluster import Cluster
from .mount import remove_tree
from .poll import alive

#: Seconds past the documented bound a call into a mount may take on a loaded 2-core
#: machine before it counts as a violation.
BOUND_MARGIN_S = 30.0
#: The longest any read (or other call into a mount) may wait, in seconds, at the default
#: ``read_timeout`` (60 s). The documented bounds: a read fails with EIO when the fetch of a
#: chunk found no source within ``read_timeout`` (docs/usage.md, docs/reliability.md), and a
#: scope=job call that reaches no leader fails with EIO after 60 s (docs/consistency.md).
#: :func:`read_bound` gives it for another ``read_timeout``.
NAMESPACE_BOUND_S = 60.0
READ_BOUND_S = max(FETCH_DEADLINE_S, NAMESPACE_BOUND_S) + BOUND_MARGIN_S

#: fault-in fails a read of a chunk whose fetch failed less than this long ago at once
#: (mtcfs/core/faultin.py REFETCH_AFTER_S; one more second for the reader's own timing)
REFETCH_WINDOW_S = REFETCH_AFTER_S + 1.0


def read_bound(read_timeout_s: float) -> float:
    """Invariant 2's bound for mounts with ``read_timeout=read_timeout_s``."""
    return max(read_timeout_s, NAMESPACE_BOUND_S) + BOUND_MARGIN_S

#: Fault kinds, in table order.
FAULT_KINDS = (
    "kill_replace",        # SIGKILL a daemon, wipe its store, mount a replacement
    "kill_restart",        # SIGKILL a daemon, mount it again on the same store
    "sigstop",             # SIGSTOP a daemon for a few seconds, then SIGCONT
    "partition",           # cut the network (the daemons' fault hook) for a few seconds
    "corrupt_ram",         # flip bytes of a chunk in a node's RAM tier (<store>/data/<vid>)
    "corrupt_replica",     # flip bytes of a chunk in a replica store (<store>/replicas/chunks)
    "corrupt_backup",      # flip bytes of a chunk in the backup tier (chunks/<h2>/<h>.zst)
    "backup_outage",       # the backup tier fails for a few seconds
    "corrupt_every_tier",  # one chunk corrupted in every copy: reads must fail, not lie
)

FAULT_LABELS = {
    "kill_replace": "SIGKILL + replacement on a wiped store",
    "kill_restart": "SIGKILL + restart on the same store",
    "sigstop": "SIGSTOP, then SIGCONT",
    "partition": "network partition, then heal",
    "corrupt_ram": "chunk corrupted in a RAM tier",
    "corrupt_replica": "chunk corrupted in a replica store",
    "corrupt_backup": "chunk corrupted in the backup tier",
    "backup_outage": "backup tier unavailable",
    "corrupt_every_tier": "chunk corrupted in every tier",
}

#: How often each kind is drawn once every kind has had its turn.
KIND_WEIGHTS = {"kill_replace": 3, "kill_restart": 2, "sigstop": 3, "partition": 3,
                "corrupt_ram": 2, "corrupt_replica": 2, "corrupt_backup": 2,
                "backup_outage": 2, "corrupt_every_tier": 1}

MiB = 1 << 20
JOB = "chaos"
STATUS_TIMEOUT_S = 30.0     # a daemon that does not answer status within this is not serving
FINAL_DURABLE_S = 120.0     # invariant 6: the last step backed up and replicated within this
_DURABLE = re.compile(r"^(replicated [1-9]\d*/\d+|backed-up)$")


# ------------------------------------------------------------------------------ config

@dataclass
class ChaosConfig:
    """One chaos run.

    Args:
        seed: the seed of the fault plan and of every byte written.
        nodes: daemons (ranks), at least 2.
        scope: ``"job"`` or ``"node"``.
        faults: how many faults to inject; with ``minutes`` too, whichever comes first.
        minutes: inject faults for this long (the final checks come after).
        backup: ``"file"`` or ``"gcs"`` (gcp-storage-emulator behind a FlakyProxy).
        kinds: the fault kinds to draw from.
        file_size: about this many bytes per rank file (the exact size varies per file).
        chunk_size: the mounts' ``chunk_size``.
        retain: committed steps the save loop keeps; older ones are deleted.
        read_timeout_s: the mounts' ``read_timeout`` (seconds).
        read_bound_s: invariant 2's bound (default: :func:`read_bound` of read_timeout_s).
        max_wall_s: a hard cap on the fault phase (then the final checks run anyway).
        strict_local_ram: also read files through a node whose RAM copy was corrupted.
        verbose: print the event log as it happens (else it is kept in the result).
        target_wait_s: how long a corruption waits for a tier to hold something to corrupt
            (the backup fills lazily) before it is skipped.
    """

    seed: int = 1
    nodes: int = 4
    scope: str = "job"
    faults: int | None = None
    minutes: float | None = None
    backup: str = "file"
    kinds: tuple[str, ...] = FAULT_KINDS
    file_size: int = 2_500_000
    chunk_size: int = MiB
    retain: int = 2
    read_timeout_s: float = FETCH_DEADLINE_S
    read_bound_s: float | None = None
    max_wall_s: float | None = None
    strict_local_ram: bool = False
    verbose: bool = False
    target_wait_s: float = 30.0

    def __post_init__(self) -> None:
        if self.scope not in ("job", "node"):
            raise ValueError(f"scope must be job or node, got {self.scope!r}")
        if self.nodes < 2:
            raise ValueError("a chaos run needs at least 2 nodes")
        if self.read_bound_s is None:
            self.read_bound_s = read_bound(self.read_timeout_s)
        if self.backup not in ("file", "gcs"):
            raise ValueError(f"backup must be file or gcs, got {self.backup!r}")
        bad = set(self.kinds) - set(FAULT_KINDS)
        if bad or not self.kinds:
            raise ValueError(f"unknown fault kinds {sorted(bad)}; known: {FAULT_KINDS}")
        if self.faults is None and self.minutes is None:
            self.faults = len(self.kinds)


# ------------------------------------------------------------------------------ result

@dataclass
class Violation:
    invariant: str    # "wrong bytes", "wait over bound", "not restorable", ...
    what: str         # one line
    detail: str = ""  # log excerpts, offsets, ...
    at_s: float = 0.0
    fault: str = ""   # the fault in progress (or last one) when it was seen

    def __str__(self) -> str:
        head = f"[{self.at_s:7.1f}s] {self.invariant}: {self.what}"
        if self.fault:
            head += f"  (during/after: {self.fault})"
        return head + (("\n" + self.detail) if self.detail else "")


@dataclass
class ChaosResult:
    config: ChaosConfig
    duration_s: float = 0.0
    faults: Counter = field(default_factory=Counter)        # kind -> injected
    fault_log: list[str] = field(default_factory=list)      # one line per fault
    harness_restarts: int = 0       # nodes restarted after their connection was aborted
    steps_attempted: int = 0
    steps_committed: int = 0
    save_errors: Counter = field(default_factory=Counter)   # reason -> count
    save_error_examples: list[str] = field(default_factory=list)
    steps_deleted: int = 0
    reads: int = 0
    reads_ok: int = 0
    bytes_verified: int = 0
    reads_skipped_local_ram: int = 0
    eio: Counter = field(default_factory=Counter)           # reason -> count
    eio_examples: list[str] = field(default_factory=list)
    read_errors: Counter = field(default_factory=Counter)   # other errno/reason -> count
    longest_read_s: float = 0.0
    longest_read_what: str = ""
    longest_op_s: float = 0.0
    longest_op_what: str = ""
    replacements: list[str] = field(default_factory=list)
    lost_files: list[str] = field(default_factory=list)     # excused losses, with reasons
    final_files_checked: int = 0
    tier_checked: int = 0
    violations: list[Violation] = field(default_factory=list)
    events: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def table(self) -> str:
        c = self.config
        w = 50
        rows: list[str] = []

        def row(label: str, value: object) -> None:
            rows.append(f"  {label:<{w}} {value}")
        rows.append(f"chaos run: seed {c.seed}, scope={c.scope}, {c.nodes} nodes, "
                    f"backup={c.backup}, {self.duration_s:.0f} s")
        rows.append(f"faults injected: {sum(self.faults.values())}")
        for k in FAULT_KINDS:
            if k in c.kinds or self.faults.get(k):
                row(FAULT_LABELS[k], self.faults.get(k, 0))
        if self.harness_restarts:
            row("nodes restarted after an aborted read", self.harness_restarts)
        rows.append("save loop:")
        row("steps attempted", self.steps_attempted)
        row("steps committed", self.steps_committed)
        for why, n in sorted(self.save_errors.items()):
            row(f"save failed: {why}", n)
        row("steps deleted by the app (retention)", self.steps_deleted)
        rows.append("reads:")
        row("reads made", self.reads)
        row("reads bit-exact", self.reads_ok)
        row("bytes verified", f"{self.bytes_verified} ({self.bytes_verified / MiB:.1f} MiB)")
        row("local reads skipped (RAM copy corrupted)", self.reads_skipped_local_ram)
        row("reads failed with EIO", sum(self.eio.values()))
        for why, n in sorted(self.eio.items()):
            row(f"  EIO: {why}", n)
        for why, n in sorted(self.read_errors.items()):
            row(f"other read error: {why}", n)
        row("longest read wait", f"{self.longest_read_s:.2f} s ({self.longest_read_what})")
        row("longest other call into a mount",
            f"{self.longest_op_s:.2f} s ({self.longest_op_what})")
        row("files lost by design (excused)", len(self.lost_files))
        row("final check: files read back bit-exact", self.final_files_checked)
        if c.scope == "node":
            row("not restored by a replacement, complete in a tier",
                self.tier_checked)
        rows.append(f"invariant violations: {len(self.violations)}")
        for inv, n in sorted(Counter(v.invariant for v in self.violations).items()):
            row(inv, n)
        return "\n".join(rows)

    def report(self) -> str:
        """The table, the faults, and every violation with its detail."""
        out = [self.table(), "", "faults:"] + [f"  {f}" for f in self.fault_log]
        if self.lost_files:
            out += ["", "files lost by design:"] + [f"  {x}" for x in self.lost_files[:40]]
        if self.save_error_examples:
            out += ["", "failed saves (first 20):"] + [f"  {x}" for x in
                                                      self.save_error_examples[:20]]
        if self.eio_examples:
            out += ["", "EIO reads (first 20):"] + [f"  {x}" for x in self.eio_examples[:20]]
        if self.violations:
            out += ["", "VIOLATIONS:"] + [str(v) for v in self.violations]
        return "\n".join(out)


# ------------------------------------------------------------------------------ data model

def file_size(cfg: ChaosConfig, step: int, rank: int) -> int:
    """The size of rank ``rank``'s file of ``step``: ``file_size`` give or take half a
    chunk."""
    r = random.Random(f"mtcfs-chaos-size:{cfg.seed}:{step}:{rank}")
    return max(1, cfg.file_size - cfg.chunk_size // 2 + r.randrange(1, cfg.chunk_size))


def file_bytes(cfg: ChaosConfig, step: int, rank: int) -> bytes:
    """The bytes rank ``rank`` writes into its file of ``step``."""
    return random.Random(f"mtcfs-chaos-data:{cfg.seed}:{step}:{rank}").randbytes(
        file_size(cfg, step, rank))


def marker_bytes(cfg: ChaosConfig, step: int, rank: int | None) -> bytes:
    who = "job" if rank is None else f"rank {rank}"
    return (f'{{"chaos_seed": {cfg.seed}, "step": {step}, "by": "{who}", '
            f'"ranks": {cfg.nodes}}}\n').encode()


@dataclass
class FileRec:
    step: int
    rel: str             # path relative to the mount root
    rank: int            # the rank that wrote it (scope=node: also the only node that has it)
    size: int
    big: bool            # a .distcp file (chunked, fetched); markers are small
    lost: str | None = None        # why it may be gone (excused), if so
    at_risk: str | None = None     # why it would be gone if the node being killed is wiped
    corrupt_chunks: set[int] = field(default_factory=set)  # chunks the chaos corrupted
    _data: bytes | None = None
    _chunks: list[str] | None = None


@dataclass
class StepRec:
    step: int
    files: list[FileRec]
    committed: bool = False
    deleted: bool = False
    commit_source: str = ""
    absent_on: set[int] = field(default_factory=set)  # scope=node: replaced nodes that
    #                                                   did not bring this step back

    @property
    def name(self) -> str:
        return f"step_{self.step}"


@dataclass
class FaultPlan:
    index: int
    kind: str
    victim: int
    duration: float
    gap: int                 # save iterations before the fault
    during: int              # save iterations while a timed fault lasts
    wait_s: float            # before a replacement / restart is mounted
    split: list[list[int]]   # partition groups
    pick: float              # which candidate a corruption takes
    then_kill: bool          # a corruption followed by the loss of the node that wrote it
    mid_save: bool           # a kill while a save is in progress
    after_commit: bool       # a kill right after a commit returned (nothing replicated yet)
    kill_delay: float        # ... this long after the save started
    flips: int               # bytes flipped by a corruption

    def describe(self) -> str:
        if self.kind in ("sigstop",):
            return f"{self.kind} node {self.victim} for {self.duration:.1f}s"
        if self.kind == "partition":
            return f"partition {self.split} for {self.duration:.1f}s"
        if self.kind == "backup_outage":
            return f"backup outage for {self.duration:.1f}s"
        if self.kind in ("kill_replace", "kill_restart"):
            return (f"{self.kind} node {self.victim}"
                    + (f" {self.kill_delay:.2f}s into a save" if self.mid_save else "")
                    + (" right after a commit" if self.after_commit else ""))
        return self.kind


def make_plan(cfg: ChaosConfig, index: int) -> FaultPlan:
    """Fault ``index`` of the run: a function of (seed, index) only, so a seed replays the
    same faults whatever happened before."""
    r = random.Random(f"mtcfs-chaos-fault:{cfg.seed}:{index}")
    order = random.Random(f"mtcfs-chaos-order:{cfg.seed}").sample(list(cfg.kinds),
                                                                  len(cfg.kinds))
    if index < len(order):
        kind = order[index]
        r.random()  # keep the stream the same length either way
    else:
        kinds = list(cfg.kinds)
        kind = r.choices(kinds, weights=[KIND_WEIGHTS[k] for k in kinds])[0]
    victim = r.randrange(cfg.nodes)
    perm = r.sample(range(cfg.nodes), cfg.nodes)
    if r.random() < 0.6:   # one node cut off from the rest
        split = [[victim], sorted(x for x in range(cfg.nodes) if x != victim)]
    else:                  # two halves
        h = cfg.nodes // 2
        split = [sorted(perm[:h]), sorted(perm[h:])]
    duration = {"sigstop": r.uniform(2, 8), "partition": r.uniform(2, 12),
                "backup_outage": r.uniform(3, 12)}.get(kind, r.uniform(2, 8))
    when = r.random()
    return FaultPlan(
        index=index, kind=kind, victim=victim, duration=round(duration, 2),
        gap=2 if index == 0 else r.randint(0, 2), during=r.randint(1, 2),
        wait_s=round(r.uniform(0, 4), 2), split=split, pick=r.random(),
        then_kill=r.random() < 0.5, mid_save=when < 0.25, after_commit=0.25 <= when < 0.5,
        kill_delay=round(r.uniform(0.0, 0.3), 3), flips=r.randint(1, 8))


# ------------------------------------------------------------------------------ backup tiers

class FileTier:
    """The ``file://`` backup tier: a directory; an outage moves it away and leaves a plain
    file in its place (so nothing can recreate it meanwhile)."""

    kind = "file"

    def __init__(self, root: Path) -> None:
        self.root = root / "backup"
        self.root.mkdir(parents=True)
        self._away = root / "backup.away"
        self.url = f"file://{self.root}"
        self.env: dict[str, str] = {}
        self.in_outage = False
        self._lock = threading.Lock()

    def _base(self) -> Path:
        return self._away if self.in_outage else self.root

    def get(self, key: str) -> bytes | None:
        with self._lock:
            try:
                return (self._base() / key).read_bytes()
            except OSError:
                return None

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            (self._base() / key).write_bytes(data)

    def outage_begin(self) -> None:
        with self._lock:
            os.rename(self.root, self._away)
            self.root.write_bytes(b"the backup tier is out (mtcfs chaos run)\n")
            self.in_outage = True

    def outage_end(self) -> None:
        with self._lock:
            if not self.in_outage:
                return
            if self.root.is_dir():  # something recreated it: keep what was written there
                for p in sorted(self.root.rglob("*")):
                    if p.is_file():
                        dst = self._away / p.relative_to(self.root)
                        dst.parent.mkdir(parents=True, exist_ok=True)
                        shutil.move(str(p), dst)
                shutil.rmtree(self.root)
            else:
                self.root.unlink(missing_ok=True)
            os.rename(self._away, self.root)
            self.in_outage = False

    def close(self) -> None:
        if self.in_outage:
            self.outage_end()


class GcsTier:
    """The ``gs://`` backup tier: gcp-storage-emulator, the daemons reaching it through a
    FlakyProxy; an outage makes the proxy fail every request."""

    kind = "gcs"

    def __init__(self, root: Path, seed: int) -> None:
        from mtcfs.tiers.backup.gcs_backend import GCSBackend

        from .gcs import FlakyProxy, GcsEmulator
        self.emu = GcsEmulator().start()
        self.proxy = FlakyProxy(self.emu.url, seed=seed).start()
        # a client that gave up on a reset answer is expected here: no traceback on stderr
        self.proxy._server.handle_error = lambda *a: None  # type: ignore[method-assign]
        prefix = f"chaos-{seed}-{os.getpid()}-{int(time.time())}"
        self.url = f"gs://{self.emu.bucket}/{prefix}"
        self.env = {"STORAGE_EMULATOR_HOST": self.proxy.url}
        self.backend = GCSBackend(self.emu.bucket, prefix, endpoint=self.emu.url)
        self.in_outage = False

    def get(self, key: str) -> bytes | None:
        try:
            return self.backend.get(key)
        except Exception:  # noqa: BLE001 (absent or unreadable: no copy here)
            return None

    def put(self, key: str, data: bytes) -> None:
        self.backend.put(key, data)

    def outage_begin(self) -> None:
        self.proxy.configure(fail_rate=1.0, reset_fraction=0.3)
        self.in_outage = True

    def outage_end(self) -> None:
        self.proxy.configure(fail_rate=0.0)
        self.in_outage = False

    def close(self) -> None:
        for f in (self.proxy.stop, self.emu.stop):
            try:
                f()
            except Exception:  # noqa: BLE001, S110
                pass


# ------------------------------------------------------------------------------ the engine

class _NodeGone(Exception):
    """A node cannot be brought back: the fault phase ends."""


class Chaos:
    """One chaos run; :meth:`run` returns a :class:`ChaosResult` (never raises for what the
    daemons do; an exception of the engine itself is recorded as a violation too)."""

    def __init__(self, cfg: ChaosConfig, root: Path) -> None:
        self.cfg = cfg
        self.root = Path(root)
        self.res = ChaosResult(config=cfg)
        self.t0 = time.monotonic()
        self._lock = threading.RLock()
        self.steps: dict[int, StepRec] = {}
        self.step_no = 0
        self.cluster: Cluster | None = None
        self.tier: FileTier | GcsTier | None = None
        self.down: set[int] = set()          # killed, not remounted yet
        self.stopped: set[int] = set()       # SIGSTOPped
        self.cut: dict[int, set[int]] = {}   # rank -> ranks it cannot reach
        self.broken: set[int] = set()        # connection aborted by the harness
        self.ram_bad: dict[int, set[str]] = {}   # rank -> digests corrupted in its RAM
        self.all_pids: set[int] = set()
        self.current_fault = ""
        self._heal: list[Callable[[], None]] = []   # undo of the timed fault in progress
        self._timers: list[threading.Timer] = []
        self._last_eio: dict[tuple[int, str], float] = {}   # (rank, rel) -> when it ended

    # -- logging ------------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def log(self, msg: str) -> None:
        line = f"[{self.now():7.1f}s] {msg}"
        with self._lock:
            self.res.events.append(line)
        if self.cfg.verbose:
            print(line, flush=True)

    def violation(self, invariant: str, what: str, detail: str = "",
                  ranks: Iterable[int] = ()) -> None:
        logs = "".join(self._log_excerpt(r) for r in sorted(set(ranks)))
        v = Violation(invariant, what, (detail + logs).rstrip(), self.now(), self.current_fault)
        with self._lock:
            self.res.violations.append(v)
        self.log(f"VIOLATION {invariant}: {what}")

    def _log_excerpt(self, rank: int, lines: int = 12) -> str:
        """The end of ``rank``'s daemon log: its last warnings and errors, then its tail."""
        if self.cluster is None:
            return ""
        try:
            text = self.cluster.node(rank).log()
        except Exception:  # noqa: BLE001
            return ""
        all_lines = text.splitlines()
        bad = [ln for ln in all_lines if re.search(r"WARNING|ERROR|Traceback|Error", ln)]
        out = bad[-lines:] + ["..."] + all_lines[-5:]
        return f"\n    --- node {rank} log ---\n" + "\n".join("    " + ln[:300] for ln in out)

    # -- the data -------------------------------------------------------------------------

    def data(self, f: FileRec) -> bytes:
        if f._data is None:
            if f.big:
                f._data = file_bytes(self.cfg, f.step, f.rank)
            else:
                f._data = marker_bytes(self.cfg, f.step, None if self.cfg.scope == "job"
                                       and f.rel.endswith(".metadata") else f.rank)
        return f._data

    def chunks(self, f: FileRec) -> list[str]:
        if f._chunks is None:
            d, cs = self.data(f), self.cfg.chunk_size
            f._chunks = [chunk_hash(d[i:i + cs]) for i in range(0, max(len(d), 1), cs)]
        return f._chunks

    def live_steps(self) -> list[StepRec]:
        """Committed steps the app has not deleted, oldest first."""
        return [s for _, s in sorted(self.steps.items()) if s.committed and not s.deleted]

    def forget_data(self) -> None:
        keep = {s.step for s in self.live_steps()}
        for s in self.steps.values():
            if s.step not in keep:
                for f in s.files:
                    f._data = None

    # -- nodes ---------------------------------------------------------------------------

    def mnt(self, rank: int) -> Path:
        assert self.cluster is not None
        return self.cluster.node(rank).mnt

    def store(self, rank: int) -> Path:
        assert self.cluster is not None
        return self.cluster.node(rank).store

    def up(self) -> list[int]:
        return [r for r in range(self.cfg.nodes) if r not in self.down and r not in self.broken]

    def _record_pid(self, rank: int) -> None:
        assert self.cluster is not None
        pid = self.cluster.node(rank).pid
        if pid:
            self.all_pids.add(pid)

    def _abort(self, rank: int, why: str) -> None:
        """Abort ``rank``'s FUSE connection so every call blocked on it returns."""
        self.log(f"aborting the FUSE connection of node {rank}: {why}")
        with self._lock:
            self.broken.add(rank)
        try:
            force_unmount(str(self.mnt(rank)))
        except Exception as exc:  # noqa: BLE001
            self.log(f"force_unmount of node {rank} failed: {exc}")

    def _restart(self, rank: int, wipe: bool, why: str) -> None:
        """Mount ``rank`` again (after kill9); one retry; :class:`_NodeGone` if it fails."""
        assert self.cluster is not None
        for attempt in (1, 2):
            try:
                self.cluster.restart(rank, wipe=wipe and attempt == 1, timeout=90)
                self._record_pid(rank)
                with self._lock:
                    self.down.discard(rank)
                    self.broken.discard(rank)
                self.log(f"node {rank} mounted again ({why}{', wiped' if wipe else ''})")
                return
            except Exception as exc:  # noqa: BLE001
                self.violation("not serving", f"node {rank} did not mount again ({why}, "
                               f"attempt {attempt}): {str(exc).splitlines()[0][:300]}",
                               ranks=[rank])
                try:
                    self.cluster.kill9(rank)
                except Exception:  # noqa: BLE001, S110
                    pass
        raise _NodeGone(f"node {rank} could not be mounted again")

    def repair(self) -> None:
        """Restart every node whose connection the harness aborted (kill9, same store)."""
        assert self.cluster is not None
        for r in sorted(self.broken - self.down):
            self.cluster.kill9(r)
            with self._lock:
                self.res.harness_restarts += 1
            self._restart(r, wipe=False, why="its connection was aborted")

    def status(self, rank: int, timeout: float = 10.0) -> dict | None:
        try:
            return control.call(str(self.store(rank) / "control.sock"), "status",
                                timeout=timeout)
        except Exception:  # noqa: BLE001
            return None

    def check_serving(self, where: str) -> None:
        """Invariant 7: every node that is up answers status (control socket)."""
        for r in self.up():
            if r in self.stopped:
                continue
            t = time.monotonic()
            st = self.status(r, timeout=STATUS_TIMEOUT_S)
            if st is None:
                self.violation("not serving", f"node {r} did not answer status within "
                               f"{STATUS_TIMEOUT_S:.0f}s ({where})", ranks=[r])
                self._abort(r, "not serving status")
            elif time.monotonic() - t > 5:
                self.log(f"node {r} took {time.monotonic() - t:.1f}s to answer status")
        self.repair()

    # -- guarded calls -------------------------------------------------------------------

    def _guarded(self, rank: int, what: str, fn: Callable[[], Any],
                 read: bool = False) -> tuple[Any, BaseException | None, float, bool]:
        """Run ``fn`` (a call into ``rank``'s mount) in a thread with the bound.

        Returns (value, exception, seconds, over_bound). Over the bound: a violation, and
        the node's FUSE connection is aborted so the thread returns.
        """
        bound = self.cfg.read_bound_s
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["v"] = fn()
            except BaseException as exc:  # noqa: BLE001
                box["e"] = exc
            finally:
                done.set()
        t = time.monotonic()
        th = threading.Thread(target=run, daemon=True, name=f"chaos-n{rank}")
        th.start()
        over = not done.wait(bound)
        took = time.monotonic() - t
        if over:
            self.violation("wait over bound",
                           f"{what} through node {rank} still waiting after {bound:.0f}s",
                           detail=self._where_blocked(th), ranks=self._suspects(rank))
            self._abort(rank, f"{what} over the bound")
            if not done.wait(30):
                self.log(f"{what}: the thread is still blocked 30s after the abort")
            box.setdefault("e", TimeoutError(f"over the {bound:.0f}s bound"))
        with self._lock:
            if read and took > self.res.longest_read_s:
                self.res.longest_read_s, self.res.longest_read_what = took, \
                    f"{what} on node {rank}, {self.current_fault or 'no fault'}"
            if not read and took > self.res.longest_op_s:
                self.res.longest_op_s, self.res.longest_op_what = took, \
                    f"{what} on node {rank}, {self.current_fault or 'no fault'}"
        return box.get("v"), box.get("e"), took, over

    def _suspects(self, rank: int) -> list[int]:
        return sorted({rank, *self.down, *self.stopped} & set(range(self.cfg.nodes)))

    @staticmethod
    def _where_blocked(th: threading.Thread) -> str:
        frame = sys._current_frames().get(th.ident or -1)
        if frame is None:
            return ""
        stack = traceback.format_stack(frame)[-3:]
        return "    blocked in:\n" + "".join("      " + s.strip().replace("\n", "\n      ")
                                             + "\n" for s in stack)

    def _parallel(self, jobs: list[Callable[[], None]]) -> None:
        """Run ``jobs`` at once, one thread each (each bounds its own calls)."""
        errs: list[BaseException] = []

        def wrap(j: Callable[[], None]) -> None:
            try:
                j()
            except BaseException as exc:  # noqa: BLE001
                errs.append(exc)
        ths = [threading.Thread(target=wrap, args=(j,), daemon=True) for j in jobs]
        for t in ths:
            t.start()
        for t in ths:
            t.join(self.cfg.read_bound_s * 4 + 60)
        if errs:
            raise errs[0]

    # -- writing ---------------------------------------------------------------------------

    def _write(self, rank: int, rel: str, data: bytes, rename_from: str | None = None) -> \
            BaseException | None:
        path = self.mnt(rank) / rel

        def fn() -> None:
            target = path if rename_from is None else self.mnt(rank) / rename_from
            with open(target, "wb") as fh:
                for i in range(0, len(data), MiB):
                    fh.write(data[i:i + MiB])
            if rename_from is not None:
                os.rename(target, path)
        _, err, _, _ = self._guarded(rank, f"write {rel}", fn)
        return err

    def _mkdir(self, rank: int, rel: str) -> BaseException | None:
        _, err, _, _ = self._guarded(
            rank, f"mkdir {rel}", lambda: os.makedirs(self.mnt(rank) / rel, exist_ok=True))
        return err

    def save(self) -> StepRec:
        """One checkpoint, DCP-style; returns its record (committed or not)."""
        cfg = self.cfg
        with self._lock:
            self.step_no += 1
            n = self.step_no
        name = f"step_{n}"
        files = [FileRec(n, f"{name}/__{r}_0.distcp", r, file_size(cfg, n, r), True)
                 for r in range(cfg.nodes)]
        rec = StepRec(n, files)
        self.steps[n] = rec
        self.res.steps_attempted += 1
        pick = random.Random(f"mtcfs-chaos-commit:{cfg.seed}:{n}").random()
        errors: dict[int, BaseException] = {}

        def fail(r: int, e: BaseException | None) -> bool:
            if e is not None:
                errors.setdefault(r, e)
                return True
            return False

        if cfg.scope == "job":
            if fail(0, self._mkdir(0, name)):
                return self._save_failed(rec, errors)

            def rank_job(r: int) -> None:
                fail(r, self._write(r, files[r].rel, self.data(files[r])))
            self._parallel([lambda r=r: rank_job(r) for r in range(cfg.nodes)])
            if errors:
                return self._save_failed(rec, errors)
            meta = FileRec(n, f"{name}/.metadata", 0, 0, False)
            meta.size = len(self.data(meta))
            rec.files.append(meta)
            tmp = f"{name}/.metadata.tmp" if pick < 0.5 else None  # DCP renames its .metadata
            if fail(0, self._write(0, meta.rel, self.data(meta), rename_from=tmp)):
                return self._save_failed(rec, errors)
            rec.commit_source = ".metadata"
        else:
            marker = ".metadata" if pick < 0.5 else "commit_success.txt"
            markers = [FileRec(n, f"{name}/{marker}", r, 0, False) for r in range(cfg.nodes)]
            for m in markers:
                m.size = len(self.data(m))

            def rank_node(r: int) -> None:
                if fail(r, self._mkdir(r, name)):
                    return
                if fail(r, self._write(r, files[r].rel, self.data(files[r]))):
                    return
                fail(r, self._write(r, markers[r].rel, self.data(markers[r])))
            self._parallel([lambda r=r: rank_node(r) for r in range(cfg.nodes)])
            rec.files += markers
            if errors:
                return self._save_failed(rec, errors)
            rec.commit_source = marker
        rec.committed = True
        self.res.steps_committed += 1
        self.log(f"{name} committed")
        return rec

    def _save_failed(self, rec: StepRec, errors: dict[int, BaseException]) -> StepRec:
        r, e = sorted(errors.items())[0]
        why = (errno.errorcode.get(e.errno, str(e.errno)) if isinstance(e, OSError) and e.errno
               else type(e).__name__)
        self.res.save_errors[why] += 1
        self.res.save_error_examples.append(
            f"[{self.now():.1f}s] {rec.name} ({self.current_fault or 'no fault'}): node {r}: "
            f"{e!r}")
        self.log(f"{rec.name} not committed: node {r}: {e!r}")
        return rec

    def retention(self) -> None:
        """Delete committed steps older than the newest ``retain`` ones, and steps that
        never committed, as a trainer's checkpoint manager would."""
        live = self.live_steps()
        doomed = live[:-self.cfg.retain] if len(live) > self.cfg.retain else []
        doomed += [s for s in self.steps.values()
                   if not s.committed and not s.deleted and s.step < self.step_no]
        for s in sorted(doomed, key=lambda s: s.step):
            ranks = [0] if self.cfg.scope == "job" else list(range(self.cfg.nodes))
            ok = True
            for r in ranks:
                if r in self.down or r in self.broken:
                    continue

                def rm(r: int = r) -> None:
                    p = self.mnt(r) / s.name
                    if os.path.lexists(p):
                        shutil.rmtree(p)
                _, err, _, _ = self._guarded(r, f"delete {s.name}", rm)
                if err is not None:
                    ok = False
                    self.log(f"delete {s.name} on node {r}: {err!r}")
            if ok:
                s.deleted = True
                if s.committed:
                    self.res.steps_deleted += 1
        self.forget_data()

    # -- reading -------------------------------------------------------------------------

    def read(self, rank: int, f: FileRec, why: str) -> str:
        """Read ``f`` through ``rank``'s mount and compare. Returns "ok", "skipped",
        "eio", "error" or "wrong"."""
        cfg = self.cfg
        if not cfg.strict_local_ram and f.big and \
                set(self.chunks(f)) & self.ram_bad.get(rank, set()):
            with self._lock:
                self.res.reads_skipped_local_ram += 1
            return "skipped"
        path = self.mnt(rank) / f.rel

        def fn() -> bytes:
            out = bytearray()
            with open(path, "rb", buffering=0) as fh:
                try:  # drop the kernel's cached pages: the read goes to the daemon
                    os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                except OSError:
                    pass
                while True:
                    b = fh.read(MiB)
                    if not b:
                        break
                    out += b
            return bytes(out)
        what = f"read {f.rel}"
        got, err, took, over = self._guarded(rank, what, fn, read=True)
        with self._lock:
            self.res.reads += 1
        if over:
            return "error"
        if err is None:
            want = self.data(f)
            if got == want:
                with self._lock:
                    self.res.reads_ok += 1
                    self.res.bytes_verified += len(got)
                return "ok"
            self._wrong_bytes(rank, f, got, want, why)
            return "wrong"
        if isinstance(err, OSError) and err.errno == errno.EIO:
            before = self._last_eio.get((rank, f.rel))
            self._last_eio[(rank, f.rel)] = time.monotonic()
            if f.lost is None and before is not None and \
                    time.monotonic() - took - before < REFETCH_WINDOW_S:
                reason = "failed again at once: the same read failed on this node < 5 s " \
                    "before (fault-in's REFETCH_AFTER_S)"
            else:
                reason = self.why_eio(rank, f)
            with self._lock:
                self.res.eio[eio_category(reason)] += 1
                self.res.eio_examples.append(
                    f"[{self.now():.1f}s] {f.rel} on node {rank} ({why}; "
                    f"{self.current_fault or 'no fault'}) after {took:.1f}s: {reason}")
            self.log(f"EIO: {f.rel} on node {rank}: {reason}")
            return "eio"
        code = (errno.errorcode.get(err.errno, str(err.errno)) if isinstance(err, OSError)
                and err.errno else type(err).__name__)
        with self._lock:
            self.res.read_errors[f"{code} ({why})"] += 1
        self.log(f"read error: {f.rel} on node {rank} ({why}): {err!r}")
        if f.lost is None and code == "ENOENT":
            self.violation("committed file missing",
                           f"{f.rel} of committed {f.rel.split('/')[0]} is gone on node "
                           f"{rank} ({why})", ranks=[rank, f.rank])
        return "error"

    def _wrong_bytes(self, rank: int, f: FileRec, got: bytes, want: bytes, why: str) -> None:
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                     min(len(got), len(want)))
        idx = first // self.cfg.chunk_size
        self.violation(
            "wrong bytes",
            f"{f.rel} read through node {rank} ({why}) differs from what rank {f.rank} wrote",
            detail=(f"    got {len(got)} bytes, wrote {len(want)}; first difference at byte "
                    f"{first} (chunk {idx}); chaos corrupted chunks {sorted(f.corrupt_chunks)}"
                    f" of it; node {rank}'s RAM marked corrupt: "
                    f"{bool(set(self.chunks(f)) & self.ram_bad.get(rank, set()))}"),
            ranks=[rank, f.rank])

    def read_many(self, plan: list[tuple[int, FileRec]], why: str) -> dict[str, int]:
        """Reads, in parallel across reading nodes (each node's reads in order); a node
        whose connection got aborted stops reading."""
        by_node: dict[int, list[FileRec]] = {}
        for r, f in plan:
            by_node.setdefault(r, []).append(f)
        out: Counter = Counter()

        def node_reads(r: int) -> None:
            for f in by_node[r]:
                if r in self.broken or r in self.down:
                    out["not read (node aborted)"] += 1
                    continue
                out[self.read(r, f, why)] += 1
        self._parallel([lambda r=r: node_reads(r) for r in sorted(by_node)])
        return dict(out)

    def readers_for(self, f: FileRec, exclude: Iterable[int] = ()) -> list[int]:
        """Nodes that can read ``f``: scope=job every node up; scope=node its own."""
        ex = set(exclude)
        if self.cfg.scope == "node":
            if f.rank in self.steps[f.step].absent_on:
                return []  # a replacement did not bring it back (checked in the tiers)
            return [f.rank] if f.rank in self.up() and f.rank not in ex else []
        return [r for r in self.up() if r not in ex]

    def sweep(self, why: str, rng: random.Random, everyone: bool = False,
              only_rank: int | None = None, exclude: Iterable[int] = ()) -> None:
        """Read the committed steps' files: each through one node chosen by ``rng`` (not
        its writer if possible), or through every node (``everyone``)."""
        plan: list[tuple[int, FileRec]] = []
        for s in self.live_steps():
            for f in s.files:
                if only_rank is not None and f.rank != only_rank:
                    continue
                readers = self.readers_for(f, exclude)
                if not readers:
                    continue
                if everyone:
                    plan += [(r, f) for r in readers]
                else:
                    others = [r for r in readers if r != f.rank] or readers
                    plan.append((rng.choice(others), f))
        if plan:
            self.log(f"reads ({why}): {self.read_many(plan, why)}")

    # -- where copies are (the probe behind EIO reasons and durability) --------------------

    def _ram_copy(self, rank: int, f: FileRec, idx: int) -> Path | None:
        """A data file in ``rank``'s RAM tier holding chunk ``idx`` of ``f`` intact."""
        cs = self.cfg.chunk_size
        want = self.data(f)[idx * cs:(idx + 1) * cs]
        try:
            entries = list(os.scandir(self.store(rank) / "data"))
        except OSError:
            return None
        for e in entries:
            try:
                if e.stat().st_size != f.size:
                    continue
                with open(e.path, "rb") as fh:
                    fh.seek(idx * cs)
                    if fh.read(len(want)) == want:
                        return Path(e.path)
            except OSError:
                continue
        return None

    def _replica_copy(self, rank: int, digest: str) -> Path | None:
        p = self.store(rank) / "replicas" / "chunks" / digest[:2] / digest
        try:
            return p if chunk_hash(p.read_bytes()) == digest else None
        except OSError:
            return None

    def _backup_copy(self, digest: str) -> bool:
        from mtcfs.tiers.backup.codec import decode_chunk
        assert self.tier is not None
        blob = self.tier.get(f"chunks/{digest[:2]}/{digest}.zst")
        if blob is None:
            return False
        try:
            decode_chunk(digest, blob)
            return True
        except Exception:  # noqa: BLE001
            return False

    def copies(self, f: FileRec) -> list[set[str]]:
        """Per chunk of ``f``: where a good copy is ("ram:r", "replica:r", "backup")."""
        out: list[set[str]] = []
        for idx, h in enumerate(self.chunks(f)):
            where: set[str] = set()
            for r in range(self.cfg.nodes):
                if self._ram_copy(r, f, idx) is not None:
                    where.add(f"ram:{r}")
                if self._replica_copy(r, h) is not None:
                    where.add(f"replica:{r}")
            if self._backup_copy(h):
                where.add("backup")
            out.append(where)
        return out

    def _manifest_homes(self, f: FileRec) -> set[str]:
        """scope=node: where a manifest of ``f``'s step for its rank lists it with its
        chunks ("replica:r", "backup")."""
        step = f"step_{f.step}"
        homes: set[str] = set()

        def lists(raw: bytes | None) -> bool:
            if not raw:
                return False
            try:
                m = StepManifest.from_bytes(raw)
            except Exception:  # noqa: BLE001
                return False
            return any(e.path == f.rel and list(e.chunks) == self.chunks(f)
                       for e in m.entries)
        for r in range(self.cfg.nodes):
            p = self.store(r) / "replicas" / "manifests" / str(f.rank) / f"{step}.json"
            try:
                if lists(p.read_bytes()):
                    homes.add(f"replica:{r}")
            except OSError:
                pass
        assert self.tier is not None
        if self.tier.get(f"steps/{step}/rank-{f.rank}/COMPLETE") is not None and \
                lists(self.tier.get(f"steps/{step}/rank-{f.rank}/manifest.json")):
            homes.add("backup")
        return homes

    def restorable_without(self, f: FileRec, lost: int) -> tuple[bool, str]:
        """Would ``f`` survive the loss of node ``lost``'s store? (reason if not)"""
        if not f.big:  # markers: scope=job inline in the namespace; scope=node tiny
            return True, ""
        per = self.copies(f)
        if self.cfg.scope == "node":
            # a restore needs a manifest (a replica store's or the backup's), then each
            # chunk from a replica store or the backup tier
            if not self._manifest_homes(f) - {f"replica:{lost}"}:
                return False, "no manifest of it off the node"
            bad = [i for i, w in enumerate(per)
                   if not {x for x in w if x == "backup" or x.startswith("replica:")}
                   - {f"replica:{lost}"}]
        else:
            bad = [i for i, w in enumerate(per) if not (w - {f"ram:{lost}", f"replica:{lost}"})]
        if bad:
            return False, f"chunks {bad} had no good copy off node {lost}"
        return True, ""

    def why_eio(self, rank: int, f: FileRec) -> str:
        if f.lost:
            return f"expected: {f.lost}"
        per = self.copies(f) if f.big else []
        none = [i for i, w in enumerate(per) if not w]
        if none:
            corrupted = sorted(set(none) & f.corrupt_chunks)
            if corrupted:
                return "no tier holds a good copy (chaos corrupted every copy)"
            return "no tier holds a good copy (not corrupted by the chaos: lost)"
        st = self.status(rank, timeout=5)
        if st and (st.get("namespace") or {}).get("unavailable_s") is not None:
            return "namespace unavailable on the reading node"
        unreachable = set(self.down) | set(self.stopped) | set(self.cut.get(rank, set()))
        if self.tier is not None and self.tier.in_outage:
            unreachable.add(-1)

        def reachable(loc: str) -> bool:
            if loc == "backup":
                return -1 not in unreachable
            return int(loc.split(":")[1]) not in unreachable
        if per and any(not any(reachable(x) for x in w) for w in per):
            return "good copies only on unreachable nodes or tiers"
        return "unexplained (a good copy of every chunk was reachable)"

    # -- faults ----------------------------------------------------------------------------

    def inject(self, p: FaultPlan) -> None:
        self.current_fault = f"fault {p.index}: {p.describe()}"
        self.log(f"=== {self.current_fault}")
        getattr(self, f"_f_{p.kind}")(p)
        self.current_fault = f"after fault {p.index}: {p.describe()}"

    def _count(self, kind: str, line: str) -> None:
        with self._lock:
            self.res.faults[kind] += 1
            self.res.fault_log.append(f"[{self.now():7.1f}s] {line}")

    def _timed(self, p: FaultPlan, heal: Callable[[], None],
               cut_off: Iterable[int] = ()) -> None:
        """Hold a timed fault for its duration while saves and reads go on; a timer heals
        it, so nothing blocked by the fault can delay its end. scope=job: the files of the
        ``cut_off`` nodes (stopped, or on the other side of a partition) are read through
        the nodes that cannot reach them, while the fault lasts."""
        healed = threading.Event()

        def do_heal() -> None:
            try:
                heal()
            except Exception as exc:  # noqa: BLE001
                self.log(f"heal failed: {exc!r}")
            finally:
                healed.set()
        with self._lock:
            self._heal.append(do_heal)
        timer = threading.Timer(p.duration, do_heal)
        timer.daemon = True
        self._timers.append(timer)
        timer.start()
        rng = random.Random(f"mtcfs-chaos-during:{self.cfg.seed}:{p.index}")
        cut_off = set(cut_off)
        if cut_off and self.cfg.scope == "job":
            plan = []
            for s in self.live_steps():
                for f in s.files:
                    if f.rank not in cut_off or not f.big:
                        continue
                    far = [r for r in self.up() if r not in cut_off
                           and (r in self.cut.get(f.rank, set()) or f.rank in self.stopped)]
                    if far:
                        plan.append((rng.choice(far), f))
            if plan:
                self.log(f"reads (while cut off): {self.read_many(plan, 'while cut off')}")
        for _ in range(p.during):
            self.iteration(rng)
            if healed.is_set():
                break
        healed.wait(p.duration + 30)
        with self._lock:
            if do_heal in self._heal:
                self._heal.remove(do_heal)
        self.log(f"healed: {p.describe()}")
        self.sweep("after heal", rng)

    def _f_sigstop(self, p: FaultPlan) -> None:
        assert self.cluster is not None
        v = p.victim
        pid = self.cluster.node(v).pid
        if not pid:
            return
        os.kill(pid, signal.SIGSTOP)
        self.stopped.add(v)
        self._count("sigstop", p.describe())

        def heal() -> None:
            try:
                os.kill(pid, signal.SIGCONT)
            finally:
                self.stopped.discard(v)
        self._timed(p, heal, cut_off=[v])
        self.check_serving("after SIGCONT")

    def _f_partition(self, p: FaultPlan) -> None:
        assert self.cluster is not None
        self.cluster.partition(*p.split)
        for g in p.split:
            for r in g:
                self.cut[r] = set(range(self.cfg.nodes)) - set(g)
        self._count("partition", p.describe())

        def heal() -> None:
            for attempt in range(5):
                try:
                    assert self.cluster is not None
                    self.cluster.partition()
                    break
                except Exception as exc:  # noqa: BLE001
                    self.log(f"heal of the partition, attempt {attempt + 1}: {exc!r}")
                    time.sleep(2)
            self.cut.clear()
        self._timed(p, heal, cut_off=p.split[0])
        self.check_serving("after the partition healed")

    def _f_backup_outage(self, p: FaultPlan) -> None:
        assert self.tier is not None
        self.tier.outage_begin()
        self._count("backup_outage", p.describe())
        self._timed(p, self.tier.outage_end)
        self.check_serving("after the backup outage")

    def _kill(self, p: FaultPlan, wipe: bool) -> None:
        """SIGKILL node ``victim`` (maybe while a save runs), read its files through the
        survivors, then mount a replacement (``wipe``) or restart it on its store."""
        assert self.cluster is not None
        cfg, v = self.cfg, p.victim
        rng = random.Random(f"mtcfs-chaos-kill:{cfg.seed}:{p.index}")
        kind = "kill_replace" if wipe else "kill_restart"
        claims = self._claims(v) if wipe else {}
        saver = None
        if p.mid_save:
            saver = threading.Thread(target=self.iteration, args=(rng, False, False),
                                     daemon=True)
            saver.start()
            time.sleep(p.kill_delay)
        elif p.after_commit:
            self.save()
        self.cluster.kill9(v)
        with self._lock:
            self.down.add(v)
        self._count(kind, p.describe())
        if saver is not None:
            saver.join(cfg.read_bound_s * 3)
        if wipe:  # what the loss of its store takes with it: the copies as of the kill
            self._durability_at_loss(v, claims)
        if cfg.scope == "job":
            # the dead node's files, through every survivor: from its replicas or the backup
            # (a survivor that read a file before has it in RAM; the others fetch it)
            cold = sum(1 for s in self.live_steps() for f in s.files if f.rank == v and f.big
                       for r in self.up() if self._ram_copy(r, f, 0) is None)
            self.log(f"node {v} dead: {cold} of its files' reads on survivors are cold")
            self.sweep(f"node {v} dead", rng, everyone=True, only_rank=v)
        time.sleep(p.wait_s)
        if wipe:
            for s in self.steps.values():
                for f in s.files:
                    if f.lost is None and f.at_risk:
                        f.lost = f.at_risk
                        self.res.lost_files.append(f"{f.rel}: {f.lost}")
                    f.at_risk = None
            self.ram_bad.pop(v, None)
        self._restart(v, wipe=wipe, why=kind)
        if wipe:
            st = self.status(v) or {}
            rest = st.get("restore") or {}
            self.res.replacements.append(
                f"node {v}: restored {rest.get('step')!r} (manifest from "
                f"{rest.get('manifest_from')!r}); newest committed: "
                f"{(self.live_steps() or [StepRec(0, [])])[-1].name}")
        self._after_remount(v, wipe, rng)
        self.check_serving(f"after {kind} of node {v}")

    def _claims(self, v: int) -> dict[int, str]:
        """``user.mtcfs.state`` of each committed step on node ``v`` (before it dies)."""
        out: dict[int, str] = {}
        if v not in self.up() or v in self.stopped:
            return out
        for s in self.live_steps():
            if self.cfg.scope == "node" and v in s.absent_on:
                continue
            claim, _, _, _ = self._guarded(
                v, f"getxattr {s.name}",
                lambda s=s: os.getxattr(self.mnt(v) / s.name, "user.mtcfs.state").decode())
            if claim:
                out[s.step] = claim
        return out

    def _durability_at_loss(self, v: int, claims: dict[int, str]) -> None:
        """Node ``v`` is dead and its store about to be wiped: which files go with it
        (excused later), and invariant 4 for the files it wrote and called durable."""
        for s in self.live_steps():
            claim = claims.get(s.step)
            for f in s.files:
                f.at_risk = None
                if f.lost is not None:
                    continue
                if self.cfg.scope == "node" and f.rank != v and f.rank not in s.absent_on:
                    continue  # in its own node's RAM, whatever happens to node v
                ok, why = self.restorable_without(f, v)
                if ok:
                    continue
                if f.corrupt_chunks:
                    why += " (the chaos corrupted copies of it)"
                f.at_risk = f"its only complete copies were on node {v} when it was lost: {why}"
                if f.rank == v and claim and _DURABLE.match(claim) and not f.corrupt_chunks:
                    self.violation("durable step lost",
                                   f"{f.rel}: node {v} said {s.name} is {claim!r}, but when "
                                   f"it was lost {why}", ranks=[v, (v + 1) % self.cfg.nodes])

    def _after_remount(self, v: int, wiped: bool, rng: random.Random) -> None:
        cfg = self.cfg
        if cfg.scope == "job":
            # the replacement sees the whole job; its own files come back from replicas
            self.sweep(f"node {v} remounted", rng, everyone=False, exclude=[])
            plan = [(v, f) for s in self.live_steps() for f in s.files]
            self.log(f"reads (through node {v} after remount): "
                     f"{self.read_many(plan, f'through node {v} after remount')}")
            return
        # scope=node: what is in the node's namespace now
        listed, err, _, _ = self._guarded(v, "listdir /", lambda: os.listdir(self.mnt(v)))
        if err is not None:
            self.log(f"listdir of node {v} after remount: {err!r}")
            return
        plan = []
        for s in self.live_steps():
            mine = [f for f in s.files if f.rank == v]
            if v in s.absent_on and not wiped:
                continue  # not brought back by an earlier replacement; still not here
            if s.name in listed:
                s.absent_on.discard(v)
                plan += [(v, f) for f in mine]
            elif not wiped:
                for f in mine:
                    if f.lost is None:
                        self.violation("committed file missing",
                                       f"{s.name} is gone from node {v} after a restart on "
                                       "its own store", ranks=[v])
                        f.lost = "reported missing after a restart"
            else:
                s.absent_on.add(v)
                for f in mine:
                    self._tier_check(f)
        for name in listed:
            m = re.fullmatch(r"step_(\d+)", name)
            if m and int(m.group(1)) in self.steps and self.steps[int(m.group(1))].deleted:
                self.log(f"node {v} shows {name}, which the app deleted (restored from a tier)")
        if plan:
            self.log(f"reads (node {v} after remount): "
                     f"{self.read_many(plan, f'node {v} after remount')}")

    def _f_kill_replace(self, p: FaultPlan) -> None:
        self._kill(p, wipe=True)

    def _f_kill_restart(self, p: FaultPlan) -> None:
        self._kill(p, wipe=False)

    # corruption ------------------------------------------------------------------------

    def _candidates(self) -> list[FileRec]:
        return [f for s in self.live_steps() for f in s.files if f.big and f.lost is None]

    @staticmethod
    def _positions(start: int, length: int, p: FaultPlan, rng: random.Random) -> list[int]:
        """``p.flips`` distinct offsets in [start, start+length) (a byte flipped twice
        would be no corruption)."""
        length = max(1, length)
        return [start + i for i in rng.sample(range(length), min(p.flips, length))]

    def _flip(self, path: Path, start: int, length: int, p: FaultPlan,
              rng: random.Random) -> None:
        """Invert ``p.flips`` bytes of the file ``path`` in [start, start+length)."""
        fd = os.open(path, os.O_RDWR)
        try:
            for i in self._positions(start, length, p, rng):
                b = os.pread(fd, 1, i)
                os.pwrite(fd, bytes([b[0] ^ 0xFF]) if b else b"\xff", i)
        finally:
            os.close(fd)

    def _pick(self, items: list, p: FaultPlan) -> Any:
        return items[min(int(p.pick * len(items)), len(items) - 1)] if items else None

    def _await_targets(self, kind: str, find: Callable[[], list]) -> list:
        """``find()``'s targets, polled until there is one or ``target_wait_s`` passes.

        The tiers a corruption needs fill in lazily (the backup runs after a commit and
        catches up after an outage), so "nothing to corrupt" at the planned moment is a
        matter of timing, not of the seed: wait for the tier rather than skip the fault
        (a skipped kind failed the short run in CI at seed 11)."""
        deadline = time.monotonic() + self.cfg.target_wait_s
        while True:
            got = find()
            if got or time.monotonic() >= deadline:
                if not got:
                    self.log(f"{kind}: no target after {self.cfg.target_wait_s:g}s")
                return got
            time.sleep(0.25)

    def _corrupt_ram_chunk(self, rank: int, f: FileRec, idx: int, p: FaultPlan,
                           rng: random.Random) -> bool:
        path = self._ram_copy(rank, f, idx)
        if path is None:
            return False
        cs = self.cfg.chunk_size
        self._flip(path, idx * cs, min(cs, f.size - idx * cs), p, rng)
        self.ram_bad.setdefault(rank, set()).add(self.chunks(f)[idx])
        f.corrupt_chunks.add(idx)
        return True

    def _corrupt_replica_chunk(self, rank: int, f: FileRec, idx: int, p: FaultPlan,
                               rng: random.Random) -> bool:
        path = self._replica_copy(rank, self.chunks(f)[idx])
        if path is None:
            return False
        self._flip(path, 0, path.stat().st_size, p, rng)
        f.corrupt_chunks.add(idx)
        return True

    def _corrupt_backup_chunk(self, f: FileRec, idx: int, p: FaultPlan,
                              rng: random.Random) -> bool:
        assert self.tier is not None
        h = self.chunks(f)[idx]
        key = f"chunks/{h[:2]}/{h}.zst"
        blob = self.tier.get(key)
        if blob is None:
            return False
        buf = bytearray(blob)
        for i in self._positions(min(16, len(buf) - 1), len(buf) - min(16, len(buf) - 1), p,
                                 rng):
            buf[i] ^= 0xFF
        self.tier.put(key, bytes(buf))
        f.corrupt_chunks.add(idx)
        return True

    def _verify_sees(self, rank: int, f: FileRec) -> None:
        """Invariant 5: ``mtcfs verify`` on ``rank`` reports the corrupted chunk."""
        assert self.cluster is not None
        m = self.cluster.node(rank)
        try:
            r = m.cli("verify", str(m.mnt), check=False, timeout=self.cfg.read_bound_s)
        except subprocess.TimeoutExpired:
            self.violation("wait over bound", f"mtcfs verify on node {rank} took over "
                           f"{self.cfg.read_bound_s:.0f}s", ranks=[rank])
            return
        if r.returncode != 1 or f.rel.split("/")[-1] not in (r.stdout + r.stderr) and \
                f"step_{f.step}" not in (r.stdout + r.stderr):
            self.violation("corruption not detected",
                           f"mtcfs verify on node {rank} did not report the chunk corrupted "
                           f"in {f.rel} (exit {r.returncode})",
                           detail=f"    {(r.stdout + r.stderr).strip()[:500]}", ranks=[rank])
        else:
            self.log(f"mtcfs verify on node {rank} reported the corruption (exit 1)")

    def _reads_after_corruption(self, f: FileRec, rng: random.Random, why: str) -> None:
        readers = self.readers_for(f)
        if readers:
            self.log(f"reads ({why}): "
                     f"{self.read_many([(r, f) for r in readers], why)}")

    def _then_kill(self, p: FaultPlan, f: FileRec) -> None:
        if p.then_kill and f.rank in self.up():
            q = FaultPlan(**{**p.__dict__, "kind": "kill_replace", "victim": f.rank,
                             "mid_save": False})
            self.current_fault += f", then kill_replace of node {f.rank} (its writer)"
            self.log(f"=== then kill_replace of node {f.rank}, which wrote {f.rel}")
            self._kill(q, wipe=True)

    def _f_corrupt_ram(self, p: FaultPlan) -> None:
        rng = random.Random(f"mtcfs-chaos-flip:{self.cfg.seed}:{p.index}")
        cands = []
        for f in self._candidates():
            for r in self.up():
                if r in self.stopped:
                    continue
                for idx in range(len(self.chunks(f))):
                    if idx not in f.corrupt_chunks and self._ram_copy(r, f, idx) is not None:
                        cands.append((r, f, idx))
        got = self._pick(cands, p)
        if got is None:
            self.log("corrupt_ram: no chunk in any RAM tier to corrupt")
            return
        r, f, idx = got
        if not self._corrupt_ram_chunk(r, f, idx, p, rng):
            return
        self._count("corrupt_ram", f"corrupt_ram: chunk {idx} of {f.rel} in node {r}'s RAM "
                    f"({p.flips} bytes)")
        self._verify_sees(r, f)
        self._reads_after_corruption(f, rng, f"after corrupting it in node {r}'s RAM")
        if r == f.rank:
            self._then_kill(p, f)

    def _f_corrupt_replica(self, p: FaultPlan) -> None:
        rng = random.Random(f"mtcfs-chaos-flip:{self.cfg.seed}:{p.index}")

        def find() -> list:
            return [(r, f, idx) for f in self._candidates()
                    for idx, h in enumerate(self.chunks(f)) for r in self.up()
                    if idx not in f.corrupt_chunks and self._replica_copy(r, h) is not None]
        got = self._pick(self._await_targets("corrupt_replica", find), p)
        if got is None:
            self.log("corrupt_replica: no replica chunk to corrupt")
            return
        r, f, idx = got
        if not self._corrupt_replica_chunk(r, f, idx, p, rng):
            return
        self._count("corrupt_replica", f"corrupt_replica: chunk {idx} of {f.rel} in node "
                    f"{r}'s replica store ({p.flips} bytes)")
        # scope=job: the holder reads it first from its replica store
        self._reads_after_corruption(f, rng, f"after corrupting its replica on node {r}")
        self._then_kill(p, f)

    def _f_corrupt_backup(self, p: FaultPlan) -> None:
        rng = random.Random(f"mtcfs-chaos-flip:{self.cfg.seed}:{p.index}")
        got = self._pick(self._await_targets("corrupt_backup", lambda: [
            (f, idx) for f in self._candidates() for idx, h in enumerate(self.chunks(f))
            if idx not in f.corrupt_chunks and self._backup_copy(h)]), p)
        if got is None:
            self.log("corrupt_backup: no backed-up chunk to corrupt")
            return
        f, idx = got
        if not self._corrupt_backup_chunk(f, idx, p, rng):
            return
        self._count("corrupt_backup", f"corrupt_backup: chunk {idx} of {f.rel} in the "
                    f"backup tier ({p.flips} bytes)")
        self._then_kill(p, f)

    def _f_corrupt_every_tier(self, p: FaultPlan) -> None:
        rng = random.Random(f"mtcfs-chaos-flip:{self.cfg.seed}:{p.index}")
        cands = [f for f in self._candidates()]
        f = self._pick(cands, p)
        if f is None:
            self.log("corrupt_every_tier: nothing to corrupt")
            return
        idx = int(p.pick * 1000) % len(self.chunks(f))
        where = []
        for r in range(self.cfg.nodes):
            for _ in range(4):  # every data file holding it (versions, caches)
                if not self._corrupt_ram_chunk(r, f, idx, p, rng):
                    break
                where.append(f"ram:{r}")
            if self._corrupt_replica_chunk(r, f, idx, p, rng):
                where.append(f"replica:{r}")
        if self._corrupt_backup_chunk(f, idx, p, rng):
            where.append("backup")
        f.lost = f"chunk {idx} corrupted by the chaos in every copy ({', '.join(where)})"
        self.res.lost_files.append(f"{f.rel}: {f.lost}")
        self._count("corrupt_every_tier", f"corrupt_every_tier: chunk {idx} of {f.rel} in "
                    f"{', '.join(where)}")
        # every node that must fetch it: EIO, never the corrupt bytes
        self._reads_after_corruption(f, rng, "after corrupting it in every tier")
        self._then_kill(p, f)

    # -- the run ---------------------------------------------------------------------------

    def iteration(self, rng: random.Random, retain: bool = True, reads: bool = True) -> None:
        """Save one step, read it back, maybe an older one, apply retention."""
        rec = self.save()
        if rec.committed and reads:
            # each file through one node, its writer included: the other nodes stay cold
            # (without a copy of their own), so a later fault makes them fetch it
            plan = []
            for f in rec.files:
                readers = self.readers_for(f)
                if readers:
                    plan.append((rng.choice(readers), f))
            older = [f for s in self.live_steps()[:-1] for f in s.files if f.big]
            if older and rng.random() < 0.5:
                f = rng.choice(older)
                readers = self.readers_for(f)
                if readers:
                    plan.append((rng.choice(readers), f))
            if plan:
                self.read_many(plan, f"after {rec.name} committed")
        if retain:
            self.retention()

    def _done(self, i: int) -> bool:
        cfg = self.cfg
        if cfg.faults is not None and i >= cfg.faults:
            return True
        if cfg.minutes is not None and self.now() >= cfg.minutes * 60:
            return True
        if cfg.max_wall_s is not None and self.now() >= cfg.max_wall_s:
            self.log(f"the fault phase hit its cap of {cfg.max_wall_s:.0f}s")
            return True
        return False

    def _heal_all(self) -> None:
        for t in self._timers:
            t.cancel()
        with self._lock:
            heals, self._heal = list(self._heal), []
        for h in heals:
            h()
        if self.cluster is not None:
            for r in list(self.stopped):
                pid = self.cluster.node(r).pid
                if pid:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
            self.stopped.clear()
        if self.tier is not None and self.tier.in_outage:
            self.tier.outage_end()

    def run(self) -> ChaosResult:
        cfg = self.cfg
        self.root.mkdir(parents=True, exist_ok=True)
        self.log(f"chaos run: seed {cfg.seed}, scope={cfg.scope}, {cfg.nodes} nodes, "
                 f"backup={cfg.backup}, root {self.root}")
        saved_env = {}
        try:
            self.tier = FileTier(self.root) if cfg.backup == "file" else \
                GcsTier(self.root, cfg.seed)
            for k, v in self.tier.env.items():
                saved_env[k] = os.environ.get(k)
                os.environ[k] = v
            opts = {"scope": cfg.scope, "replicas": 1, "chunk_size": cfg.chunk_size,
                    "backup": self.tier.url, "backup_interval": "1ckpt", "size": "1G",
                    "read_timeout": f"{cfg.read_timeout_s:g}s"}
            self.cluster = Cluster(self.root / "nodes", cfg.nodes, job=JOB, options=opts)
            self.cluster.start(timeout=90)
            for r in range(cfg.nodes):
                self._record_pid(r)
            self.log("every node mounted")
            rng = random.Random(f"mtcfs-chaos-loop:{cfg.seed}")
            i = 0
            try:
                while not self._done(i):
                    p = make_plan(cfg, i)
                    for _ in range(p.gap):
                        self.iteration(rng)
                    self.repair()
                    self.inject(p)
                    self.repair()
                    i += 1
            except _NodeGone as exc:
                self.log(f"fault phase ended early: {exc}")
            self.current_fault = "final checks"
            self._heal_all()
            try:
                self.repair()
            except _NodeGone as exc:
                self.log(f"final checks without a node: {exc}")
            self.final_checks(rng)
        except Exception as exc:  # noqa: BLE001 (an engine or set-up failure: reported)
            self.violation("chaos run failed", f"{type(exc).__name__}: {exc}",
                           detail=traceback.format_exc()[-3000:],
                           ranks=range(cfg.nodes) if self.cluster else ())
        finally:
            try:
                self._heal_all()
            except Exception as exc:  # noqa: BLE001
                self.log(f"healing at the end failed: {exc!r}")
            self.teardown()
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            self.res.duration_s = self.now()
        return self.res

    def final_checks(self, rng: random.Random) -> None:
        """Invariants 3, 6 and 7 once every fault healed."""
        cfg = self.cfg
        assert self.cluster is not None
        self.log("final checks")
        # 6: a new step is saved, replicated and backed up after all that
        rec = self.save()
        if not rec.committed:
            self.violation("no progress after faults", f"the final {rec.name} was not "
                           f"committed: {dict(self.res.save_errors)}", ranks=self.up())
        else:
            self._wait_durable(rec)
        self.retention()
        # 3: every committed step the app kept, bit-exact
        for s in self.live_steps():
            for f in s.files:
                readers = self.readers_for(f)
                if cfg.scope == "node" and f.rank in s.absent_on:
                    self._tier_check(f)
                    continue
                if not readers:
                    continue
                outcome = self.read_many([(r, f) for r in readers], "final check")
                for what, n in outcome.items():
                    if what == "ok":
                        self.res.final_files_checked += n
                    elif f.lost is None and what in ("eio", "error"):
                        self.violation("not restorable",
                                       f"{f.rel} of committed step_{s.step} could not be read "
                                       f"back at the end ({n} of {len(readers)} nodes: "
                                       f"{what})", ranks=[f.rank, *readers])
        # 7: every daemon serves, through the CLI
        for r in self.up():
            m = self.cluster.node(r)
            try:
                m.cli("status", str(m.mnt), "--json", timeout=STATUS_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001
                self.violation("not serving", f"mtcfs status on node {r} at the end: "
                               f"{str(exc).splitlines()[0][:200]}", ranks=[r])

    def _tier_check(self, f: FileRec) -> None:
        """scope=node: a committed step a replacement did not bring back must be complete
        in a replica store or the backup tier (``mtcfs restore --step`` can get it)."""
        if not f.big:
            return
        homes = self._manifest_homes(f)
        per = self.copies(f)
        ok = homes and all(w & (homes | {"backup"}) for w in per)
        if ok:
            self.res.tier_checked += 1
        elif f.lost is None:
            self.violation("not restorable", f"{f.rel}: no tier holds a manifest and every "
                           f"chunk of it (manifests: {sorted(homes)}, chunks: "
                           f"{[sorted(w) for w in per]})", ranks=[f.rank])

    def _wait_durable(self, rec: StepRec) -> None:
        """Invariant 6: ``rec`` backed up for every rank, and durable on every node."""
        assert self.tier is not None
        deadline = time.monotonic() + FINAL_DURABLE_S
        missing: list[int] = list(range(self.cfg.nodes))
        while time.monotonic() < deadline:
            missing = [r for r in range(self.cfg.nodes)
                       if self.tier.get(f"steps/{rec.name}/rank-{r}/COMPLETE") is None]
            if not missing:
                break
            time.sleep(0.5)
        if missing:
            self.violation("no progress after faults",
                           f"{rec.name} (saved after every fault healed) is not backed up for "
                           f"ranks {missing} after {FINAL_DURABLE_S:.0f}s", ranks=missing)
        else:
            self.log(f"{rec.name} is backed up for every rank")
        states: dict[int, str] = {}
        while time.monotonic() < deadline + 30:
            for r in self.up():
                got, _, _, _ = self._guarded(
                    r, f"getxattr {rec.name}",
                    lambda r=r: os.getxattr(self.mnt(r) / rec.name,
                                            "user.mtcfs.state").decode())
                states[r] = got or "?"
            if all(_DURABLE.match(s) for s in states.values()):
                return
            time.sleep(0.5)
        self.violation("no progress after faults",
                       f"{rec.name} is not durable on every node: {states}",
                       ranks=[r for r, s in states.items() if not _DURABLE.match(s)])

    def teardown(self) -> None:
        """Unmount everything; invariant 8: nothing left mounted or running."""
        if self.cluster is not None:
            self.cluster.cleanup()
        if self.tier is not None:
            try:
                self.tier.close()
            except Exception as exc:  # noqa: BLE001
                self.log(f"closing the backup tier: {exc!r}")
        time.sleep(0.2)
        left_mounts = leftover_mounts(self.root)
        left_procs = leftover_processes(self.root, self.all_pids)
        if left_mounts:
            self.violation("left behind", f"still mounted: {left_mounts}")
            for m in left_mounts:
                force_unmount(m)
        if left_procs:
            self.violation("left behind", f"still running: {left_procs}")
            for pid in left_procs:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def eio_category(reason: str) -> str:
    """The table's row for an EIO ``reason`` (the details stay in the examples)."""
    if reason.startswith("expected: chunk"):
        return "expected: the chaos corrupted a chunk in every copy"
    if reason.startswith("expected: its only complete copies"):
        return "expected: its node was lost before it was replicated or backed up"
    if reason.startswith("expected:"):
        return "expected: " + reason.split(":", 2)[1].strip()
    return reason


def leftover_mounts(root: Path) -> list[str]:
    """Mount points under ``root`` in /proc/self/mountinfo."""
    base = os.path.abspath(root) + os.sep
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            mp = line.split()[4]
            if mp.startswith(base):
                out.append(mp)
    return out


def leftover_processes(root: Path, pids: Iterable[int] = ()) -> list[int]:
    """Live processes (not this one) that are one of ``pids``, or an mtcfs process naming
    ``root`` on its command line."""
    me = os.getpid()
    base = os.fsencode(os.path.abspath(root))
    out = {pid for pid in pids if alive(pid)}
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as fh:
                cmd = fh.read()
            if base in cmd and b"mtcfs" in cmd:
                out.add(int(d))
        except OSError:
            pass
    return sorted(out)


def run_chaos(cfg: ChaosConfig, root: Path | None = None) -> ChaosResult:
    """Run ``cfg`` in ``root`` (default: a new directory under /dev/shm, removed after).

    The daemons' logs of a run with violations or unexplained EIOs are copied to
    ``/tmp/mtcfs-chaos-<scope>-<seed>-<time>.logs`` (the path is the last event)."""
    own = root is None
    if own:
        import tempfile
        root = Path(tempfile.mkdtemp(prefix=f"mtcfs-chaos-{cfg.scope}-{cfg.seed}-",
                                     dir="/dev/shm"))
    chaos = Chaos(cfg, Path(root))
    res = chaos.run()
    if not res.ok or any(k.startswith("unexplained") for k in res.eio):
        keep = Path(f"/tmp/mtcfs-chaos-{cfg.scope}-{cfg.seed}-{time.strftime('%H%M%S')}.logs")
        copy_logs(Path(root), keep)
        res.events.append(f"daemon logs kept in {keep}")
    if own:
        remove_tree(root)  # the stores' data tmpfs mounts first
    return res


def copy_logs(root: Path, dest: Path) -> None:
    """Copy every daemon log under ``root`` (``mtcfs.log`` and the ``mtcfs.log.<n>`` of
    wiped stores) to ``dest``, keeping the node directories."""
    for p in root.rglob("mtcfs.log*"):
        rel = p.relative_to(root)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(p, dest / rel)
        except OSError:
            pass


__all__ = ["BOUND_MARGIN_S", "ChaosConfig", "ChaosResult", "Chaos", "FAULT_KINDS", "READ_BOUND_S",
           "read_bound", "run_chaos", "make_plan"]
