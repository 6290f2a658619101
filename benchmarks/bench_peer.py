"""5. The peer tier: replicate and restore over gRPC, against a bare grpcio stream.

``python -m benchmarks.bench_peer [--size 1G] [--reps 3] [--only baseline,client,mtcfs]``
(or ``make bench-peer``). Three parts, each a table; everything goes to
``bench-results/peer-<timestamp>.json``:

``baseline``
    A bare grpcio stream on loopback, in a server subprocess built from grpc's generic
    handlers (raw bytes, no proto), with the Peer service's channel options (65 MiB message
    limit, 8 server threads). ``replicate``: a client stream of ``size`` bytes in 4 MiB (and
    16 MiB) messages that the server only counts. ``restore``: a server stream of ``size``
    bytes held in the server's memory that the client only counts. The ceiling of the
    transport: no hashing, no storing.
``client``
    The real thing without the daemon: :class:`PeerClient` against :func:`serve` over a
    :class:`ReplicaStore` on /dev/shm, in a server subprocess. ``put_chunks`` of ``size``
    bytes of fresh 4 MiB chunks each repeat (HasChunks, then PutChunks streams; the server
    hashes and writes each chunk), then ``get_chunks`` of them back (the server re-hashes
    each chunk it reads, the client hashes each it receives). Ratio to the bare stream of
    4 MiB messages: target >= 0.80 both ways. Data-parallel: a second server whose store has
    a ``local=`` :class:`LocalChunks` already holding every chunk: the put must move
    **0 payload bytes** (target), only hashes.
``mtcfs``
    Two daemons on loopback (:class:`tests.support.cluster.Cluster`, ``replicas=1``).
    Needs the daemon's peer wiring (``rank=,nodes=,peers=,listen=,replicas=``); until it
    lands this part fails and is reported as an error. (1) ``size`` bytes into
    ``step_1/data.bin`` of rank 0, then ``commit_success.txt`` (commits the step); timed from
    the close of ``commit_success.txt`` until the step dir reads ``replicated 1/1``.
    (2) rank 0 is SIGKILLed, its store wiped, and mounted again: timed from the start of the
    mount until ``mtcfs status --json`` shows ``restore.step == step_1`` and
    ``pending_chunks == 0`` (the wait of tests/t6_backup_restore_test.py), chunks from rank
    1. Rank 1 writes a 1 MiB ``step_1`` too, so the step is complete in the job. (3) The same
    with ``backup=file://`` on a disk directory: both ranks wait for ``backed-up``, then both
    are killed and wiped, so no peer holds anything; rank 0 restores from the backup.
    (4) Write throughput while the previous step replicates: ``step_2`` is committed and
    ``size`` bytes are written at once into ``step_3/data.bin``, on the 2-node cluster and on
    a plain one-node mount (same sequence, no peer tier). Target >= 0.90 of the plain mount.

Before every timed write or stream, ``2 x size + 1 GiB`` of RAM is touched
(``common.prefault``; ``--no-prefault`` to skip). Repeats rotate the order of the
measurements; tables show medians and ``±`` half the spread.

Internal: ``--serve stream|peer`` runs a server subprocess (prints ``ready <port>``, serves
until its stdin closes, then prints its counters as one JSON line).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    SCRATCH_DISK,
    SCRATCH_SHM,
    BenchResult,
    Check,
    GiB,
    KiB,
    MiB,
    UniqueData,
    dump_logs,
    fmt,
    fmt_noise,
    gbps,
    git_state,
    human,
    log,
    machine_info,
    median,
    mtcfs_mount,
    mtcfs_state,
    prefault,
    scratch_dir,
    wait_until,
    write_file,
    write_json,
)

PARTS = ("baseline", "client", "mtcfs")
CHUNK = 4 * MiB                      # the default chunk size: one PutChunks piece
MSG_SIZES = (4 * MiB, 16 * MiB)      # bare stream message sizes
JOB = "bench"
STREAM_SERVICE = "mtcfs.bench.Stream"
PUT_METHOD = f"/{STREAM_SERVICE}/Put"
GET_METHOD = f"/{STREAM_SERVICE}/Get"
SERVER_WORKERS = 8                   # mtcfs.tiers.peer.service.DEFAULT_WORKERS
DP_SEED = 777                        # the chunks both sides hold in the data-parallel case
TARGET_CLIENT = 0.80                 # PeerClient put/get GB/s over the bare stream's
TARGET_WRITE = 0.90                  # mount write GB/s while replicating over without
_REPLICATED = re.compile(r"^replicated (\d+)/(\d+)$")


def grpc_options() -> list[tuple[str, Any]]:
    """The channel/server options of the Peer service (mtcfs.tiers.peer.service.serve)."""
    from mtcfs.tiers.peer.limits import MAX_MESSAGE_BYTES
    return [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


def make_chunks(seed: int, size: int, chunk: int = CHUNK) -> list[bytes]:
    """``size // chunk`` distinct, incompressible chunks (the same for the same seed)."""
    data = UniqueData(seed, size=max(chunk, 16 * MiB))
    return [bytes(data.next(chunk)) for _ in range(size // chunk)]


# ---------------------------------------------------------------------- server subprocesses

def _serve_stream(size: int) -> tuple[Any, int, Callable[[], dict]]:
    """The bare stream server: Put counts a client stream, Get streams held messages."""
    import grpc

    held = {m: make_chunks(9000 + m // MiB, size, m) for m in MSG_SIZES}
    counts = {"put_bytes": 0, "get_bytes": 0}

    def put(request_iterator, context):
        n = 0
        for msg in request_iterator:
            n += len(msg)
        counts["put_bytes"] += n
        return struct.pack("<Q", n)

    def get(request, context):
        msg_size, count = struct.unpack("<QQ", request)
        msgs = held[msg_size]
        for i in range(count):
            m = msgs[i % len(msgs)]
            counts["get_bytes"] += len(m)
            yield m

    handler = grpc.method_handlers_generic_handler(STREAM_SERVICE, {
        "Put": grpc.stream_unary_rpc_method_handler(put),   # no (de)serializers: raw bytes
        "Get": grpc.unary_stream_rpc_method_handler(get),
    })
    server = grpc.server(ThreadPoolExecutor(max_workers=SERVER_WORKERS),
                         options=grpc_options() + [("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, lambda: dict(counts)


class _LocalDict:
    """A node's own RAM tier as a dict (the LocalChunks protocol)."""

    def __init__(self, chunks: dict[str, bytes]) -> None:
        self.chunks = chunks

    def has_chunk(self, digest: str) -> bool:
        return digest in self.chunks

    def read_chunk(self, digest: str) -> bytes | None:
        return self.chunks.get(digest)


def _serve_peer(root: str, capacity: int, local_size: int,
                tls_dir: str | None = None) -> tuple[Any, int, Callable[[], dict]]:
    """serve() over a ReplicaStore at ``root``; with ``local_size``, a LocalChunks holding
    the data-parallel chunks (seed DP_SEED); with ``tls_dir``, mutual TLS as rank 1 with
    the job CA in that directory (``_tls_files``)."""
    from mtcfs.base.chunking import chunk_hash
    from mtcfs.tiers.peer.replica_store import ReplicaStore
    from mtcfs.tiers.peer.service import serve

    local = None
    if local_size:
        local = _LocalDict({chunk_hash(c): c for c in make_chunks(DP_SEED, local_size)})
    store = ReplicaStore(root, capacity, local=local)
    srv = serve(store, "127.0.0.1:0", JOB, nodes=2,
                tls=_tls_files(tls_dir, 1) if tls_dir else None)
    return srv.server, srv.port, lambda: {"service": srv.service.stats(),
                                          "store": store.stats()}


def _tls_files(directory: str, rank: int) -> Any:
    """Rank ``rank``'s TLS files of the job CA in ``directory`` (made by ``_make_ca``)."""
    from mtcfs.tiers.peer.tls import TlsFiles
    d = Path(directory)
    return TlsFiles(str(d / f"{JOB}-ca.pem"), str(d / f"rank-{rank}.pem"),
                    str(d / f"rank-{rank}.key"))


def _make_ca(directory: Path) -> None:
    from mtcfs.base.pki import JobCa
    ca = JobCa(directory, JOB)
    for r in (0, 1):
        ca.issue_rank(JOB, r)


def serve_main(a: argparse.Namespace) -> int:
    if a.serve == "stream":
        server, port, stats = _serve_stream(a.size)
    else:
        server, port, stats = _serve_peer(a.root, a.capacity, a.local_size, a.tls_dir)
    print(f"ready {port}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop(None)
    print(json.dumps(stats()), flush=True)
    return 0


class ServerProc:
    """A server subprocess (``--serve ...``); ``close()`` returns its counters."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_peer",
                                      "--serve", *args], cwd=str(REPO), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("ready "):
            self.kill()
            raise RuntimeError(f"server {args} did not start: {line!r}")
        self.address = f"127.0.0.1:{int(line.split()[1])}"

    def close(self) -> dict:
        try:
            assert self.proc.stdin and self.proc.stdout
            self.proc.stdin.close()
            out = self.proc.stdout.read()
            self.proc.wait(30)
            lines = out.strip().splitlines()
            return json.loads(lines[-1]) if lines else {}
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# ---------------------------------------------------------------------- parts a and b

def stream_put(channel: Any, msgs: list[bytes]) -> float:
    call = channel.stream_unary(PUT_METHOD)
    total = sum(map(len, msgs))
    t0 = time.perf_counter()
    reply = call(iter(msgs), timeout=600)
    t = time.perf_counter() - t0
    got = struct.unpack("<Q", reply)[0]
    if got != total:
        raise RuntimeError(f"bare stream: server counted {got} bytes, sent {total}")
    return t


def stream_get(channel: Any, msg_size: int, size: int) -> float:
    call = channel.unary_stream(GET_METHOD)
    count = size // msg_size
    n = 0
    t0 = time.perf_counter()
    for msg in call(struct.pack("<QQ", msg_size, count), timeout=600):
        n += len(msg)
    t = time.perf_counter() - t0
    if n != count * msg_size:
        raise RuntimeError(f"bare stream: received {n} bytes of {count * msg_size}")
    return t


def run_streams(parts: list[str], size: int, reps: int, touch: bool) -> list[BenchResult]:
    """Parts ``baseline`` and ``client``; measurements rotate within each repeat."""
    import grpc

    from mtcfs.base.chunking import chunk_hash
    from mtcfs.tiers.peer.client import PeerClient

    size = max(size // (16 * MiB), 1) * 16 * MiB  # whole 4 and 16 MiB messages
    runs: dict[str, list] = {}

    def rec(key: str, v: Any) -> None:
        runs.setdefault(key, []).append(v)

    def touch_ram() -> None:
        if touch:
            prefault(2 * size + GiB)

    servers: dict[str, ServerProc] = {}
    server_stats: dict[str, dict] = {}
    with scratch_dir(SCRATCH_SHM, "peer") as shm:
        try:
            jobs: list[tuple[str, Callable[[int], None]]] = []
            if "baseline" in parts:
                log("starting the bare stream server")
                s_stream = ServerProc("stream", "--size", str(size))
                servers["stream"] = s_stream
                channel = grpc.insecure_channel(s_stream.address, options=grpc_options())
                grpc.channel_ready_future(channel).result(timeout=30)

                def bare(rep: int, msg_size: int) -> None:
                    msgs = make_chunks(100 * rep + msg_size // MiB, size, msg_size)
                    touch_ram()
                    rec(f"stream-put-{msg_size // MiB}M", gbps(size, stream_put(channel, msgs)))
                    del msgs
                    touch_ram()
                    rec(f"stream-get-{msg_size // MiB}M",
                        gbps(size, stream_get(channel, msg_size, size)))

                for ms in MSG_SIZES:
                    jobs.append((f"stream-{ms // MiB}M", lambda rep, ms=ms: bare(rep, ms)))
            if "client" in parts:
                log("starting the Peer servers")
                s_peer = ServerProc("peer", "--root", str(shm / "replica"), "--capacity",
                                    str((reps + 2) * size))
                servers["peer"] = s_peer
                s_dp = ServerProc("peer", "--root", str(shm / "replica-dp"), "--capacity",
                                  str(GiB), "--local-size", str(size))
                servers["dp"] = s_dp
                _make_ca(shm / "pki")
                s_tls = ServerProc("peer", "--root", str(shm / "replica-tls"), "--capacity",
                                   str((reps + 2) * size), "--tls-dir", str(shm / "pki"))
                servers["tls"] = s_tls
                client = PeerClient(s_peer.address, JOB, rank=0)
                client_dp = PeerClient(s_dp.address, JOB, rank=0)
                client_tls = PeerClient(s_tls.address, JOB, rank=0,
                                        tls=_tls_files(str(shm / "pki"), 0))
                client.list_manifests(of_rank=0)  # connect before timing
                client_dp.list_manifests(of_rank=0)
                client_tls.list_manifests(of_rank=0)
                dp_chunks = make_chunks(DP_SEED, size)
                dp_items = [(chunk_hash(c), c) for c in dp_chunks]

                def peer(rep: int, client: Any = client, key: str = "client") -> None:
                    chunks = make_chunks(5000 + rep, size)  # fresh every repeat
                    items = [(chunk_hash(c), c) for c in chunks]
                    touch_ram()
                    t0 = time.perf_counter()
                    r = client.put_chunks(items)
                    t_put = time.perf_counter() - t0
                    if r.rejected or len(r.accepted) != len(items) or r.bytes_sent != size:
                        raise RuntimeError(f"put_chunks: {len(r.accepted)} accepted, "
                                           f"{len(r.rejected)} rejected, {r.bytes_sent} bytes "
                                           f"sent of {size}: {list(r.rejected.items())[:3]}")
                    del chunks
                    rec(f"{key}-put", gbps(size, t_put))
                    touch_ram()
                    n = 0
                    t0 = time.perf_counter()
                    for _h, data in client.get_chunks([h for h, _ in items]):
                        n += len(data)
                    t_get = time.perf_counter() - t0
                    if n != size:
                        raise RuntimeError(f"get_chunks returned {n} bytes of {size}")
                    rec(f"{key}-get", gbps(size, t_get))

                def dp(rep: int) -> None:
                    t0 = time.perf_counter()
                    r = client_dp.put_chunks(dp_items)
                    t = time.perf_counter() - t0
                    rec("dp-put-seconds", t)
                    rec("dp-bytes-sent", r.bytes_sent)
                    rec("dp-chunks-skipped", len(r.skipped))

                jobs += [("client", peer), ("client-dp", dp),
                         ("client-tls", lambda rep: peer(rep, client_tls, "tls"))]
            for rep in range(reps):
                k = rep % len(jobs)
                for name, fn in jobs[k:] + jobs[:k]:
                    fn(rep)
                    time.sleep(0.3)
                log(f"peer rep {rep + 1}/{reps}: " + ", ".join(
                    f"{key} {fmt(v[-1]) if isinstance(v[-1], float) else v[-1]}"
                    for key, v in runs.items()))
            if "client" in parts:
                runs["client-stats"] = client.stats()
                runs["client-dp-stats"] = client_dp.stats()
                runs["client-tls-stats"] = client_tls.stats()
                client.close()
                client_dp.close()
                client_tls.close()
            if "baseline" in parts:
                channel.close()
        finally:
            for name, s in servers.items():
                try:
                    server_stats[name] = s.close()
                except Exception as exc:  # noqa: BLE001
                    server_stats[name] = {"error": str(exc)}
    return _stream_results(parts, size, reps, runs, server_stats)


def _stream_results(parts: list[str], size: int, reps: int, runs: dict[str, list],
                    server_stats: dict[str, dict]) -> list[BenchResult]:
    out = []
    if "baseline" in parts:
        res = BenchResult("baseline", f"5a. Bare grpcio stream on loopback: {human(size)}, "
                          f"raw bytes, 65 MiB message limit, median of {reps}",
                          ["direction", "message", "GB/s", "s per GiB"])
        for d, key in (("replicate (client->server)", "put"), ("restore (server->client)",
                                                               "get")):
            for ms in MSG_SIZES:
                xs = runs.get(f"stream-{key}-{ms // MiB}M", [])
                m = median(xs)
                res.rows.append([d, human(ms), fmt_noise(xs),
                                 fmt(GiB / 1e9 / m if m else None)])
        res.samples.update({"bytes": size, "reps": reps, "server": server_stats.get("stream"),
                            "runs": {k: v for k, v in runs.items() if k.startswith("stream")}})
        out.append(res)
    if "client" in parts:
        res = BenchResult("client", f"5b. PeerClient -> serve() + ReplicaStore on /dev/shm: "
                          f"{human(size)} of fresh 4 MiB chunks, median of {reps}",
                          ["operation", "GB/s", "bare stream GB/s", "ratio"])
        base_put = median(runs.get("stream-put-4M", []))
        base_get = median(runs.get("stream-get-4M", []))
        put, get = runs.get("client-put", []), runs.get("client-get", [])
        r_put = median(put) / base_put if median(put) and base_put else None
        r_get = median(get) / base_get if median(get) and base_get else None
        res.rows.append(["put_chunks (replicate)", fmt_noise(put), fmt(base_put), fmt(r_put)])
        res.rows.append(["get_chunks (restore)", fmt_noise(get), fmt(base_get), fmt(r_get)])
        tput, tget = runs.get("tls-put", []), runs.get("tls-get", [])
        res.rows.append(["put_chunks, mutual TLS", fmt_noise(tput), "-",
                         f"{fmt(median(tput) / median(put)) if median(tput) and median(put) else '-'}"
                         " of plaintext"])
        res.rows.append(["get_chunks, mutual TLS", fmt_noise(tget), "-",
                         f"{fmt(median(tget) / median(get)) if median(tget) and median(get) else '-'}"
                         " of plaintext"])
        dp_t = runs.get("dp-put-seconds", [])
        dp_sent = runs.get("dp-bytes-sent", [])
        dp_server = (server_stats.get("dp") or {}).get("service", {})
        res.rows.append([f"data-parallel put (all {size // CHUNK} held)",
                         f"{fmt(median(dp_t), 3)} s", "-",
                         f"{max(dp_sent) if dp_sent else '-'} B sent"])
        base_note = "" if base_put else " (no baseline in this run: --only baseline,client)"
        res.checks.append(Check("put_chunks GB/s >= 80% of the bare 4 MiB stream", r_put,
                                TARGET_CLIENT, detail=base_note))
        res.checks.append(Check("get_chunks GB/s >= 80% of the bare 4 MiB stream", r_get,
                                TARGET_CLIENT, detail=base_note))
        res.checks.append(Check(
            "data-parallel put: payload bytes sent", max(dp_sent) if dp_sent else None, 1,
            op="<", detail=f"server bytes_received {dp_server.get('bytes_received', '?')}, "
                           f"chunks skipped {dp_sent and runs['dp-chunks-skipped'][-1]}"))
        res.samples.update({"bytes": size, "reps": reps, "chunk": CHUNK,
                            "servers": {k: v for k, v in server_stats.items() if k != "stream"},
                            "runs": {k: v for k, v in runs.items()
                                     if not k.startswith("stream")}})
        res.notes.append("put: HasChunks, then PutChunks streams of <= 256 MiB; the server "
                         "hashes and writes each chunk to tmpfs. get: the server re-hashes "
                         "what it reads, the client hashes what it receives")
        out.append(res)
    return out


# ---------------------------------------------------------------------- part c: the daemons

def _replicated(path: Path, k: int = 1) -> bool:
    try:
        hit = _REPLICATED.match(mtcfs_state(path))
    except OSError:
        return False
    return bool(hit) and int(hit.group(1)) >= k


def _restored(m: Any, step: str) -> bool:
    try:
        r = m.status().get("restore") or {}
    except Exception:  # noqa: BLE001 (the control socket is not up yet)
        return False
    return r.get("step") == step and r.get("pending_chunks") == 0


def _commit(step_dir: Path) -> float:
    """Write ``commit_success.txt`` last (commits the step); returns the clock at its close."""
    fd = os.open(step_dir / "commit_success.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"Checkpoint commit was successful")
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter()


def _write_step(step_dir: Path, size: int, seed: int, commit: bool = True) -> float:
    """``size`` bytes into ``step_dir/data.bin``; returns the seconds of that write."""
    step_dir.mkdir()
    t = write_file(step_dir / "data.bin", size, UniqueData(seed))
    if commit:
        _commit(step_dir)
    return t


def _peer_cluster(root: Path, options: dict | None = None) -> Any:
    from tests.support.cluster import Cluster
    return Cluster(root, 2, job=JOB, options={"size": "12G", "replicas": 1, **(options or {})})


def mtcfs_replicate_restore(root: Path, size: int, seed: int, touch: bool) -> dict[str, Any]:
    """Close -> ``replicated 1/1`` of rank 0's step_1; then SIGKILL + wipe + restore."""
    c = _peer_cluster(root)
    try:
        c.start()
        _write_step(c.node(1).mnt / "step_1", MiB, seed + 1)  # the step is complete in the job
        d = c.node(0).mnt / "step_1"
        if touch:
            prefault(2 * size + GiB)
        t_write = _write_step(d, size, seed, commit=False)
        t_close = _commit(d)
        wait_until(lambda: _replicated(d), 900, f"{d} to be replicated 1/1", interval=0.005)
        t_rep = time.perf_counter() - t_close
        peers_after = c.status(0).get("peers")
        digest = os.getxattr(d / "data.bin", "user.mtcfs.blake3")
        c.wait_replicated(1, "step_1", timeout=300)
        c.kill9(0)
        c.wipe(0)
        if touch:
            prefault(2 * size + GiB)
        t0 = time.perf_counter()
        m = c.restart(0)
        t_mount = time.perf_counter() - t0
        wait_until(lambda: _restored(m, "step_1"), 900, "rank 0 to restore step_1 from rank 1",
                   interval=0.02)
        t_restore = time.perf_counter() - t0
        st = m.status()
        if os.getxattr(m.mnt / "step_1" / "data.bin", "user.mtcfs.blake3") != digest:
            raise RuntimeError("the restored step_1/data.bin has another blake3")
        if (st.get("restore") or {}).get("corrupt_chunks"):
            raise RuntimeError(f"restore reported corrupt chunks: {st['restore']}")
        return {"write": t_write, "close_to_replicated": t_rep, "mount": t_mount,
                "restore": t_restore, "peers_after_replication": peers_after,
                "restore_status": st.get("restore"), "peers_after_restore": st.get("peers")}
    except BaseException:
        dump_logs(c)
        raise
    finally:
        c.cleanup()


def _backed_up(path: Path) -> bool:
    try:
        return mtcfs_state(path) == "backed-up"
    except OSError:
        return False


def mtcfs_restore_backup(root: Path, target: Path, size: int, seed: int,
                         touch: bool) -> dict[str, Any]:
    """Both ranks back step_1 up to file://, both lose everything; rank 0 restores."""
    c = _peer_cluster(root, {"backup": f"file://{target}", "backup_interval": "1ckpt"})
    try:
        c.start()
        _write_step(c.node(1).mnt / "step_1", MiB, seed + 1)
        d = c.node(0).mnt / "step_1"
        _write_step(d, size, seed)
        digest = os.getxattr(d / "data.bin", "user.mtcfs.blake3")
        for r in (0, 1):
            sd = c.node(r).mnt / "step_1"
            wait_until(lambda sd=sd: _backed_up(sd), 900, f"rank {r} step_1 to be backed up",
                       interval=0.02)
        for r in (0, 1):
            c.kill9(r)
            c.wipe(r)
        if touch:
            prefault(2 * size + GiB)
        t0 = time.perf_counter()
        c.start()  # both at once, both empty: no peer holds step_1
        t_mount = time.perf_counter() - t0
        m = c.node(0)
        wait_until(lambda: _restored(m, "step_1"), 900, "rank 0 to restore step_1 from backup",
                   interval=0.02)
        t_restore = time.perf_counter() - t0
        st = m.status()
        if os.getxattr(m.mnt / "step_1" / "data.bin", "user.mtcfs.blake3") != digest:
            raise RuntimeError("the restored step_1/data.bin has another blake3")
        return {"mount": t_mount, "restore": t_restore, "restore_status": st.get("restore"),
                "peers": st.get("peers")}
    except BaseException:
        dump_logs(c)
        raise
    finally:
        c.cleanup()


def _write_during(mnt: Path, size: int, seed: int, touch: bool,
                  settled: Callable[[Path], bool]) -> dict[str, Any]:
    """step_1 written and settled; step_2 written and committed; step_3 written at once
    (timed) while step_2 is sealed and replicated in the background."""
    _write_step(mnt / "step_1", size, seed)
    wait_until(lambda: settled(mnt / "step_1"), 900, "step_1 to settle", interval=0.01)
    _write_step(mnt / "step_2", size, seed + 2, commit=False)
    if touch:
        prefault(2 * size + GiB)
    t_commit = _commit(mnt / "step_2")
    t_write = _write_step(mnt / "step_3", size, seed + 3, commit=False)
    t_end = time.perf_counter()
    t_settle = wait_until(lambda: settled(mnt / "step_2"), 900, "step_2 to settle",
                          interval=0.01)
    return {"write": t_write, "write_gbps": gbps(size, t_write),
            "commit_to_write_end": t_end - t_commit,
            "step_2_settled_after_write_end": t_settle}


def mtcfs_write_while_replicating(root: Path, size: int, seed: int, touch: bool,
                                  which: str) -> dict[str, Any]:
    if which == "plain":
        with mtcfs_mount(root, {"size": "12G"}, job=JOB) as m:
            return _write_during(m.mnt, size, seed, touch,
                                 lambda p: mtcfs_state(p) != "incomplete")
    c = _peer_cluster(root)
    try:
        c.start()
        return _write_during(c.node(0).mnt, size, seed, touch, _replicated)
    except BaseException:
        dump_logs(c)
        raise
    finally:
        c.cleanup()


def run_mtcfs(size: int, reps: int, touch: bool,
              baseline: BenchResult | None) -> BenchResult:
    res = BenchResult("mtcfs", f"5c. Two mtcfs daemons on loopback, replicas=1: "
                      f"{human(size)} step, median of {reps}",
                      ["measurement", "seconds", "GB/s", "bare stream GB/s", "ratio"])
    runs: dict[str, list] = {"replicate": [], "restore-peer": [], "restore-backup": [],
                             "write-peer": [], "write-plain": []}
    errors: dict[str, str] = {}
    with scratch_dir(SCRATCH_SHM, "peer-mtcfs") as shm, \
            scratch_dir(SCRATCH_DISK, "peer-mtcfs") as disk:
        for rep in range(reps):
            seed = 7000 + 10 * rep
            steps: list[tuple[str, Callable[[], Any]]] = [
                ("replicate", lambda rep=rep, seed=seed: mtcfs_replicate_restore(
                    shm / f"rr{rep}", size, seed, touch)),
                ("restore-backup", lambda rep=rep, seed=seed: mtcfs_restore_backup(
                    shm / f"bk{rep}", disk / f"backup{rep}", size, seed, touch)),
                ("write-peer", lambda rep=rep, seed=seed: mtcfs_write_while_replicating(
                    shm / f"wp{rep}", size, seed, touch, "peer")),
                ("write-plain", lambda rep=rep, seed=seed: mtcfs_write_while_replicating(
                    shm / f"wn{rep}", size, seed, touch, "plain")),
            ]
            if rep % 2:
                steps[2], steps[3] = steps[3], steps[2]
            for name, fn in steps:
                if name in errors:
                    continue
                try:
                    runs[name].append(fn())
                except Exception as exc:  # noqa: BLE001 (report; the other measurements go on)
                    traceback.print_exc()
                    errors[name] = f"{type(exc).__name__}: {str(exc)[:2000]}"
                # Free this measurement's stores now: three repeats of every part at once
                # do not fit in RAM at --size 1G (the kernel's OOM killer ended such a run).
                # (Each part unmounts its nodes before it returns.)
                for d in (shm / f"rr{rep}", shm / f"bk{rep}", disk / f"backup{rep}",
                          shm / f"wp{rep}", shm / f"wn{rep}"):
                    shutil.rmtree(d, ignore_errors=True)
                time.sleep(0.5)
            log(f"mtcfs rep {rep + 1}/{reps}: errors {sorted(errors) or '-'}")
    base = baseline.samples.get("runs", {}) if baseline else {}
    b_put, b_get = median(base.get("stream-put-4M", [])), median(base.get("stream-get-4M", []))

    def row(label: str, xs: list[float], b: float | None) -> None:
        m = median(xs)
        g = gbps(size, m) if m else None
        res.rows.append([label, fmt_noise(xs), fmt(g), fmt(b), fmt(g / b if g and b else None)])

    row("close -> replicated 1/1", [r["close_to_replicated"] for r in runs["replicate"]], b_put)
    row("kill -9 + wipe -> restored from peer", [r["restore"] for r in runs["replicate"]],
        b_get)
    row("kill -9 + wipe -> restored from file://",
        [r["restore"] for r in runs["restore-backup"]], None)
    wp = [r["write_gbps"] for r in runs["write-peer"]]
    wn = [r["write_gbps"] for r in runs["write-plain"]]
    res.rows.append(["write step_3 while step_2 replicates", "-", fmt_noise(wp), "-", "-"])
    res.rows.append(["write step_3, plain one-node mount", "-", fmt_noise(wn), "-", "-"])
    ratio = median(wp) / median(wn) if median(wp) and median(wn) else None
    res.checks.append(Check("write while replicating >= 90% of without", ratio, TARGET_WRITE,
                            detail="step_2 settled "
                            + ", ".join(f"{r['step_2_settled_after_write_end']:.2f}"
                                        for r in runs["write-peer"])
                            + " s after the write ended (0: replication ended first)"))
    res.samples.update({"bytes": size, "reps": reps, "runs": runs, "errors": errors})
    mounts = [r["mount"] for r in runs["replicate"]]
    res.notes.append("restore times run from the start of the mount command until status "
                     "shows restore.step == step_1 and pending_chunks == 0; the mount "
                     f"command itself took {fmt(median(mounts))} s of it (peer case)")
    for label, key in (("from peer", "replicate"), ("from file://", "restore-backup")):
        for r in runs[key][:1]:
            rs = r.get("restore_status") or {}
            res.notes.append(f"restore {label} (rep 1): manifest from "
                             f"{rs.get('manifest_from', '?')}, chunks from "
                             f"{rs.get('chunks_from', '?')}, namespace after "
                             f"{rs.get('namespace_seconds', '?')} s")
    res.notes.append("both daemons share this machine's cores: the receiving peer's hashing "
                     "and writing compete with the writer, which a real cluster does not")
    if not b_put:
        res.notes.append("no bare-stream baseline in this run: add --only baseline")
    for name, err in errors.items():
        res.notes.append(f"{name} FAILED: {err.splitlines()[0][:300]}")
    if errors and not any(runs.values()):
        raise RuntimeError("; ".join(f"{k}: {v.splitlines()[0][:300]}"
                                     for k, v in errors.items()))
    return res


# ---------------------------------------------------------------------- command

def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMGT]?)(i?B)?", text.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 256M or 1G, got {text!r}")
    return int(m.group(1)) * {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": 1 << 40}[
        m.group(2).upper()]


def parse_parts(text: str) -> list[str]:
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"--only takes {','.join(PARTS)}, got {text!r}")
    return parts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_peer",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=GiB,
                   help="bytes per measurement (default 1G; 256M for a quick run)")
    p.add_argument("--reps", type=int, default=3, help="repeats per measurement (median)")
    p.add_argument("--only", type=parse_parts, default=list(PARTS),
                   help=f"comma-separated parts: {','.join(PARTS)} (default all)")
    p.add_argument("--no-prefault", action="store_true",
                   help="do not pre-touch RAM before timed writes (see common.prefault)")
    p.add_argument("--out", default=str(REPO / "bench-results"), help="JSON output directory")
    p.add_argument("--serve", choices=("stream", "peer"), help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--capacity", type=int, default=64 * GiB, help=argparse.SUPPRESS)
    p.add_argument("--local-size", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--tls-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve:
        return serve_main(a)

    from benchmarks.run import render

    parts = [x for x in PARTS if x in a.only]
    touch = not a.no_prefault
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = Path(a.out) / f"peer-{stamp}.json"
    info = machine_info()
    print(f"mtcfs peer benchmarks: {','.join(parts)}, {human(a.size)}, {a.reps} repeats, "
          f"{info.get('nproc')} CPUs ({info.get('cpu_model', '?')}), "
          f"{info.get('mem_total_gib')} GiB RAM, "
          f"load {', '.join(f'{x:.2f}' for x in info['loadavg'])}, git {info['git']['head']}",
          flush=True)
    doc: dict[str, Any] = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.bench_peer"]
                            + (argv if argv is not None else sys.argv[1:])),
        "size": a.size, "reps": a.reps, "parts": parts, "prefault": touch, "machine": info,
        "results": {}, "errors": {}}
    t_all = time.perf_counter()
    baseline: BenchResult | None = None

    def report(res: BenchResult, t0: float) -> None:
        res.seconds = time.perf_counter() - t0
        doc["results"][res.key] = res.to_json()
        print(render(res), flush=True)
        write_json(out_path, doc)  # partial results survive a later crash

    stream_parts = [x for x in parts if x in ("baseline", "client")]
    if stream_parts:
        print(f"\n>>> {','.join(stream_parts)} ({human(a.size)})", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            for res in run_streams(stream_parts, a.size, a.reps, touch):
                if res.key == "baseline":
                    baseline = res
                report(res, t0)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            for x in stream_parts:
                doc["errors"][x] = f"{type(exc).__name__}: {exc}"
            print(f"\n{','.join(stream_parts)}: FAILED: {exc}", flush=True)
    if "mtcfs" in parts:
        print(f"\n>>> mtcfs ({human(a.size)})", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            res = run_mtcfs(a.size, a.reps, touch, baseline)
            if res.samples.get("errors"):
                doc["errors"]["mtcfs"] = res.samples["errors"]
            report(res, t0)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            doc["errors"]["mtcfs"] = f"{type(exc).__name__}: {exc}"
            print(f"\nmtcfs: FAILED: {str(exc)[:1000]}", flush=True)
    doc["seconds"] = round(time.perf_counter() - t_all, 1)
    doc["machine"]["loadavg_end"] = os.getloadavg()
    doc["machine"]["git_end"] = git_state()
    checks = [c for r in doc["results"].values() for c in r["checks"]]
    n_pass = sum(1 for c in checks if c["pass"] is True)
    n_miss = sum(1 for c in checks if c["pass"] is False)
    doc["summary"] = {"pass": n_pass, "miss": n_miss, "errors": list(doc["errors"])}
    write_json(out_path, doc)
    print(f"\n{n_pass} PASS, {n_miss} MISS"
          + (f", {len(doc['errors'])} part(s) FAILED" if doc["errors"] else "")
          + f" in {doc['seconds']:.0f}s; results in {out_path}", flush=True)
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
