"""Tier-1 tests of the backup tier's sweep gate on a real etcd (mtcfs/tiers/coord/rwlock.py,
mtcfs/tiers/coord/backup_gate.py, mtcfs/tiers/backup/gate.py).

The readers-writer lock: shared holders share, a writer waits for them and readers that come
after it wait behind it, a killed or revoked holder frees the lock within its TTL, and a
wait past its deadline ends in one line naming the holder. The gate in the backup tier: each
hazard the old sweep journal handled is shown to lose a chunk with a gate that coordinates
nothing (``NoGate``: uploads and sweeps of two nodes without agreement) and not to with the
etcd gate; uploads and sweeps interleaved in threads, repeated; a sweeper whose lease ends
stops deleting; an upload that cannot get the gate fails with one line, and a sweep is
skipped.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from mtcfs.base.chunking import chunk_hash
from mtcfs.tiers.backup import BackupStore, FileBackend, NotFound
from mtcfs.tiers.backup.errors import GateError, GateTimeout
from mtcfs.tiers.backup.layout import chunk_key, complete_key, manifest_key
from mtcfs.tiers.coord.backup_gate import EtcdSweepGate
from mtcfs.tiers.coord.etcd import Etcd, put_op
from mtcfs.tiers.coord.rwlock import EtcdRWLock, RWLockLost, RWLockTimeout
from support.cluster import free_ports
from support.etcd import etcd_client, etcd_prefix, etcd_server  # noqa: F401 (fixtures)
from t1_backup_ranks_test import (  # noqa: F401 (gates: a fixture)
    CHUNK, NOW, Counting, blob, chunk_keys, gates, make_step, restore_files,
)

TTL = 2


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---------------------------------------------------------------------- the RW lock

def test_readers_share_and_a_writer_waits_for_them(client, etcd_prefix):  # noqa: F811
    lock = EtcdRWLock(client, etcd_prefix + "rw/", owner="node-a", ttl_s=TTL)
    other = EtcdRWLock(client, etcd_prefix + "rw/", owner="node-b", ttl_s=TTL)
    r1 = lock.acquire("shared", timeout=2)
    r2 = other.acquire("shared", timeout=2)  # readers share
    with pytest.raises(RWLockTimeout) as ei:
        other.acquire("exclusive", timeout=0.4)
    msg = str(ei.value)
    assert "\n" not in msg and "not granted within 0.4 s" in msg and "node-a" in msg
    assert [m for m, _ in lock.holders()] == ["shared", "shared"]  # the failed key is gone
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(other.acquire("exclusive", timeout=10)))
    t.start()
    r1.release()
    t.join(0.5)
    assert t.is_alive()  # still one reader
    r2.release()
    t.join(5)
    w = got[0]
    assert w.held  # type: ignore[attr-defined]
    with pytest.raises(RWLockTimeout, match="exclusive by node-b"):
        lock.acquire("shared", timeout=0.3)
    w.release()  # type: ignore[attr-defined]
    assert lock.holders() == []


def test_readers_after_a_waiting_writer_wait_behind_it(client, etcd_prefix):  # noqa: F811
    """Arrival order: a writer waiting for a reader is not starved by readers after it."""
    a, b, c = (EtcdRWLock(client, etcd_prefix + "rw/", owner=n, ttl_s=TTL) for n in "abc")
    ra = a.acquire("shared", timeout=2)
    order: list[str] = []
    holds = []

    def take(lock: EtcdRWLock, mode: str, name: str) -> None:
        h = lock.acquire(mode, timeout=10)
        order.append(name)
        holds.append(h)
        time.sleep(0.2)
        h.release()

    tw = threading.Thread(target=take, args=(b, "exclusive", "writer"))
    tw.start()
    assert wait_until(lambda: len(a.holders()) == 2)
    tr = threading.Thread(target=take, args=(c, "shared", "late reader"))
    tr.start()
    assert wait_until(lambda: len(a.holders()) == 3)
    time.sleep(0.3)
    assert order == []  # the late reader waits behind the writer, which waits for `a`
    ra.release()
    tw.join(10)
    tr.join(10)
    assert order == ["writer", "late reader"]


def test_a_killed_holder_frees_the_lock_within_its_ttl(client, etcd_prefix):  # noqa: F811
    a = EtcdRWLock(client, etcd_prefix + "rw/", owner="a", ttl_s=TTL)
    b = EtcdRWLock(client, etcd_prefix + "rw/", owner="b", ttl_s=TTL)
    h = a.acquire("exclusive", timeout=2)
    h._stop.set()  # as a killed holder: renewals stop, nothing revoked
    h._thread.join(5)
    t0 = time.monotonic()
    hb = b.acquire("exclusive", timeout=3 * TTL)
    assert TTL - 1 <= time.monotonic() - t0 <= TTL + 1.5
    with pytest.raises(RWLockLost):
        h.check()  # the dead holder's own view: its lease is not certainly alive any more
    hb.release()


def test_a_revoked_hold_is_lost_and_its_fence_fails(client, etcd_prefix):  # noqa: F811
    a = EtcdRWLock(client, etcd_prefix + "rw/", owner="a", ttl_s=TTL)
    b = EtcdRWLock(client, etcd_prefix + "rw/", owner="b", ttl_s=TTL)
    h = a.acquire("exclusive", timeout=2)
    h.check(margin_s=TTL / 3)
    k = (etcd_prefix + "fenced").encode()
    assert client.txn([h.fence()], [put_op(k, b"1")]).succeeded
    client.revoke(h.lease)  # the lease ends under the holder (as after a long pause)
    assert wait_until(lambda: not h.held, 2 * TTL)  # its next renewal told it
    with pytest.raises(RWLockLost, match="lost"):
        h.check()
    assert not client.txn([h.fence()], [put_op(k, b"2")]).succeeded
    hb = b.acquire("exclusive", timeout=1)  # free at once: the key went with the lease
    h.release()  # harmless: does not touch b's key
    assert [o for _, o in b.holders()] == ["b"]
    hb.release()


# ---------------------------------------------------------------------- the gate, in use

class NoGate:
    """A gate that coordinates nothing: two nodes' uploads and sweeps as if each had only
    its own process-local lock (what the hazards look like without agreement)."""

    class _Hold:
        def check(self) -> None:
            pass

    @contextmanager
    def _cm(self) -> Iterator["NoGate._Hold"]:
        yield NoGate._Hold()

    def shared(self):
        return self._cm()

    def exclusive(self):
        return self._cm()

    def generation(self) -> int:
        return 0

    def bump(self, hold) -> tuple[int, int]:
        return 0, 0

    def describe(self) -> str:
        return "no gate"


def _x_held_by_rank_1(be, gate):
    """Stores of rank 0 (the sweeper) and rank 1 (the uploader) on ``be``, each with
    ``gate(rank)``: step 10 complete on both (rank 1's holds chunk X, referenced nowhere
    else), then step 20 (X in neither). Returns (sweeper, uploader, chunks, X)."""
    sweeper, uploader = (BackupStore(be, rank=r, clock_ns=lambda: NOW, gate=gate(r))
                         for r in (0, 1))
    chunks: dict[str, bytes] = {}
    x = blob(7, CHUNK)
    sweeper.put_step(make_step(10, {"a": blob(8, CHUNK)}, rank=0, chunks=chunks),
                     chunks.__getitem__)
    uploader.put_step(make_step(10, {"x": x}, rank=1, chunks=chunks), chunks.__getitem__)
    for r, st in ((0, sweeper), (1, uploader)):
        st.put_step(make_step(20, {"b": blob(20 + r, CHUNK)}, rank=r, chunks=chunks),
                    chunks.__getitem__)
    return sweeper, uploader, chunks, x


@pytest.fixture(params=["no gate", "etcd gate"])
def two_nodes(request, tmp_path, etcd_server, etcd_prefix):  # noqa: F811
    """Rank 0 (the sweeper) and rank 1 (the uploader) on one bucket: step 10 (rank 1's
    holds chunk X, referenced nowhere else) and step 20 (X in neither) complete on both.
    Rank 1 has loaded its index (X is in it), as a long-running daemon's would be."""
    be = Counting(FileBackend(tmp_path))
    clients: list[Etcd] = []

    def gate(rank: int):
        if request.param == "no gate":
            return NoGate()
        clients.append(Etcd(etcd_server.endpoints, timeout_s=5.0))
        return EtcdSweepGate(clients[-1], etcd_prefix + "backup/", owner=f"rank {rank}",
                             ttl_s=5)

    sweeper, uploader, chunks, x = _x_held_by_rank_1(be, gate)
    assert uploader.has_chunk(chunk_hash(x))
    yield request.param == "etcd gate", be, sweeper, uploader, chunks, x
    for c in clients:
        c.close()


def test_stale_index(two_nodes) -> None:
    """Hazard 1: rank 0's sweep deleted X, which rank 1's index believes stored (it uploaded
    X itself). Rank 1's next step with X must upload X again."""
    gated, be, sweeper, uploader, chunks, x = two_nodes
    stats = sweeper.retain(keep=1, grace_s=0)  # retires step 10: X is garbage
    assert stats.swept and stats.chunks_deleted == 2
    assert not be.exists(chunk_key(chunk_hash(x)))
    m30 = make_step(30, {"x": x, "c": blob(30, CHUNK)}, rank=1, chunks=chunks)
    up = uploader.put_step(m30, chunks.__getitem__)
    assert be.exists(complete_key("step_30", 1))
    if not gated:  # the hazard is real: a complete step that cannot be restored
        assert up.chunks_uploaded == 1 and up.chunks_resent == 0
        with pytest.raises(NotFound):
            restore_files(BackupStore(be, rank=1), "step_30")
        return
    assert up.chunks_uploaded == 2 and up.chunks_resent == 1
    assert uploader.stats()["index_reloads"] == 1
    assert sweeper.stats()["index_reloads"] == 0  # its own sweep: its index stayed true
    assert restore_files(BackupStore(be, rank=1), "step_30") == {"x": x,
                                                                  "c": blob(30, CHUNK)}


def test_sweep_in_flight(two_nodes) -> None:
    """Hazard 2, at its worst point: rank 0's sweep has read the manifests and listed the
    chunks, and is about to delete X, when rank 1 starts a step with X. Without the gate
    rank 1 skips X and marks the step complete, then X goes; with it, rank 1 waits for the
    sweep, lists chunks again and uploads X."""
    gated, be, sweeper, uploader, chunks, x = two_nodes
    be.hold_chunk_deletes = threading.Event()
    out: list[object] = []
    t_sweep = threading.Thread(target=lambda: out.append(sweeper.retain(1, grace_s=0)))
    t_sweep.start()
    assert be.deleting.wait(10)
    m30 = make_step(30, {"x": x, "c": blob(30, CHUNK)}, rank=1, chunks=chunks)
    up: list[object] = []
    t_up = threading.Thread(target=lambda: up.append(uploader.put_step(m30,
                                                                       chunks.__getitem__)))
    t_up.start()
    t_up.join(10 if not gated else 0.6)
    assert t_up.is_alive() == gated
    be.hold_chunk_deletes.set()
    t_sweep.join(20)
    t_up.join(20)
    assert out[0].chunks_deleted == 2  # type: ignore[union-attr]
    assert be.exists(complete_key("step_30", 1))
    if not gated:
        with pytest.raises(NotFound):
            restore_files(BackupStore(be, rank=1), "step_30")
        return
    assert up[0].chunks_resent == 1  # type: ignore[union-attr]
    assert restore_files(BackupStore(be, rank=1), "step_30") == {"x": x,
                                                                  "c": blob(30, CHUNK)}


def test_an_upload_in_progress_holds_a_sweep_off(tmp_path, gates) -> None:  # noqa: F811
    """The other order: rank 1 has written its intent and decided to skip X (its index has
    it) and is still uploading when rank 0 starts a sweep. The sweep waits for the upload's
    COMPLETE, then reads its manifest and keeps X."""
    be = Counting(FileBackend(tmp_path))
    sweeper, uploader, chunks, x = _x_held_by_rank_1(be, gates)
    reading, go = threading.Event(), threading.Event()

    def slow_read(h: str) -> bytes:
        reading.set()
        assert go.wait(20)
        return chunks[h]

    m30 = make_step(30, {"x": x, "c": blob(30, CHUNK)}, rank=1, chunks=chunks)
    t_up = threading.Thread(target=lambda: uploader.put_step(m30, slow_read))
    t_up.start()
    assert reading.wait(10)  # intent written, X skipped, uploading the new chunk
    out: list[object] = []
    t_sweep = threading.Thread(target=lambda: out.append(sweeper.retain(1, grace_s=0)))
    t_sweep.start()
    t_sweep.join(0.6)
    assert t_sweep.is_alive()  # steps retired (outside the gate); the sweep waits
    assert not [k for k in be.deletes if k.startswith("chunks/")]
    go.set()
    t_up.join(20)
    t_sweep.join(20)
    assert out[0].swept and out[0].steps_deleted == ["step_10"]  # type: ignore[union-attr]
    assert be.exists(chunk_key(chunk_hash(x)))  # kept: step 30 references it
    assert restore_files(BackupStore(be, rank=1), "step_30") == {"x": x,
                                                                  "c": blob(30, CHUNK)}


@pytest.mark.parametrize("gated", [False, True], ids=["no gate", "etcd gate"])
def test_uploads_and_sweeps_interleaved(tmp_path, gates, gated) -> None:  # noqa: F811
    """Rank 1 uploads steps that alternately need chunk X and not; rank 0 uploads its own and
    sweeps after each (keep=1, so X turns garbage and back again); random pauses move the
    interleaving around. With the gate every step rank 1 completes is restorable right
    after; without it one is not (X gone)."""
    be = FileBackend(tmp_path)
    sweeper, uploader = (BackupStore(be, rank=r, clock_ns=lambda: NOW,
                                     gate=gates(r) if gated else NoGate())
                         for r in (0, 1))
    chunks: dict[str, bytes] = {}
    lock = threading.Lock()
    x = blob(7, CHUNK)
    rounds = 8
    rng = random.Random(5)
    pauses = [[rng.uniform(0, 0.15) for _ in range(rounds)] for _ in range(2)]
    failures: list[str] = []
    done = threading.Barrier(2, timeout=60)

    def step(rank: int, n: int, files: dict[str, bytes]):
        with lock:  # make_step fills the shared dict
            return make_step(n, files, rank=rank, chunks=chunks)

    def read(h: str) -> bytes:
        with lock:
            return chunks[h]

    def upload() -> None:
        try:
            for n in range(1, rounds + 1):
                time.sleep(pauses[1][n - 1])
                files = {"o": blob(100 + n, CHUNK)}
                if n % 2:
                    files["x"] = x
                uploader.put_step(step(1, n, files), read)
                got = restore_files(BackupStore(be, rank=1), f"step_{n}")
                if got != files:
                    failures.append(f"step_{n}")
                done.wait()
        except Exception as exc:  # noqa: BLE001 (reported below)
            failures.append(repr(exc))
            done.abort()

    def sweep() -> None:
        try:
            for n in range(1, rounds + 1):
                sweeper.put_step(step(0, n, {"o": blob(200 + n, CHUNK)}), read)
                time.sleep(pauses[0][n - 1])
                sweeper.retain(1, grace_s=0, sweep=True)
                done.wait()
        except Exception as exc:  # noqa: BLE001
            failures.append(repr(exc))
            done.abort()

    threads = [threading.Thread(target=f) for f in (upload, sweep)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if not gated:
        assert any("NotFound" in f or f.startswith("step_") for f in failures), failures
        return
    assert not failures
    assert uploader.stats()["index_reloads"] >= 1  # the sweeps did delete X under it


def test_an_upload_that_cannot_get_the_gate_fails_with_one_line(tmp_path, gates) -> None:  # noqa: F811
    be = FileBackend(tmp_path)
    sweeper_gate = gates(0)
    st = BackupStore(be, rank=1, clock_ns=lambda: NOW, gate=gates(1))
    st._gate.shared_wait_s = 0.5  # type: ignore[union-attr]
    chunks: dict[str, bytes] = {}
    m = make_step(10, {"a": blob(1, CHUNK)}, rank=1, chunks=chunks)
    with sweeper_gate.exclusive():
        t0 = time.monotonic()
        with pytest.raises(GateTimeout) as ei:
            st.put_step(m, chunks.__getitem__)
        assert time.monotonic() - t0 < 3
    msg = str(ei.value)
    assert "\n" not in msg and "not granted within 0.5 s" in msg and "rank 0" in msg
    assert st.stats()["errors"] == 1 and not be.exists(manifest_key("step_10", 1))
    st.put_step(m, chunks.__getitem__)  # the scheduler's next try
    assert st.latest_step().step == "step_10"


def test_a_sweeper_whose_lease_ends_stops_deleting(tmp_path, gates,  # noqa: F811
                                                   client) -> None:
    """A sweeper that loses its hold (its lease revoked, as when it paused past its TTL)
    deletes nothing more; the gate is free for the others at once, and an uploader sees the
    generation the sweep bumped before its first delete."""
    be = Counting(FileBackend(tmp_path))
    gate0 = gates(0)
    sweeper = BackupStore(be, rank=0, clock_ns=lambda: NOW, gate=gate0, workers=1)
    uploader = BackupStore(be, rank=1, clock_ns=lambda: NOW, gate=gates(1))
    chunks: dict[str, bytes] = {}
    old = make_step(10, {f"f{i}": blob(i, CHUNK) for i in range(4)}, rank=0, chunks=chunks)
    sweeper.put_step(old, chunks.__getitem__)
    uploader.put_step(make_step(10, {"u": blob(50, CHUNK)}, rank=1, chunks=chunks),
                      chunks.__getitem__)
    for r, st in ((0, sweeper), (1, uploader)):
        st.put_step(make_step(20, {"b": blob(20 + r, CHUNK)}, rank=r, chunks=chunks),
                    chunks.__getitem__)
    assert uploader.has_chunk(chunk_hash(blob(0, CHUNK)))  # rank 1's index knows them too
    gen0 = gate0.generation()
    be.hold_chunk_deletes = threading.Event()
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(sweeper.retain(1, grace_s=0)))
    t.start()
    assert be.deleting.wait(10)  # the first delete is under way
    (held,) = gate0.lock.holders()
    assert held == ("exclusive", "rank 0")
    kvs, *_ = client.range(gate0.lock.prefix, gate0.lock.prefix + b"\xff")
    client.revoke(kvs[0].lease)
    assert wait_until(lambda: not gate0.lock.holders(), 5)
    time.sleep(5 / 3 + 0.6)  # the sweeper's next renewal (every TTL/3) tells it
    be.hold_chunk_deletes.set()
    t.join(20)
    stats = out[0]
    assert not stats.swept and stats.chunks_deleted == 1  # type: ignore[union-attr]
    assert len([k for k in be.deletes if k.startswith("chunks/")]) == 1
    assert len(chunk_keys(be)) == len(chunks) - 1  # the other garbage is left for next time
    assert gate0.generation() > gen0
    # Rank 1 gets the gate at once, and lists chunks again before trusting its index.
    uploader.put_step(make_step(30, {"b": blob(21, CHUNK)}, rank=1, chunks=chunks),
                      chunks.__getitem__)
    assert uploader.stats()["index_reloads"] == 1


def test_etcd_unreachable(tmp_path) -> None:
    """No etcd: an upload fails with one line (retried later by the scheduler); retention
    still retires steps but skips the chunk sweep."""
    (port,) = free_ports(1)
    dead = Etcd([f"127.0.0.1:{port}"], timeout_s=0.5)
    try:
        be = FileBackend(tmp_path)
        plain = [BackupStore(be, rank=r, clock_ns=lambda: NOW) for r in (0, 1)]
        chunks: dict[str, bytes] = {}
        for n in (1, 2):
            for r in (0, 1):
                plain[r].put_step(make_step(n, {"o": blob(10 * n + r, CHUNK)}, rank=r,
                                            chunks=chunks), chunks.__getitem__)
        st = BackupStore(be, rank=0, clock_ns=lambda: NOW,
                         gate=EtcdSweepGate(dead, "/job/backup/", owner="rank 0"))
        with pytest.raises(GateError) as ei:
            st.put_step(make_step(3, {"o": blob(99, CHUNK)}, rank=0, chunks=chunks),
                        chunks.__getitem__)
        assert "\n" not in str(ei.value) and "did not answer" in str(ei.value)
        stats = st.retain(keep=1, sweep=True)
        assert stats.steps_deleted == ["step_1"] and not stats.swept
        assert chunk_keys(be) == {chunk_key(h) for h in chunks if h != chunk_hash(
            blob(99, CHUNK))}
    finally:
        dead.close()
