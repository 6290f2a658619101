"""Tier-1 tests of the backup tier, against a directory and against GCS (emulator).

The same conformance suite runs on :class:`FileBackend` and on :class:`GCSBackend` talking to
a real gcp-storage-emulator through the real google-cloud-storage client. Transient faults
are injected by a loopback HTTP proxy (:class:`support.gcs.FlakyProxy`), not by mocks.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Iterator

import pytest

from mtcfs.base.chunking import chunk_hash
from mtcfs.base.manifest import Entry, StepManifest
from mtcfs.tiers.backup import (
    Backend, BackupError, BackupStore, ChunkCorrupt, FileBackend, GCSBackend, NotFound,
    RetryingBackend, RetryPolicy, TransientError, open_backend,
)
from mtcfs.tiers.backup.codec import encode_chunk
from mtcfs.tiers.backup.layout import chunk_key, complete_key, manifest_key
from support.gcs import FlakyProxy, GcsEmulator

CHUNK = 64 * 1024  # the smallest allowed chunk size keeps the suite fast
FAST = RetryPolicy(max_attempts=50, base_delay=0.001, max_delay=0.02)
JOB = "job"


# -- helpers -------------------------------------------------------------------------------

def blob(seed: int, size: int, *, compressible: bool = False) -> bytes:
    """Deterministic test bytes; compressible ones repeat a short pattern."""
    rng = random.Random(seed)
    if compressible:
        pattern = rng.randbytes(97)
        return (pattern * (size // len(pattern) + 1))[:size]
    return rng.randbytes(size)


def make_step(step_number: int, files: dict[str, bytes], *, created_ns: int | None = None,
              chunks: dict[str, bytes] | None = None) -> StepManifest:
    """A StepManifest for files below ``<step_number>/``; their chunks go into ``chunks``."""
    step = str(step_number)
    entries = [Entry(path=step, kind="dir", mode=0o755, mtime_ns=1)]
    for name, data in sorted(files.items()):
        hashes = []
        for off in range(0, len(data), CHUNK):
            piece = data[off:off + CHUNK]
            h = chunk_hash(piece)
            hashes.append(h)
            if chunks is not None:
                chunks[h] = piece
        entries.append(Entry(path=f"{step}/{name}", kind="file", mode=0o644, mtime_ns=2,
                             size=len(data), chunk_size=CHUNK, chunks=tuple(hashes),
                             blake3=chunk_hash(data)))
    return StepManifest(job=JOB, step=step, step_number=step_number,
                        created_ns=created_ns if created_ns is not None else step_number,
                        entries=entries)


def restore_files(store: BackupStore, step: str) -> dict[str, bytes]:
    """Read a complete step back, file by file, from its chunks."""
    m = store.get_step(step)
    return {e.path.split("/", 1)[1]: b"".join(store.get_chunk(h) for h in e.chunks)
            for e in m.entries if e.kind == "file"}


def chunk_keys(backend: Backend) -> set[str]:
    return {k for k in backend.list("chunks/")}


class Recording(Backend):
    """Wraps a backend and records the order of puts (our own interface, not a mock)."""

    def __init__(self, inner: Backend) -> None:
        self.inner, self.puts, self._lock = inner, [], threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)
        with self._lock:
            self.puts.append(key)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str) -> Iterator[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def describe(self) -> str:
        return self.inner.describe()


# -- fixtures ------------------------------------------------------------------------------

@pytest.fixture(params=["file", "gcs"])
def backend(request: pytest.FixtureRequest, tmp_path) -> Backend:
    """A raw backend, empty, of each kind."""
    if request.param == "file":
        return FileBackend(tmp_path / "backup")
    emu: GcsEmulator = request.getfixturevalue("gcs_emulator")
    return GCSBackend(emu.bucket, f"t/{uuid.uuid4().hex}", endpoint=emu.url)


@pytest.fixture
def store(backend: Backend) -> BackupStore:
    return BackupStore(RetryingBackend(backend, FAST))


# -- backend conformance -------------------------------------------------------------------

def test_backend_put_get_exists_list_delete(backend: Backend) -> None:
    assert list(backend.list("")) == []
    assert not backend.exists("a/1")
    backend.put("a/1", b"one")
    backend.put("a/10", b"ten")
    backend.put("b/x/y", b"")
    backend.put("a/1", b"uno")  # overwrite
    assert backend.get("a/1") == b"uno"
    assert backend.get("b/x/y") == b""
    assert backend.exists("a/10") and not backend.exists("a")
    assert sorted(backend.list("")) == ["a/1", "a/10", "b/x/y"]
    assert sorted(backend.list("a/1")) == ["a/1", "a/10"]  # a string prefix, not a dir
    assert sorted(backend.list("a/")) == ["a/1", "a/10"]
    assert list(backend.list("c/")) == []
    backend.delete("a/1")
    backend.delete("a/1")  # missing is fine
    backend.delete("never/was")
    assert not backend.exists("a/1")
    assert sorted(backend.list("")) == ["a/10", "b/x/y"]
    with pytest.raises(NotFound):
        backend.get("a/1")
    big = blob(1, 3 * 1024 * 1024)
    backend.put("big", big)
    assert backend.get("big") == big
    assert "backup" in backend.describe() or backend.describe().startswith("gs://")


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "../x", "a/./b", "a/\n"])
def test_backend_rejects_bad_keys(backend: Backend, key: str) -> None:
    with pytest.raises(ValueError):
        backend.put(key, b"x")
    with pytest.raises(ValueError):
        backend.get(key)


def test_file_backend_put_leaves_no_temp_files(tmp_path) -> None:
    be = FileBackend(tmp_path)
    for i in range(5):
        be.put(f"d/k{i}", b"x" * i)
    be.delete("d/k0")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["k1", "k2", "k3", "k4"]
    (tmp_path / "d" / ".mtcfs-tmp-0123").write_bytes(b"left by a crashed writer")
    assert sorted(be.list("d/")) == ["d/k1", "d/k2", "d/k3", "d/k4"]
    for i in range(1, 5):
        be.delete(f"d/k{i}")
    (tmp_path / "d" / ".mtcfs-tmp-0123").unlink()
    be.delete("d/k1")
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(BackupError) as info:
        be.put("file/below", b"x")  # a path component is a file: permanent
    assert not isinstance(info.value, TransientError)


# -- the backup store ----------------------------------------------------------------------

def test_put_step_roundtrip_bit_exact(store: BackupStore) -> None:
    files = {
        "model.bin": blob(1, 5 * CHUNK + 123),
        "opt.bin": blob(2, 3 * CHUNK, compressible=True),
        "meta.json": b'{"step": 100}',
        "empty": b"",
    }
    chunks: dict[str, bytes] = {}
    m = make_step(100, files, chunks=chunks)
    seen: list[tuple[int, int]] = []
    stats = store.put_step(m, chunks.__getitem__, progress=lambda d, t: seen.append((d, t)))
    assert stats.chunks_total == len(chunks) == stats.chunks_uploaded
    assert stats.bytes_logical == sum(len(v) for v in files.values())
    assert stats.bytes_new == sum(len(v) for v in chunks.values())
    assert 0 < stats.bytes_uploaded < stats.bytes_new  # the compressible file shrank
    assert seen[-1] == (stats.bytes_new, stats.bytes_new)
    steps = store.list_steps()
    assert [(s.step, s.step_number, s.total_bytes, s.chunks) for s in steps] == [
        ("100", 100, stats.bytes_logical, len(chunks))]
    assert store.latest_step() == steps[0]
    assert store.get_step("100").to_bytes() == m.to_bytes()
    assert restore_files(store, "100") == {k: v for k, v in files.items()}
    for h, data in chunks.items():
        assert store.has_chunk(h)
        assert store.get_chunk(h) == data
    counters = store.stats()
    assert counters["chunks_uploaded"] == len(chunks)
    assert counters["bytes_downloaded"] > 0 and counters["errors"] == 0
    with pytest.raises(NotFound):
        store.get_step("200")
    with pytest.raises(NotFound):
        store.get_chunk(chunk_hash(b"never stored"))


def test_dedup_uploads_only_changed_chunks(store: BackupStore, backend: Backend) -> None:
    weights = blob(3, 16 * CHUNK)
    chunks: dict[str, bytes] = {}
    first = store.put_step(make_step(1, {"w.bin": weights, "copy.bin": weights},
                                     chunks=chunks), chunks.__getitem__)
    assert first.chunks_total == 16 and first.chunks_uploaded == 16  # copy.bin deduped

    changed = bytearray(weights)
    changed[2 * CHUNK + 5] ^= 0xFF
    changed[9 * CHUNK] ^= 0xFF
    changed = bytes(changed)
    new_pieces = [changed[2 * CHUNK:3 * CHUNK], changed[9 * CHUNK:10 * CHUNK]]
    second = store.put_step(make_step(2, {"w.bin": changed, "copy.bin": weights},
                                      chunks=chunks), chunks.__getitem__)
    assert second.chunks_uploaded == 2
    assert second.bytes_new == 2 * CHUNK
    assert second.bytes_uploaded == sum(len(encode_chunk(p)) for p in new_pieces)
    assert len(chunk_keys(backend)) == 18

    # A fresh store on the same bucket learns what is there from one listing.
    fresh = BackupStore(RetryingBackend(backend, FAST))
    again = fresh.put_step(make_step(3, {"w.bin": changed}), lambda h: pytest.fail(h))
    assert again.chunks_uploaded == 0 and again.bytes_uploaded == 0
    assert [s.step for s in fresh.list_steps()] == ["1", "2", "3"]
    assert restore_files(fresh, "2") == {"w.bin": changed, "copy.bin": weights}
    assert fresh.put_chunk(chunk_hash(new_pieces[0]), new_pieces[0]) == 0


def test_put_chunk_verifies_hash(store: BackupStore) -> None:
    with pytest.raises(ValueError, match="hashes to"):
        store.put_chunk(chunk_hash(b"a"), b"b")
    with pytest.raises(ValueError):
        store.put_chunk("not-a-hash", b"b")
    assert store.put_chunk(chunk_hash(b"a"), b"a") > 0
    assert store.put_chunk(chunk_hash(b"a"), b"a") == 0


def test_complete_marker_is_written_last(backend: Backend) -> None:
    rec = Recording(backend)
    store = BackupStore(rec)
    chunks: dict[str, bytes] = {}
    store.put_step(make_step(7, {"a": blob(4, 6 * CHUNK)}, chunks=chunks), chunks.__getitem__)
    assert rec.puts[0] == manifest_key("7")  # the intent, before any chunk
    assert rec.puts[-1] == complete_key("7")
    assert sorted(rec.puts[1:-1]) == sorted(chunk_key(h) for h in chunks)


def test_failed_upload_is_not_listed(store: BackupStore, backend: Backend) -> None:
    chunks: dict[str, bytes] = {}
    good = make_step(1, {"a": blob(5, 2 * CHUNK)}, chunks=chunks)
    store.put_step(good, chunks.__getitem__)
    uploaded_before = store.stats()["chunks_uploaded"]
    bad = make_step(2, {"a": blob(6, 8 * CHUNK)}, chunks=chunks)
    calls = []

    def failing_read(h: str) -> bytes:
        calls.append(h)
        if len(calls) == 3:
            raise OSError("RAM tier lost the chunk")
        return chunks[h]

    with pytest.raises(OSError, match="RAM tier lost"):
        store.put_step(bad, failing_read)
    assert [s.step for s in store.list_steps()] == ["1"]
    assert store.latest_step().step == "1"
    with pytest.raises(NotFound):
        store.get_step("2")
    assert backend.exists(manifest_key("2")) and not backend.exists(complete_key("2"))
    partial = store.stats()["chunks_uploaded"] - uploaded_before
    assert partial < 8
    # Retrying the step later completes it, uploading only what is still missing.
    stats = store.put_step(bad, chunks.__getitem__)
    assert stats.chunks_uploaded == 8 - partial
    assert [s.step for s in store.list_steps()] == ["1", "2"]
    assert restore_files(store, "2") == {"a": blob(6, 8 * CHUNK)}


def test_corrupt_chunk_raises(store: BackupStore, backend: Backend) -> None:
    data = blob(7, 3 * CHUNK)
    chunks: dict[str, bytes] = {}
    store.put_step(make_step(1, {"a": data}, chunks=chunks), chunks.__getitem__)
    h1, h2, h3 = list(chunks)
    backend.put(chunk_key(h1), b"definitely not zstd")
    backend.put(chunk_key(h2), encode_chunk(b"a valid frame of other bytes"))
    backend.put(chunk_key(h3), encode_chunk(chunks[h3])[:-7])  # truncated
    for h in (h1, h2, h3):
        with pytest.raises(ChunkCorrupt, match=h) as info:
            store.get_chunk(h)
        assert info.value.chunk == h
    assert store.stats()["corrupt_chunks"] == 3


def test_retention_deletes_old_steps_and_exactly_unreferenced_chunks(
        backend: Backend) -> None:
    now = 10**18
    store = BackupStore(RetryingBackend(backend, FAST), clock_ns=lambda: now)
    base = blob(8, 4 * CHUNK)
    chunks: dict[str, bytes] = {}
    manifests = {}
    for n in (1, 2, 3, 4):
        files = {"shared": base, f"own{n}": blob(100 + n, 2 * CHUNK)}
        manifests[n] = make_step(n, files, chunks=chunks, created_ns=n)
        store.put_step(manifests[n], chunks.__getitem__)
    # An abandoned upload older than what will be kept, and a fresh one in progress.
    stale = make_step(0, {"x": blob(200, CHUNK)}, chunks=chunks, created_ns=0)
    store.begin_step(stale)
    store.put_chunk(*next((h, chunks[h]) for h in stale.chunk_set()))
    inflight = make_step(5, {"y": blob(300, CHUNK)}, chunks=chunks, created_ns=now)
    store.begin_step(inflight)
    store.put_chunk(*next((h, chunks[h]) for h in inflight.chunk_set()))
    orphan = blob(400, 1000)
    store.put_chunk(chunk_hash(orphan), orphan)  # referenced by nothing

    before = chunk_keys(backend)
    stats = store.retain(keep=2, grace_s=60)
    assert stats.steps_kept == ["3", "4"] and stats.steps_deleted == ["1", "2"]
    assert stats.incomplete_deleted == ["0"] and stats.swept
    live = manifests[3].chunk_set() | manifests[4].chunk_set() | inflight.chunk_set()
    expected = {chunk_key(h) for h in live}
    assert chunk_keys(backend) == expected
    assert stats.chunks_kept == len(expected)
    assert stats.chunks_deleted == len(before - expected)
    assert [s.step for s in store.list_steps()] == ["3", "4"]
    assert not backend.exists(manifest_key("1")) and not backend.exists(complete_key("2"))
    assert not backend.exists(manifest_key("0")) and backend.exists(manifest_key("5"))
    # The index forgot the swept chunks: a step needing one uploads it again.
    assert not store.has_chunk(chunk_hash(orphan))
    assert restore_files(store, "3") == {"shared": base, "own3": blob(103, 2 * CHUNK)}
    assert store.put_chunk(chunk_hash(orphan), orphan) > 0
    with pytest.raises(ValueError):
        store.retain(keep=0)


def test_retention_grace_protects_recent_incomplete_step(tmp_path) -> None:
    now = 10**18
    store = BackupStore(FileBackend(tmp_path), clock_ns=lambda: now)
    chunks: dict[str, bytes] = {}
    for n in (10, 20):
        store.put_step(make_step(n, {"f": blob(n, CHUNK)}, chunks=chunks, created_ns=now),
                       chunks.__getitem__)
    slow = make_step(5, {"g": blob(5, CHUNK)}, chunks=chunks, created_ns=now - 10**9)
    store.begin_step(slow)  # e.g. re-uploading an old step after a rollback
    store.put_chunk(*next((h, chunks[h]) for h in slow.chunk_set()))
    stats = store.retain(keep=1, grace_s=3600)
    assert stats.incomplete_deleted == [] and stats.steps_deleted == ["10"]
    assert all(store.has_chunk(h) for h in slow.chunk_set())


def test_concurrent_steps_upload_shared_chunks_once(store: BackupStore) -> None:
    shared = blob(9, 6 * CHUNK)
    chunks: dict[str, bytes] = {}
    ms = [make_step(n, {"s": shared, "o": blob(50 + n, CHUNK)}, chunks=chunks)
          for n in (1, 2, 3)]
    results = []
    threads = [threading.Thread(target=lambda m=m: results.append(
        store.put_step(m, chunks.__getitem__))) for m in ms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(r.chunks_uploaded for r in results) == 6 + 3
    assert [s.step for s in store.list_steps()] == ["1", "2", "3"]


def test_retention_waits_for_an_upload_in_progress(tmp_path) -> None:
    store = BackupStore(FileBackend(tmp_path))
    chunks: dict[str, bytes] = {}
    store.put_step(make_step(1, {"a": blob(60, CHUNK)}, chunks=chunks), chunks.__getitem__)
    m2 = make_step(2, {"b": blob(61, 3 * CHUNK)}, chunks=chunks)
    reading, release = threading.Event(), threading.Event()

    def slow_read(h: str) -> bytes:
        reading.set()
        assert release.wait(10)
        return chunks[h]

    upload = threading.Thread(target=store.put_step, args=(m2, slow_read))
    upload.start()
    assert reading.wait(10)
    done = []
    sweeper = threading.Thread(target=lambda: done.append(store.retain(keep=1, grace_s=0)))
    sweeper.start()
    sweeper.join(0.3)
    assert sweeper.is_alive() and not done  # blocked by the upload
    release.set()
    upload.join(10)
    sweeper.join(10)
    assert done[0].steps_kept == ["2"] and done[0].steps_deleted == ["1"]
    assert restore_files(store, "2") == {"b": blob(61, 3 * CHUNK)}


def test_split_upload_and_remote_check(backend: Backend) -> None:
    """begin_step / put_chunk on several stores (nodes) / commit_step, as the coordinator
    would drive an upload shared by nodes."""
    node_a = BackupStore(backend)
    node_b = BackupStore(backend, check_remote=True)
    chunks: dict[str, bytes] = {}
    m = make_step(9, {"a": blob(70, 2 * CHUNK), "b": blob(71, 2 * CHUNK)}, chunks=chunks)
    h = list(chunks)
    node_a.begin_step(m)
    assert node_b.has_chunk(h[0]) is False  # b loads its index now
    for x in h[:2]:
        assert node_a.put_chunk(x, chunks[x]) > 0
    assert node_b.put_chunk(h[0], chunks[h[0]]) == 0  # found remotely, not uploaded again
    node_b.put_chunk(h[2], chunks[h[2]])
    with pytest.raises(BackupError, match=h[3]):
        node_a.commit_step(m)  # one chunk is nowhere
    assert node_a.list_steps() == []
    node_b.put_chunk(h[3], chunks[h[3]])
    node_a.commit_step(m)  # asks the backend about the chunks b uploaded
    assert restore_files(node_b, "9") == {"a": blob(70, 2 * CHUNK), "b": blob(71, 2 * CHUNK)}


def test_unreadable_manifest_blocks_the_sweep(tmp_path) -> None:
    be = FileBackend(tmp_path)
    store = BackupStore(be)
    chunks: dict[str, bytes] = {}
    for n in (1, 2):
        store.put_step(make_step(n, {"f": blob(80 + n, CHUNK)}, chunks=chunks),
                       chunks.__getitem__)
    be.put(manifest_key("3"), b"{not json")
    stats = store.retain(keep=1, grace_s=0)
    assert stats.steps_deleted == ["1"] and not stats.swept and stats.chunks_deleted == 0
    assert len(chunk_keys(be)) == 2


# -- transient faults through the real client ------------------------------------------------

def test_transient_faults_are_retried_until_the_step_completes(gcs_emulator) -> None:
    prefix = f"t/{uuid.uuid4().hex}"
    with FlakyProxy(gcs_emulator.url, fail_rate=0.3, reset_fraction=0.3, lost_fraction=0.2,
                    seed=42) as proxy:
        flaky = RetryingBackend(GCSBackend(gcs_emulator.bucket, prefix, endpoint=proxy.url),
                                FAST)
        store = BackupStore(flaky)
        files = {"model": blob(11, 12 * CHUNK), "opt": blob(12, 4 * CHUNK, compressible=True)}
        chunks: dict[str, bytes] = {}
        m = make_step(300, files, chunks=chunks)
        stats = store.put_step(m, chunks.__getitem__)
        assert stats.chunks_uploaded == len(chunks)
        assert [s.step for s in store.list_steps()] == ["300"]
        assert restore_files(store, "300") == files
        counters = store.stats()
        assert counters["retries"] > 0 and counters["gave_up"] == 0
        assert proxy.faults() > 0 and proxy.counts["resets"] > 0
        # Reading back without faults, straight from the emulator, is bit-exact too.
        direct = BackupStore(GCSBackend(gcs_emulator.bucket, prefix, endpoint=gcs_emulator.url))
        assert restore_files(direct, "300") == files


def test_retry_gives_up_with_transient_error_when_attempts_run_out(gcs_emulator) -> None:
    with FlakyProxy(gcs_emulator.url, fail_first=10) as proxy:
        be = RetryingBackend(GCSBackend(gcs_emulator.bucket, "t/giveup", endpoint=proxy.url),
                             RetryPolicy(max_attempts=3, base_delay=0.001, max_delay=0.001))
        with pytest.raises(TransientError) as info:
            be.put("k", b"v")
        assert "503" in str(info.value)
        assert be.stats() == {"retries": 2, "retry_wait_ms": 0, "gave_up": 1}
        assert proxy.counts["requests"] == 3, proxy.log


def test_unreachable_endpoint_is_transient() -> None:
    from support.gcs import free_port
    be = GCSBackend("bkt", "p", endpoint=f"http://127.0.0.1:{free_port()}", timeout=2)
    with pytest.raises(TransientError):
        be.get("k")


def test_permanent_errors_are_not_retried(gcs_emulator) -> None:
    be = RetryingBackend(GCSBackend("no-such-bucket", "p", endpoint=gcs_emulator.url), FAST)
    with pytest.raises(BackupError) as info:
        be.put("k", b"v")
    assert not isinstance(info.value, TransientError)
    assert be.stats()["retries"] == 0


def test_retry_policy_backoff_deadline_and_stop() -> None:
    policy = RetryPolicy(base_delay=0.1, max_delay=1.0)
    rng = random.Random(0)
    for n in range(1, 12):
        cap = min(1.0, 0.1 * 2 ** (n - 1))
        assert all(0 <= policy.backoff(n, rng) <= cap for _ in range(50))
    waits: list[float] = []
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 5:
            raise TransientError("try again")
        return "ok"

    assert policy.call(flaky, sleep=waits.append) == "ok"
    assert len(waits) == 4
    with pytest.raises(ValueError):  # not transient: no retry
        policy.call(lambda: (_ for _ in ()).throw(ValueError("bug")), sleep=waits.append)

    clock = [0.0]

    def sleep(s: float) -> None:
        clock[0] += s

    def always() -> None:
        raise TransientError("down")

    with pytest.raises(TransientError) as info:
        RetryPolicy(base_delay=1, max_delay=4, deadline=10).call(
            always, sleep=sleep, clock=lambda: clock[0])
    assert clock[0] <= 10 and "deadline" in "".join(info.value.__notes__)
    stop = threading.Event()
    stop.set()
    with pytest.raises(TransientError):
        RetryPolicy().call(always, stop=stop)
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


# -- URLs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("url", [
    "", "gs://", "gs:///prefix", "gs://Bad_Bucket/x", "gs://bkt/a/../b", "file://relative/p",
    "file:relative", "file:///a/../b", "s3://bucket/x", "/abs/path", "gs://bkt/p?x=1",
])
def test_open_backend_rejects_bad_urls(url: str) -> None:
    with pytest.raises(ValueError) as info:
        open_backend(url)
    msg = str(info.value)
    assert repr(url) in msg and "\n" not in msg


def test_open_backend_accepts_good_urls(tmp_path, gcs_emulator, monkeypatch) -> None:
    fb = open_backend(f"file://{tmp_path}/b")
    assert isinstance(fb, FileBackend) and fb.describe() == f"file://{tmp_path}/b"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.url)
    gb = open_backend(f"gs://{gcs_emulator.bucket}/jobs/x/")
    assert isinstance(gb, GCSBackend)
    assert gb.describe().startswith(f"gs://{gcs_emulator.bucket}/jobs/x")
    gb.put("k", b"via env")
    assert GCSBackend(gcs_emulator.bucket, "jobs/x", endpoint=gcs_emulator.url).get("k") \
        == b"via env"
