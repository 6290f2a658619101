#!/usr/bin/env python3
"""mtcfs scope=job: four nodes, one directory; lose a node, restart the job on two.

    python examples/demo_job.py
    python examples/demo_job.py --steps 12 --every 4 --more 4 --width 1024

What it does (needs root or FUSE permissions, like any mtcfs mount):

1. makes a scratch directory under /dev/shm with, per node, a RAM-tier store and a mount
   point; picks a free loopback port per node; mounts the 4 "nodes" with the CLI
   (``mtcfs JOB MNT -o store=...,rank=R,nodes=4,peers=<every address>,listen=<its own>,
   replicas=1,scope=job,coord=etcd://...``; a local etcd orders the namespace). With
   ``scope=job`` the four mounts are ONE POSIX directory: a file closed on one node is
   readable on every node, names are ordered job-wide;
2. runs a 4-rank torch.distributed job (gloo on 127.0.0.1, one OS process per rank, rank i
   with its working directory on node i's mount): an MLP sharded with FSDP2
   (``fully_shard``), trained on CPU for ``--steps`` steps, saved every ``--every`` steps
   with ``torch.distributed.checkpoint.save`` into ``step_<n>`` of the rank's working
   directory, unchanged: each rank writes its shard ``__<rank>_0.distcp`` on its own node,
   rank 0 writes ``.metadata``. After each save the demo shows that every node lists every
   rank's files, and the ``user.mtcfs.state`` xattr of the step directory on each node. The
   saving ranks record a digest of every FULL tensor (model and Adam state, gathered with
   ``full_tensor()``) in a file outside the mounts;
3. node 3 dies once the newest step is ``replicated 1/1`` everywhere: its daemon is
   SIGKILLed, the dead mount is cleared (``mtcfs umount --force``) and its store is wiped.
   A replacement node 3 mounts on an empty store: it shows the job's directory at once, and
   its own shards (rank 3's files, written on the lost node) stream back from the peer that
   holds its replica (files up to 256 KiB come inline, with the namespace log itself);
4. the job restarts on a DIFFERENT number of nodes: 2 ranks, on nodes 2 and 3 (the
   replacement), load the newest step with ``torch.distributed.checkpoint.load``. DCP
   reshards at load: each rank reads the parts it needs of the shards the 4 ranks wrote on
   other nodes. Every full tensor of the model and the optimizer is compared with the
   digests the 4-rank job recorded: they must be identical, bit for bit. The 2 ranks then
   train ``--more`` steps and save again; every node, the 2 that did not take part
   included, lists that save;
5. prints a summary (remount time of the replacement, load time, bytes) and PASS or FAIL;
   the exit status is 0 only on PASS.

Every rank and every mount is always torn down (clean unmount, else abort + lazy unmount),
also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

warnings.filterwarnings("ignore")  # DCP/FSDP warn about CPU, experimental APIs, ...
NODES = 4
LOST = 3  # the node that dies
RESTART_ON = (2, 3)  # the nodes of the 2-rank restart (3 is the replacement)
REPLICATED = "replicated 1/1"
HERE = Path(__file__).resolve()


# ====================================================================== the torch ranks
# One OS process per rank: ``demo_job.py --worker ...``, started by the launcher below with
# its working directory on the mount of the node hosting it. Rank 0 tells the launcher what
# it did on stdout, in lines ``@event {json}``.

def build(width: int, mesh):
    """The MLP 64 -> width -> width -> 10 and its Adam, sharded with FSDP2 over ``mesh``
    (each Linear its own FSDP unit, then the root). Same initial weights on every rank."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 10))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model, opt, step: int, rank: int) -> float:
    """One step of data-parallel regression: each rank its own batch, from (step, rank)."""
    import torch

    g = torch.Generator().manual_seed(1_000 * step + rank)
    x = torch.randn(64, 64, generator=g)
    y = torch.sin(x[:, :10] * 2.0)
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def state_dict(model, opt, step: int) -> dict:
    """What DCP saves and loads: model and optimizer (DTensor shards, FQN keys), the step."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": torch.tensor(step)}


def full_digests(state, prefix: str = "") -> dict[str, str]:
    """sha256 of every FULL tensor of ``state`` (DTensors gathered with ``full_tensor()``),
    dtype and shape included. A collective: every rank calls it, with the same keys."""
    import torch
    from torch.distributed.tensor import DTensor

    out: dict[str, str] = {}
    if isinstance(state, torch.Tensor):
        full = state.full_tensor() if isinstance(state, DTensor) else state
        full = full.detach().contiguous().cpu()
        h = hashlib.sha256(f"{full.dtype}{tuple(full.shape)}".encode())
        h.update(full.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[prefix] = h.hexdigest()
    elif isinstance(state, dict):
        for k in sorted(state, key=str):
            out.update(full_digests(state[k], f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(full_digests(v, f"{prefix}[{i}]"))
    return out


def worker(a: argparse.Namespace) -> None:
    """One torch rank: join the group, (load,) train, save every ``--every`` steps, leave."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    rank, world = a.rank, a.world
    out = Path(a.out)

    def event(kind: str, **kw) -> None:
        if rank == 0:
            print(f"@{kind} {json.dumps(kw)}", flush=True)

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world,))
    model, opt = build(a.width, mesh)
    event("started", world=world, cwd=os.getcwd(),
          params=sum(p.numel() for p in model.parameters()))
    start = 0
    if a.load is not None:
        path = os.path.abspath(f"step_{a.load}")
        sd = state_dict(model, opt, -1)
        dist.barrier()
        t0 = time.monotonic()
        dcp.load(sd, checkpoint_id=path)
        load_s = time.monotonic() - t0
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        start = int(sd["step"])
        digests = full_digests(state_dict(model, opt, start))
        slowest = torch.tensor(load_s)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            (out / f"loaded-step_{a.load}-by-{world}.json").write_text(json.dumps(digests))
        event("loaded", step=start, path=path, load_s=slowest.item(), tensors=len(digests))
    for n in range(start, a.steps):
        loss = torch.tensor(train_step(model, opt, n, rank))
        dist.all_reduce(loss)
        done = n + 1
        if done % a.every and done != a.steps:
            continue
        path = os.path.abspath(f"step_{done}")
        sd = state_dict(model, opt, done)
        t0 = time.monotonic()
        dcp.save(sd, checkpoint_id=path)
        save_s = torch.tensor(time.monotonic() - t0)
        dist.all_reduce(save_s, op=dist.ReduceOp.MAX)  # the slowest rank's save
        digests = full_digests(sd)  # outside the mounts: the reference of any later load
        if rank == 0:
            (out / f"saved-step_{done}-by-{world}.json").write_text(json.dumps(digests))
        event("saved", step=done, path=path, save_s=save_s.item(),
              loss=loss.item() / world, tensors=len(digests))
    dist.barrier()
    dist.destroy_process_group()


# ====================================================================== the launcher

sys.path.insert(0, str(HERE.parent))
from _mount_util import (  # noqa: E402
    remove_store,
    MtcfsMount, job_tls, local_etcd, print_node_logs, run_in_scratch, stop_local_etcd,
)
from demo import human  # noqa: E402
from demo_peers import free_ports, kill9, on_all, teardown_all  # noqa: E402


def say(*a) -> None:
    print(*a, flush=True)


class Ranks:
    """The OS processes of one torch job, rank ``r`` working in ``dirs[r]``. Rank 0's
    ``@event`` lines are handed out by :meth:`events`; every rank's stderr goes to
    ``logs/world<N>-rank<r>.err`` (outside the mounts)."""

    def __init__(self, name: str, dirs: list[Path], work: Path, args: list[str]) -> None:
        self.name = name
        self.logs = [work / "logs" / f"world{len(dirs)}-rank{r}.err" for r in range(len(dirs))]
        self.lines: queue.Queue = queue.Queue()
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0]),
               "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONWARNINGS": "ignore"}
        self.procs: list[subprocess.Popen] = []
        try:
            for r, d in enumerate(dirs):
                with open(self.logs[r], "wb") as err:
                    # a session of its own: Ctrl-C in the terminal reaches the launcher
                    # only, which then stops every rank before it unmounts
                    self.procs.append(subprocess.Popen(
                        [sys.executable, str(HERE), "--worker", "--rank", str(r),
                         "--world", str(len(dirs)), "--out", str(work / "digests"), *args],
                        cwd=d, env=env, stdin=subprocess.DEVNULL, stderr=err,
                        stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                        text=True, start_new_session=True))
        except BaseException:
            self.kill()
            raise
        threading.Thread(target=self._read, daemon=True).start()

    def pids(self, nodes) -> str:
        return ", ".join(f"rank {r} pid {p.pid} (node {n})"
                         for r, (p, n) in enumerate(zip(self.procs, nodes)))

    def _read(self) -> None:
        for line in self.procs[0].stdout:
            self.lines.put(line)
        self.lines.put(None)

    def events(self, timeout: float = 300.0):
        """Yield ``(kind, dict)`` for each event of rank 0 until every rank exited.

        Raises:
            RuntimeError: a rank failed (the others are killed), or ``timeout`` passed.
        """
        deadline = time.monotonic() + timeout
        eof = False
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: timed out after {timeout:.0f} s{self._tails()}")
            failed = [r for r, p in enumerate(self.procs) if p.poll()]
            if failed:
                raise RuntimeError(f"{self.name}: rank(s) {failed} failed{self._tails()}")
            if eof and all(p.poll() is not None for p in self.procs):
                return
            try:
                line = self.lines.get(timeout=0.05)
            except queue.Empty:
                continue
            if line is None:
                eof = True
            elif m := re.match(r"@(\w+) (.*)$", line):
                yield m.group(1), json.loads(m.group(2))
            else:
                say(f"          rank 0: {line.rstrip()}")

    def _tails(self) -> str:
        self.kill()
        return "".join(f"\n--- {log.name} (exit {p.returncode}) ---\n"
                       + log.read_text(errors="replace")[-2000:]
                       for p, log in zip(self.procs, self.logs) if p.returncode)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()


@dataclass
class Save:
    step: int
    world: int
    save_s: float
    loss: float
    listed: dict[int, list[str]] = field(default_factory=dict)
    states: list[str] = field(default_factory=list)
    bytes: int = 0

    @property
    def name(self) -> str:
        return f"step_{self.step}"

    @property
    def files(self) -> list[str]:
        return sorted([".metadata", *(f"__{r}_0.distcp" for r in range(self.world))])

    @property
    def everywhere(self) -> bool:
        return len(self.listed) == NODES and all(v == self.files for v in self.listed.values())


@dataclass
class Report:
    steps: int
    every: int
    more: int
    params: int = 0
    saves: list[Save] = field(default_factory=list)
    job_s: float = 0.0
    durable_s: float = 0.0
    killed_pid: int = 0
    mount_s: float = 0.0
    same_namespace: bool = False
    own_bytes: int = 0
    own_s: float = 0.0
    chunks_from: dict = field(default_factory=dict)
    own_state: str = ""
    durable_again_s: float = 0.0
    loaded: int = 0
    load_s: float = 0.0
    load_fetched: dict[int, int] = field(default_factory=dict)
    tensors: int = 0
    tensors_equal: int = 0

    @property
    def passed(self) -> bool:
        return (len(self.saves) >= 2 and all(s.everywhere for s in self.saves)
                and self.same_namespace and self.chunks_from.get("backup", 0) == 0
                and self.own_state == REPLICATED
                and self.loaded == self.saves_by(NODES)[-1].step
                and self.tensors > 0 and self.tensors_equal == self.tensors
                and (self.more == 0 or self.saves[-1].world == len(RESTART_ON)))

    def own_source(self) -> str:
        """Where the replacement's own files came from."""
        peers, backup = self.chunks_from.get("peers", 0), self.chunks_from.get("backup", 0)
        if not peers and not backup:  # the replacement replayed the publish ops
            return "inline in the namespace log (files up to 256 KiB travel in it)"
        return (f"{peers} chunks from the peers (its replica is on node "
                f"{(LOST + 1) % NODES}), {backup} from a backup tier")

    def saves_by(self, world: int) -> list[Save]:
        return [s for s in self.saves if s.world == world]


def listing(mnts: list[Path], name: str) -> dict[int, list[str]]:
    """What each live mount lists in ``name``."""
    out = {}
    for r, m in enumerate(mnts):
        if m is not None:
            try:
                out[r] = sorted(os.listdir(m / name))
            except OSError as exc:
                out[r] = [f"<{exc.strerror}>"]
    return out


def state(m: Path, name: str) -> str:
    try:
        return os.getxattr(m / name, "user.mtcfs.state").decode()
    except OSError as exc:
        return f"<{exc.strerror}>"


def run_job(ranks: Ranks, rep: Report, mnts: list[Path]) -> None:
    """Follow a running job: print each save, what every node lists, the step's state."""
    for kind, ev in ranks.events():
        if kind == "started":
            rep.params = ev["params"]
        elif kind == "loaded":
            rep.loaded, rep.load_s = ev["step"], ev["load_s"]
            say(f"  step {ev['step']:>4}: step_{ev['step']} loaded by {ranks.name} in "
                f"{ev['load_s']:.3f} s ({ev['tensors']} full tensors)")
        elif kind == "saved":
            s = Save(ev["step"], len(ranks.procs), ev["save_s"], ev["loss"])
            s.listed = listing(mnts, s.name)
            s.states = [state(m, s.name) for m in mnts]
            s.bytes = sum(os.path.getsize(mnts[0] / s.name / f) for f in s.files)
            rep.saves.append(s)
            same = "every rank's files on every node" if s.everywhere else "DIFFERENT listings"
            say(f"  step {s.step:>4}: {s.name} saved by {s.world} ranks in {s.save_s:.3f} s "
                f"({human(s.bytes)}, loss {s.loss:.4f}); {same}:")
            for r, names in s.listed.items():
                say(f"          node {r}: {' '.join(names)}")
            say(f"          user.mtcfs.state of {s.name}: {' | '.join(s.states)}")


def run(args: argparse.Namespace, work: Path) -> Report:
    rep = Report(args.steps, args.every, args.more)
    ports = free_ports(NODES)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    for d in ("logs", "digests"):
        (work / d).mkdir()
    mounts: list[MtcfsMount] = []
    # the nodes agree (scope=job's namespace included) through etcd: a local one-member one
    coord = local_etcd("job")
    tls = job_tls(work, f"demo-job-{os.getpid()}", NODES)  # the job CA: mutual TLS
    for r in range(NODES):
        (work / f"n{r}" / "mnt").mkdir(parents=True)
        mounts.append(MtcfsMount(f"demo-job-{os.getpid()}", work / f"n{r}" / "mnt", {
            "store": str(work / f"n{r}" / "store"), "size": args.size, "rank": str(r),
            "nodes": str(NODES), "peers": peers, "listen": f"127.0.0.1:{ports[r]}",
            "replicas": "1", "scope": "job", **coord, **tls(r)}))
    mnts = [m.mnt for m in mounts]
    say(f"mtcfs scope=job demo: {NODES} nodes on this machine, one directory; torch "
        f"FSDP2 + DCP, gloo, one process per rank; replicas=1 (ring: node r's files have a "
        f"copy on node r+1)")
    say(f"scratch: {work}")
    jobs: list[Ranks] = []
    try:
        t0 = time.monotonic()
        on_all(lambda m: m.mount(), mounts)
        for r, m in enumerate(mounts):
            say(f"  node {r}: mount point {m.mnt}, peer service 127.0.0.1:{ports[r]}, "
                f"daemon pid {m.pid}")
        say(f"  {NODES} nodes mounted in {time.monotonic() - t0:.2f} s")

        # --- phase 1: 4 ranks, rank i on node i, train and save into one directory -------
        say(f"  the job: {NODES} ranks, rank i working in node i's mount")
        t0 = time.monotonic()
        jobs.append(Ranks(f"{NODES} ranks", mnts, work, [
            "--steps", str(args.steps), "--every", str(args.every), "--width", str(args.width)]))
        say(f"          {jobs[-1].pids(range(NODES))}")
        run_job(jobs[-1], rep, mnts)
        rep.job_s = time.monotonic() - t0
        latest = rep.saves_by(NODES)[-1]
        say(f"  the {NODES}-rank job is done ({rep.params:,} parameters, {rep.job_s:.1f} s "
            f"with the start of torch)")

        deadline = time.monotonic() + 60
        while (states := [state(m, latest.name) for m in mnts]) != [REPLICATED] * NODES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{latest.name} not replicated in 60 s: {states}")
            time.sleep(0.01)
        rep.durable_s = time.monotonic() - t0 - rep.job_s
        say(f"          user.mtcfs.state of {latest.name}: {' | '.join(states)}")

        # --- phase 2: node 3 dies; a replacement mounts on an empty store ----------------
        rep.killed_pid = kill9(mounts[LOST])
        store = Path(mounts[LOST].options["store"])
        shutil.copyfile(store / "mtcfs.log", work / "logs" / f"node{LOST}-lost-mtcfs.log")
        remove_store(store)
        say(f"  node {LOST} dies: daemon {rep.killed_pid} SIGKILLed, dead mount cleared, "
            f"store wiped")
        say(f"          node 0 still lists {latest.name}: "
            f"{' '.join(sorted(os.listdir(mnts[0] / latest.name)))}")

        t0 = time.monotonic()
        mounts[LOST].mount()
        rep.mount_s = time.monotonic() - t0
        top = listing(mnts, "")
        steps = {s.name: listing(mnts, s.name) for s in rep.saves}
        rep.same_namespace = top[LOST] == top[0] and all(
            v[LOST] == v[0] == s.files for s, v in zip(rep.saves, steps.values()))
        say(f"  new node {LOST} (empty store, daemon pid {mounts[LOST].pid}) mounted in "
            f"{rep.mount_s:.3f} s; it lists {' '.join(top[LOST])}, "
            f"{'the same as every other node' if rep.same_namespace else 'NOT what node 0 lists'}")
        say(f"          node {LOST}: {latest.name}: {' '.join(steps[latest.name][LOST])}")
        st = mounts[LOST].status()
        while (st.get("restore") or {}).get("pending_chunks", 1):
            if time.monotonic() - t0 > 60:
                raise TimeoutError(f"node {LOST}'s files did not come back: {st.get('restore')}")
            time.sleep(0.01)
            st = mounts[LOST].status()
        rep.own_s = time.monotonic() - t0
        rep.chunks_from = dict(st["restore"].get("chunks_from") or {})
        own = [f"{s.name}/__{LOST}_0.distcp" for s in rep.saves]
        rep.own_bytes = sum(os.path.getsize(mnts[LOST] / f) for f in own)
        say(f"          its own files ({' '.join(own)}: {human(rep.own_bytes)}, written by "
            f"the lost node) back after {rep.own_s:.3f} s: {rep.own_source()}")
        rep.own_state = state(mnts[LOST], latest.name)
        while rep.own_state != REPLICATED and time.monotonic() - t0 < 60:
            time.sleep(0.01)
            rep.own_state = state(mnts[LOST], latest.name)
        rep.durable_again_s = time.monotonic() - t0
        say(f"          user.mtcfs.state of {latest.name} on node {LOST}: {rep.own_state!r} "
            f"after {rep.durable_again_s:.3f} s (its replica on node {(LOST + 1) % NODES} "
            f"confirmed again)")

        # --- phase 3: the job restarts on 2 nodes, resharding at load --------------------
        before = {r: mounts[r].status()["counters"]["bytes_faulted"] for r in RESTART_ON}
        say(f"  the job restarts with {len(RESTART_ON)} ranks on nodes "
            f"{' and '.join(map(str, RESTART_ON))}: load {latest.name} (saved by {NODES} "
            f"ranks), train {args.more} more steps")
        jobs.append(Ranks(f"{len(RESTART_ON)} ranks", [mnts[r] for r in RESTART_ON], work, [
            "--load", str(latest.step), "--steps", str(latest.step + args.more),
            "--every", str(max(args.more, 1)), "--width", str(args.width)]))
        say(f"          {jobs[-1].pids(RESTART_ON)}")
        run_job(jobs[-1], rep, mnts)
        rep.load_fetched = {r: mounts[r].status()["counters"]["bytes_faulted"] - before[r]
                            for r in RESTART_ON}
        want = json.loads((work / "digests" / f"saved-{latest.name}-by-{NODES}.json").read_text())
        got = json.loads((work / "digests" / f"loaded-{latest.name}-by-"
                          f"{len(RESTART_ON)}.json").read_text())
        rep.tensors = len(want)
        rep.tensors_equal = sum(1 for k, v in want.items() if got.get(k) == v)
        if got.keys() != want.keys():
            rep.tensors += len(got.keys() - want.keys())
    finally:
        for j in jobs:  # no rank may keep a mount busy
            j.kill()
        teardown_all(mounts)
    return rep


def print_report(rep: Report) -> None:
    print()
    print(f"== mtcfs scope=job demo: {NODES} nodes, FSDP2 + DCP, {rep.params:,} parameters, "
          f"{rep.steps} steps on {NODES} ranks, then {rep.more} on {len(RESTART_ON)} ==")
    print(f"{'checkpoint':<12} {'ranks':>5} {'size':>10} {'save':>9}  every node lists "
          f"every rank's files")
    for s in rep.saves:
        print(f"{s.name:<12} {s.world:>5} {human(s.bytes):>10} {s.save_s:>7.3f} s  "
              f"{'yes' if s.everywhere else 'NO'}")
    print(f"{rep.saves_by(NODES)[-1].name if rep.saves_by(NODES) else '?'} "
          f"{REPLICATED} on every node {rep.durable_s:.3f} s after the job ended")
    print(f"node {LOST} lost (daemon {rep.killed_pid} SIGKILLed, store wiped); replacement "
          f"mounted in {rep.mount_s:.3f} s, showing the job's directory: "
          f"{'yes' if rep.same_namespace else 'NO'}")
    print(f"its own files ({human(rep.own_bytes)}) back after {rep.own_s:.3f} s: "
          f"{rep.own_source()}; {rep.own_state!r} again after {rep.durable_again_s:.3f} s")
    fetched = ", ".join(f"node {r} {human(b)}" for r, b in rep.load_fetched.items())
    print(f"loaded step_{rep.loaded} with {len(RESTART_ON)} ranks in {rep.load_s:.3f} s "
          f"(fetched from other nodes: {fetched}); full tensors of model and optimizer "
          f"identical to the {NODES}-rank save: {rep.tensors_equal}/{rep.tensors}")
    print("PASS" if rep.passed else "FAIL")


def _print_logs(work: Path) -> None:
    """The end of every node's daemon log, to stderr (the demo failed)."""
    print_node_logs(work, NODES)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="training steps of the 4-rank job")
    p.add_argument("--every", type=int, default=3,
                   help="checkpoint every N steps (and after the last)")
    p.add_argument("--more", type=int, default=2,
                   help="steps the 2-rank job trains (and saves) after its load; 0: none")
    p.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    p.add_argument("--size", default="1G", help="RAM tier capacity per node (size= option)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--load", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.every < 1 or args.steps < 2 * args.every or args.more < 0:
        p.error("need --every >= 1, --steps >= 2 * --every (two saves) and --more >= 0")

    rep = run_in_scratch("mtcfs-demo-job-", NODES, lambda work: run(args, work), _print_logs)
    if rep is None:
        return 130
    print_report(rep)
    return 0 if rep.passed else 1


if __name__ == "__main__":
    code = main()
    # A rank leaves without the interpreter's teardown: torch now and then aborts there
    # ("terminate called without an active exception") after destroy_process_group.
    stop_local_etcd()  # os._exit skips atexit: stop it here
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
