"""Tier-1 tests of the backup tier in a multi-node job: per-rank manifests on one bucket.

Every rank has its own :class:`BackupStore` (``rank=r``) on the same :class:`FileBackend`,
as nodes of a job share one bucket. Covered: the rank layout and chunks shared across ranks,
listing and restoring each rank's own manifest, ``complete_ranks``, job-wide retention (also
two ranks at once, and a sweep on one node while another uploads, through the job's sweep
gate on a real etcd), upload shares between data-parallel twins (alive and dead), and the
scheduler passing a share to ``put_step``. The hazards the gate closes, each also shown
without it, are in t1_sweep_gate_test.py.
"""

from __future__ import annotations

import dataclasses

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import trio

from mtcfs.base.chunking import chunk_hash
from mtcfs.base.manifest import Entry, StepManifest
from mtcfs.tiers.backup import Backend, BackupError, BackupStore, FileBackend, NotFound
from mtcfs.tiers.backup.layout import (
    check_rank, chunk_key, complete_key, manifest_key, parse_rank_step_key, parse_step_key,
    step_dir,
)
from mtcfs.tiers.coord.backup_gate import EtcdSweepGate
from mtcfs.tiers.coord.etcd import Etcd
from mtcfs.tiers.backup.scheduler import BackupService
from support.etcd import etcd_prefix, etcd_server  # noqa: F401 (fixtures)

CHUNK = 64 * 1024
JOB = "job"
NOW = 10**18


# -- helpers -------------------------------------------------------------------------------

def blob(seed: int, size: int) -> bytes:
    import random
    return random.Random(seed).randbytes(size)


def make_step(step_number: int, files: dict[str, bytes], *, rank: int = 0,
              created_ns: int | None = None, chunks: dict[str, bytes] | None = None,
              name: str | None = None) -> StepManifest:
    """A StepManifest of ``files`` below ``step_<n>/``; their chunks go into ``chunks``."""
    step = name or f"step_{step_number}"
    entries = [Entry(path=step, kind="dir", mode=0o755, mtime_ns=1)]
    for fname, data in sorted(files.items()):
        hashes = []
        for off in range(0, len(data), CHUNK):
            piece = data[off:off + CHUNK]
            hashes.append(chunk_hash(piece))
            if chunks is not None:
                chunks[hashes[-1]] = piece
        entries.append(Entry(path=f"{step}/{fname}", kind="file", mode=0o644, mtime_ns=2,
                             size=len(data), chunk_size=CHUNK, chunks=tuple(hashes),
                             blake3=chunk_hash(data)))
    return StepManifest(job=JOB, step=step, step_number=step_number,
                        created_ns=NOW if created_ns is None else created_ns,
                        entries=entries, rank=rank)


def restore_files(store: BackupStore, step: str, rank: int | None = None) -> dict[str, bytes]:
    m = store.get_step(step, rank)
    return {e.path.split("/", 1)[1]: b"".join(store.get_chunk(h) for h in e.chunks)
            for e in m.entries if e.kind == "file"}


def chunk_keys(backend: Backend) -> set[str]:
    return set(backend.list("chunks/"))


class Counting(Backend):
    """Wraps a backend, counts puts per key, and can hold chunk deletes at a gate."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.puts: Counter[str] = Counter()
        self.deletes: list[str] = []
        self._lock = threading.Lock()
        self.hold_chunk_deletes: threading.Event | None = None  # set() it to let them pass
        self.deleting = threading.Event()  # set when a held chunk delete arrived

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)
        with self._lock:
            self.puts[key] += 1

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str) -> Iterator[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        gate = self.hold_chunk_deletes
        if gate is not None and key.startswith("chunks/"):
            self.deleting.set()
            assert gate.wait(30)
        self.inner.delete(key)
        with self._lock:
            self.deletes.append(key)

    def describe(self) -> str:
        return self.inner.describe()

    def chunk_puts(self) -> Counter[str]:
        with self._lock:
            return Counter({k: n for k, n in self.puts.items() if k.startswith("chunks/")})


def stores(backend: Backend, n: int, gates: Callable[[int], EtcdSweepGate] | None = None,
           **kw) -> list[BackupStore]:
    return [BackupStore(backend, rank=r, clock_ns=lambda: NOW,
                        gate=gates(r) if gates is not None else None, **kw) for r in range(n)]


@pytest.fixture
def gates(etcd_server, etcd_prefix):  # noqa: F811
    """``gates(rank)``: that rank's sweep gate of one job on the test etcd (as each node of a
    job builds its own, on its own client)."""
    clients: list[Etcd] = []

    def make(rank: int) -> EtcdSweepGate:
        clients.append(Etcd(etcd_server.endpoints, timeout_s=5.0))
        return EtcdSweepGate(clients[-1], etcd_prefix + "backup/", owner=f"rank {rank}",
                             ttl_s=5)

    yield make
    for c in clients:
        c.close()


# -- layout --------------------------------------------------------------------------------

def test_rank_layout_names() -> None:
    assert manifest_key("step_20") == "steps/step_20/manifest.json"  # single node unchanged
    assert complete_key("step_20") == "steps/step_20/COMPLETE"
    assert manifest_key("step_20", 3) == "steps/step_20/rank-3/manifest.json"
    assert complete_key("step_20", 0) == "steps/step_20/rank-0/COMPLETE"
    assert step_dir("7", 12) == "steps/7/rank-12/"
    assert parse_rank_step_key("steps/step_20/rank-3/COMPLETE") == ("step_20", 3, "COMPLETE")
    assert parse_step_key("steps/step_20/rank-3/COMPLETE") is None
    assert parse_rank_step_key("steps/step_20/COMPLETE") is None
    for bad in ("steps/s/rank-03/COMPLETE", "steps/s/rank-/x", "steps/s/rank-x/x",
                "steps/s/rank-1/", "chunks/ab/x"):
        assert parse_rank_step_key(bad) is None, bad
    for bad in (-1, True, 1.0, "1", 10**9):
        with pytest.raises(ValueError):
            check_rank(bad)  # type: ignore[arg-type]


def test_store_arguments(tmp_path, gates) -> None:
    be = FileBackend(tmp_path)
    with pytest.raises(ValueError, match="needs a rank"):
        BackupStore(be, gate=gates(0))
    with pytest.raises(ValueError):
        BackupStore(be, rank=-1)
    with pytest.raises(ValueError):
        BackupStore(be, world_size=2)  # needs a rank
    with pytest.raises(ValueError):
        BackupStore(be, rank=2, world_size=2)
    s = BackupStore(be, rank=1, world_size=2)
    assert (s.rank, s.world_size) == (1, 2)
    assert BackupStore(be).rank is None
    with pytest.raises(ValueError):
        s.put_step(make_step(1, {}), lambda h: b"", share_wait_s=-1)


# -- ranks on one bucket -------------------------------------------------------------------

def test_three_ranks_share_chunks_and_keep_their_own_manifests(tmp_path) -> None:
    be = Counting(FileBackend(tmp_path))
    common = blob(1, 4 * CHUNK)  # identical on every rank (e.g. replicated embeddings)
    half = blob(2, 2 * CHUNK)    # identical on ranks 0 and 1
    chunks: dict[str, bytes] = {}
    files = {
        0: {"common.bin": common, "half.bin": half, "own.bin": blob(10, 3 * CHUNK + 17)},
        1: {"common.bin": common, "half.bin": half, "own.bin": blob(11, 2 * CHUNK)},
        2: {"common.bin": common, "own.bin": blob(12, CHUNK), "empty": b""},
    }
    ms = {r: make_step(20, files[r], rank=r, chunks=chunks) for r in files}
    ss = stores(be, 3)
    results = {r: ss[r].put_step(ms[r], chunks.__getitem__) for r in (0, 1, 2)}

    # Each chunk object is stored, and uploaded, once.
    assert chunk_keys(be) == {chunk_key(h) for h in chunks}
    assert set(be.chunk_puts().values()) == {1}
    assert sum(r.chunks_uploaded for r in results.values()) == len(chunks)
    assert results[1].chunks_uploaded == 2 and results[2].chunks_uploaded == 1
    # The rank layout, and nothing in the single-node one.
    for r in (0, 1, 2):
        assert be.exists(manifest_key("step_20", r)) and be.exists(complete_key("step_20", r))
    assert not be.exists(manifest_key("step_20")) and not be.exists(complete_key("step_20"))
    marker = json.loads(be.get(complete_key("step_20", 2)))
    assert marker["rank"] == 2 and marker["step_number"] == 20

    # Each rank lists and restores its own manifest bit-exactly; others' on request.
    fresh = stores(be, 3)  # new processes: nothing cached
    for r in (0, 1, 2):
        steps = fresh[r].list_steps()
        assert [(s.step, s.step_number, s.total_bytes) for s in steps] == [
            ("step_20", 20, sum(map(len, files[r].values())))]
        assert fresh[r].latest_step() == steps[0]
        assert fresh[r].get_step("step_20").to_bytes() == ms[r].to_bytes()
        assert restore_files(fresh[r], "step_20") == files[r]
        other = (r + 1) % 3
        assert fresh[r].list_steps(rank=other)[0].total_bytes == \
            sum(map(len, files[other].values()))
        assert fresh[r].get_step("step_20", rank=other).to_bytes() == ms[other].to_bytes()
    assert fresh[0].list_steps(rank=7) == [] and fresh[0].latest_step(rank=7) is None
    with pytest.raises(NotFound, match="rank 7"):
        fresh[0].get_step("step_20", rank=7)
    single = BackupStore(be)
    assert single.list_steps() == [] and single.latest_step() is None
    assert single.list_steps(rank=1)[0].step == "step_20"


def test_complete_ranks(tmp_path) -> None:
    be = FileBackend(tmp_path)
    ss = stores(be, 3)
    chunks: dict[str, bytes] = {}
    assert ss[0].complete_ranks() == {}
    ms = {r: make_step(20, {"f": blob(r, CHUNK)}, rank=r, chunks=chunks) for r in range(3)}
    ss[0].put_step(ms[0], chunks.__getitem__)
    ss[1].put_step(ms[1], chunks.__getitem__)
    ss[2].begin_step(ms[2])  # rank 2 is still uploading
    m10 = make_step(10, {"f": blob(5, CHUNK)}, rank=1, chunks=chunks)
    ss[1].put_step(m10, chunks.__getitem__)
    BackupStore(be).put_step(make_step(30, {"g": blob(6, CHUNK)}, chunks=chunks),
                             chunks.__getitem__)  # single-node layout: not a rank's
    assert ss[2].complete_ranks() == {"step_20": (20, {0, 1}), "step_10": (10, {1})}
    with pytest.raises(BackupError):
        ss[2].commit_step(ms[2])  # its chunk is not there yet
    for h in ms[2].chunk_set():
        ss[2].put_chunk(h, chunks[h])
    ss[2].commit_step(ms[2])
    by_step = BackupStore(be).complete_ranks()
    assert by_step["step_20"] == (20, {0, 1, 2})
    newest_all = max((n, s) for s, (n, rs) in by_step.items() if rs >= {0, 1, 2})
    assert newest_all == (20, "step_20")
    assert ss[2].list_steps() == [ss[2].latest_step()] and ss[2].latest_step().step == "step_20"


# -- job-wide retention --------------------------------------------------------------------

def test_job_retention_keeps_chunks_other_ranks_need(tmp_path, gates) -> None:
    be = FileBackend(tmp_path)
    r0, r1 = stores(be, 2, gates)
    chunks: dict[str, bytes] = {}
    base = blob(1, 2 * CHUNK)           # in every step of both ranks
    only10 = blob(2, CHUNK)             # rank 0, step 10 only: dies with step 10
    cross = blob(3, CHUNK)              # rank 0 step 10 and rank 1 step 20 (kept)
    revived = blob(4, CHUNK)            # rank 1 step 10 and rank 1's upload of step 40
    files = {
        (0, 10): {"b": base, "x": only10, "c": cross},
        (1, 10): {"b": base, "r": revived},
        (0, 20): {"b": base, "o": blob(20, CHUNK)},
        (1, 20): {"b": base, "c": cross},
        (0, 30): {"b": base, "o": blob(30, CHUNK)},
        (1, 30): {"b": base, "o": blob(31, CHUNK)},
        (0, 40): {"b": base, "o": blob(40, CHUNK)},
    }
    ms = {k: make_step(k[1], f, rank=k[0], chunks=chunks) for k, f in files.items()}
    for (rank, _), m in sorted(ms.items(), key=lambda kv: kv[0][1]):
        (r0, r1)[rank].put_step(m, chunks.__getitem__)
    # Rank 1 is uploading step 40 (fresh intent); an abandoned upload of an old step.
    up40 = make_step(40, {"b": base, "r": revived}, rank=1, chunks=chunks)
    r1.begin_step(up40)
    stale = make_step(5, {"s": blob(50, CHUNK)}, rank=1, chunks=chunks, created_ns=0)
    r1.begin_step(stale)
    r1.put_chunk(*next((h, chunks[h]) for h in stale.chunk_set()))
    orphan = blob(60, 1000)
    r1.put_chunk(chunk_hash(orphan), orphan)

    stats = r1.retain(keep=2, grace_s=60)
    assert stats.steps_kept == ["step_20", "step_30"]  # complete on both ranks
    assert stats.steps_deleted == ["step_10"] and stats.incomplete_deleted == ["step_5"]
    assert stats.swept
    live = set().union(*(m.chunk_set() for k, m in ms.items() if k[1] >= 20),
                       up40.chunk_set())
    assert chunk_keys(be) == {chunk_key(h) for h in live}
    assert stats.chunks_deleted == 3 and stats.chunks_kept == len(live)  # only10, stale, orphan
    assert be.exists(chunk_key(chunk_hash(cross))) and be.exists(chunk_key(chunk_hash(revived)))
    assert not be.exists(chunk_key(chunk_hash(only10)))
    for r in (0, 1):
        assert not be.exists(manifest_key("step_10", r))
    assert [s.step for s in r0.list_steps()] == ["step_20", "step_30", "step_40"]
    assert [s.step for s in r1.list_steps()] == ["step_20", "step_30"]
    gen = gates(9).generation()
    assert gen > 0  # the sweep bumped the sweep generation (before deleting)

    # Nothing to retire: no sweep, the generation stays.
    again = r0.retain(keep=2, grace_s=60)
    assert again.steps_deleted == [] and not again.swept and again.chunks_deleted == 0
    assert gates(9).generation() == gen

    # Rank 0's index still believes `only10` is stored (it uploaded it); the generation
    # tells it that a sweep ran since, so it lists chunks again and uploads it again.
    m50 = make_step(50, {"b": base, "x": only10}, rank=0, chunks=chunks)
    st50 = r0.put_step(m50, chunks.__getitem__)
    assert st50.chunks_uploaded == 1 and st50.chunks_resent == 1
    assert r0.stats()["index_reloads"] == 1 and r1.stats()["index_reloads"] == 0
    assert restore_files(BackupStore(be, rank=0), "step_50") == {"b": base, "x": only10}
    r1.commit_step(up40)  # rank 1's chunks survived: it completes
    assert restore_files(r1, "step_40") == {"b": base, "r": revived}

    # With world_size=3 nothing is complete in the job (rank 2 never saved): keep all.
    r2 = BackupStore(be, rank=2, world_size=3, clock_ns=lambda: NOW, gate=gates(2))
    kept = r2.retain(keep=1, grace_s=60)
    assert kept.steps_kept == [] and kept.steps_deleted == [] and not kept.swept
    # world_size=2: step 50 is complete on rank 0 only, 40 on both: keep 40 (and 50).
    rk = BackupStore(be, rank=0, world_size=2, clock_ns=lambda: NOW,
                     gate=gates(0)).retain(keep=1, grace_s=60)
    assert rk.steps_kept == ["step_40"] and rk.steps_deleted == ["step_20", "step_30"]
    assert [s.step for s in r0.list_steps()] == ["step_40", "step_50"]
    assert restore_files(BackupStore(be, rank=0), "step_50") == {"b": base, "x": only10}
    with pytest.raises(ValueError):
        r0.retain(keep=0)


def test_single_node_retention_keeps_rank_chunks(tmp_path) -> None:
    """A single-node store sharing the bucket never sweeps chunks a rank manifest needs."""
    be = FileBackend(tmp_path)
    single, ranked = BackupStore(be), BackupStore(be, rank=0)
    chunks: dict[str, bytes] = {}
    for n in (1, 2):
        single.put_step(make_step(n, {"f": blob(n, CHUNK)}, name=str(n), chunks=chunks),
                        chunks.__getitem__)
    rm = make_step(1, {"f": blob(1, CHUNK), "g": blob(9, CHUNK)}, name="1", chunks=chunks)
    ranked.put_step(rm, chunks.__getitem__)
    stats = single.retain(keep=1, grace_s=0)
    assert stats.steps_deleted == ["1"] and stats.swept
    assert all(be.exists(chunk_key(h)) for h in rm.chunk_set())
    assert restore_files(ranked, "1") == {"f": blob(1, CHUNK), "g": blob(9, CHUNK)}
    assert single.retain(keep=1, sweep=False).swept is False


def test_multi_node_store_without_a_gate_does_not_sweep(tmp_path) -> None:
    be = FileBackend(tmp_path)
    ss = stores(be, 2)
    chunks: dict[str, bytes] = {}
    for n in (1, 2):
        for r in (0, 1):
            ss[r].put_step(make_step(n, {"o": blob(10 * n + r, CHUNK)}, rank=r, chunks=chunks),
                           chunks.__getitem__)
    stats = ss[0].retain(keep=1, sweep=True)
    assert stats.steps_deleted == ["step_1"] and not stats.swept and stats.chunks_deleted == 0
    assert chunk_keys(be) == {chunk_key(h) for h in chunks}  # nothing swept


def test_two_ranks_retain_at_once(tmp_path, gates) -> None:
    be = FileBackend(tmp_path)
    ss = stores(be, 2, gates)
    chunks: dict[str, bytes] = {}
    ms = {}
    for n in range(1, 7):
        for r in (0, 1):
            ms[r, n] = make_step(n, {"s": blob(n, 2 * CHUNK), "o": blob(100 * r + n, CHUNK)},
                                 rank=r, chunks=chunks)
            ss[r].put_step(ms[r, n], chunks.__getitem__)
    for keep in (4, 2):
        out: list[object] = []
        threads = [threading.Thread(target=lambda s=s, o=out, k=keep: o.append(
            s.retain(k, sweep=True))) for s in ss]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(out) == 2 and all(not isinstance(o, Exception) for o in out)
    live = set().union(*(m.chunk_set() for (r, n), m in ms.items() if n >= 5))
    assert chunk_keys(be) == {chunk_key(h) for h in live}
    for r in (0, 1):
        assert [s.step for s in ss[r].list_steps()] == ["step_5", "step_6"]
        assert restore_files(BackupStore(be, rank=r), "step_5") == {
            "s": blob(5, 2 * CHUNK), "o": blob(100 * r + 5, CHUNK)}


def test_upload_waits_for_a_sweep_on_another_node(tmp_path, gates) -> None:
    """Rank 0 sweeps; rank 1, whose index says chunk X is stored, starts a step with X right
    after rank 0 read the manifests and before it deletes X. Rank 1 must wait for the sweep
    (the gate), then list chunks again and upload X, not mark a step complete whose chunk
    is gone."""
    be = Counting(FileBackend(tmp_path))
    sweeper, uploader = stores(be, 2, gates)
    chunks: dict[str, bytes] = {}
    x = blob(7, CHUNK)
    for r, st in ((0, sweeper), (1, uploader)):
        st.put_step(make_step(10, {"x": x} if r == 0 else {"a": blob(8, CHUNK)}, rank=r,
                              chunks=chunks), chunks.__getitem__)
        st.put_step(make_step(20, {"b": blob(20 + r, CHUNK)}, rank=r, chunks=chunks),
                    chunks.__getitem__)
    assert uploader.has_chunk(chunk_hash(x))  # loaded, as a long-running daemon's would be

    be.hold_chunk_deletes = threading.Event()
    sweep_out: list[object] = []
    t_sweep = threading.Thread(target=lambda: sweep_out.append(sweeper.retain(1, grace_s=0)))
    t_sweep.start()
    assert be.deleting.wait(10)  # the sweep has marked, and is about to delete X
    m30 = make_step(30, {"x": x, "c": blob(30, CHUNK)}, rank=1, chunks=chunks)
    up_out: list[object] = []
    t_up = threading.Thread(target=lambda: up_out.append(
        uploader.put_step(m30, chunks.__getitem__)))
    t_up.start()
    t_up.join(0.6)
    assert t_up.is_alive() and not be.exists(manifest_key("step_30", 1))  # waiting
    assert be.exists(chunk_key(chunk_hash(x)))
    be.hold_chunk_deletes.set()
    t_sweep.join(20)
    t_up.join(20)
    assert sweep_out[0].chunks_deleted >= 1  # type: ignore[union-attr]
    stats = up_out[0]
    assert stats.chunks_resent == 1 and stats.seconds_waiting > 0.3  # type: ignore[union-attr]
    assert uploader.stats()["index_reloads"] == 1
    assert restore_files(BackupStore(be, rank=1), "step_30") == {"x": x, "c": blob(30, CHUNK)}


def test_commit_step_reports_a_chunk_a_sweep_deleted(tmp_path, gates) -> None:
    be = FileBackend(tmp_path)
    (st,) = stores(be, 1, gates)
    chunks: dict[str, bytes] = {}
    x = blob(1, CHUNK)
    st.put_step(make_step(10, {"x": x}, chunks=chunks), chunks.__getitem__)
    m = make_step(20, {"x": x}, chunks=chunks)
    st.begin_step(m)
    other = gates(3)  # another node sweeps X (between this node's begin and commit)
    with other.exclusive() as hold:
        other.bump(hold)
        be.delete(chunk_key(chunk_hash(x)))
    with pytest.raises(BackupError, match=chunk_hash(x)):
        st.commit_step(m)
    assert st.list_steps()[-1].step == "step_10"


# -- upload shares -------------------------------------------------------------------------

def share_of(index: int, parts: int) -> Callable[[str], bool]:
    return lambda d: int(d[:8], 16) % parts == index


def test_twins_upload_each_chunk_once(tmp_path) -> None:
    be = Counting(FileBackend(tmp_path))
    twins = stores(be, 2)
    chunks: dict[str, bytes] = {}
    files = {"w.bin": blob(1, 24 * CHUNK), "o.bin": blob(2, 9 * CHUNK + 5)}
    ms = [make_step(20, files, rank=r, chunks=chunks) for r in (0, 1)]
    ours = [sum(share_of(r, 2)(h) for h in chunks) for r in (0, 1)]
    assert min(ours) > 0  # both have a share
    barrier = threading.Barrier(2)  # both decide what to upload before either uploads

    def run(r: int, out: dict[int, object]) -> None:
        started, lock = [False], threading.Lock()

        def read(h: str) -> bytes:  # called from several upload threads
            with lock:
                if not started[0]:
                    barrier.wait(10)
                    started[0] = True
            return chunks[h]

        out[r] = twins[r].put_step(ms[r], read, share=share_of(r, 2), share_wait_s=20)

    out: dict[int, object] = {}
    threads = [threading.Thread(target=run, args=(r, out)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    puts = be.chunk_puts()
    assert set(puts) == {chunk_key(h) for h in chunks} and set(puts.values()) == {1}
    a, b = out[0], out[1]
    assert (a.chunks_uploaded, b.chunks_uploaded) == tuple(ours)  # type: ignore[union-attr]
    assert a.chunks_by_others == b.chunks_uploaded  # type: ignore[union-attr]
    assert b.chunks_by_others == a.chunks_uploaded  # type: ignore[union-attr]
    assert a.chunks_taken_over == b.chunks_taken_over == 0  # type: ignore[union-attr]
    for r in (0, 1):
        assert restore_files(BackupStore(be, rank=r), "step_20") == files
    assert twins[0].stats()["chunks_by_others"] == ours[1]


def test_share_with_a_dead_twin_uploads_everything(tmp_path) -> None:
    be = Counting(FileBackend(tmp_path))
    (st,) = stores(be, 1)
    chunks: dict[str, bytes] = {}
    files = {"w.bin": blob(3, 12 * CHUNK)}
    m = make_step(20, files, chunks=chunks)
    theirs = sum(not share_of(0, 2)(h) for h in chunks)
    assert 0 < theirs < len(chunks)
    seen: list[tuple[int, int]] = []
    t0 = time.monotonic()
    stats = st.put_step(m, chunks.__getitem__, progress=lambda d, t: seen.append((d, t)),
                        share=share_of(0, 2), share_wait_s=0.3)
    assert time.monotonic() - t0 >= 0.3 and stats.seconds_waiting >= 0.3
    assert stats.chunks_uploaded == len(chunks) and stats.chunks_taken_over == theirs
    assert stats.chunks_by_others == 0
    assert seen[-1] == (12 * CHUNK, 12 * CHUNK)
    assert set(be.chunk_puts().values()) == {1} and len(be.chunk_puts()) == len(chunks)
    assert restore_files(BackupStore(be, rank=0), "step_20") == files


def test_a_twin_backing_up_later_uploads_nothing_taken_over_for_it(tmp_path) -> None:
    """Twins back up at different times: rank 0 waits for rank 1's share, takes it over;
    rank 1 (its index of the bucket loaded before) then uploads nothing again."""
    be = Counting(FileBackend(tmp_path))
    early, late = BackupStore(be, rank=0), BackupStore(be, rank=1)
    chunks: dict[str, bytes] = {}
    m10 = make_step(10, {"x.bin": blob(5, CHUNK)}, chunks=chunks)
    m10 = dataclasses.replace(m10, rank=1)
    late.put_step(m10, chunks.__getitem__)  # rank 1 has its index of the bucket loaded
    be.puts.clear()
    m = make_step(20, {"w.bin": blob(4, 12 * CHUNK)}, chunks=chunks)
    early.put_step(m, chunks.__getitem__, share=share_of(0, 2), share_wait_s=0.1)
    stats = late.put_step(dataclasses.replace(m, rank=1), chunks.__getitem__,
                          share=share_of(1, 2), share_wait_s=0.1)
    assert stats.chunks_uploaded == 0, stats
    assert set(be.chunk_puts().values()) == {1}
    assert len(be.chunk_puts()) == len(m.chunk_set())


def test_share_finds_a_slow_twins_chunks(tmp_path) -> None:
    """The twin uploads its share while this node waits: nothing is uploaded twice."""
    be = Counting(FileBackend(tmp_path))
    me, twin = stores(be, 2)
    chunks: dict[str, bytes] = {}
    files = {"w.bin": blob(4, 10 * CHUNK)}
    m = make_step(20, files, chunks=chunks)
    theirs = [h for h in chunks if not share_of(0, 2)(h)]
    me.has_chunk(theirs[0])

    def late_twin() -> None:
        time.sleep(0.3)
        for h in theirs:
            twin.put_chunk(h, chunks[h])

    t = threading.Thread(target=late_twin)
    t.start()
    stats = me.put_step(m, chunks.__getitem__, share=share_of(0, 2), share_wait_s=20)
    t.join(10)
    assert stats.chunks_by_others == len(theirs) and stats.chunks_taken_over == 0
    assert stats.chunks_uploaded == len(chunks) - len(theirs)
    assert set(be.chunk_puts().values()) == {1}


def test_share_wait_ends_once_the_twin_is_on_a_newer_step(tmp_path) -> None:
    """The twin began step 21 and not step 20: it will not upload its share of step 20, so
    this node stops waiting at once and uploads it (goodput finding: twins on different
    steps each waited the whole share wait)."""
    be = Counting(FileBackend(tmp_path))
    me, twin = stores(be, 2)
    chunks: dict[str, bytes] = {}
    files = {"w.bin": blob(7, 12 * CHUNK)}
    m = make_step(20, files, chunks=chunks)
    twin.begin_step(make_step(21, {"w.bin": blob(8, CHUNK)}, rank=1))
    assert me.steps_begun([1, 2]) == {1: {"step_21"}, 2: set()}
    theirs = sum(not share_of(0, 2)(h) for h in chunks)
    t0 = time.monotonic()
    stats = me.put_step(m, chunks.__getitem__, share=share_of(0, 2), share_wait_s=60,
                        twins=[1])
    assert time.monotonic() - t0 < 20 and stats.seconds_waiting < 20
    assert stats.chunks_uploaded == len(chunks) and stats.chunks_taken_over == theirs > 0
    assert set(be.chunk_puts().values()) == {1}
    assert restore_files(BackupStore(be, rank=0), "step_20") == files


@pytest.mark.parametrize("twin_began", [["step_19"], ["step_20", "step_21"]])
def test_share_wait_goes_on_while_the_twin_may_still_upload(tmp_path, twin_began) -> None:
    """A twin behind this step (it may join it) or on this very step (it is uploading its
    share) is waited for, up to share_wait_s."""
    be = FileBackend(tmp_path)
    me, twin = stores(be, 2)
    chunks: dict[str, bytes] = {}
    m = make_step(20, {"w.bin": blob(9, 8 * CHUNK)}, chunks=chunks)
    for name in twin_began:
        n = int(name.split("_")[1])
        twin.begin_step(make_step(n, {"w.bin": blob(10, CHUNK)}, rank=1, name=name))
    stats = me.put_step(m, chunks.__getitem__, share=share_of(0, 2), share_wait_s=0.5,
                        twins=[1])
    assert stats.seconds_waiting >= 0.5 and stats.chunks_taken_over > 0


# -- the scheduler passes the share ----------------------------------------------------------

def test_backup_service_passes_share(tmp_path) -> None:
    chunks: dict[str, bytes] = {}
    m = make_step(20, {"w.bin": blob(5, 6 * CHUNK)}, chunks=chunks)
    store = BackupStore(FileBackend(tmp_path), rank=0)
    rec = SimpleNamespace(name=m.step, number=20, committed_ns=1, backed_up_ns=None,
                          backing_up=False)
    calls: list[str] = []
    fs = SimpleNamespace(
        steps={m.step: rec}, subscribe=lambda cb: None, backup_pending=lambda: None,
        set_backup_pending=lambda name: None, step_sealed=lambda r: True, step_in_ram=lambda r: True,
        snapshot_step=lambda name: (m, []), chunk_reader=lambda pinned: chunks.__getitem__,
        unpin=lambda pinned: None, evict=list,
        mark_backed_up=lambda name, pinned: calls.append(name) or True,
        backup_retired=lambda kept: [])
    with pytest.raises(ValueError):
        BackupService(fs, store, interval_s=None, every_ckpts=1, keep_backups=2, url="u",
                      interval_text="1", share_wait_s=-1)
    svc = BackupService(fs, store, interval_s=None, every_ckpts=1, keep_backups=2, url="u",
                        interval_text="1", share=share_of(1, 2), share_wait_s=0.05)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.run)
            await svc.request()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert calls == [m.step] and svc.status.backups == 1
    theirs = sum(not share_of(1, 2)(h) for h in chunks)
    assert store.stats()["chunks_taken_over"] == theirs > 0
    assert svc.status.last_chunks_by_others == 0


def test_backup_service_joins_the_step_a_twin_began(tmp_path) -> None:
    """A twin began step_20 in the bucket: this node, holding step_20 and the newer step_21,
    backs up step_20 (so the job has a step complete on both), and a twin's step it does
    not hold, or one not newer than its last backup, is not joined."""
    be = FileBackend(tmp_path)
    chunks: dict[str, bytes] = {}
    ms = {n: make_step(n, {"w.bin": blob(40 + n, 3 * CHUNK)}, chunks=chunks, rank=1)
          for n in (19, 20, 21)}
    twin = BackupStore(be, rank=0)
    for n in (19, 20, 22):
        twin.begin_step(make_step(n, {"w.bin": blob(40 + n, 3 * CHUNK)}))
    recs = {f"step_{n}": SimpleNamespace(name=f"step_{n}", number=n, committed_ns=n,
                                         backed_up_ns=1 if n == 19 else None,
                                         backing_up=False) for n in (19, 20, 21)}
    calls: list[str] = []

    def mark(name: str, pinned: object) -> bool:
        calls.append(name)
        recs[name].backed_up_ns = 2
        return True

    fs = SimpleNamespace(
        steps=recs, subscribe=lambda cb: None, backup_pending=lambda: None,
        set_backup_pending=lambda name: None, step_sealed=lambda r: True,
        step_in_ram=lambda r: True, snapshot_step=lambda name: (ms[int(name[5:])], []),
        chunk_reader=lambda pinned: chunks.__getitem__, unpin=lambda pinned: None,
        evict=list, mark_backed_up=mark, backup_retired=lambda kept: [])
    svc = BackupService(fs, BackupStore(be, rank=1), interval_s=3600.0, every_ckpts=None,
                        keep_backups=5, url="u", interval_text="1h", share=share_of(1, 2),
                        share_wait_s=0.05, twins=lambda: {0})

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.run)
            with trio.fail_after(20):
                while not calls:
                    await trio.sleep(0.02)
            await trio.sleep(0.3)  # step_21 is not due for an hour, and no twin began it
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert calls == ["step_20"]
    assert restore_files(BackupStore(be, rank=1), "step_20") == {"w.bin": blob(60, 3 * CHUNK)}


def test_backup_service_waits_for_chunks_still_being_restored(tmp_path) -> None:
    """A step restored from a peer is backed up only once all its chunks are in RAM; a
    reader that fails in an unexpected way is a failed attempt, not a dead daemon."""
    chunks: dict[str, bytes] = {}
    m = make_step(20, {"w.bin": blob(6, 3 * CHUNK)}, chunks=chunks)
    store = BackupStore(FileBackend(tmp_path), rank=1)
    rec = SimpleNamespace(name=m.step, number=20, committed_ns=1, backed_up_ns=None,
                          backing_up=False)
    version = SimpleNamespace(missing={2})  # chunk 2 is still being fetched
    calls: list[str] = []
    broken = [True]

    def reader(pinned: list[object]) -> Callable[[str], bytes]:
        def read(h: str) -> bytes:
            if broken[0]:
                raise KeyError(h)
            return chunks[h]
        return read

    fs = SimpleNamespace(
        steps={m.step: rec}, subscribe=lambda cb: None, backup_pending=lambda: None,
        set_backup_pending=lambda name: None, step_sealed=lambda r: True, step_in_ram=lambda r: not version.missing,
        snapshot_step=lambda name: (m, [version]), chunk_reader=reader,
        unpin=lambda pinned: None, evict=list,
        mark_backed_up=lambda name, pinned: calls.append(name) or True,
        backup_retired=lambda kept: [])
    svc = BackupService(fs, store, interval_s=None, every_ckpts=1, keep_backups=2, url="u",
                        interval_text="1")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.run)
            await trio.sleep(0.3)
            assert calls == [] and svc.status.pending == [m.step]
            assert svc.status.failures == 0
            with pytest.raises(BackupError, match="not in RAM yet"):
                await svc.request()
            version.missing.clear()
            with pytest.raises(BackupError, match="KeyError"):
                await svc.request()
            assert svc.status.failures == 1
            broken[0] = False
            await svc.request()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert calls == [m.step] and svc.status.backups == 1
    assert restore_files(store, m.step) == {"w.bin": blob(6, 3 * CHUNK)}


def test_backup_interval_in_training_steps(tmp_path) -> None:
    """Orbax's backup-interval-steps (mtcfs/tiers/mtc/): the newest step is due when its
    number is at least that far past the last backed-up step's, or when the job went back
    to an older step and trains again; a step restored under Orbax's marker resets the
    count (counted from it if it is backed up, else due at once)."""
    def step(n, backed=False, source="orbax-rename"):
        return SimpleNamespace(name=str(n), number=n, committed_ns=n,
                               backed_up_ns=1 if backed else None, source=source)
    fs = SimpleNamespace(steps={"100": step(100, backed=True)}, subscribe=lambda fn: None,
                         backup_pending=lambda: None, set_backup_pending=lambda name: None)
    svc = BackupService(fs, BackupStore(FileBackend(tmp_path), rank=0), interval_s=600.0,
                        every_ckpts=None, keep_backups=2, url="u", interval_text="10m")
    svc.every_steps = 50
    assert svc._last_number == 100 and not svc._due()  # nothing newer
    fs.steps["120"] = step(120)
    assert not svc._due()  # 20 steps past the last backup
    fs.steps["150"] = step(150)
    assert svc._due()  # 50 steps past it
    fs.steps = {"40": step(40)}  # the job went back to step 40 and trains again
    assert svc._due()
    svc._on_event("committed", step(30, backed=True, source="orbax-restore"))
    fs.steps = {"30": step(30, backed=True), "60": step(60)}
    assert svc._last_number == 30 and not svc._due()
    fs.steps["80"] = step(80)
    assert svc._due()


def test_a_failed_time_based_backup_is_tried_again_after_the_backoff(tmp_path) -> None:
    """backup_interval=1h: the first upload fails (the bucket is away once); the step is
    backed up after the failure's short backoff, not an hour later. Before the fix the
    failed attempt kept its start of the interval, so the step waited the whole hour."""
    chunks: dict[str, bytes] = {}
    m = make_step(20, {"w.bin": blob(7, 3 * CHUNK)}, chunks=chunks)

    class FailsOnce(FileBackend):
        failed = False

        def put(self, key: str, data: bytes) -> None:
            if not FailsOnce.failed:
                FailsOnce.failed = True
                raise OSError("the bucket is away")
            super().put(key, data)

    store = BackupStore(FailsOnce(tmp_path), rank=0)
    rec = SimpleNamespace(name=m.step, number=20, committed_ns=1, backed_up_ns=None,
                          backing_up=False)
    calls: list[str] = []
    fs = SimpleNamespace(
        steps={m.step: rec}, subscribe=lambda cb: None, backup_pending=lambda: None,
        set_backup_pending=lambda name: None, step_sealed=lambda r: True,
        step_in_ram=lambda r: True, snapshot_step=lambda name: (m, []),
        chunk_reader=lambda pinned: chunks.__getitem__, unpin=lambda pinned: None, evict=list,
        mark_backed_up=lambda name, pinned: calls.append(name) or True, backup_retired=lambda kept: [])
    svc = BackupService(fs, store, interval_s=3600.0, every_ckpts=None, keep_backups=2,
                        url="u", interval_text="1h")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.run)
            with trio.fail_after(30):  # the first backoff is at most 4 s
                while not calls:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert FailsOnce.failed and svc.status.failures == 1
    assert calls == [m.step] and svc.status.backups == 1
    assert restore_files(store, m.step) == {"w.bin": blob(7, 3 * CHUNK)}


# -- which step a job restores, whatever its node count now (adversarial review) ----------

def _save_job_step(be, number: int, ranks, world: int, *, legacy: bool = False) -> None:
    """Every rank in ``ranks`` of a ``world``-rank job backs up its own file of step N
    (``legacy``: markers without the world size, as stores before it was recorded)."""
    for r in ranks:
        chunks: dict[str, bytes] = {}
        m = make_step(number, {f"__{r}_0.distcp": blob(100 * number + r, 70_000)}, rank=r,
                      chunks=chunks)
        BackupStore(be, rank=r, world_size=None if legacy else world,
                    clock_ns=lambda: NOW).put_step(m, chunks.__getitem__)


def _files_of(manifests) -> list[str]:
    from mtcfs.tiers.restore.namespace import snapshot_from_manifests
    snap = snapshot_from_manifests(manifests)
    return sorted(e["name"] for e in snap["entries"] if e["kind"] == "file")


@pytest.mark.parametrize("nodes", [2, 4, 8])
def test_a_job_restore_brings_back_every_rank_of_the_step_whatever_its_node_count(
        tmp_path, nodes) -> None:
    """A 4-rank job saved step_10. The job restarts on ``nodes`` nodes with every store
    wiped (scope=job rebuilds the namespace from the backup tier): the step comes back with
    all 4 ranks' files. Before, on 2 nodes it came back with ranks 0 and 1 only, silently;
    on 8 nodes nothing was restorable (found by an adversarial review)."""
    from mtcfs.tiers.restore.namespace import latest_job_step

    be = FileBackend(str(tmp_path / "bucket"))
    _save_job_step(be, 10, range(4), world=4)
    manifests = latest_job_step(BackupStore(be, rank=0, world_size=nodes), nodes=nodes)
    assert manifests is not None and {m.step for m in manifests} == {"step_10"}
    assert _files_of(manifests) == [f"__{r}_0.distcp" for r in range(4)]


@pytest.mark.parametrize("legacy", [False, True])
def test_a_job_restore_never_picks_a_step_some_of_its_ranks_did_not_complete(
        tmp_path, legacy) -> None:
    """4-rank job: step_10 complete on every rank; step_20 complete on ranks 0 and 1 only
    (ranks 2 and 3 died during its upload, after their intent manifests). Restarted on 2
    nodes, the restore brings back step_10, not the torn step_20; also from markers written
    before the world size was recorded (the ranks with any object of the step count).
    Before, step_20 was chosen, with 2 of its 4 shards."""
    from mtcfs.tiers.backup.layout import complete_key
    from mtcfs.tiers.restore.namespace import latest_job_step

    be = FileBackend(str(tmp_path / "bucket"))
    _save_job_step(be, 10, range(4), world=4, legacy=legacy)
    _save_job_step(be, 20, range(4), world=4, legacy=legacy)
    for r in (2, 3):  # their uploads died before COMPLETE
        be.delete(complete_key("step_20", r))
    manifests = latest_job_step(BackupStore(be, rank=0, world_size=2), nodes=2)
    assert manifests is not None and {m.step for m in manifests} == {"step_10"}
    assert len(manifests) == 4


def test_the_peer_tiers_backup_latest_needs_every_rank_not_a_count_of_them(tmp_path) -> None:
    """scope=node, several nodes: ``backup_latest`` (the newest step complete for every
    rank; it overrides etcd's decision when newer). A bucket left by a 4-rank job holds
    step_20 complete on ranks 1, 2, 3 only (rank 0 died during its upload) and step_10 on
    all. Restarted with nodes=3, it is step_10. Before, 3 ranks counted as enough: ranks 1
    and 2 restored step_20, rank 0 could not, and the job restored a mix."""
    from mtcfs.tiers.peer.tier_membership import MembershipRounds

    be = FileBackend(str(tmp_path / "bucket"))
    _save_job_step(be, 10, range(4), world=4)
    _save_job_step(be, 20, range(1, 4), world=4)
    me = SimpleNamespace(backup_store=BackupStore(be, rank=1, world_size=3),
                         cfg=SimpleNamespace(nodes=3))
    ref = MembershipRounds.backup_latest(me)  # type: ignore[arg-type]
    assert ref is not None and ref.step == "step_10", ref


def test_retention_after_a_restore_on_more_nodes_keeps_the_older_complete_steps(tmp_path
                                                                                ) -> None:
    """A 2-rank job left step_10 and step_20; restored on 3 nodes, it saves step_30. With
    backup_keep=3 all three are kept: the older steps are complete for the job that wrote
    them. Before, retention counted this job's 3 ranks: the older steps, lacking rank 2,
    looked like dead uploads and were deleted, past the grace period."""
    be = FileBackend(str(tmp_path / "bucket"))
    _save_job_step(be, 10, range(2), world=2)
    _save_job_step(be, 20, range(2), world=2)
    _save_job_step(be, 30, range(3), world=3)
    BackupStore(be, rank=0, world_size=3, clock_ns=lambda: NOW + 10**12).retain(3, grace_s=0)
    assert sorted(BackupStore(be, rank=0, world_size=3).job_complete_steps()) == [
        "step_10", "step_20", "step_30"]
