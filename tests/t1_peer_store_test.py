"""Tier-1 tests of the replica store: chunks and manifests held for other ranks, on a real
directory, verified on the way in and out, capacity-limited, reference-counted."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from mtcfs.base.chunking import chunk_hash
from mtcfs.base.manifest import Entry, ManifestError, StepManifest
from mtcfs.tiers.peer import (
    ChunkMismatch, ChunkNotFound, ReplicaChunkCorrupt, ReplicaFull, ReplicaStore,
)
from support.peer import CHUNK, LocalTier, blob, chunks_of, make_step

JOB = "job"


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chunk_file(store: ReplicaStore, h: str) -> str:
    return os.path.join(store.root, "chunks", h[:2], h)


def tmp_files(store: ReplicaStore) -> list[str]:
    return os.listdir(os.path.join(store.root, "tmp"))


@pytest.fixture
def store(tmp_path):
    return ReplicaStore(str(tmp_path / "replicas"), capacity=64 * CHUNK)


# -- chunks ---------------------------------------------------------------------------------

def test_put_and_get_are_verified(store):
    data = blob(1, CHUNK)
    h = chunk_hash(data)
    assert not store.has(h)
    assert store.put_chunk(h, data) is True
    assert store.has(h)
    assert store.get_chunk(h) == data
    assert store.put_chunk(h, data) is False  # held: verified, not rewritten
    assert store.used == CHUNK
    s = store.stats()
    assert (s["chunks_stored"], s["chunks_already_present"], s["chunks"]) == (1, 1, 1)
    with open(chunk_file(store, h), "rb") as f:
        assert f.read() == data
    assert tmp_files(store) == []


def test_wrong_hash_is_refused_and_nothing_stored(store):
    good, bad = blob(1, CHUNK), blob(2, CHUNK)
    h = chunk_hash(good)
    with pytest.raises(ChunkMismatch) as exc:
        store.put_chunk(h, bad)
    assert exc.value.chunk == h and exc.value.actual == chunk_hash(bad)
    assert not store.has(h)
    assert not os.path.exists(chunk_file(store, h))
    assert store.used == 0 and tmp_files(store) == []
    assert store.stats()["chunks_mismatched"] == 1
    # offered again with wrong bytes while a good copy is held: refused too, copy kept
    store.put_chunk(h, good)
    with pytest.raises(ChunkMismatch):
        store.put_chunk(h, bad)
    assert store.get_chunk(h) == good


def test_malformed_digest_is_refused(store):
    with pytest.raises(ValueError):
        store.put_chunk("../../etc/passwd", b"x")
    with pytest.raises(ValueError):
        store.has("ABC")
    with pytest.raises(ValueError):
        store.get_chunk("0" * 63)


def test_corrupt_chunk_on_disk_is_deleted_and_never_served(store):
    data = blob(3, CHUNK)
    h = chunk_hash(data)
    store.put_chunk(h, data)
    with open(chunk_file(store, h), "r+b") as f:  # a bit flips in RAM
        f.seek(100)
        f.write(bytes([data[100] ^ 1]))
    with pytest.raises(ReplicaChunkCorrupt) as exc:
        store.get_chunk(h)
    assert exc.value.chunk == h
    assert not os.path.exists(chunk_file(store, h))
    assert not store.has(h)
    assert store.used == 0
    assert store.stats()["corrupt_deleted"] == 1
    with pytest.raises(ChunkNotFound):
        store.get_chunk(h)
    store.put_chunk(h, data)  # a good copy can come back
    assert store.get_chunk(h) == data


def test_scrub_finds_corrupt_chunks(store):
    good = {chunk_hash(blob(i, CHUNK)): blob(i, CHUNK) for i in range(4)}
    for h, d in good.items():
        store.put_chunk(h, d)
    victim = min(good)
    with open(chunk_file(store, victim), "wb") as f:
        f.write(b"short")
    assert store.scrub() == [victim]
    assert sorted(h for h in good if store.has(h)) == sorted(set(good) - {victim})


def test_pieces_are_written_in_order_and_verified(store):
    data = blob(4, 3 * CHUNK + 17)
    h = chunk_hash(data)
    with store.chunk_writer(h, len(data)) as w:
        assert w.stores
        for off in range(0, len(data), 50_000):
            w.write(data[off:off + 50_000])
        assert store.used == len(data)  # reserved while in flight
        assert w.commit() is True
    assert store.get_chunk(h) == data
    with store.chunk_writer(h, len(data)) as w:  # held: only hashed
        assert not w.stores
        w.write(data)
        assert w.commit() is False
    with store.chunk_writer(chunk_hash(b"abc"), 3) as w:
        with pytest.raises(ValueError):
            w.write(b"abcd")
        w.write(b"ab")
        with pytest.raises(ValueError):
            w.commit()
    assert tmp_files(store) == [] and store.used == len(data)


def test_abandoned_writer_releases_its_reservation(store):
    w = store.chunk_writer(chunk_hash(b"x" * 10), 10)
    w.write(b"x" * 5)
    assert store.used == 10
    w.abort()
    assert store.used == 0 and tmp_files(store) == []


def test_empty_chunk(store):
    h = chunk_hash(b"")
    assert store.put_chunk(h, b"") is True
    assert store.get_chunk(h) == b""


# -- capacity -------------------------------------------------------------------------------

def test_capacity_is_enforced(tmp_path):
    store = ReplicaStore(str(tmp_path / "r"), capacity=3 * CHUNK)
    datas = [blob(10 + i, CHUNK) for i in range(4)]
    for d in datas[:3]:
        store.put_chunk(chunk_hash(d), d)
    with pytest.raises(ReplicaFull) as exc:
        store.put_chunk(chunk_hash(datas[3]), datas[3])
    assert exc.value.errno == errno.ENOSPC and exc.value.free == 0
    assert not store.has(chunk_hash(datas[3]))
    assert store.used == 3 * CHUNK and tmp_files(store) == []
    assert store.put_chunk(chunk_hash(datas[0]), datas[0]) is False  # held: no space needed
    # a writer in flight holds its space
    stats = store.gc(1, orphan_grace_s=0)
    assert stats.chunks_deleted == 3 and store.used == 0
    w = store.chunk_writer(chunk_hash(datas[3]), 2 * CHUNK + 1)
    with pytest.raises(ReplicaFull):
        store.put_chunk(chunk_hash(datas[0]), datas[0])
    w.abort()
    store.put_chunk(chunk_hash(datas[0]), datas[0])


def test_manifests_count_against_capacity(tmp_path):
    files = {"a": blob(20, 2 * CHUNK)}
    m = make_step(JOB, 1, 100, files)
    raw = m.to_bytes()
    store = ReplicaStore(str(tmp_path / "r"), capacity=2 * CHUNK + len(raw) - 1)
    for h, d in chunks_of(files["a"]).items():
        store.put_chunk(h, d)
    with pytest.raises(ReplicaFull):
        store.put_manifest(m)
    assert store.list_manifests() == []
    assert store.used == 2 * CHUNK


# -- manifests ------------------------------------------------------------------------------

def test_manifest_reports_missing_chunks_and_survives_restart(tmp_path):
    files = {"w.bin": blob(30, 3 * CHUNK), "meta.json": b'{"step": 100}'}
    m = make_step(JOB, 2, 100, files)
    all_chunks = {**chunks_of(files["w.bin"]), **chunks_of(files["meta.json"])}
    store = ReplicaStore(str(tmp_path / "r"), capacity=1 << 30)
    first = min(all_chunks)
    store.put_chunk(first, all_chunks[first])
    res = store.put_manifest(m)
    assert res.chunks_total == 4 and not res.replaced
    assert sorted(res.missing) == sorted(set(all_chunks) - {first})
    for h in res.missing:
        store.put_chunk(h, all_chunks[h])
    assert store.missing_chunks(2, "100") == []
    again = store.put_manifest(m)
    assert again.replaced and again.complete
    [info] = store.list_manifests(2, with_bytes=True)
    assert (info.rank, info.step, info.step_number, info.chunks_total, info.chunks_missing) == \
        (2, "100", 100, 4, 0)
    assert StepManifest.from_bytes(info.manifest) == m
    used = store.used

    reopened = ReplicaStore(str(tmp_path / "r"), capacity=1 << 30)
    assert reopened.used == used
    assert [(i.rank, i.step, i.chunks_missing) for i in reopened.list_manifests()] == \
        [(2, "100", 0)]
    assert reopened.get_chunk(first) == all_chunks[first]
    assert os.path.isfile(os.path.join(reopened.root, "manifests", "2", "100.json"))


def test_manifest_paths_escaping_the_job_are_refused(store):
    bad = [
        Entry(path="100", kind="dir", mode=0o755, mtime_ns=1),
        Entry(path="100/../../etc/passwd", kind="file", mode=0o644, mtime_ns=1),
    ]
    with pytest.raises(ManifestError):
        store.put_manifest(StepManifest(job=JOB, step="100", step_number=100, created_ns=1,
                                        entries=bad, rank=1))
    outside = [Entry(path="100", kind="dir", mode=0o755, mtime_ns=1),
               Entry(path="200/x", kind="file", mode=0o644, mtime_ns=1)]
    with pytest.raises(ManifestError):
        store.put_manifest(StepManifest(job=JOB, step="100", step_number=100, created_ns=1,
                                        entries=outside, rank=1))
    for step in ("..", "a/b", ""):
        with pytest.raises(ValueError):
            store.put_manifest(StepManifest(job=JOB, step=step, step_number=1, created_ns=1,
                                            entries=[], rank=1))
    assert store.list_manifests() == []
    assert os.listdir(os.path.join(store.root, "manifests")) == []


def test_unreadable_manifest_is_dropped_at_open(tmp_path):
    store = ReplicaStore(str(tmp_path / "r"), capacity=1 << 20)
    store.put_manifest(make_step(JOB, 1, 5, {"f": b"hello"}))
    path = os.path.join(store.root, "manifests", "1", "5.json")
    with open(path, "wb") as f:
        f.write(b"{not json")
    with open(os.path.join(store.root, "tmp", "leftover"), "wb") as f:
        f.write(b"x")
    reopened = ReplicaStore(str(tmp_path / "r"), capacity=1 << 20)
    assert reopened.list_manifests() == [] and not os.path.exists(path)
    assert tmp_files(reopened) == []


# -- garbage collection ---------------------------------------------------------------------

def put_step(store: ReplicaStore, rank: int, step_number: int,
             files: dict[str, bytes]) -> StepManifest:
    m = make_step(JOB, rank, step_number, files)
    for d in files.values():
        for h, c in chunks_of(d).items():
            store.put_chunk(h, c)
    assert store.put_manifest(m).complete
    return m


def test_gc_keeps_referenced_chunks_and_respects_grace(tmp_path):
    clock = FakeClock()
    store = ReplicaStore(str(tmp_path / "r"), capacity=1 << 30, clock=clock)
    shared = blob(40, CHUNK)              # an unchanged tensor, in every step of rank 1
    old_only = blob(41, CHUNK)
    new_only = blob(42, CHUNK)
    other_rank = blob(43, CHUNK)          # rank 2's step references old_only too
    put_step(store, 1, 100, {"a": shared + old_only})
    put_step(store, 1, 200, {"a": shared + new_only})
    put_step(store, 2, 100, {"b": old_only + other_rank})
    orphan = blob(44, CHUNK)              # put by a sender that has not published yet
    store.put_chunk(chunk_hash(orphan), orphan)
    clock.now += 10

    stats = store.gc(1, orphan_grace_s=60)
    assert stats.manifests_deleted == [(1, "100")]
    assert stats.chunks_deleted == 0      # old_only still referenced by rank 2, orphan young
    assert store.has(chunk_hash(old_only)) and store.has(chunk_hash(orphan))

    store.drop_manifest(2, "100")
    clock.now += 30
    assert store.has(chunk_hash(orphan))  # asked for: its grace period restarts
    clock.now += 45
    stats = store.gc(1, orphan_grace_s=60)
    # old_only and other_rank: unreferenced for long; orphan: asked for 45 s ago
    assert stats.chunks_deleted == 2
    assert not store.has(chunk_hash(old_only)) and not store.has(chunk_hash(other_rank))
    assert store.has(chunk_hash(orphan))
    assert store.has(chunk_hash(shared)) and store.has(chunk_hash(new_only))
    clock.now += 61
    assert store.gc(1, orphan_grace_s=60).chunks_deleted == 1
    assert store.used == 2 * CHUNK + len(store.get_manifest(1, "200"))


def test_gc_protects_steps_complete_in_the_job(tmp_path):
    store = ReplicaStore(str(tmp_path / "r"), capacity=1 << 30)
    for n in (100, 200, 300):
        put_step(store, 3, n, {"x": blob(n, CHUNK)})
    stats = store.gc(1, protect_steps={100}, orphan_grace_s=0)
    assert stats.manifests_deleted == [(3, "200")]
    assert [i.step for i in store.list_manifests(3)] == ["100", "300"]
    assert stats.chunks_deleted == 1 and stats.chunks_kept == 2
    with pytest.raises(ValueError):
        store.gc(0)


# -- the node's own tier --------------------------------------------------------------------

def test_own_tier_answers_has_and_get_without_space(tmp_path):
    data = blob(50, CHUNK)
    h = chunk_hash(data)
    local = LocalTier({h: data})
    store = ReplicaStore(str(tmp_path / "r"), capacity=0, local=local)
    assert store.has(h)
    assert store.get_chunk(h) == data
    m = make_step(JOB, 1, 7, {"w": data})
    with pytest.raises(ReplicaFull):  # own-tier chunks take no space; a manifest does
        store.put_manifest(m)
    local.chunks[h] = b"rotten" + data[6:]
    with pytest.raises(ReplicaChunkCorrupt):
        store.get_chunk(h)
    assert store.stats()["corrupt_local"] == 1


def test_own_tier_counts_as_held_for_manifests(tmp_path):
    data = blob(51, 2 * CHUNK)
    local = LocalTier(chunks_of(data))
    store = ReplicaStore(str(tmp_path / "r"), capacity=1 << 20, local=local)
    res = store.put_manifest(make_step(JOB, 1, 7, {"w": data}))
    assert res.complete and res.chunks_total == 2
    assert store.list_manifests(1)[0].chunks_missing == 0
    assert store.stats()["chunks"] == 0


# -- threads --------------------------------------------------------------------------------

def test_concurrent_puts_keep_the_books_straight(tmp_path):
    store = ReplicaStore(str(tmp_path / "r"), capacity=1 << 30)
    datas = [blob(60 + i, CHUNK) for i in range(16)]
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(len(datas)):
                d = datas[(i + k) % len(datas)]
                store.put_chunk(chunk_hash(d), d)
                assert store.get_chunk(chunk_hash(d)) == d
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = store.stats()
    assert s["chunks"] == 16 and s["chunks_stored"] == 16
    assert s["chunks_stored"] + s["chunks_already_present"] == 8 * 16
    assert store.used == 16 * CHUNK and tmp_files(store) == []


# -- the per-rank quota -------------------------------------------------------------------------

def test_each_sender_rank_holds_at_most_its_quota(tmp_path):
    from mtcfs.tiers.peer.errors import ReplicaQuotaExceeded
    quota = 3 * CHUNK + 100
    s = ReplicaStore(str(tmp_path / "r"), capacity=100 * CHUNK, quota=lambda: quota)
    mine = [blob(i, CHUNK) for i in range(5)]
    for data in mine[:3]:
        w = s.chunk_writer(chunk_hash(data), len(data), rank=1)
        w.write(data)
        assert w.commit()
    with pytest.raises(ReplicaQuotaExceeded) as e:
        s.chunk_writer(chunk_hash(mine[3]), CHUNK, rank=1)
    assert e.value.errno == errno.ENOSPC and "rank 1's share" in str(e.value)
    assert not tmp_files(s) and s.held_by_rank() == {1: 3 * CHUNK}
    # another rank has its own share; the node's own hand-overs (no rank) have none
    w = s.chunk_writer(chunk_hash(mine[3]), CHUNK, rank=2)
    w.write(mine[3])
    w.commit()
    s.put_chunk(chunk_hash(mine[4]), mine[4])
    assert s.held_by_rank() == {1: 3 * CHUNK, 2: CHUNK}
    # a chunk already held costs its sender nothing; a manifest counts against its rank
    w = s.chunk_writer(chunk_hash(mine[0]), CHUNK, rank=2)
    w.write(mine[0])
    assert not w.commit()
    m = make_step(JOB, 1, 10, {"f": b"".join(mine[:3])})
    with pytest.raises(ReplicaQuotaExceeded):  # 3 chunks + a manifest > 3 chunks + 100
        s.put_manifest(StepManifest(job=JOB, step="10", step_number=10, created_ns=1,
                                    entries=[*m.entries,
                                             Entry(path="10/pad", kind="file", mode=0o644,
                                                   mtime_ns=1, size=0)], rank=1))
    # freed by gc: the share is usable again
    s.gc(keep_steps_per_rank=1, orphan_grace_s=0)
    assert s.held_by_rank() == {}
    w = s.chunk_writer(chunk_hash(mine[3]), CHUNK, rank=1)
    w.abort()


def test_chunks_found_at_start_belong_to_the_rank_whose_manifest_lists_them(tmp_path):
    data = blob(7, 2 * CHUNK)
    s = ReplicaStore(str(tmp_path / "r"), capacity=100 * CHUNK)
    for h, piece in chunks_of(data).items():
        s.put_chunk(h, piece)
    s.put_manifest(make_step(JOB, 3, 10, {"f": data}))
    again = ReplicaStore(str(tmp_path / "r"), capacity=100 * CHUNK, quota=lambda: 10 * CHUNK)
    assert again.held_by_rank()[3] >= 2 * CHUNK
