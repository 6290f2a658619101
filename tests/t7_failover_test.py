"""Fault-in fails over through every source, in order, and ends in bounded time.

The order a chunk is asked of (docs/reliability.md): the local store, the local replica
store, the writer, the writer's replicas, every other member, the backup tier. Each test
leaves one source alone holding a valid copy of a file's chunks, with every source before
it dead (SIGKILL), hung (SIGSTOP) or corrupt (bytes flipped in its store), and reads the
file bit-exact through another node's mount within the bound; the last one leaves no valid
copy anywhere and expects EIO within the bound, named in ``mtcfs status``.

4 real daemons in scope=job (the namespace ordered by the tests' etcd, so it serves with
two nodes out), ring placement with one replica: rank r's files are replicated to rank r+1.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

import pytest

from mtcfs.base.chunking import chunk_hash
from mtcfs.core.faultin import FETCH_DEADLINE_S, REFETCH_AFTER_S
from mtcfs.base.mountinfo import force_unmount
from mtcfs.tiers.peer.sources import ATTEMPT_S

CS = 1024 * 1024
SIZE = 2 * CS + 12345  # 3 chunks
JOB = {"scope": "job", "replicas": 1, "chunk_size": "1M"}
WRITER, REPLICA = 2, 3  # ring placement: rank 2's replica is on rank 3
#: What a read may take here: the fault-in deadline, plus slack for a loaded machine.
BOUND_S = FETCH_DEADLINE_S + 15


def _digests(data: bytes) -> list[str]:
    return [chunk_hash(data[i:i + CS]) for i in range(0, len(data), CS)]


def _timed_read(mount, rel: str) -> tuple[bytes | OSError, float]:
    """Read ``rel`` through ``mount`` in a thread; never waits past BOUND_S (the FUSE
    connection is aborted then, so the thread returns, and the test fails)."""
    out: list = []

    def read() -> None:
        try:
            out.append(mount.path(rel).read_bytes())
        except OSError as exc:
            out.append(exc)

    t0 = time.monotonic()
    th = threading.Thread(target=read, daemon=True)
    th.start()
    th.join(BOUND_S)
    took = time.monotonic() - t0
    if th.is_alive():
        log = mount.log()[-3000:]
        force_unmount(mount.mnt)
        th.join(10)
        pytest.fail(f"a read of {rel} did not return within {BOUND_S:.0f} s\n{log}")
    return out[0], took


def _corrupt_data_files(mount, data: bytes) -> int:
    """Flip a byte in every chunk of ``data`` held in ``mount``'s RAM store (data files)
    and replica store. Returns how many copies were spoiled."""
    spoiled = 0
    digests = set(_digests(data))
    for f in (mount.store / "data").iterdir():
        blob = f.read_bytes()
        if blob == data:
            with open(f, "r+b") as fh:
                for off in range(0, len(data), CS):
                    fh.seek(off + 7)
                    fh.write(bytes([blob[off + 7] ^ 0xFF]))
                    spoiled += 1
    chunks = mount.store / "replicas" / "chunks"
    if chunks.is_dir():
        for f in chunks.rglob("*"):
            if f.is_file() and f.name in digests:
                blob = f.read_bytes()
                f.write_bytes(bytes([blob[0] ^ 0xFF]) + blob[1:])
                spoiled += 1
    return spoiled


def _cluster_with_step(make_cluster, options: dict | None = None):
    """4 nodes; rank 2 writes step_5/__2_0.distcp, step_5 is committed and replicated."""
    c = make_cluster(4, options={**JOB, **(options or {})})
    c.node(0).path("step_5").mkdir()
    data = os.urandom(SIZE)
    c.node(WRITER).path("step_5", "__2_0.distcp").write_bytes(data)
    c.node(0).path("step_5", ".metadata").write_bytes(b"meta")  # commits step_5
    if "backup" in (options or {}):  # the state says backed-up once both are done
        c.node(WRITER).wait_state("step_5/__2_0.distcp", "backed-up", timeout=60)
        c.node(REPLICA).wait_for(lambda: _replica_copies(c.node(REPLICA), data) == 3, 60,
                                 "the replica's chunks")
    else:
        c.wait_replicated(WRITER, "step_5")
    return c, data


def _replica_copies(mount, data: bytes) -> int:
    chunks = mount.store / "replicas" / "chunks"
    digests = set(_digests(data))
    return sum(1 for f in chunks.rglob("*") if f.name in digests) if chunks.is_dir() else 0


def _stop(c, rank: int) -> int:
    pid = c.node(rank).pid
    os.kill(pid, signal.SIGSTOP)
    return pid


def _assert_read(c, reader: int, data: bytes, bound: float = BOUND_S) -> float:
    got, took = _timed_read(c.node(reader), "step_5/__2_0.distcp")
    assert not isinstance(got, OSError), f"{got}\n{c.node(reader).log()[-3000:]}"
    assert got == data
    assert took < bound
    return took


def test_the_local_store_alone(make_cluster):
    """The reader read the file before (its store holds the chunks); the writer and its
    replica are dead: the read is served locally. (Rank 0 leads the namespace: the reader
    needs its lease to open a file.)"""
    c, data = _cluster_with_step(make_cluster)
    _assert_read(c, 1, data)
    c.kill9(WRITER)
    c.kill9(REPLICA)
    _assert_read(c, 1, data, bound=5)


def test_the_local_replica_store_alone(make_cluster):
    """The reader holds the writer's replica; the writer is dead: no peer is asked."""
    c, data = _cluster_with_step(make_cluster)
    c.kill9(WRITER)
    pid1 = _stop(c, 1)
    try:
        _assert_read(c, REPLICA, data, bound=5)
    finally:
        os.kill(pid1, signal.SIGCONT)


def test_the_writer_alone(make_cluster):
    """The writer's replica is corrupt and its own copy gone: the writer serves."""
    c, data = _cluster_with_step(make_cluster)
    assert _corrupt_data_files(c.node(REPLICA), data) == 3
    _assert_read(c, 0, data)
    st = c.status(0)
    assert st["reads"]["failed"] == 0


def test_the_writers_replica_alone_when_the_writer_hangs(make_cluster):
    """The writer is SIGSTOPped (a hung node: no refusal, no answer): after one attempt of
    at most ATTEMPT_S the reader asks the writer's replica, and asks the hung writer last
    for every chunk after."""
    c, data = _cluster_with_step(make_cluster)
    pid = _stop(c, WRITER)
    try:
        took = _assert_read(c, 0, data, bound=ATTEMPT_S + 15)
        st = c.status(0)
        assert WRITER in st["reads"]["suspect_peers"] or took < ATTEMPT_S
    finally:
        os.kill(pid, signal.SIGCONT)


def test_the_daemon_serves_other_requests_while_a_read_waits(make_cluster):
    """The writer and its replica both hang: a read of the writer's file waits on them. The
    reading node meanwhile answers lookups, listings and reads of other files and mtcfs
    status at once (a namespace change would wait for the hung members, as scope=job orders
    it: docs/consistency.md); when the two come back (SIGCONT) the waiting read gets its
    bytes (its passes over the sources repeat until read_timeout)."""
    c, data = _cluster_with_step(make_cluster)
    mine = os.urandom(100_000)
    c.node(0).path("step_5", "own").write_bytes(mine)
    pids = [_stop(c, WRITER), _stop(c, REPLICA)]
    out: list = []
    try:
        reader = threading.Thread(target=lambda: out.append(
            _timed_read(c.node(0), "step_5/__2_0.distcp")), daemon=True)
        reader.start()
        time.sleep(1.0)
        assert not out, "the read should be waiting on the hung nodes"
        for what, call in [
                ("listdir", lambda: sorted(os.listdir(c.node(0).path("step_5")))),
                ("read", lambda: c.node(0).path("step_5", "own").read_bytes() == mine),
                ("status", lambda: c.status(0)["reads"])]:
            t0 = time.monotonic()
            assert call() is not None
            assert time.monotonic() - t0 < 3, f"{what} waited behind the read"
        assert not out
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    reader.join(BOUND_S + 15)
    assert out and out[0][0] == data, out[0][0] if out else "no answer"


def test_another_member_alone(make_cluster):
    """Rank 1 read the file (its RAM store holds it); the writer is dead and its replica
    corrupt: the reader on rank 0 gets the chunks from rank 1, a member that neither wrote
    nor replicates the file."""
    c, data = _cluster_with_step(make_cluster)
    _assert_read(c, 1, data)
    c.kill9(WRITER)
    assert _corrupt_data_files(c.node(REPLICA), data) == 3
    _assert_read(c, 0, data)


def test_the_backup_tier_alone(make_cluster, tmp_path):
    """Every peer copy is dead, hung or corrupt; the step was backed up: the backup serves."""
    c, data = _cluster_with_step(
        make_cluster, {"backup": f"file://{tmp_path / 'bucket'}", "backup_interval": "1ckpt"})
    c.kill9(WRITER)
    assert _corrupt_data_files(c.node(REPLICA), data) == 3
    pid1 = _stop(c, 1)
    try:
        _assert_read(c, 0, data)
    finally:
        os.kill(pid1, signal.SIGCONT)
    st = c.status(0)
    assert st["restore"]["chunks_from"].get("backup", 0) >= 3


def test_no_source_at_all_is_eio_within_the_bound_and_named_in_status(make_cluster):
    """The writer is dead, its replica corrupt, another member hung, no backup: EIO within
    the bound (not a hang; ``read_timeout=12s`` here, past one whole pass over the sources
    with the hung member's 10 s attempt in it: as the dead and the hung node may come back,
    passes repeat until then), the status names the file and the sources tried, and a later
    read asks again (and fails again: nothing came back)."""
    c, data = _cluster_with_step(make_cluster, {"read_timeout": "12s"})
    c.kill9(WRITER)
    assert _corrupt_data_files(c.node(REPLICA), data) == 3
    pid1 = _stop(c, 1)
    try:
        got, took = _timed_read(c.node(0), "step_5/__2_0.distcp")
        assert isinstance(got, OSError) and got.errno == errno.EIO, got
        assert took < 12 + 15
        reads = c.status(0)["reads"]
        assert reads["failed"] >= 1
        last = reads["last_failure"]
        assert "step_5/__2_0.distcp" in last
        assert f"rank {WRITER}" in last and f"rank {REPLICA}" in last and "rank 1" in last
        out = c.node(0).cli("status", str(c.node(0).mnt)).stdout
        assert "chunk fetches failed with EIO" in out and "step_5/__2_0.distcp" in out
        assert "step_5/__2_0.distcp" in c.node(0).log()
        time.sleep(REFETCH_AFTER_S)  # a read right after fails at once with the same error
        got, took = _timed_read(c.node(0), "step_5/__2_0.distcp")
        assert isinstance(got, OSError) and got.errno == errno.EIO
        assert c.status(0)["reads"]["failed"] > reads["failed"]  # tried again
    finally:
        os.kill(pid1, signal.SIGCONT)


def test_scope_node_a_replacement_reads_past_a_hung_holder_from_the_backup_tier(
        make_cluster, tmp_path):
    """scope=node, 3 nodes, rank 1's data replicated to rank 2 and backed up. Rank 1 is
    replaced on an empty store while rank 2 hangs (SIGSTOP): the replacement's mount comes
    up, and its files read bit-exact from the backup tier within the bound (rank 2 is asked
    once per chunk at most, for at most ATTEMPT_S, then last)."""
    c = make_cluster(3, options={"replicas": 1, "chunk_size": "1M",
                                 "backup": f"file://{tmp_path / 'bucket'}",
                                 "backup_interval": "1ckpt"})
    data = os.urandom(SIZE)
    d = c.node(1).path("step_7")
    d.mkdir()
    (d / "w.bin").write_bytes(data)
    (d / "commit_success.txt").write_bytes(b"ok")  # commits step_7
    c.node(1).wait_state("step_7/w.bin", "backed-up", timeout=60)
    c.node(2).wait_for(lambda: _replica_copies(c.node(2), data) == 3, 60, "the replica")
    c.kill9(1)
    c.wipe(1)
    pid2 = _stop(c, 2)
    try:
        t0 = time.monotonic()
        c.restart(1, timeout=180)
        got, took = _timed_read(c.node(1), "step_7/w.bin")
        assert got == data, got
        assert took < BOUND_S, took
        st = c.status(1)
        assert st["restore"]["chunks_from"]["backup"] >= 1, st["restore"]
        print(f"replacement up in {time.monotonic() - t0 - took:.1f} s, read {took:.1f} s")
    finally:
        os.kill(pid2, signal.SIGCONT)
