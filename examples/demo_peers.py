#!/usr/bin/env python3
"""mtcfs peer tier: three nodes on one machine, lose one, get it back from its peers.

    python examples/demo_peers.py
    python examples/demo_peers.py --steps 40 --every 10 --crash-at 28

What it does (needs root or FUSE permissions, like any mtcfs mount):

1. makes a scratch directory under /dev/shm with, per node, a RAM-tier store and a mount
   point, and a ``file://`` backup bucket; picks a free loopback port per node; mounts the 3
   "nodes" with the CLI (``mtcfs JOB MNT -o store=...,rank=R,nodes=3,peers=<every
   address>,listen=<its own>,replicas=1,backup=file://...,backup_interval=1h``). The backup
   tier is configured: the first checkpoint goes there at once, the next ones not within the
   hour, so the newest checkpoint exists only in RAM, on its node and its peer;
2. each rank trains its own small model shard on CPU, deterministically (its own seed and
   data), and saves a DCP checkpoint (model + optimizer + step) into ``MNT/step_<n>`` of its
   own mount every ``--every`` steps, with ``torch.distributed.checkpoint.save`` unchanged
   (no process group); the ``user.mtcfs.state`` xattr of each checkpoint is printed as it
   goes from ``local`` to ``replicated 1/1`` (a copy in the RAM of its ring peer) or
   ``backed-up``;
3. node 1 dies a few steps after the latest checkpoint: its daemon is SIGKILLed, the dead
   mount is cleared (``mtcfs umount --force``) and its store is wiped;
4. a replacement node 1 mounts on an empty store: the newest checkpoint complete on every
   rank appears in its mount, and its data streams in from the peer that holds the copy.
   The demo prints how long that took and which tiers served it: peers, and nothing read
   from the backup tier;
5. the job restarts from that checkpoint: every rank loads it from its own mount (node 1
   from the restored one) and trains to the end. Every rank's final weights and optimizer
   state are compared with an uninterrupted run of the same length in this process: they
   must be identical, bit for bit. Prints a summary and PASS or FAIL; the exit status is 0
   only on PASS.

Every mount is always torn down (clean unmount, else abort + lazy unmount), also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _mount_util import (  # noqa: E402
    remove_store,
    MtcfsMount, force_unmount, is_mounted, job_tls, local_etcd, mtcfs, print_node_logs,
    run_in_scratch,
)
from demo import TorchJob, human  # noqa: E402

warnings.filterwarnings("ignore")
NODES = 3
LOST = 1  # the rank whose node dies
REPLICATED = "replicated 1/1"


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free a moment ago (bound to port 0 at once)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class ShardJob(TorchJob):
    """demo.py's MLP regression, one per rank: its own initial weights and its own data, as
    if each rank owned a different shard of the model."""

    def __init__(self, rank: int, width: int) -> None:
        super().__init__(width)
        self.rank = rank

    def init(self):
        import torch
        from torch import nn
        torch.manual_seed(1000 + self.rank)
        model = nn.Sequential(nn.Linear(64, self.width), nn.Tanh(),
                              nn.Linear(self.width, self.width), nn.Tanh(),
                              nn.Linear(self.width, 16))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        return model, opt

    def batch(self, n: int):
        g = self.torch.Generator().manual_seed(1_000_000 * (self.rank + 1) + n)
        x = self.torch.randn(128, 64, generator=g)
        y = self.torch.sin(x[:, :16] * (2.0 + self.rank)) + 0.1 * self.torch.randn(
            128, 16, generator=g)
        return x, y


# ---------------------------------------------------------------------- bookkeeping

@dataclass
class Ckpt:
    rank: int
    step: int
    name: str
    save_s: float
    saved_at: float
    replicated_at: float | None = None
    durable_as: str = ""
    size: int | None = None


@dataclass
class Report:
    steps: int
    every: int
    crash_at: int
    params: int = 0
    ckpts: list[Ckpt] = field(default_factory=list)
    killed_pid: int = 0
    restored: str = ""
    restore_bytes: int = 0
    manifest_from: str = ""
    chunks_from: dict = field(default_factory=dict)
    backup_downloaded: int = -1
    bucket_files: int = -1
    bucket_steps: list[str] = field(default_factory=list)
    mount_s: float = 0.0
    namespace_s: float = 0.0
    full_s: float = 0.0
    resumed_from: int = 0
    loaded_equal: bool = False
    final_loss: dict[int, float] = field(default_factory=dict)
    ref_loss: dict[int, float] = field(default_factory=dict)
    tensors: dict[int, int] = field(default_factory=dict)
    tensors_equal: dict[int, int] = field(default_factory=dict)
    state_after: str = ""

    def rank_ok(self, r: int) -> bool:
        return (r in self.final_loss and self.final_loss[r] == self.ref_loss.get(r)
                and self.tensors.get(r, 0) > 0 and self.tensors_equal.get(r) == self.tensors[r])

    @property
    def passed(self) -> bool:
        return (self.loaded_equal and all(self.rank_ok(r) for r in range(NODES))
                and self.chunks_from.get("peers", 0) > 0
                and self.chunks_from.get("backup", 0) == 0)


_print_lock = threading.Lock()


def say(*a) -> None:
    with _print_lock:
        print(*a, flush=True)


class ReplicationWatcher(threading.Thread):
    """Records when each saved checkpoint's ``user.mtcfs.state`` becomes ``replicated 1/1``
    (the plain-xattr way a training script asks "is this checkpoint durable yet?"), and
    prints a line once a step is durable (``replicated 1/1`` or ``backed-up``) on every
    node."""

    def __init__(self, mnts: list[Path]) -> None:
        super().__init__(daemon=True, name="replication-watcher")
        self.mnts = mnts
        self.pending: list[Ckpt] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def add(self, c: Ckpt) -> None:
        with self.lock:
            self.pending.append(c)

    def run(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                todo = [c for c in self.pending if c.replicated_at is None]
            for c in todo:
                try:
                    state = os.getxattr(self.mnts[c.rank] / c.name, "user.mtcfs.state").decode()
                except OSError:
                    continue
                if state in (REPLICATED, "backed-up"):
                    c.replicated_at, c.durable_as = time.monotonic(), state
                    with self.lock:
                        same = sorted((o for o in self.pending if o.step == c.step),
                                      key=lambda o: o.rank)
                    if len(same) == NODES and all(o.replicated_at for o in same):
                        slowest = max(o.replicated_at - o.saved_at for o in same)
                        say(f"          {c.name}: durable on every node: "
                            f"{' | '.join(o.durable_as for o in same)} "
                            f"(at most {slowest:.3f} s after its save)")
            self.stop.wait(0.01)

    def wait(self, cs: list[Ckpt], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while any(c.replicated_at is None for c in cs):
            if time.monotonic() > deadline:
                late = [f"node {c.rank} {c.name}" for c in cs if c.replicated_at is None]
                raise TimeoutError(f"not replicated in {timeout:.0f}s: {', '.join(late)}")
            time.sleep(0.01)


# ---------------------------------------------------------------------- the demo

def on_all(fn, items) -> None:
    """``fn(item)`` for every item at once, one thread each; re-raise the first error."""
    errors: list[BaseException] = []

    def one(x) -> None:
        try:
            fn(x)
        except BaseException as exc:  # noqa: BLE001 (re-raised below)
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(x,), daemon=True) for x in items]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    finally:  # also on Ctrl-C: no mount may come up after the teardown
        for t in threads:
            while t.is_alive():
                try:
                    t.join()
                except KeyboardInterrupt:
                    pass
    if errors:
        raise errors[0]


def kill9(m: MtcfsMount) -> int:
    """SIGKILL the daemon of ``m`` (a node crash) and clear its dead mount."""
    pid, m.pid = m.pid, None
    assert pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    mtcfs("umount", str(m.mnt), "--force", check=False, timeout=30)
    if is_mounted(m.mnt):
        force_unmount(m.mnt)
    return pid


def run(args: argparse.Namespace, work: Path) -> Report:
    jobs = [ShardJob(r, args.width) for r in range(NODES)]
    crash_at = args.crash_at if args.crash_at is not None else max(args.every,
                                                                   (args.steps * 7) // 10)
    if crash_at < args.every or crash_at >= args.steps:
        raise SystemExit(f"--crash-at must be in [--every, --steps): got {crash_at}")
    rep = Report(args.steps, args.every, crash_at, params=jobs[0].params(jobs[0].init()))

    ports = free_ports(NODES)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    bucket = work / "bucket"
    bucket.mkdir()
    mounts: list[MtcfsMount] = []
    coord = local_etcd("peers")  # the nodes find each other and agree through etcd
    tls = job_tls(work, f"demo-peers-{os.getpid()}", NODES)  # the job CA: mutual TLS
    for r in range(NODES):
        (work / f"n{r}" / "mnt").mkdir(parents=True)
        opts = {"store": str(work / f"n{r}" / "store"), "size": args.size,
                "rank": str(r), "nodes": str(NODES), "peers": peers,
                "listen": f"127.0.0.1:{ports[r]}", "replicas": "1", **coord, **tls(r)}
        if not args.no_backup:
            opts.update({"backup": f"file://{bucket}", "backup_interval": "1h"})
        mounts.append(MtcfsMount(f"demo-peers-{os.getpid()}", work / f"n{r}" / "mnt", opts))
    mnts = [m.mnt for m in mounts]
    say(f"mtcfs peer-tier demo: {NODES} nodes on this machine, PyTorch + DCP, "
        f"replicas=1 (ring: node r's copy lives on node r+1)")
    say(f"scratch: {work}")
    say(f"backup: file://{bucket} every 1h (only the first checkpoint gets there in time)"
        if not args.no_backup else "backup: none (--no-backup)")
    watcher = ReplicationWatcher(mnts)
    try:
        t0 = time.monotonic()
        on_all(lambda m: m.mount(), mounts)
        for r, m in enumerate(mounts):
            say(f"  node {r}: mount point {m.mnt}, peer service 127.0.0.1:{ports[r]}, "
                f"daemon pid {m.pid}")
        say(f"  {NODES} nodes mounted in {time.monotonic() - t0:.2f} s")
        watcher.start()

        # --- phase 1: every rank trains and checkpoints until node 1 is lost ----------
        states = [job.init() for job in jobs]
        saved_weights = None
        for n in range(crash_at):
            for job, st in zip(jobs, states):
                job.train_step(st, n)
            done = n + 1
            if done % args.every:
                continue
            saves = []
            for r, (job, st) in enumerate(zip(jobs, states)):
                t1 = time.monotonic()
                job.save(mnts[r], st, done)
                c = Ckpt(r, done, job.ckpt_name(done), time.monotonic() - t1, time.monotonic())
                rep.ckpts.append(c)
                saves.append(c)
                watcher.add(c)
                if r == LOST:
                    saved_weights = (done, job.snapshot(st))
            now = [m.state(saves[0].name) for m in mounts]
            say(f"  step {done:>4}: {saves[0].name} saved on every node "
                f"({' / '.join(f'{c.save_s:.3f}' for c in saves)} s); "
                f"user.mtcfs.state: {' | '.join(now)}")
        latest = [c for c in rep.ckpts if c.step == rep.ckpts[-1].step]
        watcher.wait(latest)
        watcher.stop.set()
        watcher.join()
        sizes = {}
        for r, m in enumerate(mounts):
            sizes.update({(r, row["step"]): row["bytes"] for row in m.checkpoints()})
        for c in rep.ckpts:
            c.size = sizes.get((c.rank, c.name))
        name = latest[0].name
        state1 = mounts[LOST].state(name)

        # --- phase 2: node 1 dies; a replacement mounts on an empty store ------------
        rep.killed_pid = kill9(mounts[LOST])
        store = Path(mounts[LOST].options["store"])
        remove_store(store)
        say(f"  step {crash_at:>4}: node {LOST} dies: daemon {rep.killed_pid} SIGKILLed "
            f"({crash_at - latest[0].step} steps after {name}, which was {state1!r}), "
            f"dead mount cleared, store wiped")
        rep.bucket_files = sum(len(fs) for _d, _s, fs in os.walk(bucket))
        if (bucket / "steps").is_dir():
            rep.bucket_steps = sorted(os.listdir(bucket / "steps"))

        t0 = time.monotonic()
        mounts[LOST].mount()  # on an empty store: the job's newest checkpoint comes back
        rep.mount_s = time.monotonic() - t0
        while not (mnts[LOST] / name / ".metadata").exists():
            if time.monotonic() - t0 > 60:
                raise TimeoutError(f"{name} did not appear on the replacement node")
            time.sleep(0.01)
        rep.namespace_s = time.monotonic() - t0
        st = mounts[LOST].status()
        while (st.get("restore") or {}).get("pending_chunks"):
            if time.monotonic() - t0 > 120:
                raise TimeoutError(f"the restore did not finish: {st['restore']}")
            time.sleep(0.01)
            st = mounts[LOST].status()
        rep.full_s = time.monotonic() - t0
        restore = st.get("restore") or {}
        rep.restored = restore.get("step", "")
        rep.restore_bytes = restore.get("bytes", 0)
        rep.manifest_from = restore.get("manifest_from", "")
        rep.chunks_from = dict(restore.get("chunks_from") or {})
        rep.backup_downloaded = ((st.get("backup") or {}).get("store") or {}).get(
            "chunks_downloaded", -1)
        say(f"  new node {LOST} (empty store, pid {mounts[LOST].pid}): {os.listdir(mnts[LOST])}"
            f" in its mount after {rep.namespace_s:.3f} s, all {human(rep.restore_bytes)} "
            f"back after {rep.full_s:.3f} s")
        say(f"          served by: peers: {rep.chunks_from.get('peers', 0)} chunks, "
            f"backup: {rep.chunks_from.get('backup', 0)} chunks "
            f"(manifest from {rep.manifest_from or '?'})")

        # --- phase 3: the job restarts from the checkpoint; every rank resumes --------
        for r, (job, m) in enumerate(zip(jobs, mnts)):
            resume = job.latest(m)
            if resume != latest[0].step:
                raise RuntimeError(f"node {r}: expected {name}, found step {resume}")
            states[r], start = job.load(m, resume)
            assert start == resume, (start, resume)
            if r == LOST:
                loaded = jobs[r].snapshot(states[r])
                step, want = saved_weights
                rep.loaded_equal = step == resume and loaded.keys() == want.keys() and all(
                    job.equal(loaded[k], want[k]) for k in loaded)
        rep.resumed_from = latest[0].step
        say(f"  step {rep.resumed_from:>4}: every rank loads {name} from its own mount and "
            f"resumes (node {LOST}'s state bit-exact: "
            f"{'yes' if rep.loaded_equal else 'NO'})")
        for n in range(rep.resumed_from, args.steps):
            for r, (job, st) in enumerate(zip(jobs, states)):
                rep.final_loss[r] = job.train_step(st, n)
        say(f"  step {args.steps:>4}: every rank is done")
        try:
            rep.state_after = mounts[LOST].state(name)
        except OSError:
            pass
    finally:
        watcher.stop.set()
        teardown_all(mounts)

    # Reference: the same training, uninterrupted, in memory.
    say("  comparing with an uninterrupted run of every rank, in memory")
    for r, (job, st) in enumerate(zip(jobs, states)):
        ref = job.init()
        for n in range(args.steps):
            rep.ref_loss[r] = job.train_step(ref, n)
        want, final = job.snapshot(ref), job.snapshot(st)
        rep.tensors[r] = len(want)
        rep.tensors_equal[r] = sum(1 for k, v in want.items()
                                   if k in final and job.equal(final[k], v))
    return rep


def teardown_all(mounts: list[MtcfsMount]) -> None:
    """Unmount every node at once, whatever state it is in."""
    def one(m: MtcfsMount) -> None:
        try:
            m.force()
        finally:
            if is_mounted(m.mnt):
                force_unmount(m.mnt)
    on_all(one, mounts)


def print_report(rep: Report) -> None:
    print()
    print(f"== mtcfs peer-tier demo: {NODES} nodes, DCP, {rep.params:,} parameters per rank, "
          f"{rep.steps} steps, checkpoint every {rep.every} ==")
    print(f"{'checkpoint':<12} {'node':>4} {'size':>10} {'save (RAM tier)':>16} "
          f"{'durable after':>14}  as")
    for c in rep.ckpts:
        ra = "-" if c.replicated_at is None else f"{c.replicated_at - c.saved_at:.3f} s"
        print(f"{c.name:<12} {c.rank:>4} {human(c.size) if c.size else '-':>10} "
              f"{c.save_s:>14.3f} s {ra:>14}  {c.durable_as or '-'}")
    print(f"node {LOST} lost at step {rep.crash_at} (daemon {rep.killed_pid} SIGKILLed, store "
          f"wiped); the backup bucket held {rep.bucket_files} files, steps "
          f"{rep.bucket_steps}")
    print(f"restored {rep.restored or '?'} ({human(rep.restore_bytes)}) on an empty store: "
          f"mount {rep.mount_s:.3f} s, namespace in {rep.namespace_s:.3f} s, all data after "
          f"{rep.full_s:.3f} s")
    print(f"served by: peers: {rep.chunks_from.get('peers', 0)} chunks, "
          f"backup: {rep.chunks_from.get('backup', 0)} chunks; manifest from "
          f"{rep.manifest_from or '?'}; chunks downloaded from the backup: "
          f"{rep.backup_downloaded}")
    if rep.state_after:
        print(f"node {LOST}'s {rep.restored} is now {rep.state_after!r}")
    print(f"resumed at step {rep.resumed_from} -> {rep.steps}: node {LOST}'s loaded state "
          f"bit-exact: {'yes' if rep.loaded_equal else 'NO'}")
    for r in range(NODES):
        fl, rl = rep.final_loss.get(r, float("nan")), rep.ref_loss.get(r, float("nan"))
        print(f"node {r}: final loss {fl!r} vs uninterrupted {rl!r}: "
              f"{'identical' if fl == rl else 'DIFFERENT'}; weights and optimizer state "
              f"{rep.tensors_equal.get(r, 0)}/{rep.tensors.get(r, 0)} entries identical")
    print("PASS" if rep.passed else "FAIL")


def _print_logs(work: Path) -> None:
    """The end of every node's daemon log, to stderr (the demo failed)."""
    print_node_logs(work, NODES)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="training steps in all")
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--crash-at", type=int, default=None,
                   help="step at which node 1 is lost (default: 70%% of --steps)")
    p.add_argument("--width", type=int, default=768, help="hidden width of each MLP")
    p.add_argument("--size", default="1G", help="RAM tier capacity per node (size= option)")
    p.add_argument("--no-backup", action="store_true",
                   help="mount without the (never used) file:// backup tier")
    args = p.parse_args(argv)
    if args.steps < 2 or args.every < 1:
        p.error("need --steps >= 2 and --every >= 1")

    rep = run_in_scratch("mtcfs-demo-peers-", NODES, lambda work: run(args, work), _print_logs)
    if rep is None:
        return 130
    print_report(rep)
    return 0 if rep.passed else 1


if __name__ == "__main__":
    sys.exit(main())
