"""7. Orbax multi-tier checkpointing (mount option ``mtc``): restart to the restore marker, and
the bytes that cross between data-parallel replicas.

``python -m benchmarks.bench_mtc [--gib 1.0] [--reps 3] [--json OUT] [--no-prefault]``
(or ``make bench-mtc``). Two daemons on loopback (:class:`tests.support.cluster.Cluster`,
``mtc``, stores on /dev/shm, ``backup=file://`` a fresh directory on the local disk under
/var/tmp), driven only through the files Orbax uses (docs/orbax-mtc.md): ``replicator.yaml``
written as ``replicator.yaml.tmp`` + ``os.replace``, steps written into
``<step>.orbax-checkpoint-tmp-<n>/`` and committed by renaming that directory to ``<step>``,
restore markers ``bench-s<step>-n<rank>-w0.restore`` polled with ``os.listdir`` of the mount
root (every 5 ms) and taken as Orbax takes them (``os.replace(marker, <step>)``; an ``s0``
file is deleted).

A step is OCDBT-shaped: ``--gib`` GiB per node of incompressible bytes (every 1 MiB distinct,
:class:`benchmarks.common.UniqueData`) in files of about 256 MiB
(``state/ocdbt.process_<r>/d/<32 hex>``) plus four small metadata files. Every repeat uses a
fresh cluster and runs, in order:

``start``   the trainer's first start: yaml on both nodes (``assume-data-parallelism: 1``,
            ``peer-ranks`` the other node, ``backup-interval-steps: 1``), the ``s0`` markers.
``save``    both nodes save steps 1 and 2 at once (each node its own bytes), then wait until
            both steps read ``peers 1/1`` and ``backup complete`` on both nodes.
``local``   a trainer restart with both daemons up: yaml on both -> markers (data local).
``peer``    rank 1's daemon is SIGKILLed, its store wiped, its mount started again (T0 = the
            mount command); as soon as its ``jax-init-info.txt`` is there (what Orbax polls
            for) both nodes get a yaml (the whole job restarts). Timed: T0 -> rank 1's
            marker, and each node's yaml -> its marker; ``mtc.last_restore`` of the status.
            The files under rank 1's marker must have the sha256 of what it wrote.
``backup``  after the markers are taken and both steps 2 re-settled (peers and backup),
            both daemons are SIGKILLed and both stores wiped (replica stores included: no
            peer holds anything), the page cache is dropped (root; cold reads of the backup
            directory), both mounts started at once, yaml on both when both
            ``jax-init-info.txt`` are there; timed as ``peer``; both nodes' bytes checked.
``dedup``   (first repeat only, unless ``--dedup-every-rep``) the payload bytes that cross
            between the two nodes for steps both save at once, per link (the sender's log
            line ``<step> replicated to rank <peer> (...; N payload bytes)``; the status
            counters ``peers.replication[].chunks_sent / chunks_skipped`` beside them), in
            three settings: the yaml's ``assume-data-parallelism: 1`` (steps 10-12); after
            a trainer restart with ``2``, Orbax's value for 2 slices (20-22); and a second
            cluster whose mounts also say ``assume_data_parallelism=2`` (the mount option,
            which makes the peers data-parallel twins; no backup tier; 30-32). Each setting
            saves: identical bytes under identical names; identical bytes under per-rank
            names (``ocdbt.process_0/d/<a>`` vs ``ocdbt.process_1/d/<b>``, as Orbax writes
            them); the previous step with 3 x 1 MiB changed at random offsets (with the
            yaml's ``1``: a different change on each node, so the peer holds only the
            previous step's chunks; otherwise the same change on both). Timed: the last
            commit -> ``peers 1/1`` on both nodes.

Baselines in the same repeat: ``cp -r`` of one node's step (the same bytes, same files)
from a tmpfs directory to another (the floor for bringing the step into RAM), and a cold
read (page cache dropped) of every file of the ``file://`` backup directory, front to back
in 16 MiB reads (the floor for reading it back).

Before each timed restore and the ``cp -r``, ``2 x size + 1 GiB`` of RAM is touched
(``common.prefault``; ``--no-prefault`` skips it). Tables show medians (``±`` half the spread
over the median). Everything goes to ``bench-results/mtc-<timestamp>.json`` unless ``--json``
names another file.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import math
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    IO_SIZE,
    REPO,
    SCRATCH_DISK,
    SCRATCH_SHM,
    BenchResult,
    GiB,
    MiB,
    UniqueData,
    drop_caches,
    dump_logs,
    fmt,
    fmt_noise,
    gbps,
    git_state,
    log,
    machine_info,
    median,
    prefault,
    scratch_dir,
    wait_until,
    write_json,
)

JOB = "bench"
NODES = 2
FILE_TARGET = 256 * MiB          # OCDBT data files of a few hundred MiB
PATCHES = 3                      # regions changed in the "few MiB changed" steps
PATCH_LEN = MiB                  # each region's length (unaligned to the 4 MiB chunks)
POLL_S = 0.005                   # marker polling (os.listdir of the mount root)
RESTORE_TIMEOUT_S = 300.0        # Orbax's own wait for the marker
SETTLE_TIMEOUT_S = 600.0


# ---------------------------------------------------------------------- step content

@dataclass(frozen=True)
class Blob:
    """A file's bytes, reproducible: ``UniqueData(seed)``'s stream, ``size`` bytes, with each
    ``(offset, length, seed)`` of ``patches`` overwritten by random bytes of that seed."""

    seed: int
    size: int
    patches: tuple[tuple[int, int, int], ...] = ()


@functools.lru_cache(maxsize=64)
def _patch_bytes(seed: int, length: int) -> bytes:
    return random.Random(seed).randbytes(length)


def blob_stream(b: Blob) -> Iterator[memoryview]:
    data = UniqueData(b.seed)
    off = 0
    while off < b.size:
        n = min(IO_SIZE, b.size - off)
        view = data.next(n)
        hits = [p for p in b.patches if p[0] < off + n and p[0] + p[1] > off]
        if hits:
            buf = bytearray(view)
            for po, pl, ps in hits:
                lo, hi = max(po, off), min(po + pl, off + n)
                buf[lo - off:hi - off] = _patch_bytes(ps, pl)[lo - po:hi - po]
            view = memoryview(buf)
        yield view
        off += n


Layout = dict[str, Any]  # relative path -> Blob or bytes


def step_layout(size: int, seed: int, proc: int, name_seed: int) -> Layout:
    """An OCDBT-shaped step of ``size`` data bytes: ``state/ocdbt.process_<proc>/d/<hex>``
    files of about FILE_TARGET (names drawn from ``name_seed``, bytes from ``seed``) and the
    small metadata files Orbax writes."""
    n = max(2, round(size / FILE_TARGET))
    names = random.Random(name_seed)
    out: Layout = {}
    left = size
    for i in range(n):
        part = left if i == n - 1 else size // n
        out[f"state/ocdbt.process_{proc}/d/{names.getrandbits(128):032x}"] = \
            Blob(seed * 100 + i, part)
        left -= part
    small = random.Random(seed)
    out["state/manifest.ocdbt"] = small.randbytes(1500)
    out["state/_METADATA"] = small.randbytes(3000)
    out["process_metadata/global_process_metadata.json"] = b'{"process_count": 2}'
    out["_CHECKPOINT_METADATA"] = b'{"item_handlers": "orbax.checkpoint.PyTreeCheckpointHandler"}'
    return out


def patched(layout: Layout, name_seed: int | None, patch_seed: int) -> Layout:
    """``layout`` with PATCHES regions of PATCH_LEN changed (spread over its data files, at
    random offsets: a region touches one or two 4 MiB chunks), under new names if ``name_seed`` is given."""
    blobs = [(k, v) for k, v in layout.items() if isinstance(v, Blob)]
    rng = random.Random(patch_seed)
    names = random.Random(name_seed) if name_seed is not None else None
    out: Layout = {}
    for i, (k, b) in enumerate(blobs):
        ps = list(b.patches)
        for _ in range(i, PATCHES, len(blobs)):  # patch j goes to data file j % len(blobs)
            ps.append((rng.randrange(0, b.size - PATCH_LEN), PATCH_LEN, rng.getrandbits(48)))
        key = k if names is None else f"{k.rsplit('/', 1)[0]}/{names.getrandbits(128):032x}"
        out[key] = Blob(b.seed, b.size, tuple(ps))
    out.update({k: v for k, v in layout.items() if not isinstance(v, Blob)})
    return out


def layout_bytes(layout: Layout) -> int:
    return sum(v.size if isinstance(v, Blob) else len(v) for v in layout.values())


def write_tree(base: Path, layout: Layout, hashed: bool) -> dict[str, str]:
    """Write ``layout`` below ``base``; returns relpath -> sha256 (if ``hashed``)."""
    sums: dict[str, str] = {}
    for rel, content in layout.items():
        p = base / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256() if hashed else None
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pieces = blob_stream(content) if isinstance(content, Blob) else [memoryview(content)]
            for view in pieces:
                if h is not None:
                    h.update(view)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
        finally:
            os.close(fd)
        if h is not None:
            sums[rel] = h.hexdigest()
    return sums


def save_step(mnt: Path, step: int, layout: Layout, hashed: bool = False) -> dict[str, Any]:
    """Orbax-style save: write into ``<step>.orbax-checkpoint-tmp-<n>``, rename it to
    ``<step>`` (the commit). Returns sha256 sums, write seconds and the commit clock."""
    tmp = mnt / f"{step}.orbax-checkpoint-tmp-{time.time_ns() // 1000}"
    t0 = time.perf_counter()
    sums = write_tree(tmp, layout, hashed)
    os.rename(tmp, mnt / str(step))
    t1 = time.perf_counter()
    return {"sha256": sums, "write_s": t1 - t0, "committed_at": t1}


def sha256_tree(base: Path, rels: list[str]) -> dict[str, str]:
    buf = bytearray(IO_SIZE)
    mv = memoryview(buf)
    out = {}
    for rel in rels:
        h = hashlib.sha256()
        with open(base / rel, "rb", buffering=0) as f:
            while n := f.readinto(mv):
                h.update(mv[:n])
        out[rel] = h.hexdigest()
    return out


def verify(base: Path, want: dict[str, str], what: str) -> int:
    """sha256 of every file of ``want`` under ``base``; raises on a difference. Returns the
    bytes read."""
    got = sha256_tree(base, sorted(want))
    bad = [rel for rel in want if got.get(rel) != want[rel]]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} of {len(want)} files differ from what was "
                           f"written (e.g. {bad[0]})")
    return sum((base / rel).stat().st_size for rel in want)


def in_threads(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run ``fns`` at once, one thread each; re-raise the first failure."""
    out: list[Any] = [None] * len(fns)
    errs: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 (re-raised below)
            errs.append(exc)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise errs[0]
    return out


# ---------------------------------------------------------------------- the protocol files

def ctl(mnt: Path, cmd: str) -> Any:
    """A control-socket request in this process (``mtcfs status --json`` without the
    subprocess, which costs ~0.3 s)."""
    from mtcfs import control
    sock = os.getxattr(mnt, "user.mtcfs.control").decode()
    return control.call(sock, cmd, timeout=30)


def write_yaml(mnt: Path, rank: int, dp: int) -> float:
    """``replicator.yaml`` as Orbax writes it (``.tmp`` then ``os.replace``); returns the
    clock right after the replace."""
    text = (f"job-name: {JOB}\nframework: orbax\nassume-data-parallelism: {dp}\n"
            f"node-rank: {rank}\nnodes: {NODES}\npeer-ranks: [{1 - rank}]\n"
            "backup-interval-steps: 1\n")
    tmp = mnt / "replicator.yaml.tmp"
    tmp.write_text(text)
    os.replace(tmp, mnt / "replicator.yaml")
    return time.perf_counter()


def _marker_re(rank: int) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(JOB)}-s(\d+)-n{rank}-w0\.restore$")


def wait_markers(mnts: dict[int, Path], timeout: float = RESTORE_TIMEOUT_S
                 ) -> dict[int, tuple[str, int, float]]:
    """Poll every mount root until each rank's marker is there (a failure file raises).
    Returns rank -> (marker name, step, clock when first seen)."""
    pats = {r: _marker_re(r) for r in mnts}
    got: dict[int, tuple[str, int, float]] = {}
    deadline = time.perf_counter() + timeout
    while len(got) < len(mnts):
        for r, mnt in mnts.items():
            if r in got:
                continue
            try:
                names = os.listdir(mnt)
            except OSError:
                continue
            now = time.perf_counter()
            for n in names:
                m = pats[r].match(n)
                if m:
                    got[r] = (n, int(m.group(1)), now)
            if "replicator.failed" in names and r not in got:
                try:
                    why = (mnt / "replicator.failed").read_text()
                except OSError as exc:
                    why = str(exc)
                raise RuntimeError(f"rank {r}: replicator.failed: {why.strip()}")
        if time.perf_counter() > deadline:
            raise TimeoutError(f"no restore marker after {timeout:.0f}s on rank(s) "
                               f"{sorted(set(mnts) - set(got))}")
        time.sleep(POLL_S)
    return got


def take_marker(mnt: Path, name: str, step: int) -> None:
    """What Orbax does with a marker: a directory becomes ``<step>``; an s0 file goes."""
    p = mnt / name
    if step and p.is_dir():
        os.replace(p, mnt / str(step))
    else:
        p.unlink()


def _row(mnt: Path, step: int) -> dict[str, Any] | None:
    for r in ctl(mnt, "checkpoints") or []:
        if r.get("step") == str(step):
            return r
    return None


def settled(mnt: Path, step: int, backup: bool = True) -> bool:
    try:
        r = _row(mnt, step)
    except Exception:  # noqa: BLE001 (the daemon is busy or restarting)
        return False
    return bool(r) and r.get("peers") == "1/1" and (not backup or r.get("backup") == "complete")


def wait_settled(c: Any, step: int, backup: bool = True, interval: float = 0.05) -> float:
    """Wait until ``step`` is confirmed by the peer (and backed up) on every node."""
    t0 = time.perf_counter()
    for r in range(c.nodes):
        mnt = c.node(r).mnt
        wait_until(lambda mnt=mnt: settled(mnt, step, backup), SETTLE_TIMEOUT_S,
                   f"rank {r}: step {step} peers 1/1{' and backed up' if backup else ''}",
                   interval=interval)
    return time.perf_counter() - t0


def link_counters(mnt: Path) -> dict[int, dict[str, int]]:
    st = ctl(mnt, "status")
    return {int(link["peer"]): {**{k: int(link[k]) for k in
                                   ("bytes_sent", "chunks_sent", "chunks_skipped")},
                                "data_parallel_twin": link.get("data_parallel_twin")}
            for link in (st.get("peers") or {}).get("replication", [])}


# ---------------------------------------------------------------------- one repeat

@dataclass
class Rep:
    """The cluster of one repeat and what was written into it."""

    c: Any
    size: int
    rep: int
    touch: bool
    sums: dict[int, dict[str, str]] = field(default_factory=dict)  # rank -> step 2's sums
    out: dict[str, Any] = field(default_factory=dict)

    def mnt(self, r: int) -> Path:
        return self.c.node(r).mnt

    def touch_ram(self) -> None:
        if self.touch:
            prefault(2 * self.size + GiB)


def node_layout(rep: int, step: int, rank: int, size: int) -> Layout:
    seed = 100_000 * (rep + 1) + 100 * step + rank
    return step_layout(size, seed, rank, name_seed=seed + 7)


def phase_start(s: Rep) -> None:
    """The trainer's first start: yaml -> s0 markers, taken."""
    t = {r: write_yaml(s.mnt(r), r, 1) for r in range(NODES)}
    got = wait_markers({r: s.mnt(r) for r in range(NODES)})
    for r, (name, step, _) in got.items():
        if step != 0:
            raise RuntimeError(f"rank {r}: a fresh job got marker {name}, not s0")
        take_marker(s.mnt(r), name, step)
    s.out["start"] = {"yaml_to_marker": {r: got[r][2] - t[r] for r in got}}


def phase_save(s: Rep) -> None:
    """Both nodes save steps 1 and 2 at once; wait until both are replicated and backed up."""
    res = {}
    for step in (1, 2):
        got = in_threads([functools.partial(save_step, s.mnt(r), step,
                                            node_layout(s.rep, step, r, s.size),
                                            hashed=step == 2) for r in range(NODES)])
        res[step] = {"write_s": [g["write_s"] for g in got]}
        if step == 2:
            s.sums = {r: got[r]["sha256"] for r in range(NODES)}
        t_commit = max(g["committed_at"] for g in got)
        res[step]["commit_to_settled_s"] = None
        if step == 2:
            wait_settled(s.c, 1)
            wait_settled(s.c, 2)
            res[step]["commit_to_settled_s"] = time.perf_counter() - t_commit
    s.out["save"] = res


def restart_and_restore(s: Rep, ranks: list[int], step: int) -> dict[str, Any]:
    """Start the (killed, wiped) daemons of ``ranks`` again, write every node's yaml as soon
    as every restarted node shows ``jax-init-info.txt``, wait for every marker."""
    s.touch_ram()
    mnts = {r: s.mnt(r) for r in range(NODES)}
    box: dict[str, Any] = {}

    def restart() -> None:
        try:
            box["mounts"] = s.c.restart_many(ranks)
        except BaseException as exc:  # noqa: BLE001 (re-raised below)
            box["error"] = exc
        box["mounted_at"] = time.perf_counter()

    t0 = time.perf_counter()
    th = threading.Thread(target=restart, name="restart")
    th.start()
    try:
        wait_until(lambda: "error" in box or all(
            (mnts[r] / "jax-init-info.txt").exists() for r in ranks), 120,
            "jax-init-info.txt of the restarted node(s)", interval=POLL_S)
        if "error" in box:
            raise box["error"]
        t_init = time.perf_counter()
        t_yaml = {r: write_yaml(mnts[r], r, 1) for r in range(NODES)}
        got = wait_markers(mnts)
    finally:
        th.join()
    if "error" in box:
        raise box["error"]
    for r, (name, st, _) in got.items():
        if st != step:
            raise RuntimeError(f"rank {r}: marker {name}, expected step {step}")
    statuses = {r: ctl(mnts[r], "status") for r in range(NODES)}
    return {
        "t0_to_init_info_s": t_init - t0,
        "t0_to_mounted_s": box["mounted_at"] - t0,
        "t0_to_marker_s": {r: got[r][2] - t0 for r in range(NODES)},
        "yaml_to_marker_s": {r: got[r][2] - t_yaml[r] for r in range(NODES)},
        "markers": {r: got[r][0] for r in range(NODES)},
        "last_restore": {r: (statuses[r].get("mtc") or {}).get("last_restore")
                         for r in range(NODES)},
        "restore_status": {r: statuses[r].get("restore") for r in range(NODES)},
        "server_bytes_sent": {r: ((statuses[r].get("peers") or {}).get("server") or {})
                              .get("bytes_sent") for r in range(NODES)},
    }


def take_all(s: Rep, out: dict[str, Any]) -> None:
    for r in range(NODES):
        take_marker(s.mnt(r), out["markers"][r], 2)


def phase_local(s: Rep) -> None:
    """A trainer restart with both daemons up: yaml -> marker, data local."""
    t = {r: write_yaml(s.mnt(r), r, 1) for r in range(NODES)}
    got = wait_markers({r: s.mnt(r) for r in range(NODES)})
    lr = {r: ctl(s.mnt(r), "status")["mtc"]["last_restore"] for r in range(NODES)}
    for r, (name, st, _) in got.items():
        if st != 2:
            raise RuntimeError(f"rank {r}: marker {name}, expected step 2")
        take_marker(s.mnt(r), name, st)
    s.out["local"] = {"yaml_to_marker_s": {r: got[r][2] - t[r] for r in got},
                      "last_restore": lr}
    s.out["local"]["resettle_s"] = wait_settled(s.c, 2)


def phase_peer(s: Rep) -> None:
    """Rank 1 crashes and loses its RAM tier; the job restarts; rank 1 restores from rank 0."""
    before = link_counters(s.mnt(0))
    s.c.kill9(1)
    s.c.wipe(1)
    out = restart_and_restore(s, [1], 2)
    nbytes = verify(s.mnt(1) / out["markers"][1], s.sums[1], "rank 1 after the peer restore")
    out["verified_bytes"] = nbytes
    out["link0_before"] = before
    take_all(s, out)
    out["resettle_s"] = wait_settled(s.c, 2)
    s.out["peer"] = out


def backup_read(bk: Path) -> dict[str, Any]:
    """Cold read (page cache dropped) of every file of the backup directory."""
    cold = drop_caches()
    buf = bytearray(IO_SIZE)
    mv = memoryview(buf)
    files = total = 0
    t0 = time.perf_counter()
    for dirpath, _dirs, names in os.walk(bk):
        for n in names:
            with open(os.path.join(dirpath, n), "rb", buffering=0) as f:
                while k := f.readinto(mv):
                    total += k
            files += 1
    secs = time.perf_counter() - t0
    return {"cold": cold, "files": files, "bytes": total, "seconds": secs,
            "gbps": gbps(total, secs)}


def phase_backup(s: Rep, bk: Path) -> None:
    """Both nodes crash and lose their RAM tier; the job restarts from the backup tier."""
    for r in range(NODES):
        s.c.kill9(r)
    for r in range(NODES):
        s.c.wipe(r)
    raw = backup_read(bk)
    drop_caches()
    out = restart_and_restore(s, list(range(NODES)), 2)
    out["backup_read"] = raw
    out["verified_bytes"] = {
        r: verify(s.mnt(r) / out["markers"][r], s.sums[r], f"rank {r} after the backup restore")
        for r in range(NODES)}
    take_all(s, out)
    out["resettle_s"] = wait_settled(s.c, 2)
    s.out["backup"] = out


_REPLICATED_LOG = re.compile(r"replication\.peer\.tier: (\S+) replicated to rank (\d+) "
                             r"\(\d+/\d+; (\d+) payload bytes\)")


def logged_payload(m: Any, step: int, peer: int) -> int:
    """Payload bytes the daemon's log says it sent to ``peer`` for ``step`` (every
    replication of it so far; the counters of the status may include other steps' rounds)."""
    return sum(int(hit.group(3)) for hit in _REPLICATED_LOG.finditer(m.log())
               if hit.group(1) == str(step) and int(hit.group(2)) == peer)


def dedup_step(s: Rep, step: int, layouts: dict[int, Layout], label: str, dp: str,
               backup: bool = True) -> dict[str, Any]:
    """Both nodes save ``step`` at once; bytes each link sent for it."""
    before = {r: link_counters(s.mnt(r)) for r in range(NODES)}
    got = in_threads([functools.partial(save_step, s.mnt(r), step, layouts[r])
                      for r in range(NODES)])
    t_commit = max(g["committed_at"] for g in got)
    wait_settled(s.c, step, backup=False, interval=0.01)
    secs = time.perf_counter() - t_commit
    after = {r: link_counters(s.mnt(r)) for r in range(NODES)}
    links = {}
    for r in range(NODES):
        p = 1 - r
        links[f"{r}->{p}"] = {k: after[r][p][k] - before[r].get(p, {}).get(k, 0)
                              for k in ("bytes_sent", "chunks_sent", "chunks_skipped")}
        links[f"{r}->{p}"].update(payload=layout_bytes(layouts[r]),
                                  logged_bytes_sent=logged_payload(s.c.node(r), step, p),
                                  data_parallel_twin=after[r][p]["data_parallel_twin"])
    if backup:  # backed up too (as the yaml asks) before the next step
        wait_settled(s.c, step)
    return {"step": step, "label": label, "dp": dp, "commit_to_replicated_s": secs,
            "links": links}


def dedup_block(s: Rep, first: int, dp: str, same_change: bool,
                backup: bool = True) -> list[dict[str, Any]]:
    """Three steps both nodes save at once: identical bytes and names; identical bytes under
    per-rank names; the previous step with a few MiB changed."""
    size = s.size
    base = 100_000 * (s.rep + 1) + 90_000 + first
    same = step_layout(size, base, 0, name_seed=base + 1)
    rows = [dedup_step(s, first, {0: same, 1: same}, "identical bytes, identical names", dp,
                       backup)]
    per_rank = {r: step_layout(size, base + 10, r, name_seed=base + 11 + r)
                for r in range(NODES)}
    rows.append(dedup_step(s, first + 1, per_rank,
                           "identical bytes, names ocdbt.process_<rank>/d/<random>", dp, backup))
    changed = {r: patched(per_rank[r], base + 20 + r, base + 30 + (0 if same_change else r))
               for r in range(NODES)}
    label = (f"the previous step with {PATCHES} x {PATCH_LEN // MiB} MiB changed, "
             + ("the same change on both nodes" if same_change
                else "a different change on each node"))
    rows.append(dedup_step(s, first + 2, changed, label, dp, backup))
    return rows


def trainer_restart(s: Rep, dp: int) -> dict[str, Any]:
    """yaml on both nodes -> markers (local data), taken; the step settled again."""
    t = {r: write_yaml(s.mnt(r), r, dp) for r in range(NODES)}
    got = wait_markers({r: s.mnt(r) for r in range(NODES)})
    for r, (name, st, _) in got.items():
        take_marker(s.mnt(r), name, st)
    step = got[0][1]
    if step:
        wait_settled(s.c, step, backup=s.c.node(0).options.get("backup") is not None)
    return {"yaml_to_marker_s": {r: got[r][2] - t[r] for r in got}, "step": step}


def phase_dedup(s: Rep) -> None:
    """In the cluster of the restart parts: with the yaml's assume-data-parallelism 1
    (steps 10-12), then, after a trainer restart with 2 (Orbax's value for 2 slices), 20-22."""
    rows = dedup_block(s, 10, "yaml 1", same_change=False)
    s.out["restart_dp2"] = trainer_restart(s, 2)
    rows += dedup_block(s, 20, "yaml 2", same_change=True)
    s.out["dedup"] = rows


def run_twins(shm: Path, size: int, rep: int, touch: bool, store_size: str,
              logs: Path | None) -> list[dict[str, Any]]:
    """A second cluster whose mounts say ``assume_data_parallelism=2`` (the mount option):
    the peers are data-parallel twins and replicate by hashes only. No backup tier."""
    from tests.support.cluster import Cluster
    root = shm / f"t{rep}"
    c = Cluster(root, NODES, job=JOB, options={"mtc": True, "size": store_size,
                                                 "assume_data_parallelism": 2})
    s = Rep(c, size, rep, touch)
    try:
        c.start()
        trainer_restart(s, 2)
        return dedup_block(s, 30, "mount 2 + yaml 2", same_change=True, backup=False)
    except BaseException:
        dump_logs(c)
        raise
    finally:
        c.cleanup()
        _save_logs(root, logs, f"rep{rep}-twins")
        shutil.rmtree(root, ignore_errors=True)


def _save_logs(root: Path, logs: Path | None, name: str) -> None:
    if logs is None:
        return
    for f in root.glob("n*/**/mtcfs.log*"):
        dest = logs / name / f.relative_to(root)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest)


def cp_baseline(root: Path, size: int, rep: int, touch: bool) -> dict[str, Any]:
    """``cp -r`` of rank 1's step 2 (same files, same bytes) from tmpfs to tmpfs."""
    src, dst = root / "cp-src", root / "cp-dst"
    try:
        layout = node_layout(rep, 2, 1, size)
        write_tree(src, layout, hashed=False)
        if touch:
            prefault(2 * size + GiB)
        t0 = time.perf_counter()
        subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
        secs = time.perf_counter() - t0
        return {"bytes": layout_bytes(layout), "seconds": secs,
                "gbps": gbps(layout_bytes(layout), secs)}
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)


def run_rep(shm: Path, disk: Path, size: int, rep: int, touch: bool, dedup: bool,
            store_size: str, logs: Path | None = None) -> dict[str, Any]:
    from tests.support.cluster import Cluster
    t_rep = time.perf_counter()
    out: dict[str, Any] = {"loadavg": os.getloadavg()}
    out["cp"] = cp_baseline(shm, size, rep, touch)
    log(f"rep {rep + 1}: cp -r {out['cp']['seconds']:.2f} s")
    bk = disk / f"backup{rep}"
    bk.mkdir()
    c = Cluster(shm / f"c{rep}", NODES, job=JOB,
                options={"mtc": True, "size": store_size, "backup": f"file://{bk}"})
    s = Rep(c, size, rep, touch, out=out)
    phases: list[tuple[str, Callable[[], None]]] = [
        ("start", lambda: phase_start(s)),
        ("save", lambda: phase_save(s)),
        ("local", lambda: phase_local(s)),
        ("peer", lambda: phase_peer(s)),
        ("backup", lambda: phase_backup(s, bk)),
    ]
    if dedup:
        phases.append(("dedup", lambda: phase_dedup(s)))
    try:
        c.start()
        for name, fn in phases:
            t = time.perf_counter()
            fn()
            out.setdefault("phase_seconds", {})[name] = round(time.perf_counter() - t, 2)
            log(f"rep {rep + 1}: {name} done in {time.perf_counter() - t:.1f} s")
    except BaseException:
        dump_logs(c)
        raise
    finally:
        c.cleanup()
        _save_logs(shm / f"c{rep}", logs, f"rep{rep}")
        shutil.rmtree(shm / f"c{rep}", ignore_errors=True)
        shutil.rmtree(bk, ignore_errors=True)
    if dedup:
        t = time.perf_counter()
        out["dedup"] += run_twins(shm, size, rep, touch, store_size, logs)
        out["phase_seconds"]["dedup-twins"] = round(time.perf_counter() - t, 2)
        log(f"rep {rep + 1}: dedup with twins done in {time.perf_counter() - t:.1f} s")
    out["seconds"] = time.perf_counter() - t_rep
    return out


# ---------------------------------------------------------------------- tables

def _get(runs: list[dict], *path: Any) -> list[Any]:
    out = []
    for r in runs:
        v: Any = r
        for k in path:
            if v is None:
                break
            # (int keys are strings once the runs went through JSON)
            v = (v[k] if k in v else v.get(str(k))) if isinstance(v, dict) else None
        out.append(v)
    return out


def restart_table(runs: list[dict], size: int, reps: int) -> BenchResult:
    res = BenchResult("restart", f"7a. Restart to the restore marker, 2 nodes, "
                      f"{size / GiB:.3g} GiB per node, median of {len(runs)}",
                      ["measurement", "seconds", "GB/s (step bytes)", "x cp -r"])
    cp = [r["cp"]["seconds"] for r in runs]
    cp_m = median(cp)

    def row(label: str, xs: list[Any], nbytes: int | None = size) -> None:
        m = median(xs)
        shown = fmt_noise(xs, 3) if m and m >= 0.05 else fmt(m, 3)  # no ±% of ~0
        res.rows.append([label, shown, fmt(gbps(nbytes, m) if nbytes else None),
                         fmt(m / cp_m if m and cp_m and nbytes else None)])

    row("baseline: cp -r of one node's step, tmpfs -> tmpfs", cp)
    raw = [_get([r], "backup", "backup_read")[0] for r in runs]
    rs = [x["seconds"] * size / x["bytes"] if x and x["bytes"] else None for x in raw]
    row("baseline: cold read of the file:// backup dir (scaled to one step)", rs)
    row("first start (no step): yaml -> s0 marker, rank 0",
        [_get([r], "start", "yaml_to_marker", 0)[0] for r in runs], None)
    row("trainer restart, daemons up: yaml -> marker, rank 1",
        [_get([r], "local", "yaml_to_marker_s", 1)[0] for r in runs], None)
    for key, what in (("peer", "rank 1 from rank 0 (peer)"),
                      ("backup", "both ranks from file:// (backup)")):
        rk = 1
        row(f"{what}: T0 (mount cmd) -> rank {rk} marker",
            _get(runs, key, "t0_to_marker_s", rk))
        row(f"{what}: T0 -> jax-init-info.txt (mount)", _get(runs, key, "t0_to_init_info_s"),
            None)
        row(f"{what}: yaml -> rank {rk} marker", _get(runs, key, "yaml_to_marker_s", rk))
        row(f"{what}: last_restore.seconds, rank {rk}",
            _get(runs, key, "last_restore", rk, "seconds"))
        row(f"{what}: last_restore.decision_seconds, rank {rk}",
            _get(runs, key, "last_restore", rk, "decision_seconds"), None)
        row(f"{what}: last_restore.data_seconds, rank {rk}",
            _get(runs, key, "last_restore", rk, "data_seconds"))
        row(f"{what}: yaml -> rank 0 marker", _get(runs, key, "yaml_to_marker_s", 0),
            None if key == "peer" else size)
    srcs = sorted({f"{k}: rank {r} {_get([x], k, 'last_restore', r, 'source')[0]}"
                   for x in runs for k in ("peer", "backup") for r in range(NODES)})
    res.notes.append("sources (mtc.last_restore.source): " + "; ".join(srcs))
    res.notes.append("every restored byte verified: sha256 of each file read through the "
                     "marker directory equals what the node wrote")
    raw0 = raw[0] or {}
    res.notes.append(f"backup dir read: {fmt(median([x['gbps'] for x in raw if x]))} GB/s cold "
                     f"({raw0.get('files')} files, {(raw0.get('bytes') or 0) / GiB:.2f} GiB)"
                     f"{'' if raw0.get('cold') else ' (NOT cold: not root)'}")
    res.samples["cp"] = cp
    return res


def dedup_table(runs: list[dict]) -> BenchResult:
    res = BenchResult("dedup", "7b. Payload bytes between the two nodes for a step both save "
                      "at once (per link; ratio = payload sent / the step's bytes)",
                      ["assume-data-parallelism (twins?)", "step", "step MiB", "sent 0->1 MiB",
                       "sent 1->0 MiB", "ratio (max link)", "chunks sent/skipped 0->1",
                       "commit -> peers 1/1 s"])
    with_dedup = [r["dedup"] for r in runs if r.get("dedup")]
    if not with_dedup:
        return res
    for i, row in enumerate(with_dedup[0]):
        rows = [d[i] for d in with_dedup if len(d) > i]
        l01 = [x["links"]["0->1"] for x in rows]
        l10 = [x["links"]["1->0"] for x in rows]
        payload = row["links"]["0->1"]["payload"]
        sent01 = median([x["logged_bytes_sent"] for x in l01]) or 0
        sent10 = median([x["logged_bytes_sent"] for x in l10]) or 0
        twin = "twins" if l01[0].get("data_parallel_twin") else "not twins"
        res.rows.append([f"{row['dp']} ({twin})", f"{row['step']}: {row['label']}",
                         f"{payload / MiB:.1f}", f"{sent01 / MiB:.2f}", f"{sent10 / MiB:.2f}",
                         f"{max(sent01, sent10) / payload:.4f}",
                         f"{l01[0]['chunks_sent']}/{l01[0]['chunks_skipped']}",
                         fmt_noise([x["commit_to_replicated_s"] for x in rows])])
    res.notes.append("sent: the payload bytes of the sender's log lines '<step> replicated to "
                     "rank <peer> (...; N payload bytes)' for that step; chunks: the delta of "
                     "peers.replication[].chunks_sent/chunks_skipped of its status over the "
                     "step (may include another step's round)")
    res.notes.append("twins: the link's data_parallel_twin in mtcfs status (hashes-only "
                     "replication first): the yaml's assume-data-parallelism > 1 (hashes only "
                     "for 5 s) or the mount option assume_data_parallelism (60 s)")
    return res


# ---------------------------------------------------------------------- command

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_mtc",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="GiB per node per step (default 1)")
    p.add_argument("--reps", type=int, default=3, help="repeats (median; default 3)")
    p.add_argument("--json", type=Path, help="results file (default "
                   "bench-results/mtc-<timestamp>.json)")
    p.add_argument("--no-prefault", action="store_true",
                   help="do not touch 2 x size + 1 GiB of RAM before timed restores")
    p.add_argument("--no-dedup", action="store_true", help="skip the dedup part")
    p.add_argument("--dedup-every-rep", action="store_true",
                   help="run the dedup part in every repeat (default: the first only)")
    p.add_argument("--logs", type=Path, help="copy the daemons' logs into this directory")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run import render

    a = parse_args(argv)
    size = int(a.gib * GiB) // MiB * MiB
    store_size = f"{max(2, math.ceil(8 * a.gib))}G"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = a.json or REPO / "bench-results" / f"mtc-{stamp}.json"
    info = machine_info()
    print(f"mtcfs mtc benchmark: {size / GiB:.3g} GiB per node, {a.reps} repeats, "
          f"{info.get('nproc')} CPUs, load {', '.join(f'{x:.2f}' for x in info['loadavg'])}, "
          f"git {info['git']['head']}", flush=True)
    doc: dict[str, Any] = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.bench_mtc"]
                            + (argv if argv is not None else sys.argv[1:])),
        "bytes_per_node": size, "reps": a.reps, "nodes": NODES, "store_size": store_size,
        "stores": SCRATCH_SHM, "backup_dir": f"file:// under {SCRATCH_DISK} (local disk)",
        "prefault": not a.no_prefault, "machine": info, "results": {}, "errors": {}}
    t0 = time.perf_counter()
    runs: list[dict] = []
    with scratch_dir(SCRATCH_SHM, "mtc") as shm, scratch_dir(SCRATCH_DISK, "mtc") as disk:
        for rep in range(a.reps):
            try:
                runs.append(run_rep(shm, disk, size, rep, not a.no_prefault,
                                    not a.no_dedup and (rep == 0 or a.dedup_every_rep),
                                    store_size, a.logs))
            except Exception as exc:  # noqa: BLE001 (reported; the next repeat runs)
                traceback.print_exc()
                doc["errors"][f"rep{rep}"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
            time.sleep(0.5)
    doc["runs"] = runs
    tables = [restart_table(runs, size, a.reps), dedup_table(runs)] if runs else []
    for res in tables:
        if not res.rows:
            continue
        res.seconds = time.perf_counter() - t0
        res.notes += [f"{k} FAILED: {v.splitlines()[0][:300]}" for k, v in doc["errors"].items()]
        doc["results"][res.key] = res.to_json()
        print(render(res), flush=True)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    doc["machine"]["loadavg_end"] = os.getloadavg()
    doc["machine"]["git_end"] = git_state()
    write_json(out_path, doc)
    print(f"\n{len(doc['errors'])} repeat(s) failed in {doc['seconds']:.0f}s; results in "
          f"{out_path}", flush=True)
    return 1 if doc["errors"] or not runs else 0


if __name__ == "__main__":
    sys.exit(main())
