"""Recovery at the speed of the wire (issue 41): a lost node's shard back from its holders.

``python -m benchmarks.bench_recovery [--size 1G] [--reps 3] [--nodes 3] [--replicas 2]
[--tls]`` (or ``make bench-recovery``). Everything goes to
``bench-results/recovery-<timestamp>.json``.

Each repeat, in one run on one machine:

``tcp``
    The physical path: the same bytes copied between two processes over a loopback TCP
    socket, ``sendfile(2)`` from a tmpfs file on one side, ``recv_into`` + ``write`` into a
    tmpfs file on the other, no hashing. Timed from the connect to the last byte written.
``replicate``
    ``nodes`` daemons on loopback (``replicas=``); rank 0 writes ``size`` bytes into
    ``step_1/data.bin`` and commits the step; timed from the close of
    ``commit_success.txt`` until the step reads ``replicated R/R``.
``restore``
    Rank 0 is SIGKILLed and its store wiped (its RAM tier lost), then mounted again on the
    empty store: timed from the start of the mount until ``step_1/data.bin`` has been read
    back through the mount, bit-exact (its blake3 is the one written), with every chunk
    from the holders (``mtcfs status``: none from the backup tier, none corrupt).

Ratios are ``tcp`` seconds / ``mtcfs`` seconds (1.0 = the speed of the plain copy); the
issue's targets are >= 0.5 both ways. The daemons' CPU seconds are recorded per phase.

``--shaped 1,2,3`` instead measures the restore where the network, not the CPU, is the limit:
for each count k, k+1 nodes with ``replicas=k``; every holder's ports (gRPC and chunk
stream) send at most ``--holder-rate`` (1 Gbit/s) and all of them together at most
``--link-rate`` (4 Gbit/s, the replacement's link), shaped on loopback by an HTB qdisc with
one class per holder (``tc``, matched by source port; removed at the end). The figure is
the bulk restore's own rate (``mtcfs status``: restore.bulk_from_peers) against the sum of
the holders' line rates; target >= 0.8.

``--job-restore`` instead measures the bucket read once per job: ``--nodes`` (4) daemons
with ``assume_data_parallelism=--twins`` (2) and a ``file://`` backup tier; ranks r and
r + N/D write the same ``--size`` bytes (data-parallel replicas of one shard), commit the
step and wait until it is backed up. Then the whole job is lost at once (every daemon
SIGKILLed, every store wiped) and restarted on empty stores, all at once; each rank reads
its shard back through its mount, bit-exact. The figure is the bytes the bucket served
(``bytes_downloaded`` summed over the job's daemons) over the unique bytes of the step (the
compressed size of its distinct chunks, as stored in the bucket); target <= 1.05. The same
job and bytes mounted without ``assume_data_parallelism`` are the contrast: the bucket
still stores each chunk once, but each rank reads its own shard from it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO, SCRATCH_SHM, BenchResult, Check, GiB, MiB, UniqueData, cpu_seconds, daemon_pid,
    dump_logs,
    fmt, git_state, log, machine_info, median, mtcfs_state, prefault, scratch_dir,
    wait_until, write_file, write_json,
)

JOB = "bench-recovery"


def tcp_copy(src: Path, dst: Path) -> float:
    """Seconds to copy ``src`` to ``dst`` over a loopback TCP socket (sendfile / recv)."""
    size = src.stat().st_size
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # the sender
        try:
            conn, _ = lsock.accept()
            with open(src, "rb") as f:
                off = 0
                while off < size:
                    off += os.sendfile(conn.fileno(), f.fileno(), off, size - off)
            conn.close()
        finally:
            os._exit(0)
    lsock.close()
    buf = bytearray(4 * MiB)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s, open(dst, "wb", buffering=0) as f:
        got = 0
        while got < size:
            n = s.recv_into(view)
            if not n:
                raise RuntimeError(f"the sender stopped after {got} of {size} bytes")
            f.write(view[:n])
            got += n
    t = time.perf_counter() - t0
    os.waitpid(pid, 0)
    return t


def _replicated(path: Path, k: int) -> bool:
    try:
        state = mtcfs_state(path)
    except OSError:
        return False
    return state.startswith("replicated ") and int(state.split()[1].split("/")[0]) >= k


def _commit(step_dir: Path) -> float:
    fd = os.open(step_dir / "commit_success.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"Checkpoint commit was successful")
    finally:
        os.close(fd)
    return time.perf_counter()


def _read_back(path: Path) -> tuple[float, str]:
    """Read ``path`` through the mount in 16 MiB reads; (seconds, blake3 hex)."""
    import blake3
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    buf = bytearray(16 * MiB)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return time.perf_counter() - t0, h.hexdigest()


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs so far (/proc/stat), for the machine's load over a
    phase: busy / total between two samples."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


def busy_since(before: tuple[float, float]) -> float:
    b, t = machine_busy()
    return round((b - before[0]) / max(1, t - before[1]), 3)


def cpu_of(c: Any) -> dict[int, float]:
    out = {}
    for r in range(c.nodes):
        try:
            out[r] = cpu_seconds(daemon_pid(c.node(r)))
        except Exception:  # noqa: BLE001 (a killed node)
            pass
    return out


def _profile(c: Any, phase: str) -> list[Any]:
    """With MTCFS_BENCH_PYSPY=DIR: py-spy records every daemon (a flame graph per rank)."""
    out = os.environ.get("MTCFS_BENCH_PYSPY")
    if not out:
        return []
    import subprocess
    Path(out).mkdir(parents=True, exist_ok=True)
    spies = []
    for r in range(c.nodes):
        pid = daemon_pid(c.node(r))
        spies.append(subprocess.Popen(
            [str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(pid), "-r", "250",
             "--nonblocking", "--threads", *os.environ.get("MTCFS_BENCH_PYSPY_ARGS", "").split(), "-f", "raw", "-o", f"{out}/{phase}-rank{r}.txt"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(0.5)
    return spies


def _stop(spies: list[Any]) -> None:
    import signal
    for s in spies:
        s.send_signal(signal.SIGINT)
    for s in spies:
        s.wait(timeout=30)


def one_rep(root: Path, size: int, nodes: int, replicas: int, tls: bool, seed: int,
            touch: bool, extra: dict[str, str] | None = None) -> dict[str, Any]:
    from tests.support.cluster import Cluster
    import blake3
    src = root / "tcp-src.bin"
    dst = root / "tcp-dst.bin"
    write_file(src, size, UniqueData(seed))
    want = blake3.blake3(src.read_bytes(), max_threads=blake3.blake3.AUTO).hexdigest()
    if touch:
        prefault(2 * size + GiB)
    t_tcp = tcp_copy(src, dst)
    dst.unlink()
    src.unlink()
    c = Cluster(root / "cluster", nodes, job=JOB, tls=tls,
                options={"size": f"{max(4, 3 * size // GiB + 2)}G", "replicas": replicas,
                         **(extra or {})})
    try:
        c.start()
        for r in range(1, nodes):  # the step is complete in the job
            d = c.node(r).mnt / "step_1"
            d.mkdir()
            write_file(d / "data.bin", MiB, UniqueData(seed + r))
            _commit(d)
        d = c.node(0).mnt / "step_1"
        d.mkdir()
        write_file(d / "data.bin", size, UniqueData(seed))
        cpu0 = cpu_of(c)
        spies = _profile(c, "replicate")
        busy0 = machine_busy()
        t_close = _commit(d)
        wait_until(lambda: _replicated(d, replicas), 900,
                   f"{d} to be replicated {replicas}/{replicas}", interval=0.005)
        t_rep = time.perf_counter() - t_close
        busy_rep = busy_since(busy0)
        _stop(spies)
        cpu1 = cpu_of(c)
        if os.getxattr(d / "data.bin", "user.mtcfs.blake3").decode() != want:
            raise RuntimeError("step_1/data.bin does not have the blake3 written")
        for r in range(1, nodes):
            c.wait_replicated(r, "step_1", timeout=300)
        c.kill9(0)
        c.wipe(0)
        if touch:
            prefault(2 * size + GiB)
        cpu2 = cpu_of(c)
        busy2 = machine_busy()
        t0 = time.perf_counter()
        m = c.restart(0)
        t_mount = time.perf_counter() - t0
        spies = _profile(c, "restore")
        if os.environ.get("MTCFS_BENCH_WAIT_RESTORED"):
            wait_until(lambda: (m.status().get("restore") or {}).get("pending_chunks") == 0,
                       300, "the restore", interval=0.25)
            log(f"restored in {time.perf_counter() - t0:.2f} s from the mount's start")
        t_read, got = _read_back(m.mnt / "step_1" / "data.bin")
        _stop(spies)
        t_restore = time.perf_counter() - t0
        busy_res = busy_since(busy2)
        cpu3 = cpu_of(c)
        if got != want:
            raise RuntimeError(f"the restored step_1/data.bin hashes to {got}, not {want}")
        st = m.status()
        restore = st.get("restore") or {}
        if restore.get("corrupt_chunks"):
            raise RuntimeError(f"restore reported corrupt chunks: {restore}")
        return {"tcp": t_tcp, "replicate": t_rep, "mount": t_mount, "read": t_read,
                "restore": t_restore, "restore_status": restore,
                "machine_busy_replicate": busy_rep, "machine_busy_restore": busy_res,
                "cpu_replicate": {r: round(cpu1[r] - cpu0.get(r, 0), 3) for r in cpu1},
                "cpu_restore": {r: round(cpu3[r] - cpu2.get(r, 0), 3) for r in cpu3}}
    except BaseException:
        dump_logs(c)
        raise
    finally:
        c.cleanup()


def _tc(*args: str) -> None:
    import subprocess
    subprocess.run(["tc", *args], check=True, capture_output=True, text=True, timeout=30)


def shape(ports_by_holder: dict[int, list[int]], holder_rate: str, link_rate: str) -> None:
    """HTB on ``lo``: each holder's source ports in a class of ``holder_rate``, all under
    one of ``link_rate``; every other packet unshaped."""
    _tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "99",
        "r2q", "1000")
    _tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb", "rate",
        link_rate, "ceil", link_rate, "burst", "1m", "cburst", "1m")
    _tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:99", "htb", "rate",
        "100gbit")
    for i, (_rank, ports) in enumerate(sorted(ports_by_holder.items())):
        cls = f"1:{10 + i}"
        _tc("class", "add", "dev", "lo", "parent", "1:1", "classid", cls, "htb", "rate",
            holder_rate, "ceil", holder_rate, "burst", "256k", "cburst", "256k")
        for port in ports:
            _tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "ip", "sport", str(port), "0xffff", "flowid", cls)


def unshape() -> None:
    import subprocess
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True,
                   timeout=30)


def _rate_bits(text: str) -> float:
    units = {"k": 1e3, "m": 1e6, "g": 1e9}
    t = text.lower().removesuffix("bit")
    return float(t[:-1]) * units[t[-1]] if t[-1] in units else float(t)


def shaped_rep(root: Path, size: int, holders: int, holder_rate: str, link_rate: str,
               seed: int, tls: bool) -> dict[str, Any]:
    """One restore of rank 0 from ``holders`` holders behind shaped links."""
    from tests.support.cluster import Cluster
    import blake3
    nodes = holders + 1
    c = Cluster(root / f"shaped{holders}", nodes, job=JOB, tls=tls,
                options={"size": f"{max(4, 3 * size // GiB + 2)}G", "replicas": holders})
    try:
        c.start()
        for r in range(1, nodes):
            d = c.node(r).mnt / "step_1"
            d.mkdir()
            write_file(d / "data.bin", MiB, UniqueData(seed + r))
            _commit(d)
        d = c.node(0).mnt / "step_1"
        d.mkdir()
        write_file(d / "data.bin", size, UniqueData(seed))
        _commit(d)
        want = os.getxattr(d / "data.bin", "user.mtcfs.blake3").decode()
        wait_until(lambda: _replicated(d, holders), 900, "step_1 replicated", interval=0.05)
        for r in range(1, nodes):
            c.wait_replicated(r, "step_1", timeout=300)
        ports = {}
        for r in range(1, nodes):
            peers = c.status(r)["peers"]
            ports[r] = [int(peers["listen"].rsplit(":", 1)[1]), int(peers["stream_port"])]
        c.kill9(0)
        c.wipe(0)
        shape(ports, holder_rate, link_rate)
        try:
            t0 = time.perf_counter()
            m = c.restart(0)
            t_read, got = _read_back(m.mnt / "step_1" / "data.bin")
            t_restore = time.perf_counter() - t0
        finally:
            unshape()
        if got != want:
            raise RuntimeError(f"the restored step_1/data.bin hashes to {got}, not {want}")
        bulk = (m.status().get("restore") or {}).get("bulk_from_peers") or {}
        line = holders * _rate_bits(holder_rate)
        rate = bulk["bytes"] * 8 / bulk["seconds"] if bulk.get("seconds") else None
        return {"holders": holders, "restore": t_restore, "read": t_read, "bulk": bulk,
                "bulk_bits_per_s": rate, "line_bits_per_s": line,
                "ratio": rate / line if rate else None}
    finally:
        unshape()
        c.cleanup()


def _bucket_bytes(bucket: Path) -> int:
    """Bytes of the chunk objects under a ``file://`` bucket (compressed, as stored)."""
    return sum(p.stat().st_size for p in bucket.rglob("*")
               if p.is_file() and "chunks" in p.relative_to(bucket).parts)


def job_restore_rep(root: Path, size: int, nodes: int, twins: int, seed: int,
                    tls: bool, option: bool = True) -> dict[str, Any]:
    """One whole-job restore from the bucket: ranks r and r + N/twins write the same bytes;
    ``option=False``: the job does not say so (no ``assume_data_parallelism``)."""
    from tests.support.cluster import Cluster
    import blake3
    bucket = root / "bucket"
    shards = nodes // twins
    opts: dict[str, Any] = {"size": f"{max(4, 3 * size // GiB + 2)}G",
                            "backup": f"file://{bucket}", "backup_interval": "1ckpt"}
    if option:
        opts["assume_data_parallelism"] = twins
    c = Cluster(root / "cluster", nodes, job=JOB, tls=tls, options=opts)
    want: dict[int, str] = {}
    try:
        c.start()
        for r in range(nodes):
            d = c.node(r).mnt / "step_1"
            d.mkdir()
            write_file(d / "shard.bin", size, UniqueData(seed + r % shards))
            _commit(d)
        for r in range(nodes):
            c.node(r).wait_state("step_1", "backed-up", timeout=900)
            want[r] = os.getxattr(c.node(r).mnt / "step_1" / "shard.bin",
                                  "user.mtcfs.blake3").decode()
        unique = _bucket_bytes(bucket)
        for r in range(nodes):
            c.kill9(r)
        busy0 = machine_busy()
        t0 = time.perf_counter()
        mounts = c.restart_many(range(nodes), wipe=True, timeout=120)
        t_mount = time.perf_counter() - t0
        reads: dict[int, float] = {}
        errors: list[BaseException] = []

        def read(r: int) -> None:
            try:
                _, got = _read_back(mounts[r].mnt / "step_1" / "shard.bin")
                if got != want[r]:
                    raise RuntimeError(f"rank {r}'s restored shard hashes to {got}")
                reads[r] = time.perf_counter() - t0
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)
        threads = [threading.Thread(target=read, args=(r,)) for r in range(nodes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(900)
        if errors or len(reads) < nodes:
            raise RuntimeError(f"whole-job read back failed: {errors or 'a reader hung'}")
        t_all = time.perf_counter() - t0
        busy = busy_since(busy0)
        sts = [m.wait_for(lambda m=m: (lambda s: s if (s.get("restore") or {}).get(
            "pending_chunks") == 0 else None)(m.status()), 300, "the restore")
            for m in mounts]
        down = [s["backup"]["store"]["bytes_downloaded"] for s in sts]
        served = [s["restore"]["chunks_from"] for s in sts]
        return {"twins": twins, "option": option, "unique_bytes": unique,
                "bucket_bytes_read": down, "ratio": sum(down) / unique, "mount": t_mount,
                "read_back": t_all, "per_rank_read_back": reads, "chunks_from": served,
                "machine_busy": busy}
    except BaseException:
        dump_logs(c)
        raise
    finally:
        c.cleanup()


def main_job_restore(a: argparse.Namespace) -> int:
    if a.nodes % a.twins:
        raise SystemExit(f"bench_recovery: --twins {a.twins} must divide --nodes {a.nodes}")
    rows, runs = [], []
    with scratch_dir(SCRATCH_SHM, "mtcfs-bench-recovery-") as root:
        for option in (True, False):
            reps = []
            for rep in range(a.reps):
                d = root / f"opt{int(option)}-rep{rep}"
                d.mkdir()
                try:
                    r = job_restore_rep(d, a.size, a.nodes, a.twins, 6100 + rep, a.tls,
                                        option)
                finally:  # the bucket and the stores are in RAM: 4-6x --size per repeat
                    shutil.rmtree(d, ignore_errors=True)
                log(f"option {option}, rep {rep}: bucket read {sum(r['bucket_bytes_read'])} B"
                    f" of {r['unique_bytes']} unique ({r['ratio']:.3f}) per rank"
                    f" {r['bucket_bytes_read']}; all read back in {r['read_back']:.2f} s")
                reps.append(r)
            runs.extend(reps)
            label = (f"assume_data_parallelism={a.twins}" if option
                     else "no assume_data_parallelism")
            rows.append([label, fmt(median([r["unique_bytes"] / MiB for r in reps])),
                         fmt(median([sum(r["bucket_bytes_read"]) / MiB for r in reps])),
                         fmt(median([r["ratio"] for r in reps]), 3),
                         fmt(median([r["read_back"] for r in reps]))])
    res = BenchResult("recovery-job", f"whole-job restore from a file:// bucket: {a.nodes} "
                      f"nodes on empty stores, {a.size // MiB} MiB per rank, "
                      f"{'mutual TLS' if a.tls else 'plaintext'}, median of {a.reps}",
                      ["", "unique bytes in the bucket, MiB", "bucket bytes read, MiB",
                       "ratio", "restart + all ranks read back, s"], rows=rows)
    res.checks = [Check("bucket bytes read / unique bytes", float(rows[0][3]), 1.05, "<=")]
    res.samples = {"runs": runs, "size": a.size, "machine": machine_info(),
                   "git": git_state()}
    return report(res, Path(a.out), "recovery-job")


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": MiB, "G": GiB}
    t = text.strip().upper().rstrip("IB")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_recovery", description=__doc__.split("\n")[0])
    p.add_argument("--size", type=parse_size, default=GiB, help="shard size (default 1G)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--nodes", type=int, default=None,
                   help="daemons (default 3; 4 with --job-restore)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--tls", action="store_true", help="peers speak mutual TLS")
    p.add_argument("--no-prefault", action="store_true")
    p.add_argument("--shaped", help="holder counts, e.g. 1,2,3: restore over shaped links")
    p.add_argument("--holder-rate", default="1gbit", help="each holder's line rate (tc)")
    p.add_argument("--link-rate", default="4gbit", help="the replacement's line rate (tc)")
    p.add_argument("--job-restore", action="store_true",
                   help="the whole job restored from a file:// bucket (--nodes 4, --twins 2)")
    p.add_argument("--twins", type=int, default=2,
                   help="--job-restore: assume_data_parallelism (default 2)")
    p.add_argument("--options", default="",
                   help="more mount options for every node, k=v,... (e.g. bg_sched=normal)")
    p.add_argument("--out", default=str(REPO / "bench-results"))
    a = p.parse_args(argv)
    extra = dict(kv.split("=", 1) for kv in a.options.split(",") if kv)
    if a.nodes is None:
        a.nodes = 4 if a.job_restore else 3
    if a.replicas >= a.nodes:
        p.error(f"--replicas must be below --nodes ({a.nodes})")
    if a.shaped:
        return main_shaped(a)
    if a.job_restore:
        return main_job_restore(a)
    runs: list[dict[str, Any]] = []
    with scratch_dir(SCRATCH_SHM, "mtcfs-bench-recovery-") as root:
        for rep in range(a.reps):
            d = root / f"rep{rep}"
            d.mkdir()
            r = one_rep(d, a.size, a.nodes, a.replicas, a.tls, 4100 + rep, not a.no_prefault,
                        extra)
            log(f"rep {rep}: tcp {r['tcp']:.2f} s, close->replicated {r['replicate']:.2f} s,"
                f" mount+read back {r['restore']:.2f} s (mount {r['mount']:.2f}, read"
                f" {r['read']:.2f}); cpu restore {r['cpu_restore']}, machine busy"
                f" {r['machine_busy_replicate']:.0%} / {r['machine_busy_restore']:.0%}")
            runs.append(r)
    tcp = median([r["tcp"] for r in runs]) or 0.0
    rep_s = median([r["replicate"] for r in runs]) or 0.0
    res_s = median([r["restore"] for r in runs]) or 0.0
    res = BenchResult(
        "recovery", f"{a.nodes} nodes on loopback, replicas={a.replicas}, "
                    f"{'mutual TLS' if a.tls else 'plaintext'}, {a.size // MiB} MiB shard, "
                    f"median of {a.reps}{', ' + a.options if a.options else ''}", ["", "seconds", "ratio to TCP"])
    res.rows = [
        ["plain TCP copy (sendfile), s", fmt(tcp), "1.00"],
        [f"close -> replicated {a.replicas}/{a.replicas}, s", fmt(rep_s), fmt(tcp / rep_s)],
        ["mount + read back from the holders, s", fmt(res_s), fmt(tcp / res_s)],
    ]
    res.checks = [Check("close -> replicated, ratio to TCP", tcp / rep_s, 0.5),
                  Check("mount + read back, ratio to TCP", tcp / res_s, 0.5)]
    res.samples = {"runs": runs, "size": a.size, "machine": machine_info(),
                   "git": git_state()}
    return report(res, Path(a.out), "recovery")


def report(res: BenchResult, out: Path, stem: str) -> int:
    """Print ``res`` as a table with its checks; write it to ``out/<stem>-<time>.json``."""
    print(f"\n{res.title}\n")
    print("| " + " | ".join(res.columns) + " |")
    print("| --- " * len(res.columns) + "|")
    for row in res.rows:
        print("| " + " | ".join(row) + " |")
    for chk in res.checks:
        print(f"{chk.name}: {fmt(chk.value)} {chk.op} {chk.threshold}"
              f" {'PASS' if chk.ok else 'MISS'}")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    write_json(out / f"{stem}-{stamp}.json", res.to_json())
    return 0


def main_shaped(a: argparse.Namespace) -> int:
    counts = [int(x) for x in a.shaped.split(",")]
    rows, runs = [], []
    with scratch_dir(SCRATCH_SHM, "mtcfs-bench-recovery-") as root:
        for k in counts:
            reps = []
            for rep in range(a.reps):
                d = root / f"k{k}-rep{rep}"
                d.mkdir()
                r = shaped_rep(d, a.size, k, a.holder_rate, a.link_rate, 5100 + rep, a.tls)
                log(f"{k} holders, rep {rep}: bulk {r['bulk_bits_per_s'] / 1e9:.2f} Gbit/s of"
                    f" {r['line_bits_per_s'] / 1e9:.2f} ({r['ratio']:.2f}); mount + read back"
                    f" {r['restore']:.2f} s")
                reps.append(r)
            runs.extend(reps)
            ratio = median([r["ratio"] for r in reps])
            rate = median([r["bulk_bits_per_s"] for r in reps]) or 0.0
            rows.append([str(k), f"{k * _rate_bits(a.holder_rate) / 1e9:.1f}",
                         f"{rate / 1e9:.2f}", fmt(ratio),
                         fmt(median([r["restore"] for r in reps]))])
    res = BenchResult("recovery-shaped", f"restore of a {a.size // MiB} MiB shard over shaped "
                      f"links: each holder {a.holder_rate}, the replacement {a.link_rate}, "
                      f"median of {a.reps}",
                      ["holders", "sum of line rates, Gbit/s", "bulk restore, Gbit/s",
                       "ratio", "mount + read back, s"], rows=rows)
    res.checks = [Check(f"{r[0]} holders: ratio to the line rates", float(r[3]), 0.8)
                  for r in rows if r[3] != "-"]
    res.samples = {"runs": runs, "size": a.size, "machine": machine_info(),
                   "git": git_state()}
    return report(res, Path(a.out), "recovery-shaped")


if __name__ == "__main__":
    sys.exit(main())
