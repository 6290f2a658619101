"""Rewrites of sealed files (``make bench-rewrite``, issue 18).

``python -m benchmarks.bench_rewrite [--sizes 1G,2G] [--reps 3] [--base DIR] [--scope job]
[--json OUT]``

For each size and kind (``sparse``: 8 MiB of data then a hole; ``dense``: every byte
written; ``dense+reader``: dense, with a read-only descriptor held open throughout;
``dense+pinned``: dense, in a committed step whose backup upload is in flight throughout,
so the old version stays pinned: the mount backs up to a ``file://`` bucket after every
checkpoint and failpoint ``backup.put_chunk`` holds each chunk's upload for
:data:`PIN_S`), one file is written and sealed, then rewritten ``--reps`` times: open O_RDWR,
``pwrite`` of one byte at a different offset, close, until the new version is sealed
(``user.mtcfs.state`` leaves ``writing``). Per rewrite it records the wall time, the
daemon's CPU time (utime + stime from /proc/PID/stat), the bytes the seal hashed
(``seal_bytes_hashed``, absent before issue 18) and the growth of RAM used (status).
Then the first ``getxattr user.mtcfs.blake3`` (the whole-file hash, computed on demand
after a rewrite since issue 18) is timed once.

Systems, in the same run: ``tmpfs`` (the same open/pwrite/close in /dev/shm),
``before`` (a mount whose daemon runs the code at ``--base``, default /work/main, i.e.
the tree before the change) and ``after`` (this tree). ``--scope job``: each is rank 0
of a 2-node ``scope=job`` namespace on a 1-member etcd on loopback (started here), each
job under a key prefix of its own, so each close also publishes the file job-wide. Results
go to ``bench-results/rewrite-<timestamp>.json`` unless ``--json`` names another file.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    SCRATCH_SHM,
    cpu_seconds,
    environ,
    git_state,
    in_tree,
    loopback_etcd,
    machine_info,
    mtcfs_mount,
    scratch_dir,
    write_json,
)

MiB = 1 << 20
HEAD = 8 * MiB
#: Seconds the backup upload of a ``+pinned`` file stalls on each chunk (its pin stays).
PIN_S = 20


def make_file(p: Path, size: int, kind: str) -> None:
    block = os.urandom(MiB)
    with open(p, "wb") as f:
        n = HEAD if kind == "sparse" else size
        for off in range(0, n, MiB):
            f.write(block[: min(MiB, n - off)])
        f.truncate(size)


def wait_sealed(p: Path, timeout: float = 600.0) -> None:
    end = time.monotonic() + timeout
    while True:
        try:
            if os.getxattr(p, "user.mtcfs.state") != b"writing":
                return
        except OSError:
            return  # tmpfs: nothing to wait for
        if time.monotonic() > end:
            raise TimeoutError(f"{p} still being written after {timeout} s")
        time.sleep(0.001)


def rewrite_once(p: Path, off: int) -> None:
    fd = os.open(p, os.O_RDWR)
    try:
        os.pwrite(fd, b"\x5a", off)
    finally:
        os.close(fd)


def bench_system(name: str, d: Path, size: int, kind: str, reps: int,
                 mount: Any = None) -> dict[str, Any]:
    p = d / f"{kind}-{size}"
    if kind.endswith("+pinned"):
        (d / "step_1").mkdir(exist_ok=True)
        p = d / "step_1" / f"{kind}-{size}"
    make_file(p, size, kind)
    wait_sealed(p)
    if kind.endswith("+pinned") and mount is not None:
        (d / "step_1" / "commit_success.txt").write_text("ok")  # commits the step
        wait_sealed(d / "step_1" / "commit_success.txt")
        end = time.monotonic() + 60  # the scheduler starts the upload: the version is pinned
        while (mount.status().get("backup") or {}).get("uploading") != "step_1":
            if time.monotonic() > end:
                raise TimeoutError("the backup upload of step_1 did not start in 60 s")
            time.sleep(0.05)
    pid = int(mount.status()["pid"]) if mount is not None else None
    reader = os.open(p, os.O_RDONLY) if kind.endswith("+reader") else None
    out: dict[str, Any] = {"system": name, "size": size, "kind": kind, "runs": []}
    for i in range(reps):
        off = (size // (reps + 1)) * (i + 1) + 12345  # a different chunk each time
        st0 = mount.status() if mount is not None else None
        c0 = cpu_seconds(pid) if pid else 0.0
        t0 = time.perf_counter()
        rewrite_once(p, off)
        wait_sealed(p)
        wall = time.perf_counter() - t0
        run: dict[str, Any] = {"wall_s": round(wall, 4)}
        if mount is not None and st0 is not None and pid is not None:
            run["daemon_cpu_s"] = round(cpu_seconds(pid) - c0, 3)
            st1 = mount.status()
            h0 = st0["counters"].get("seal_bytes_hashed")
            h1 = st1["counters"].get("seal_bytes_hashed")
            run["hashed_bytes"] = None if h0 is None or h1 is None else h1 - h0
            run["ram_used_growth"] = st1["ram"]["used"] - st0["ram"]["used"]
        out["runs"].append(run)
        print(f"  {name:6s} {kind:12s} {size // MiB:5d} MiB rewrite {i}: {run}", flush=True)
    if reader is not None:
        os.close(reader)
        wait_sealed(p)
    if mount is not None and pid is not None:
        c0 = cpu_seconds(pid)
        t0 = time.perf_counter()
        os.getxattr(p, "user.mtcfs.blake3")
        out["blake3_xattr"] = {"wall_s": round(time.perf_counter() - t0, 4),
                               "daemon_cpu_s": round(cpu_seconds(pid) - c0, 3)}
        print(f"  {name:6s} {kind:12s} first blake3 xattr: {out['blake3_xattr']}", flush=True)
    p.unlink()
    return out


@contextlib.contextmanager
def job_etcd(scope: str) -> Iterator[Any]:
    """A 1-member etcd on loopback (data on /dev/shm) for ``--scope job``; None otherwise."""
    if scope != "job":
        yield None
        return
    with scratch_dir(SCRATCH_SHM, "rewrite-etcd") as root, loopback_etcd(root) as e:
        yield e


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper()
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def bench_mount(name: str, tree: str, sizes: list[int], kinds: list[str], reps: int,
                etcd: Any) -> list[dict[str, Any]]:
    """Every size and kind on one fresh mount whose daemon runs the code at ``tree``."""
    results: list[dict[str, Any]] = []
    with scratch_dir(SCRATCH_SHM, f"rewrite-{name}") as root:
        opts, env = {"size": "6G"}, {"PYTHONPATH": tree}
        if any(k.endswith("+pinned") for k in kinds):
            opts.update(backup=f"file://{root}/bucket", backup_interval="1ckpt")
            env["MTCFS_FAILPOINTS"] = f"backup.put_chunk=sleep({PIN_S})"
        with one_mount(root, opts, env, tree, etcd) as m:
            for size in sizes:
                for kind in kinds:
                    results.append(bench_system(name, m.mnt, size, kind, reps, m))
    return results


@contextlib.contextmanager
def one_mount(root: Path, opts: dict[str, Any], env: dict[str, str], tree: str,
              etcd: Any) -> Iterator[Any]:
    """The mount the rewrites run on, its daemons running the code at ``tree``: one
    scope=node daemon, or with ``etcd`` rank 0 of a 2-node scope=job namespace on it (a
    job-wide namespace needs nodes >= 2; rank 1 only applies the ops and holds the
    published versions as remote, missing chunks)."""
    with in_tree(tree):  # the daemons (and the status CLI) run the code in ``tree``
        if etcd is None:
            with mtcfs_mount(root, opts, env=env) as m:
                yield m
            return
        from tests.support.cluster import Cluster

        job = f"rewrite-{uuid.uuid4().hex[:8]}"
        c = Cluster(root, 2, job=job, options={**opts, "scope": "job", "replicas": 1,
                                               "coord": etcd.url,
                                               "coord_prefix": f"/mtcfs-bench/{job}"})
        try:
            with environ(env):
                c.start()
            yield c.node(0)
        finally:
            c.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1G,2G")
    ap.add_argument("--kinds", default="sparse,dense,dense+reader,dense+pinned")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--base", default="/work/main", help="tree whose code the 'before' "
                    "daemon runs (empty: skip 'before')")
    ap.add_argument("--scope", choices=("node", "job"), default="node")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    kinds = a.kinds.split(",")
    systems = [("before", a.base)] if a.base else []
    systems.append(("after", str(REPO)))
    results: list[dict[str, Any]] = []
    load = os.getloadavg()
    with scratch_dir(SCRATCH_SHM, "rewrite-tmpfs") as t:
        for size in sizes:
            for kind in kinds:
                results.append(bench_system("tmpfs", t, size, kind, a.reps))
    with job_etcd(a.scope) as etcd:
        for name, tree in systems:
            results.extend(bench_mount(name, tree, sizes, kinds, a.reps, etcd))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = a.json or REPO / "bench-results" / f"rewrite-{stamp}.json"
    write_json(path, {"bench": "rewrite", "scope": a.scope, "machine": machine_info(),
                      "git": git_state(), "loadavg_start": load,
                      "loadavg_end": os.getloadavg(), "results": results})
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
