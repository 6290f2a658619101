#!/usr/bin/env python3
"""Orbax multi-tier checkpointing on mtcfs, no GKE: lose a node, restore from its peer.

    python examples/demo_mtc.py
    python examples/demo_mtc.py --nodes 4 --mib 8

What it does (needs root or FUSE permissions, like any mtcfs mount):

1. makes a scratch directory under /dev/shm with, per node, a RAM-tier store and a mount
   point, and a ``file://`` backup bucket; mounts ``--nodes`` "nodes" with the CLI, each
   with option ``mtc`` (the mount is the node's replicator for Orbax) and
   ``jax_coordinator=127.0.0.1:<port>``; each writes ``jax-init-info.txt`` at once;
2. starts one JAX process per node (CPU, two devices each) running Orbax's own
   ``initialize_multi_tier_checkpointing`` and ``ReplicatorCheckpointManager`` unchanged,
   with ``num_slices=2``: every process's pytree shards are held identically by its peer in
   the other slice (data parallelism). The trainer writes ``replicator.yaml``; mtcfs checks
   it, acknowledges it and, finding nothing to restore, gives the empty ``s0`` marker; the
   trainer saves steps 1..3 into its node's mount. Each step is replicated to the node's
   peer rank (from the yaml) and backed up every 2 steps (``backup-interval-steps: 2``);
3. node 1 dies: its daemon is SIGKILLed, the dead mount cleared, its store wiped. A
   replacement node 1 mounts on an empty store;
4. the job restarts (new processes, same command): every node's mtcfs joins a
   restore round in etcd, which picks the newest step every rank can restore (3), node 1 brings its data
   back from its peer, verified, and hands it to Orbax as the ``.restore`` marker; every
   process restores step 3 and compares every shard with the expected values, bit for bit;
   then the job saves steps 4 and 5.

Prints the time from the replacement's yaml to its marker and where the data came from,
then PASS or FAIL (exit status 0 only on PASS). Every mount is always torn down, also on
Ctrl-C. The trainer is the one the tests use (``tests/support/mtc_trainer.py``); the CPU-only
shims it needs (a JAX cluster environment giving the process count, absl flags) are there,
not in mtcfs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from _mount_util import (  # noqa: E402
    remove_store,
    MtcfsMount, job_tls, local_etcd, print_node_logs, run_in_scratch,
)
from demo_peers import free_ports, kill9, on_all, teardown_all  # noqa: E402
from support.mtc_trainer import run_trainers  # noqa: E402

LOST = 1  # the rank whose node dies


def say(*a) -> None:
    print(*a, flush=True)


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def run(args: argparse.Namespace, work: Path) -> bool:
    n = args.nodes
    say(f"scratch: {work}")
    ports = free_ports(n + 1)
    jax_port, peer_ports = ports[0], ports[1:]
    peers = "+".join(f"127.0.0.1:{p}" for p in peer_ports)
    bucket = work / "bucket"
    bucket.mkdir()
    mounts: list[MtcfsMount] = []
    coord = local_etcd("mtc")  # the nodes agree on the step to restore through etcd
    tls = job_tls(work, "demo", n)  # the job CA: the peers speak mutual TLS
    for r in range(n):
        (work / f"n{r}" / "mnt").mkdir(parents=True)
        mounts.append(MtcfsMount("demo", work / f"n{r}" / "mnt", {
            "store": str(work / f"n{r}" / "store"), "rank": str(r), "nodes": str(n),
            "peers": peers, "listen": f"127.0.0.1:{peer_ports[r]}", "size": args.size,
            "backup": f"file://{bucket}", "mtc": None,
            "jax_coordinator": f"127.0.0.1:{jax_port}", **coord, **tls(r)}))
    try:
        on_all(lambda m: m.mount(), mounts)
        say(f"{n} nodes mounted with -o mtc; node 0's jax-init-info.txt: "
            f"{(mounts[0].mnt / 'jax-init-info.txt').read_text().split()}")
        dirs = [m.mnt for m in mounts]
        t = time.monotonic()
        rows = run_trainers(dirs, work / "persistent", num_slices=2, save_steps=[1, 2, 3],
                            backup_interval_steps=2, coordinator_port=jax_port, mib=args.mib,
                            expect_step=None, run_name="demo", workdir=work / "logs1")
        say(f"first run: {n} processes initialized (nothing to restore), saved steps 1..3 in "
            f"{time.monotonic() - t:.1f} s; Orbax lists {rows[0]['all_steps']}")
        for m in mounts:
            wait_for(lambda: any(c["step"] == "3" and c["peers"] == "1/1"
                                 for c in m.checkpoints()), 60, f"{m.mnt}/3 replicated")
        say("step 3 of every node is replicated to its peer rank: " + ", ".join(
            f"node {r} -> {m.status()['peers']['peers']}" for r, m in enumerate(mounts)))

        lost = mounts[LOST]
        pid = kill9(lost)
        remove_store(work / f"n{LOST}" / "store")
        say(f"node {LOST} lost: daemon pid {pid} SIGKILLed, its RAM tier wiped")
        lost.mount()
        say(f"replacement node {LOST} mounted on an empty store; it lists "
            f"{sorted(os.listdir(lost.mnt))}")

        t = time.monotonic()
        rows = run_trainers(dirs, work / "persistent", num_slices=2, save_steps=[4, 5],
                            restore=True, backup_interval_steps=2, coordinator_port=jax_port,
                            mib=args.mib, expect_step=3, run_name="demo",
                            workdir=work / "logs2")
        took = time.monotonic() - t
        info = lost.status()["mtc"]["last_restore"] or {}
        say(f"job restarted in {took:.1f} s: every process restored step "
            f"{sorted({r['step'] for r in rows})}; node {LOST}: marker "
            f"{info.get('marker')} {info.get('seconds')} s after its replicator.yaml "
            f"(decision {info.get('decision_seconds')} s, data {info.get('data_seconds')} s from "
            f"{info.get('source')}, {info.get('bytes')} bytes)")
        ok = all(r["ok"] and r["step"] == 3 for r in rows)
        say(f"every shard of every array bit-exact: {'yes' if ok else 'NO'}; then saved steps "
            f"4 and 5: Orbax lists {rows[0]['all_steps']}")
        print("PASS" if ok else "FAIL")
        return ok
    finally:
        teardown_all(mounts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2, choices=(2, 4),
                   help="nodes (= JAX processes), 2 slices")
    p.add_argument("--mib", type=float, default=4.0, help="MiB of arrays in the pytree")
    p.add_argument("--size", default="1G", help="RAM tier capacity per node (size= option)")
    args = p.parse_args(argv)
    ok = run_in_scratch("mtcfs-demo-mtc-", args.nodes, lambda work: run(args, work),
                        lambda work: print_node_logs(work, args.nodes))
    if ok is None:
        return 130
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
