"""DCP load on a scope=job cluster: every rank reads shards other nodes wrote, vs local data.

4 torch ranks (gloo on loopback) save a state dict of DTensors (``Shard(0)`` over the 4
ranks, ``--size`` bytes in all) with ``dcp.save`` to a 4-node scope=job cluster, rank i on
node i. Then, timed (the slowest rank's ``dcp.load``, median of ``--reps``):

* ``remote``: rank i runs on node (i+1) % 4, so every byte it loads was written on another
  node and is faulted in through the job namespace (chunks verified by blake3);
* ``local``: rank i runs on node i and reads what it wrote;
* ``tmpfs``: the same save and load in one /dev/shm directory (the baseline).

Each ``remote`` repetition saves a new step first, so no node holds the shards it reads.

Run: ``python -m benchmarks.bench_job_dcp [--size 256M] [--reps 3] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mtcfs.options import parse_size

WORLD = 4
TENSORS = 4


def _worker(args: argparse.Namespace) -> None:
    """One torch rank: save or load step ``args.step`` under ``args.dir``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", rank=args.rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    rows = args.size // (TENSORS * 1024 * 4)
    rows -= rows % WORLD

    def state(fill: bool) -> dict[str, Any]:
        out = {}
        for t in range(TENSORS):
            g = torch.Generator().manual_seed(t)
            full = torch.rand((rows, 1024), generator=g) if fill else torch.empty((rows, 1024))
            out[f"w{t}"] = distribute_tensor(full, mesh, [Shard(0)])
        return out

    path = os.path.join(args.dir, f"step_{args.step}")
    sd = state(args.mode == "save")
    dist.barrier()
    t0 = time.perf_counter()
    if args.mode == "save":
        dcp.save(sd, checkpoint_id=path)
    else:
        dcp.load(sd, checkpoint_id=path)
    seconds = time.perf_counter() - t0
    if args.mode == "load":  # the loaded shard must be the saved one
        for t in range(TENSORS):
            g = torch.Generator().manual_seed(t)
            want = torch.rand((rows, 1024), generator=g).chunk(WORLD)[args.rank]
            assert torch.equal(sd[f"w{t}"].to_local(), want), f"w{t} differs on rank {args.rank}"
    print(json.dumps({"rank": args.rank, "seconds": seconds}), flush=True)
    dist.barrier()
    os._exit(0)  # skips a rare abort in torch's process-group teardown


def _run(dirs: list[Path], mode: str, step: int, size: int) -> float:
    """Start one worker per dir; the slowest rank's seconds."""
    port = _free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_job_dcp", "--worker", "--rank", str(r),
         "--dir", str(d), "--mode", mode, "--step", str(step), "--size", str(size)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for r, d in enumerate(dirs)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{mode} rank failed ({p.returncode}): {stderr[-2000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1])["seconds"])
    return max(out)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="256M", help="bytes of tensors in all (default 256M)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--dir")
    ap.add_argument("--mode")
    ap.add_argument("--step", type=int)
    args = ap.parse_args()
    if args.worker:
        args.size = int(args.size)
        _worker(args)
        return
    size = parse_size(args.size)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support.cluster import Cluster

    root = Path(tempfile.mkdtemp(prefix="mtcfs-bench-jobdcp-", dir="/dev/shm"))
    res: dict[str, list[float]] = {"save": [], "remote": [], "local": [], "tmpfs": []}
    try:
        flat = root / "tmpfs"
        flat.mkdir()
        for rep in range(args.reps):
            _run([flat] * WORLD, "save", rep, size)
            res["tmpfs"].append(_run([flat] * WORLD, "load", rep, size))
            shutil.rmtree(flat / f"step_{rep}")
        c = Cluster(root / "job", WORLD, options={"scope": "job", "replicas": 1,
                                                  "size": str(2 * size)})
        try:
            c.start()
            for rep in range(args.reps):
                mine = [c.node(i).path() for i in range(WORLD)]
                res["save"].append(_run(mine, "save", rep, size))
                moved = [c.node((i + 1) % WORLD).path() for i in range(WORLD)]
                res["remote"].append(_run(moved, "load", rep, size))
                res["local"].append(_run(mine, "load", rep, size))
                shutil.rmtree(mine[0] / f"step_{rep}")
        finally:
            c.cleanup()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = {k: round(statistics.median(v), 3) for k, v in res.items()}
    gib = size / 2**30
    print(f"DCP, {WORLD} ranks, {size / 2**20:.0f} MiB, median of {args.reps} (seconds, GB/s):")
    for k, v in summary.items():
        print(f"  {k:7s} {v:7.3f} s  {size / v / 1e9:5.2f} GB/s")
    print(f"  remote/local load time: {summary['remote'] / summary['local']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"size": size, "gib": gib, "runs": res,
                                               "median_s": summary}, indent=1))


if __name__ == "__main__":
    main()
