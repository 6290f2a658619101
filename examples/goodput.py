#!/usr/bin/env python3
"""Goodput under failures: checkpoints to the backup tier against mtcfs, same failures.

    python examples/goodput.py --short                 # the test form (~2 minutes)
    python examples/goodput.py --png docs/goodput.png  # the long form (docs/goodput.md)

A data-parallel job of 2 ranks (torch.distributed, gloo, CPU) trains a small MLP with Adam;
batch n of rank r depends on (seed, r, n) only, so a step redone after a failure is the same
step. Each strategy runs the same job to the same number of steps under the same seeded
failure schedule (wall-clock seconds since the strategy started, exponential inter-arrival
with mean ``--mtbf``), and every strategy's final weights and optimizer state are compared,
bit for bit, with an uninterrupted run's:

1. ``backup``: every rank writes ``torch.save`` of its state straight to the backup tier, a
   ``file://``-style directory whose writes and reads go through a token bucket at the RAM
   tier's measured save rate divided by ``--ratio`` (10 by default; docs/goodput.md says
   why), at the interval Young/Daly give for its own save time;
2. ``mtcfs-yd``: every rank writes ``torch.save`` into its node's mtcfs mount (2 nodes,
   ``replicas=1``, lazy backup to a ``file://`` bucket) and seals it, at the interval
   Young/Daly give for mtcfs's save time;
3. ``mtcfs-base``: the same mounts at the baseline's interval.

Failures, all real: ``process`` (the rank processes are SIGKILLed and restarted, as a
launcher restarts the whole job when one rank dies; mtcfs restores from RAM), ``node`` (also
that node's daemon is SIGKILLed, its store wiped, a replacement mounted on an empty store:
mtcfs restores from the peer), ``job`` (every node lost: mtcfs restores from its backup
tier). The baseline restores from the backup tier after every kind.

What is scaled: a step is the real forward/backward/all-reduce/Adam step padded with a sleep
to ``--step-ms``; mtcfs's reads from its backup tier after a ``job`` failure are charged at
the baseline's bandwidth (the rank waits until bytes / bandwidth after its load started).
Everything else (saves, seals, restores, kills, remounts, the peer copy) is real.

With ``--data-parallel`` the mtcfs nodes mount with ``assume_data_parallelism=2``: the two
ranks are data-parallel twins and split each backup's upload between them.

Prints a table (goodput measured and as Young/Daly predict it, steps lost, recovery time
per failure kind, save stall, bytes to the backup tier, final weights equal) and writes the
plot (step against wall time, failures marked) to ``--png``; ``--json`` writes the results.
Then, per mtcfs strategy, the newest step complete on every rank in the backup bucket at
each failure and at the end, against the newest step checkpointed on every rank, and how
soon a newer job-complete backup followed each node replacement.
Exit status 0 only when every strategy's final state equals the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import random
import re
import shutil
import signal
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _mount_util import (  # noqa: E402
    remove_store,
    MtcfsMount, job_tls, local_etcd, print_node_logs, run_in_scratch,
)

from mtcfs.plan import expected_waste, plan_interval  # noqa: E402

NODES = 2  # ranks, one mtcfs node each
KINDS = ("process", "node", "job")
#: A recovery longer than this prints the daemons' logs (a replacement takes 0.2-3 s here).
SLOW_RECOVERY_S = 20.0
KIND_WEIGHTS = (0.6, 0.3, 0.1)  # job-wide failures are rare
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch._inductor", "torch.onnx")
_STEP_DIR = re.compile(r"step_(\d+)")
_STEP_FILE = re.compile(r"step_(\d+)\.pt")


# ---------------------------------------------------------------------- the trainer

def make_model(width: int) -> tuple[Any, Any]:
    """The MLP and its Adam, initialised from a fixed seed (identical on every rank)."""
    import torch
    from torch import nn
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(256, width), nn.Tanh(), nn.Linear(width, width),
                          nn.Tanh(), nn.Linear(width, 256))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(seed: int, rank: int, n: int) -> tuple[Any, Any]:
    """Rank ``rank``'s batch of step ``n``: a function of (seed, rank, n) only."""
    import torch
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 100_003 + n)
    x = torch.randn(64, 256, generator=g)
    return x, torch.sin(3 * x) + 0.05 * torch.randn(64, 256, generator=g)


def digest(model: Any, opt: Any) -> str:
    """sha256 over every tensor of the model and optimizer state, in a fixed order."""
    import torch
    h = hashlib.sha256()

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            h.update(str(obj.dtype).encode())
            h.update(obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                h.update(str(k).encode())
                walk(obj[k])
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        else:
            h.update(repr(obj).encode())
    walk(model.state_dict())
    walk(opt.state_dict())
    return h.hexdigest()


def throttled_write(path: Path, data: memoryview, bandwidth: float) -> None:
    """Write ``data`` to ``path`` at most ``bandwidth`` bytes/s (a token bucket of 1 MiB
    pieces: after each piece, wait until its share of time has passed), then fsync."""
    t0 = time.monotonic()
    piece = 1 << 20
    with open(path, "wb") as f:
        for off in range(0, len(data), piece):
            f.write(data[off:off + piece])
            wait = t0 + (off + piece) / bandwidth - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        f.flush()
        os.fsync(f.fileno())


def throttled_read(path: Path, bandwidth: float) -> bytes:
    """Read ``path`` at most ``bandwidth`` bytes/s (as :func:`throttled_write`)."""
    t0 = time.monotonic()
    piece = 1 << 20
    out = bytearray()
    with open(path, "rb") as f:
        while chunk := f.read(piece):
            out += chunk
            wait = t0 + len(out) / bandwidth - time.monotonic()
            if wait > 0:
                time.sleep(wait)
    return bytes(out)


def steps_in(d: Path, pattern: re.Pattern[str]) -> dict[int, str]:
    """Step number -> name of the entries of ``d`` that match ``pattern``."""
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return {}
    return {int(m.group(1)): name for name in names if (m := pattern.fullmatch(name))}


def save_mtcfs(mnt: Path, sock: str, state: dict[str, Any], n: int) -> int:
    """``torch.save`` into ``mnt/step_n/state.pt``, seal the step (what ``mtcfs seal``
    does, through the control socket), keep the two newest steps. Returns bytes written."""
    import torch

    from mtcfs import control
    d = mnt / f"step_{n}"
    d.mkdir(exist_ok=True)
    torch.save(state, d / "state.pt")
    control.call(sock, "seal", timeout=60, path=d.name)
    for old in sorted(steps_in(mnt, _STEP_DIR))[:-2]:
        shutil.rmtree(mnt / f"step_{old}", ignore_errors=True)
    return (d / "state.pt").stat().st_size


def save_backup(rank_dir: Path, state: dict[str, Any], n: int, bandwidth: float) -> int:
    """``torch.save`` into memory, then a throttled write of ``step_n.pt`` into the backup
    directory, committed by a rename (an object store's atomic put); keeps the two newest.
    Returns bytes written."""
    import torch
    buf = io.BytesIO()
    torch.save(state, buf)
    tmp = rank_dir / f".step_{n}.pt.tmp"
    throttled_write(tmp, buf.getbuffer(), bandwidth)
    os.rename(tmp, rank_dir / f"step_{n}.pt")
    for old in sorted(steps_in(rank_dir, _STEP_FILE))[:-2]:
        (rank_dir / f"step_{old}.pt").unlink(missing_ok=True)
    return buf.getbuffer().nbytes


@dataclass(frozen=True)
class WorkerSpec:
    """What one rank process is told at (re)start."""

    rank: int
    port: int  #: the gloo rendezvous port (rank 0 listens)
    seed: int
    steps: int  #: train to this step
    step_s: float  #: pad each step to this many seconds (0: no padding)
    every: int  #: checkpoint every N steps (0: never)
    mode: str  #: "mtcfs" | "backup" | "none"
    ckpt_dir: str  #: the node's mount (mtcfs) or this rank's backup directory
    restore: int | None  #: the step to restore, None: from scratch
    bandwidth: float  #: the backup tier's bytes/s (mode "backup")
    restore_floor_s: float  #: a restore takes at least this long (mtcfs from its backup)
    width: int


def worker(spec: WorkerSpec, conn: mpc.Connection) -> None:
    """One rank: restore if told to, train to ``spec.steps`` with checkpoints, report each
    event to the driver through ``conn``, end with the digest of its final state."""
    try:
        _train(spec, conn)
    except BaseException:  # noqa: BLE001 (reported, then the process ends)
        conn.send(("error", spec.rank, traceback.format_exc()))
        os._exit(1)


def _train(spec: WorkerSpec, conn: mpc.Connection) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model, opt = make_model(spec.width)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec.port}",
                            rank=spec.rank, world_size=NODES, timeout=timedelta(seconds=60))
    ckpt = Path(spec.ckpt_dir)
    sock = os.getxattr(ckpt, "user.mtcfs.control").decode() if spec.mode == "mtcfs" else ""
    start = 0
    if spec.restore is not None:
        t0 = time.monotonic()
        if spec.mode == "mtcfs":
            path = ckpt / f"step_{spec.restore}" / "state.pt"
            state = torch.load(path, weights_only=True)
            nbytes = path.stat().st_size
        else:
            raw = throttled_read(ckpt / f"step_{spec.restore}.pt", spec.bandwidth)
            state, nbytes = torch.load(io.BytesIO(raw), weights_only=True), len(raw)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = int(state["step"])
        if start != spec.restore:
            raise RuntimeError(f"step_{spec.restore} holds step {start}")
        wait = t0 + spec.restore_floor_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        conn.send(("loaded", spec.rank, start, time.monotonic() - t0, nbytes))
    # what is newer than the restored step (or partial: killed mid-save) is redone
    if spec.mode == "mtcfs":
        for n, name in steps_in(ckpt, _STEP_DIR).items():
            if n > start:
                shutil.rmtree(ckpt / name, ignore_errors=True)
    elif spec.mode == "backup":
        for name in os.listdir(ckpt):
            m = _STEP_FILE.fullmatch(name)
            if name.endswith(".tmp") or (m and int(m.group(1)) > start):
                (ckpt / name).unlink(missing_ok=True)
    dist.barrier()
    conn.send(("ready", spec.rank, start, time.monotonic()))
    params = list(model.parameters())
    for n in range(start + 1, spec.steps + 1):
        t0 = time.monotonic()
        x, y = batch(spec.seed, spec.rank, n)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)  # sum of 2 ranks: the same bits in either order
        flat.div_(NODES)
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        opt.step()
        if spec.step_s:
            wait = t0 + spec.step_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        conn.send(("step", spec.rank, n, time.monotonic()))
        if spec.every and n % spec.every == 0 and n < spec.steps:
            t1 = time.monotonic()
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": n}
            if spec.mode == "mtcfs":
                nbytes = save_mtcfs(ckpt, sock, state, n)
            else:
                nbytes = save_backup(ckpt, state, n, spec.bandwidth)
            conn.send(("saved", spec.rank, n, time.monotonic() - t1, nbytes))
    conn.send(("done", spec.rank, digest(model, opt)))
    dist.destroy_process_group()


# ---------------------------------------------------------------------- the driver

@dataclass(frozen=True)
class Failure:
    """One scheduled failure: ``t`` seconds after the strategy started."""

    t: float
    kind: str
    rank: int


def schedule(seed: int, mtbf_s: float, horizon_s: float, short: bool) -> list[Failure]:
    """Exponential inter-arrival times of mean ``mtbf_s`` up to ``horizon_s``; kinds drawn
    with :data:`KIND_WEIGHTS` and the rank hit uniformly. With ``short`` (the test form, a
    handful of failures) there are no ``job`` failures and the first two failures are one
    ``process`` and one ``node`` in a seeded order: a test that sees 2-4 failures must not
    hang on whether the rare kind came up."""
    rng = random.Random(seed)
    kinds, weights = (KINDS[:2], KIND_WEIGHTS[:2]) if short else (KINDS, KIND_WEIGHTS)
    first = list(kinds) if short else []
    rng.shuffle(first)
    out: list[Failure] = []
    t = 0.0
    while True:
        t += rng.expovariate(1 / mtbf_s)
        if t > horizon_s:
            return out
        kind = first[len(out)] if len(out) < len(first) else rng.choices(kinds, weights)[0]
        out.append(Failure(round(t, 3), kind, rng.randrange(NODES)))


@dataclass
class FailureRecord:
    kind: str
    rank: int
    t: float  #: seconds after the strategy started (when injected)
    step: int  #: the last step done when it hit
    restored: int  #: the step training resumed from
    recovery_s: float = 0.0  #: injection -> every rank ready to train again
    #: mtcfs, parts of recovery_s: the lost nodes' replacement mounted (kill, wipe, mount),
    #: then a common complete step seen in every mount
    replace_s: float = 0.0
    pick_s: float = 0.0
    #: mtcfs: the newest step complete on every rank in the backup tier when it hit
    backup_step: int | None = None
    sealed: int = 0  #: the newest step every rank had checkpointed when it hit


@dataclass
class Result:
    name: str
    label: str
    every: int
    wall_s: float = 0.0
    setup_s: float = 0.0  #: mounting and unmounting around the timed run
    goodput: float = 0.0
    predicted: float = 0.0  #: Young/Daly at the schedule's MTBF
    predicted_seen: float = 0.0  #: Young/Daly at the MTBF this run met
    stalls: list[float] = field(default_factory=list)
    ckpt_bytes: int = 0
    backup_bytes: int = 0
    failures: list[FailureRecord] = field(default_factory=list)
    timeline: list[tuple[float, int]] = field(default_factory=list)
    digests: dict[int, str] = field(default_factory=dict)
    equal: bool = False
    #: mtcfs: (s since start, newest step complete on every rank in the backup tier), at
    #: each change (sampled every 0.5 s while ranks train)
    backup_timeline: list[tuple[float, int]] = field(default_factory=list)
    backup_final: int | None = None  #: mtcfs: that step at the end, just before unmount
    last_sealed: int = 0  #: the newest step every rank checkpointed (sealed or committed)
    #: mtcfs: seconds after the last step until ``last_sealed`` was complete on every rank in
    #: the backup tier (waited for up to :func:`catch_up_s`), None if it was not
    backup_caught_up_s: float | None = None
    #: mtcfs: CPU seconds of the nodes' background work (seal hashing, replication, backup,
    #: scrub) over the run, at the default budget (bg_sched=idle); None: not mtcfs
    background_cpu_s: float | None = None

    @property
    def steps_lost(self) -> int:
        return sum(f.step - f.restored for f in self.failures)

    def recovery(self, kind: str) -> list[float]:
        return [f.recovery_s for f in self.failures if f.kind == kind]


def say(*a: object) -> None:
    print(*a, flush=True)


class Nodes:
    """The 2 mtcfs nodes of an mtcfs strategy: mounts at ``work/n<r>/mnt``, stores and the
    ``file://`` bucket under ``work/<name>``. Keeps the bytes each node's daemons uploaded
    to the backup tier (the ``bytes_uploaded`` counter, read before a daemon is killed)."""

    def __init__(self, work: Path, name: str, backup_interval: str,
                 data_parallel: int = 1) -> None:
        from demo_peers import free_ports
        self.root = work / name
        self.bucket = self.root / "bucket"
        self.bucket.mkdir(parents=True)
        ports = free_ports(NODES)
        job = f"goodput-{name}-{os.getpid()}"
        coord = local_etcd(f"goodput-{name}")
        tls = job_tls(self.root, job, NODES)
        self.mounts: list[MtcfsMount] = []
        for r in range(NODES):
            (work / f"n{r}" / "mnt").mkdir(parents=True, exist_ok=True)
            opts: dict[str, str | None] = {
                "store": str(self.root / f"n{r}" / "store"), "size": "1G", "rank": str(r),
                "nodes": str(NODES), "replicas": "1",
                "peers": ",".join(f"127.0.0.1:{p}" for p in ports),
                "listen": f"127.0.0.1:{ports[r]}", "backup": f"file://{self.bucket}",
                "backup_interval": backup_interval, **coord, **tls(r)}
            if data_parallel > 1:  # the ranks are data-parallel twins: split the backup
                opts["assume_data_parallelism"] = str(data_parallel)
            self.mounts.append(MtcfsMount(job, work / f"n{r}" / "mnt", opts))
        self.uploaded_dead = [0] * NODES
        #: CPU seconds of each node's background work (seal, replication, backup, scrub:
        #: mtcfs status budget.cpu), of its lost daemons and of the live one
        self.bg_cpu_dead = [0.0] * NODES
        self.bg_cpu_live = [0.0] * NODES
        self.dead_logs: dict[int, list[str]] = {}  # rank -> end of its lost daemon's log
        self.uploaded_live = [0] * NODES

    def mount(self) -> None:
        from demo_peers import on_all
        on_all(lambda m: m.mount(), self.mounts)

    def sample(self, r: int) -> None:
        try:
            st = self.mounts[r].status()
            self.uploaded_live[r] = int(((st.get("backup") or {}).get("store") or {})
                                        .get("bytes_uploaded", 0))
            self.bg_cpu_live[r] = float(((st.get("budget") or {}).get("cpu") or {})
                                        .get("cpu_s", 0.0))
        except Exception:  # noqa: BLE001 (a daemon that does not answer keeps its last figure)
            pass

    def uploaded(self) -> int:
        return sum(self.uploaded_dead) + sum(self.uploaded_live)

    def background_cpu(self) -> float:
        """CPU seconds the nodes' background work used (the real budget, docs/usage.md
        "Background work"), lost daemons included up to their last sample."""
        return sum(self.bg_cpu_dead) + sum(self.bg_cpu_live)

    def replace(self, ranks: list[int]) -> None:
        """Lose these nodes (daemon SIGKILLed, dead mount cleared, store wiped) and mount a
        replacement on an empty store for each."""
        from demo_peers import kill9, on_all
        self.dead_logs = {}  # only this failure's
        for r in ranks:
            self.sample(r)
            self.uploaded_dead[r] += self.uploaded_live[r]
            self.uploaded_live[r] = 0
            self.bg_cpu_dead[r] += self.bg_cpu_live[r]
            self.bg_cpu_live[r] = 0.0

        def lose(r: int) -> None:
            kill9(self.mounts[r])
            try:  # the lost daemon's last words, for report_slow
                log_path = Path(self.mounts[r].options["store"] or "") / "mtcfs.log"
                self.dead_logs[r] = log_path.read_text(errors="replace").splitlines()[-80:]
            except OSError:
                self.dead_logs[r] = []
            remove_store(self.mounts[r].options["store"] or "", ignore_errors=True)
        on_all(lose, ranks)
        on_all(lambda r: self.mounts[r].mount(), ranks)

    def backup_complete(self) -> int | None:
        """The newest step complete on every rank in the ``file://`` bucket (a ``COMPLETE``
        marker in ``steps/<step>/rank-<r>/`` for every r), or None."""
        return job_complete_backup(self.bucket)

    def complete_steps(self, r: int) -> set[int]:
        """Steps whose directory in node r's mount is a complete checkpoint."""
        mnt = self.mounts[r].mnt
        out = set()
        for n, name in steps_in(mnt, _STEP_DIR).items():
            try:
                if os.getxattr(mnt / name, "user.mtcfs.state").decode() != "incomplete":
                    out.add(n)
            except OSError:
                pass
        return out

    def report_slow(self, rec: FailureRecord) -> None:
        """Say that recovery ``rec`` was slow and print the end of every node's daemon
        log to stderr (what a failed run needs to be explained)."""
        say(f"  WARNING: the recovery after the {rec.kind} failure at t={rec.t:.1f}s took "
            f"{rec.recovery_s:.1f} s (more than {SLOW_RECOVERY_S:g} s): replacement mounted "
            f"after {rec.replace_s:.1f} s, a common step seen {rec.pick_s:.1f} s later, the "
            "rest is the ranks' restart and restore; daemon logs on stderr")
        for r, lines in sorted(self.dead_logs.items() if rec.kind != "process" else ()):
            print(f"--- node {r}: end of its lost daemon's log ---\n" + "\n".join(lines),
                  file=sys.stderr)
        print_node_logs(self.root, NODES, 80)  # the stores are root/n<r>/store

    def unmount(self) -> None:
        from demo_peers import on_all
        for r in range(NODES):
            self.sample(r)
        on_all(lambda m: m.unmount(), self.mounts)


def job_complete_backup(bucket: Path) -> int | None:
    """The newest step complete on every rank in the ``file://`` bucket of a multi-node
    job (``steps/step_<n>/rank-<r>/COMPLETE`` for every rank r < NODES), or None."""
    done = [n for n, name in steps_in(bucket / "steps", _STEP_DIR).items()
            if all((bucket / "steps" / name / f"rank-{r}" / "COMPLETE").exists()
                   for r in range(NODES))]
    return max(done) if done else None


@dataclass
class Setup:
    """Everything the strategies share."""

    work: Path
    seed: int
    steps: int
    step_s: float
    width: int
    mtbf_s: float
    failures: list[Failure]
    bandwidth: float  #: the backup tier's bytes/s (set by calibrate)
    ckpt_bytes: int  #: one rank's checkpoint (set by calibrate)
    backup_interval: str
    max_wall_s: float
    data_parallel: int = 1  #: mtcfs's assume_data_parallelism (1: not given)


def spawn(ctx: Any, specs: list[WorkerSpec]) -> tuple[list[Any], list[mpc.Connection]]:
    procs, conns = [], []
    for spec in specs:
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=worker, args=(spec, child), daemon=True,
                        name=f"goodput-rank{spec.rank}")
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    return procs, conns


def _ready(conns: list[mpc.Connection], timeout: float) -> list[mpc.Connection]:
    """The connections of ``conns`` with a message (or EOF) waiting, after ``timeout``."""
    got = mpc.wait(list(conns), timeout)
    return [c for c in conns if c in got]


def kill_all(procs: list[Any], first: int = 0) -> None:
    """SIGKILL every rank process, ``first`` first, and reap them."""
    for p in [procs[first]] + [q for i, q in enumerate(procs) if i != first]:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(10)


def run_reference(ctx: Any, s: Setup) -> dict[int, str]:
    """The uninterrupted run: no checkpoints, no padding, no failures."""
    from demo_peers import free_ports
    port = free_ports(1)[0]
    procs, conns = spawn(ctx, [WorkerSpec(r, port, s.seed, s.steps, 0.0, 0, "none",
                                          str(s.work), None, 0.0, 0.0, s.width)
                               for r in range(NODES)])
    out: dict[int, str] = {}
    deadline = time.monotonic() + 300
    try:
        while len(out) < NODES:
            if time.monotonic() > deadline:
                raise TimeoutError("the reference run did not finish in 300 s")
            for c in _ready(conns, 1.0):
                try:
                    msg = c.recv()
                except EOFError:  # a rank that is done has exited
                    conns.remove(c)
                    if len(conns) < NODES - len(out):
                        raise RuntimeError("a reference rank ended unexpectedly")
                    continue
                if msg[0] == "error":
                    raise RuntimeError(f"reference rank {msg[1]}: {msg[2]}")
                if msg[0] == "done":
                    out[msg[1]] = msg[2]
    finally:
        kill_all(procs)
    return out


def run_strategy(ctx: Any, s: Setup, name: str, label: str, mode: str, every: int,
                 ref: dict[int, str]) -> Result:
    """Run the job to ``s.steps`` under ``s.failures``; see the module docstring."""
    from demo_peers import free_ports
    res = Result(name, label, every)
    nodes: Nodes | None = None
    rank_dirs = [s.work / name / "bucket" / f"rank{r}" for r in range(NODES)]
    if mode == "mtcfs":
        nodes = Nodes(s.work, name, s.backup_interval, s.data_parallel)
        nodes.mount()
        dirs = [str(m.mnt) for m in nodes.mounts]
    else:
        for d in rank_dirs:
            d.mkdir(parents=True)
        dirs = [str(d) for d in rank_dirs]
    procs: list[Any] = []
    saved: dict[int, set[int]] = {r: set() for r in range(NODES)}  # rank -> steps saved
    t0 = time.monotonic()

    def scan_backup(now: float) -> int | None:
        """The bucket's newest step complete on every rank, noted in res.backup_timeline
        when it changed (mtcfs strategies)."""
        assert nodes is not None
        newest = nodes.backup_complete()
        if newest is not None and (not res.backup_timeline
                                   or res.backup_timeline[-1][1] != newest):
            res.backup_timeline.append((round(now - t0, 3), newest))
        return newest
    try:
        t0 = time.monotonic()
        deadline = t0 + s.max_wall_s
        res.timeline.append((0.0, 0))
        todo = list(s.failures)
        restore: int | None = None
        floor = 0.0
        recovering: FailureRecord | None = None
        next_scan = 0.0  # when to look at the backup bucket next (mtcfs)
        while True:
            port = free_ports(1)[0]
            procs, conns = spawn(ctx, [WorkerSpec(
                r, port, s.seed, s.steps, s.step_s, every, mode, dirs[r], restore,
                s.bandwidth, floor, s.width) for r in range(NODES)])
            ready: set[int] = set()
            last = restore or 0
            hit: Failure | None = None
            while len(res.digests) < NODES:
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError(f"{name}: not done after {s.max_wall_s:.0f} s")
                if nodes is not None and now >= next_scan:
                    scan_backup(now)
                    next_scan = now + 0.5
                if len(ready) == NODES and todo and t0 + todo[0].t <= now:
                    hit = todo.pop(0)
                    break
                wait = 0.05 if not todo else min(0.05, max(0.0, t0 + todo[0].t - now))
                for c in _ready(conns, wait):
                    try:
                        msg = c.recv()
                    except EOFError:  # a rank that is done has exited
                        conns.remove(c)
                        if len(conns) < NODES - len(res.digests):
                            codes = [p.exitcode for p in procs]
                            raise RuntimeError(f"{name}: a rank ended unexpectedly ({codes})")
                        continue
                    kind, rank = msg[0], msg[1]
                    if kind == "error":
                        raise RuntimeError(f"{name}: rank {rank}: {msg[2]}")
                    if kind == "ready":
                        ready.add(rank)
                        if len(ready) == NODES and recovering is not None:
                            recovering.recovery_s = msg[3] - (t0 + recovering.t)
                            if recovering.recovery_s > SLOW_RECOVERY_S and nodes is not None:
                                nodes.report_slow(recovering)
                            res.timeline.append((msg[3] - t0, msg[2]))
                            recovering = None
                    elif kind == "step" and rank == 0:
                        last = msg[2]
                        res.timeline.append((msg[3] - t0, msg[2]))
                    elif kind == "saved":
                        saved[rank].add(msg[2])
                        res.stalls.append(msg[3])
                        res.ckpt_bytes = msg[4]
                        if mode == "backup":
                            res.backup_bytes += msg[4]
                    elif kind == "done":
                        res.digests[rank] = msg[2]
            if hit is None:
                res.wall_s = time.monotonic() - t0
                break
            # --- a failure: the job's ranks die; the kind says what else is lost ---------
            t_hit = time.monotonic()
            kill_all(procs, hit.rank)
            in_backup = scan_backup(t_hit) if nodes is not None else None
            lost = {"process": [], "node": [hit.rank], "job": list(range(NODES))}[hit.kind]
            if nodes is not None:
                if lost:
                    nodes.replace(lost)
                t_replaced = time.monotonic()
                if hit.kind == "process":
                    expect = False  # nothing left RAM: what is there is all there is
                elif hit.kind == "node":
                    expect = any(all(n in saved[r] for r in range(NODES)) for n in saved[0])
                else:
                    expect = any(all((d / f"rank-{r}").is_dir() for r in range(NODES))
                                 for d in (nodes.bucket / "steps").glob("*"))  # backed up
                restore = pick_mtcfs(nodes, expect)
                replace_s, pick_s = t_replaced - t_hit, time.monotonic() - t_replaced
                floor = (s.ckpt_bytes / s.bandwidth) if hit.kind == "job" and restore else 0.0
            else:
                restore = pick_backup(rank_dirs)
            rec = FailureRecord(hit.kind, hit.rank, round(t_hit - t0, 3), last,
                                restore or 0, backup_step=in_backup,
                                sealed=max((n for n in set.intersection(*saved.values())
                                            if n <= last), default=0))
            if nodes is not None:
                rec.replace_s, rec.pick_s = round(replace_s, 3), round(pick_s, 3)
            res.failures.append(rec)
            recovering = rec
            # in the plot: down to the restored step at the failure, flat while recovering
            res.timeline += [(t_hit - t0, last), (t_hit - t0, restore or 0)]
            say(f"  {name}: t={t_hit - t0:6.1f}s {hit.kind:>7} failure (rank {hit.rank}) "
                f"at step {last}: restoring "
                f"{'step ' + str(restore) if restore else 'from scratch'}"
                + (f" (backup tier: step {in_backup} complete on every rank)"
                   if nodes is not None else ""))
    finally:
        if procs:
            kill_all(procs)
        res.last_sealed = max(set.intersection(*saved.values()), default=0)
        if nodes is not None:
            res.backup_final = nodes.backup_complete()
            if res.backup_final is not None:
                scan_backup(time.monotonic())
            if len(res.digests) == NODES and res.last_sealed:
                # the job is done: does the backup tier reach its last checkpoint? (bounded)
                t_end, limit = time.monotonic(), catch_up_s(s)
                while time.monotonic() - t_end < limit:
                    if (scan_backup(time.monotonic()) or 0) >= res.last_sealed:
                        res.backup_caught_up_s = round(time.monotonic() - t_end, 2)
                        break
                    time.sleep(0.2)
            res.backup_bytes = nodes.uploaded() if nodes.mounts[0].pid else res.backup_bytes
            for r in range(NODES):
                nodes.sample(r)
            res.background_cpu_s = nodes.background_cpu()
            nodes.unmount()
            res.backup_bytes = max(res.backup_bytes, nodes.uploaded())
    res.goodput = s.steps * s.step_s / res.wall_s
    res.equal = all(res.digests.get(r) == ref[r] for r in range(NODES))
    return res


def catch_up_s(s: Setup) -> float:
    """How long the end of an mtcfs strategy waits for its last checkpoint to be complete
    on every rank in the backup tier: 4 backup intervals, at least 30 s."""
    return max(30.0, 4 * float(s.backup_interval.rstrip("s")))


def pick_backup(rank_dirs: list[Path]) -> int | None:
    """The newest step every rank committed to the backup directory."""
    common = set.intersection(*(set(steps_in(d, _STEP_FILE)) for d in rank_dirs))
    return max(common) if common else None


def pick_mtcfs(nodes: Nodes, expect: bool, timeout: float = 30.0) -> int | None:
    """The newest step complete in every node's mount. A replaced node shows the job's
    newest checkpoint complete on all ranks (from its peer or the backup tier) once its
    restore has begun: when one is ``expect``ed, wait for it (at most ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        common = set.intersection(*(nodes.complete_steps(r) for r in range(NODES)))
        if common:
            return max(common)
        if not expect:
            return None
        if time.monotonic() > deadline:
            say(f"  WARNING: no common checkpoint in the mounts after {timeout:.0f} s")
            return None
        time.sleep(0.02)


# ---------------------------------------------------------------------- calibration

def measure_stall(ctx: Any, s: Setup, mode: str, dirs: list[str], steps: int = 5) -> list[float]:
    """The save stalls of both ranks checkpointing every step for ``steps`` padded steps
    (``steps - 1`` saves each), into ``dirs`` (mounts or backup directories)."""
    from demo_peers import free_ports
    port = free_ports(1)[0]
    procs, conns = spawn(ctx, [WorkerSpec(r, port, s.seed, steps, s.step_s, 1, mode, dirs[r],
                                          None, s.bandwidth, 0.0, s.width)
                               for r in range(NODES)])
    stalls: list[float] = []
    deadline = time.monotonic() + 120
    try:
        while conns:
            if time.monotonic() > deadline:
                raise TimeoutError(f"calibration ({mode}) did not finish in 120 s")
            for c in _ready(conns, 1.0):
                try:
                    msg = c.recv()
                except EOFError:
                    conns.remove(c)
                    continue
                if msg[0] == "error":
                    raise RuntimeError(f"calibration rank {msg[1]}: {msg[2]}")
                if msg[0] == "saved":
                    stalls.append(msg[3])
                    s.ckpt_bytes = msg[4]
    finally:
        kill_all(procs)
    return stalls


def calibrate(ctx: Any, s: Setup, ratio: float) -> tuple[float, float]:
    """Measure the save stall into mtcfs (both ranks saving at once into their own node of
    a 2-node setup configured as the strategies', 5 saves each; median), set the backup
    tier's bandwidth to the RAM tier's save rate so measured / ``ratio``, and measure the
    save stall there the same way. Returns (mtcfs save s, backup tier save s); sets
    ``s.bandwidth`` and ``s.ckpt_bytes``."""
    nodes = Nodes(s.work, "calib", s.backup_interval, s.data_parallel)
    nodes.mount()
    try:
        mtcfs_s = statistics.median(measure_stall(ctx, s, "mtcfs",
                                                  [str(m.mnt) for m in nodes.mounts]))
    finally:
        nodes.unmount()
    s.bandwidth = s.ckpt_bytes / mtcfs_s / ratio
    dirs = [s.work / "calib" / "backup" / f"rank{r}" for r in range(NODES)]
    for d in dirs:
        d.mkdir(parents=True)
    backup_s = statistics.median(measure_stall(ctx, s, "backup", [str(d) for d in dirs]))
    shutil.rmtree(s.work / "calib", ignore_errors=True)
    return mtcfs_s, backup_s


# ---------------------------------------------------------------------- report

def predict(res: Result, s: Setup, mtbf_s: float) -> float:
    """Young/Daly's first-order goodput (mtcfs.plan.expected_waste) for this strategy's
    interval, its measured mean save stall and its measured mean recovery time, with
    failures every ``mtbf_s`` seconds."""
    delta = statistics.mean(res.stalls) if res.stalls else 0.0
    rec = [f.recovery_s for f in res.failures]
    restart = statistics.mean(rec) if rec else 0.0
    return 1 - expected_waste(res.every * s.step_s, mtbf_s, delta, restart)


def _mean(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.2f}" if xs else "-"


def _background(r: Result) -> str:
    """What the background work cost the job: its CPU seconds, and that against the CPU
    the run's wall time gives the job's ranks (one core each)."""
    if r.background_cpu_s is None:
        return "-"
    job = r.wall_s * NODES
    return f"{r.background_cpu_s:.1f} ({100 * r.background_cpu_s / job:.1f} %)" if job \
        else f"{r.background_cpu_s:.1f}"


def table(results: list[Result], s: Setup) -> str:
    head = ("| strategy | interval | goodput | Young/Daly: MTBF / seen | failures p/n/j "
            "| steps lost "
            "| recovery s p/n/j | save stall s (median) | backup MB "
            "| background CPU s (% of the job's) | weights equal |")
    rows = [head, "|" + " --- |" * 11]
    for r in results:
        n = [len(r.recovery(k)) for k in KINDS]
        stall = statistics.median(r.stalls) if r.stalls else 0.0
        rows.append(
            f"| {r.label} | {r.every} steps ({r.every * s.step_s:.1f} s) "
            f"| {100 * r.goodput:.1f} % "
            f"| {100 * r.predicted:.1f} % / {100 * r.predicted_seen:.1f} % "
            f"| {n[0]}/{n[1]}/{n[2]} | {r.steps_lost} "
            f"| {' / '.join(_mean(r.recovery(k)) for k in KINDS)} "
            f"| {stall:.3f} ({len(r.stalls) // NODES} ckpts) "
            f"| {r.backup_bytes / 1e6:.0f} "
            f"| {_background(r)} | {'yes' if r.equal else 'NO'} |")
    return "\n".join(rows)


def backup_report(results: list[Result], s: Setup) -> str:
    """Per mtcfs strategy: is its backup tier current after node replacements? The newest
    step complete on every rank in the bucket against the newest step every rank
    checkpointed, at each failure and at the end, and which step each whole-job restore
    used."""
    lines = [f"backup tier (mtcfs backs up every {s.backup_interval}"
             + (f", assume_data_parallelism={s.data_parallel}" if s.data_parallel > 1 else "")
             + "): newest step complete on every rank / newest step checkpointed on every rank"]
    for r in results:
        if r.name == "backup":
            continue
        lines.append(f"  {r.label}:")
        for f in r.failures:
            what = {"process": "", "node": f" -> node {f.rank} replaced",
                    "job": f" -> restored step {f.restored} from the backup tier"}[f.kind]
            lines.append(f"    t={f.t:6.1f}s {f.kind:>7} at step {f.step}: backup "
                         f"{f.backup_step if f.backup_step is not None else 'none'} / "
                         f"checkpointed {f.sealed}{what}")
        for f in (f for f in r.failures if f.kind == "node"):
            after = [(t, n) for t, n in r.backup_timeline if t > f.t and n > f.sealed]
            lines.append(f"    after the replacement at t={f.t:.1f}s: "
                         + (f"first newer job-complete backup (step {after[0][1]}) "
                            f"{after[0][0] - f.t:.1f} s later" if after
                            else "no step newer than the checkpoint it restored was "
                            "checkpointed after it" if r.last_sealed <= f.sealed
                            else "NO newer step complete on every rank in the backup tier"))
        adv = [n for _, n in r.backup_timeline]
        lines.append(f"    job-complete backup steps, in order: {adv}")
        lines.append(f"    at the end: backup {r.backup_final if r.backup_final is not None else 'none'}"
                     f" / checkpointed {r.last_sealed} (every {r.every} steps); step "
                     f"{r.last_sealed} complete on every rank "
                     + (f"{r.backup_caught_up_s:.1f} s after the last step"
                        if r.backup_caught_up_s is not None
                        else f"NOT within {catch_up_s(s):.0f} s after the last step"))
    return "\n".join(lines)


def plot(results: list[Result], s: Setup, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    marks = {"process": "x", "node": "o", "job": "s"}
    for r in results:
        ts, ns = zip(*r.timeline)
        (line,) = ax.plot(ts, ns, lw=1.3,
                          label=f"{r.label}: goodput {100 * r.goodput:.0f} %")
        for f in r.failures:
            ax.plot([f.t], [f.step], marks[f.kind], color=line.get_color(), ms=7,
                    mfc="none", mew=1.5)
    for k, mk in marks.items():
        ax.plot([], [], mk, color="black", mfc="none", label=f"{k} failure")
    ax.axhline(s.steps, color="grey", lw=0.6, ls=":")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("training step")
    ax.set_title(f"{s.steps} steps of {s.step_s * 1000:.0f} ms, MTBF {s.mtbf_s:.0f} s, "
                 f"seed {s.seed}: same failures for every strategy")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------- main

def run(args: argparse.Namespace, work: Path) -> tuple[list[Result], Setup, dict[str, Any]]:
    ctx = mp.get_context("forkserver")
    # the rank processes fork from a server that has imported what they need (also what
    # torch.use_deterministic_algorithms imports, ~3 s here): a restart costs no imports
    ctx.set_forkserver_preload(list(PRELOAD))
    say(f"goodput run: {NODES} ranks, {args.steps} steps of {args.step_ms} ms, "
        f"MTBF {args.mtbf} s, seed {args.seed}")
    say(f"scratch: {work}")
    if args.data_parallel:
        say("mtcfs mounts with assume_data_parallelism=2: the ranks' nodes split each backup")
    step_s = args.step_ms / 1000
    horizon = 20 * args.steps * step_s + 600
    s = Setup(work, args.seed, args.steps, step_s, args.width, args.mtbf,
              schedule(args.seed, args.mtbf, horizon, args.short), 0.0, 0,
              f"{max(1, round(args.mtbf / 3))}s", horizon,
              2 if args.data_parallel else 1)
    t = time.monotonic()
    ref = run_reference(ctx, s)
    t_ref = time.monotonic() - t
    say(f"uninterrupted run: {t_ref:.1f} s, final state {ref[0][:16]}... "
        f"(ranks equal: {'yes' if ref[0] == ref[1] else 'NO'})")
    mtcfs_s, backup_s = calibrate(ctx, s, args.ratio)
    nbytes, bw = s.ckpt_bytes, s.bandwidth
    say(f"calibration: checkpoint {nbytes / 1e6:.1f} MB per rank; save stall mtcfs "
        f"{mtcfs_s:.3f} s, backup tier {backup_s:.3f} s at {bw / 1e6:.1f} MB/s "
        f"(the RAM tier's {nbytes / mtcfs_s / 1e6:.0f} MB/s / {args.ratio:g})")
    plan_m = plan_interval(args.mtbf, mtcfs_s)
    plan_b = plan_interval(args.mtbf, backup_s)
    every_m = max(1, round(plan_m.daly_s / step_s))
    every_b = max(1, round(plan_b.daly_s / step_s))
    say(f"Young/Daly intervals: mtcfs {plan_m.young_s:.2f} / {plan_m.daly_s:.2f} s "
        f"-> every {every_m} steps; backup tier {plan_b.young_s:.2f} / {plan_b.daly_s:.2f} s "
        f"-> every {every_b} steps")
    plans = [("backup", "backup tier, Young/Daly interval", "backup", every_b),
             ("mtcfs-yd", "mtcfs, Young/Daly interval", "mtcfs", every_m),
             ("mtcfs-base", "mtcfs, baseline's interval", "mtcfs", every_b)]
    results = []
    for name, label, mode, every in plans:
        say(f"strategy {name}: {label}, every {every} steps")
        t = time.monotonic()
        res = run_strategy(ctx, s, name, label, mode, every, ref)
        res.setup_s = time.monotonic() - t - res.wall_s
        res.predicted = predict(res, s, s.mtbf_s)
        # ... and at the failure rate this run met (wall time / failures)
        res.predicted_seen = predict(res, s, res.wall_s / max(1, len(res.failures)))
        say(f"  {name}: {res.wall_s:.1f} s (+{res.setup_s:.1f} s to set up), goodput {100 * res.goodput:.1f} %, "
            f"{len(res.failures)} failures, final state equal: {res.equal}")
        results.append(res)
    calib = {"mtcfs_save_s": mtcfs_s, "backup_save_s": backup_s, "ckpt_bytes": nbytes,
             "backup_bandwidth": bw, "ratio": args.ratio,
             "young_daly": {"mtcfs": asdict(plan_m), "backup": asdict(plan_b)},
             "backup_interval": s.backup_interval, "data_parallel": s.data_parallel}
    return results, s, calib


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true",
                   help="the test form: 120 steps, MTBF 8 s, no job failures")
    p.add_argument("--steps", type=int, default=None, help="steps to train (long: 1500)")
    p.add_argument("--mtbf", type=float, default=None, help="mean time between failures, s "
                   "(long: 30)")
    p.add_argument("--step-ms", type=float, default=100.0, help="a step's time (padded)")
    p.add_argument("--seed", type=int, default=1, help="data order and failure schedule")
    p.add_argument("--ratio", type=float, default=10.0,
                   help="RAM tier save rate / backup tier bandwidth")
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--data-parallel", action="store_true",
                   help="mount mtcfs with assume_data_parallelism=2 (the 2 ranks are "
                   "data-parallel twins: they split each backup's upload)")
    p.add_argument("--png", type=Path, default=Path("goodput.png"), help="the plot")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    args.steps = args.steps or (120 if args.short else 1500)
    args.mtbf = args.mtbf or (8.0 if args.short else 30.0)

    def on_error(work: Path) -> None:
        for log in sorted(work.glob("*/n*/store/mtcfs.log")):
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            print(f"--- {log} ---\n{tail}", file=sys.stderr)

    out = run_in_scratch("mtcfs-goodput-", NODES, lambda w: run(args, w), on_error)
    if out is None:
        return 130
    results, s, calib = out
    say("")
    say(table(results, s))
    say("")
    say(backup_report(results, s))
    plot(results, s, args.png)
    say(f"plot: {args.png}")
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "calibration": calib,
            "schedule": [asdict(f) for f in s.failures if f.t < max(r.wall_s for r in results)],
            "results": [{**{k: v for k, v in asdict(r).items() if k != "timeline"},
                         "steps_lost": r.steps_lost} for r in results]}, indent=1))
    ok = all(r.equal for r in results)
    say("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
