"""The backup store: chunks and steps of one job in one backend.

See :mod:`replication.backup.layout` for the object names. The rules that make a backup
trustworthy:

* A chunk object is named by the blake3 of its *uncompressed* bytes and checked against that
  name on every read (:func:`replication.backup.codec.decode_chunk`); bad bytes are never
  returned.
* Each unique chunk is uploaded once per bucket, ever: the store knows which chunks the
  bucket holds (:class:`~replication.backup.chunk_index.ChunkIndex`) and skips them, across
  files, steps and restarts.
* A step is written in three phases: ``manifest.json`` first (an *intent*: it pins the
  step's chunks against a sweep), then the missing chunks, then ``COMPLETE`` last. Only steps
  with ``COMPLETE`` are listed and restored, so a failure at any point leaves the previous
  complete step as the latest one. (The intent comes before the chunks rather than after
  them so that a retention sweep, here or on another node, sees which chunks an upload in
  progress relies on; see :mod:`replication.backup.retention`.)
* Retention never overlaps this store's uploads: uploads hold a shared lock, retention the
  exclusive one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import replace

from mtcfs.chunking import chunk_hash, chunk_span
from mtcfs.manifest import StepManifest
from replication.backup.backend import Backend
from replication.backup.chunk_index import ChunkIndex
from replication.backup.codec import DEFAULT_LEVEL, decode_chunk, encode_chunk
from replication.backup.counters import Counters
from replication.backup.errors import BackupError, ChunkCorrupt, NotFound
from replication.backup.layout import check_hash, check_step, chunk_key
from replication.backup.records import BackupStats, RetentionStats, StepInfo
from replication.backup.retention import run_retention
from replication.backup.rwlock import SharedExclusiveLock
from replication.backup.steps import StepCatalog

log = logging.getLogger(__name__)

#: Most threads one store uses for uploads, marker reads and deletes.
MAX_WORKERS = 4
#: Default grace period of :meth:`BackupStore.retain`, seconds.
DEFAULT_GRACE_S = 6 * 3600.0


def unique_chunks(manifest: StepManifest) -> dict[str, int]:
    """Map each chunk a manifest references to its uncompressed length in bytes.

    Raises:
        ValueError: if a chunk digest is not 64 lowercase hex characters.
    """
    sizes: dict[str, int] = {}
    for e in manifest.entries:
        if e.kind != "file":
            continue
        for i, h in enumerate(e.chunks):
            if h not in sizes:
                sizes[check_hash(h)] = chunk_span(i, e.size, e.chunk_size)[1]
    return sizes


class BackupStore:
    """Chunks and step manifests of one job in one backend.

    Thread-safe. All methods block; call them from worker threads.

    Args:
        backend: where objects go; wrap it in
            :class:`~replication.backup.retry.RetryingBackend` to survive transient faults.
        level: zstd compression level for chunks.
        workers: threads for chunk uploads, marker reads and deletes (1..4).
        check_remote: before uploading a chunk this store does not know, ask the backend
            whether another node uploaded it meanwhile (one extra metadata request per new
            chunk; saves the upload when nodes share data).
        clock_ns: wall clock in ns since the epoch (injectable for tests of ``grace_s``).
    """

    def __init__(self, backend: Backend, *, level: int = DEFAULT_LEVEL,
                 workers: int = MAX_WORKERS, check_remote: bool = False,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self._backend = backend
        self._level = level
        self._workers = max(1, min(MAX_WORKERS, workers))
        self._check_remote = check_remote
        self._clock_ns = clock_ns
        self._index = ChunkIndex(backend)
        self._steps = StepCatalog(backend, self._workers)
        self._gc = SharedExclusiveLock()
        self._counters = Counters((
            "chunks_uploaded", "chunks_deduped", "chunks_downloaded", "bytes_uploaded",
            "bytes_downloaded", "steps_uploaded", "steps_deleted", "chunks_deleted",
            "corrupt_chunks", "errors",
        ))

    @property
    def backend(self) -> Backend:
        """The backend the store writes to."""
        return self._backend

    def describe(self) -> str:
        """The backend's description (its URL)."""
        return self._backend.describe()

    def stats(self) -> dict[str, int]:
        """Return a snapshot of the counters.

        Keys: ``chunks_uploaded``, ``chunks_deduped`` (skipped, already there),
        ``chunks_downloaded``, ``bytes_uploaded`` (compressed chunks plus metadata),
        ``bytes_downloaded``, ``steps_uploaded``, ``steps_deleted``, ``chunks_deleted``,
        ``corrupt_chunks``, ``errors`` (backup errors raised to callers), ``known_chunks``
        (-1 before the index is loaded), plus the backend's own counters when it has a
        ``stats()`` (``retries``, ``retry_wait_ms``, ``gave_up`` for a RetryingBackend).
        """
        out = self._counters.snapshot()
        out["known_chunks"] = self._index.size()
        backend_stats = getattr(self._backend, "stats", None)
        if callable(backend_stats):
            out.update(backend_stats())
        return out

    def _counting_errors(self) -> "_ErrorCounter":
        return _ErrorCounter(self._counters)

    # -- chunks ----------------------------------------------------------------------------

    def has_chunk(self, h: str) -> bool:
        """Return whether chunk ``h`` is in the bucket, as far as this store knows.

        The first call lists ``chunks/``; later calls are answered from memory.

        Raises:
            ValueError: if ``h`` is not a hex blake3 digest.
            BackupError: if the first listing fails.
        """
        with self._counting_errors():
            return self._index.contains(h)

    def put_chunk(self, h: str, data: bytes | memoryview) -> int:
        """Upload one chunk unless the bucket already has it.

        Args:
            h: hex blake3 digest of ``data``.
            data: the uncompressed chunk.

        Returns:
            Compressed bytes uploaded; 0 if the chunk was already there (or another thread
            of this store uploaded it meanwhile).

        Raises:
            ValueError: if ``h`` is malformed or ``data`` does not hash to ``h``.
            BackupError: if the upload fails (TransientError once retries are exhausted).
        """
        with self._gc.shared():
            return self._put_chunk(h, data)

    def _put_chunk(self, h: str, data: bytes | memoryview) -> int:
        key = chunk_key(h)
        got = chunk_hash(data)
        if got != h:
            raise ValueError(f"chunk data hashes to {got}, not to {h}: refusing to upload")
        with self._counting_errors():
            if not self._index.claim(h):
                self._counters.add("chunks_deduped")
                return 0
            stored = False
            try:
                if self._check_remote and self._backend.exists(key):
                    stored = True
                    self._counters.add("chunks_deduped")
                    return 0
                blob = encode_chunk(data, self._level)
                self._backend.put(key, blob)
                stored = True
            finally:
                self._index.release(h, stored)
        self._counters.add("chunks_uploaded")
        self._counters.add("bytes_uploaded", len(blob))
        return len(blob)

    def get_chunk(self, h: str) -> bytes:
        """Download one chunk, decompress it and check its hash.

        Args:
            h: hex blake3 digest of the chunk.

        Returns:
            The uncompressed bytes, guaranteed to hash to ``h``.

        Raises:
            ValueError: if ``h`` is malformed.
            NotFound: if the bucket does not have the chunk.
            ChunkCorrupt: if the stored object does not decode to bytes hashing to ``h``.
            BackupError: on other backend failures.
        """
        key = chunk_key(h)
        with self._counting_errors():
            blob = self._backend.get(key)
            self._counters.add("chunks_downloaded")
            self._counters.add("bytes_downloaded", len(blob))
            try:
                return decode_chunk(h, blob)
            except ChunkCorrupt:
                self._counters.add("corrupt_chunks")
                log.error("backup chunk %s in %s is corrupt", h, self.describe())
                raise

    # -- steps -----------------------------------------------------------------------------

    def put_step(self, manifest: StepManifest, read_chunk: Callable[[str], bytes],
                 progress: Callable[[int, int], None] | None = None) -> BackupStats:
        """Back up one step: intent manifest, missing chunks, then the COMPLETE marker.

        Args:
            manifest: the step to back up.
            read_chunk: returns the uncompressed bytes of a chunk by digest (from the RAM
                tier); called from up to 4 worker threads, only for chunks the bucket lacks.
                An exception it raises aborts the upload and propagates.
            progress: called in the calling thread as ``progress(done, total)`` in logical
                bytes of the step's unique chunks, once at the start and after each chunk.

        Returns:
            What was uploaded (:class:`BackupStats`).

        Raises:
            ValueError: if the manifest has a bad step name or chunk digest, or
                ``read_chunk`` returned bytes that do not hash to the digest asked for.
            BackupError: if an upload fails; the step is then not complete in the backup.
            Exception: whatever ``read_chunk`` or ``progress`` raised.
        """
        t0 = time.monotonic()
        check_step(manifest.step)
        sizes = unique_chunks(manifest)
        with self._gc.shared():
            with self._counting_errors():
                meta = self._steps.write_intent(manifest)
                self._counters.add("bytes_uploaded", meta)
                missing = self._index.missing(sizes)
            total = sum(sizes.values())
            done = total - sum(sizes[h] for h in missing)
            if progress is not None:
                progress(done, total)
            uploaded = sent = new = 0
            for h, n in self._upload_all(missing, read_chunk):
                if n:
                    uploaded += 1
                    sent += n
                    new += sizes[h]
                done += sizes[h]
                if progress is not None:
                    progress(done, total)
            meta += self._commit(manifest, sizes)
        stats = BackupStats(
            step=manifest.step, chunks_total=len(sizes), chunks_uploaded=uploaded,
            bytes_logical=manifest.total_bytes, bytes_new=new, bytes_uploaded=sent,
            bytes_metadata=meta, seconds=time.monotonic() - t0)
        log.info("backed up step %s to %s: %d of %d chunks uploaded, %d bytes sent in %.1f s",
                 manifest.step, self.describe(), uploaded, len(sizes), sent + meta,
                 stats.seconds)
        return stats

    def _upload_all(self, missing: list[str], read_chunk: Callable[[str], bytes]
                    ) -> Iterator[tuple[str, int]]:
        """Upload ``missing`` chunks on up to ``workers`` threads; yield (digest, bytes sent)
        as each finishes. On the first failure, cancel the rest and raise it."""
        if not missing:
            return
        abort = threading.Event()

        def one(h: str) -> int:
            if abort.is_set():
                return 0
            return self._put_chunk(h, read_chunk(h))

        with ThreadPoolExecutor(max_workers=min(self._workers, len(missing)),
                                thread_name_prefix="mtcfs-backup") as pool:
            pending: dict[Future[int], str] = {pool.submit(one, h): h for h in missing}
            try:
                while pending:
                    done, _ = wait(pending, return_when=FIRST_EXCEPTION)
                    for fut in done:
                        h = pending.pop(fut)
                        yield h, fut.result()  # raises the worker's exception
            finally:
                if pending:
                    abort.set()
                    for fut in pending:
                        fut.cancel()

    def begin_step(self, manifest: StepManifest) -> None:
        """Write a step's manifest as an intent, before its chunks.

        For uploads split across nodes: ``begin_step`` on one node, ``put_chunk`` on many,
        ``commit_step`` once all are done. :meth:`put_step` does all three.

        Raises:
            ValueError: on a bad step name.
            BackupError: if the backend fails.
        """
        check_step(manifest.step)
        with self._gc.shared(), self._counting_errors():
            self._counters.add("bytes_uploaded", self._steps.write_intent(manifest))

    def commit_step(self, manifest: StepManifest) -> None:
        """Write a step's COMPLETE marker after checking all its chunks are in the bucket.

        Chunks this store has not seen are looked up in the backend (other nodes may have
        uploaded them).

        Raises:
            ValueError: on a bad step name or chunk digest.
            BackupError: if a chunk is missing (the step stays incomplete) or the backend
                fails.
        """
        check_step(manifest.step)
        with self._gc.shared():
            self._commit(manifest, unique_chunks(manifest))

    def _commit(self, manifest: StepManifest, sizes: dict[str, int]) -> int:
        with self._counting_errors():
            for h in self._index.missing(sizes):
                if not self._backend.exists(chunk_key(h)):
                    raise BackupError(f"step {manifest.step}: chunk {h} is not in "
                                      f"{self.describe()}; not marking the step complete")
                self._index.add(h)
            n = self._steps.write_marker(manifest, len(sizes), self._clock_ns())
        self._counters.add("bytes_uploaded", n)
        self._counters.add("steps_uploaded")
        return n

    def list_steps(self) -> list[StepInfo]:
        """Return the complete steps in the backup, lowest step number first.

        Raises:
            BackupError: if the backend fails.
        """
        with self._counting_errors():
            return self._steps.complete_steps(self._steps.scan())

    def latest_step(self) -> StepInfo | None:
        """Return the complete step with the highest step number, or None if there is none.

        Raises:
            BackupError: if the backend fails.
        """
        steps = self.list_steps()
        return steps[-1] if steps else None

    def get_step(self, step: str) -> StepManifest:
        """Return the manifest of a complete step.

        Raises:
            ValueError: on a bad step name.
            NotFound: if the step is absent or not complete.
            BackupError: if the manifest is unreadable or the backend fails.
        """
        check_step(step)
        with self._counting_errors():
            if not self._steps.is_complete(step):
                raise NotFound(f"step {step!r} is not complete in {self.describe()}")
            return self._steps.read_manifest(step)

    # -- retention -------------------------------------------------------------------------

    def retain(self, keep: int, *, grace_s: float = DEFAULT_GRACE_S) -> RetentionStats:
        """Keep the newest ``keep`` complete steps, delete the rest, sweep unused chunks.

        Waits for this store's uploads to finish and holds new ones back while it runs. See
        :mod:`replication.backup.retention` for the procedure and for uploads on other nodes.

        Args:
            keep: complete steps to keep (>= 1), by step number.
            grace_s: seconds; an incomplete step is deleted only if it is older than every
                kept step and its manifest was taken more than this long ago.

        Returns:
            What was kept and deleted (:class:`RetentionStats`).

        Raises:
            ValueError: if ``keep < 1`` or ``grace_s < 0``.
            BackupError: if the backend fails (a partial sweep is harmless; run it again).
        """
        if keep < 1:
            raise ValueError(f"retention must keep at least 1 complete step, got {keep}")
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        t0 = time.monotonic()
        with self._gc.exclusive(), self._counting_errors():
            stats = run_retention(self._steps, self._backend, keep=keep,
                                  grace_ns=int(grace_s * 1e9), now_ns=self._clock_ns(),
                                  forget=self._index.forget, workers=self._workers)
        stats = replace(stats, seconds=time.monotonic() - t0)
        self._counters.add("steps_deleted",
                           len(stats.steps_deleted) + len(stats.incomplete_deleted))
        self._counters.add("chunks_deleted", stats.chunks_deleted)
        log.info("retention on %s: kept steps %s, deleted %d steps and %d chunks",
                 self.describe(), stats.steps_kept,
                 len(stats.steps_deleted) + len(stats.incomplete_deleted),
                 stats.chunks_deleted)
        return stats


class _ErrorCounter:
    """Context manager counting BackupErrors that pass through it (they still propagate)."""

    def __init__(self, counters: Counters) -> None:
        self._counters = counters

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> bool:
        if exc is not None and isinstance(exc, BackupError):
            self._counters.add("errors")
        return False
