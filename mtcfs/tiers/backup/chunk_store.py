"""The backup store: chunks and steps of one job in one backend.

See :mod:`mtcfs.tiers.backup.layout` for the object names. The rules that make a backup
trustworthy:

* A chunk object is named by the blake3 of its *uncompressed* bytes and checked against that
  name on every read (:func:`mtcfs.tiers.backup.codec.decode_chunk`); bad bytes are never
  returned.
* Each unique chunk is uploaded once per bucket, ever: the store knows which chunks the
  bucket holds (:class:`~mtcfs.tiers.backup.chunk_index.ChunkIndex`) and skips them, across
  files, steps and restarts.
* A step is written in three phases: ``manifest.json`` first (an *intent*: it pins the
  step's chunks against a sweep), then the missing chunks, then ``COMPLETE`` last. Only steps
  with ``COMPLETE`` are listed and restored, so a failure at any point leaves the previous
  complete step as the latest one. (The intent comes before the chunks rather than after
  them so that a retention sweep, here or on another node, sees which chunks an upload in
  progress relies on; see :mod:`mtcfs.tiers.backup.retention`.)
* Retention never overlaps this store's uploads: uploads hold a shared lock, retention the
  exclusive one. A multi-node store does the same job-wide through its sweep gate
  (:mod:`mtcfs.tiers.backup.gate`): uploads hold it shared, chunk sweeps exclusive.

Multi-node jobs (``rank`` set): every rank has its own store on the same bucket. Its step
manifests and markers live in ``steps/<step>/rank-<rank>/``; chunks are shared, so a chunk
two ranks hold is stored once. Listing, reading and writing steps act on the store's own
rank; :meth:`BackupStore.list_steps` and :meth:`BackupStore.get_step` read another rank's
when asked, and :meth:`BackupStore.complete_ranks` tells which ranks completed which step.
Retention counts steps complete on every rank (:func:`~mtcfs.tiers.backup.retention.
run_job_retention`), and uploads and sweeps pass the sweep gate
(:mod:`mtcfs.tiers.backup.gate`) so that any rank may sweep while others upload.

Upload shares: data-parallel twins hold the same chunks. With ``share``, :meth:`put_step`
uploads only the missing chunks that are this node's share, waits (polling the bucket) for
the twins to upload theirs, and uploads itself only what is still missing after
``share_wait_s``, so a dead twin costs time, not data.

A wait pays off only if the twins back up the *same* step. They may not: each node's
scheduler picks its own newest step at its own time (after a node is replaced, its timer
starts at its mount). The goodput run (docs/goodput.md) found each twin then waiting the
whole ``share_wait_s`` for a share that never came and starting the next backup at once
(the interval was shorter than the wait), so the timers' offset never closed: every step
was complete on one rank only, and the job had no new step to restore. Decision: the
twins converge through the rank manifests in the bucket, no other channel. With ``twins``,
the wait ends as soon as every twin has begun a newer step and not this one (it will not
come back: the scheduler only joins steps newer than its last backup), and
:class:`~mtcfs.tiers.backup.scheduler.BackupService` backs up at once a step a twin has
begun (:meth:`BackupStore.steps_begun`) if it holds it, so both complete that step. A twin
behind this step or on it is still waited for, up to ``share_wait_s``. See
docs/peer-protocol.md (item 8).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from functools import partial
from typing import Literal

from mtcfs.base import pools
from mtcfs.base.steps import step_number
from mtcfs.base.chunking import chunk_hash, chunk_span
from mtcfs.base.failpoints import failpoint
from mtcfs.base.manifest import StepManifest
from mtcfs.base.token_bucket import TokenBucket
from mtcfs.tiers.backup.backend import Backend
from mtcfs.tiers.backup.chunk_index import ChunkIndex
from mtcfs.tiers.backup.codec import DEFAULT_LEVEL, decode_chunk, encode_chunk
from mtcfs.base.counters import Counters
from mtcfs.tiers.backup.errors import BackupError, ChunkCorrupt, NotFound
from mtcfs.tiers.backup.gate import GateHold, SweepGate
from mtcfs.tiers.backup.layout import MANIFEST, check_hash, check_rank, check_step, chunk_key
from mtcfs.tiers.backup.records import BackupStats, RetentionStats, StepInfo
from mtcfs.tiers.backup.retention import run_job_retention, run_retention
from mtcfs.tiers.backup.rwlock import SharedExclusiveLock
from mtcfs.tiers.backup.steps import StepCatalog, complete_ranks, job_complete, scan_layouts

log = logging.getLogger(__name__)

#: Most threads one store uses for uploads, marker reads and deletes.
MAX_WORKERS = 4
#: Default grace period of :meth:`BackupStore.retain`, seconds.
DEFAULT_GRACE_S = 6 * 3600.0
#: Default of ``share_wait_s`` in :meth:`BackupStore.put_step`, seconds.
DEFAULT_SHARE_WAIT_S = 60.0
#: First pause between two polls for other nodes' shares, seconds; it doubles up to
#: ``min(SHARE_POLL_MAX_S, share_wait_s / 8)``.
SHARE_POLL_FIRST_S = 0.05
SHARE_POLL_MAX_S = 5.0
#: A poll round stops after this many chunks not yet there (checked in upload order), so
#: waiting for a dead twin costs a few requests per round, not one per chunk.
SHARE_POLL_MISSES = 16


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


@dataclass
class _Tally:
    """What one put_step sent, as it goes."""

    uploaded: int = 0
    sent: int = 0
    new: int = 0
    by_others: int = 0
    taken_over: int = 0
    resent: int = 0
    waiting: float = 0.0


class BackupStore:
    """Chunks and step manifests of one job (of one rank of it) in one backend.

    Thread-safe. All methods block; call them from worker threads.

    Args:
        backend: where objects go; wrap it in
            :class:`~mtcfs.tiers.backup.retry.RetryingBackend` to survive transient faults.
        level: zstd compression level for chunks.
        workers: threads for chunk uploads (zstd and the request), marker reads and
            deletes (1..4; mount option ``backup_threads``).
        budget: the bytes per second uploads may send (``backup_rate=``): each chunk
            takes its compressed size before its request; None: unbounded.
        check_remote: before uploading a chunk this store does not know, ask the backend
            whether another node uploaded it meanwhile (one extra metadata request per new
            chunk; saves the upload when nodes share data).
        clock_ns: wall clock in ns since the epoch (injectable for tests of ``grace_s``).
        rank: None for a single-node mount (layout ``steps/<step>/``, exactly as before);
            the node's rank (>= 0) in a multi-node job: its steps live in
            ``steps/<step>/rank-<rank>/``.
        world_size: ranks in the job (ranks 0..world_size-1), for retention's "complete on
            every rank"; None: every rank that has a manifest or marker in the bucket. Only
            with ``rank``.
        gate: the job's sweep gate (:mod:`mtcfs.tiers.backup.gate`), only with ``rank``:
            uploads hold it shared and chunk sweeps exclusive, so any rank may sweep while
            others upload. None on a multi-node store: retention never sweeps chunks.

    Raises:
        ValueError: on a bad ``rank`` (not None or an int >= 0), a ``world_size`` < 1 or not
            above ``rank``, or a ``world_size`` or ``gate`` without ``rank``.
    """

    def __init__(self, backend: Backend, *, level: int = DEFAULT_LEVEL,
                 workers: int = MAX_WORKERS, check_remote: bool = False,
                 clock_ns: Callable[[], int] = time.time_ns, rank: int | None = None,
                 world_size: int | None = None, gate: SweepGate | None = None,
                 budget: TokenBucket | None = None) -> None:
        check_rank(rank)
        if gate is not None and rank is None:
            raise ValueError("a sweep gate is for a multi-node store: it needs a rank")
        if world_size is not None:
            if rank is None:
                raise ValueError("world_size needs a rank")
            if isinstance(world_size, bool) or not isinstance(world_size, int) \
                    or world_size <= rank:
                raise ValueError(f"world_size must be an int above rank {rank}, "
                                 f"got {world_size!r}")
        self._backend = backend
        self._level = level
        self._workers = max(1, min(MAX_WORKERS, workers))
        self._check_remote = check_remote
        self._clock_ns = clock_ns
        self._rank = rank
        self._world_size = world_size
        self._index = ChunkIndex(backend)
        self._steps = StepCatalog(backend, self._workers, rank)
        self._gate = gate
        self._budget = budget
        #: The sweep generation the index is true at (None: not compared yet).
        self._synced: int | None = None
        self._sync_lock = threading.Lock()
        self._gc = SharedExclusiveLock()
        self._counters = Counters((
            "chunks_uploaded", "chunks_deduped", "chunks_downloaded", "bytes_uploaded",
            "bytes_downloaded", "steps_uploaded", "steps_deleted", "chunks_deleted",
            "corrupt_chunks", "errors", "chunks_by_others", "chunks_taken_over",
            "chunks_resent", "index_reloads",
        ))

    @property
    def rank(self) -> int | None:
        """This store's rank in the job, or None for a single-node store."""
        return self._rank

    @property
    def world_size(self) -> int | None:
        """The job's rank count given at construction, or None."""
        return self._world_size

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
        (-1 before the index is loaded), ``chunks_by_others`` / ``chunks_taken_over`` /
        ``chunks_resent`` (totals of the :class:`BackupStats` fields), ``index_reloads``
        (times a multi-node store forgot its index because a sweep elsewhere bumped the
        sweep generation), plus the backend's own
        counters when it has a ``stats()`` (``retries``, ``retry_wait_ms``, ``gave_up`` for
        a RetryingBackend).
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

        The first call lists ``chunks/``; later calls are answered from memory (on a
        multi-node store, as of the last upload's look at the sweep generation: a sweep on
        another node since may have deleted it; uploads correct for that themselves).

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
                if self._budget is not None:
                    self._budget.take(len(blob))  # backup_rate=: may sleep
                failpoint("backup.put_chunk")  # tests: a kill during an upload
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
                 progress: Callable[[int, int], None] | None = None, *,
                 share: Callable[[str], bool] | None = None,
                 share_wait_s: float = DEFAULT_SHARE_WAIT_S,
                 twins: Collection[int] = ()) -> BackupStats:
        """Back up one step: intent manifest, missing chunks, then the COMPLETE marker.

        On a multi-node store the step is this rank's (``steps/<step>/rank-<rank>/``); with
        a gate, the call holds it shared from before the intent until the marker (no chunk
        sweep runs in the job meanwhile), and first lists ``chunks/`` again if a sweep
        bumped the sweep generation since this store's index was true
        (:mod:`mtcfs.tiers.backup.gate`), so it uploads again any chunk a sweep deleted.

        Args:
            manifest: the step to back up.
            read_chunk: returns the uncompressed bytes of a chunk by digest (from the RAM
                tier); called from up to 4 worker threads, only for chunks the bucket lacks.
                An exception it raises aborts the upload and propagates.
            progress: called in the calling thread as ``progress(done, total)`` in logical
                bytes of the step's unique chunks, once at the start and after each chunk.
            share: ``share(digest) -> bool``, True for the chunks this node uploads itself
                (e.g. ``lambda d: int(d[:8], 16) % D == i`` for the i-th of D data-parallel
                twins); None: this node uploads every missing chunk. Called in the calling
                thread, once per missing chunk; an exception it raises aborts the upload.
            share_wait_s: with ``share``, seconds (>= 0) to wait after uploading this node's
                share for the other nodes to upload theirs (the bucket is polled with a
                backoff); chunks still missing then are uploaded by this node.
            twins: with ``share``, the ranks whose shares this node waits for (its
                data-parallel twins). The wait ends early, and this node uploads the rest,
                once every one of them is known to be elsewhere: it has no manifest of this
                step in the bucket but has one (intent or complete) of a step with a higher
                number, so it will not come back to this one (:meth:`steps_begun`, one
                listing of ``steps/`` per poll round). Empty: wait the whole
                ``share_wait_s`` for whatever is missing.

        Returns:
            What was uploaded (:class:`BackupStats`), including how many chunks other nodes
            uploaded (``chunks_by_others``) and how many of their share this node took over.

        Raises:
            ValueError: if the manifest has a bad step name or chunk digest,
                ``share_wait_s < 0``, or ``read_chunk`` returned bytes that do not hash to
                the digest asked for.
            BackupError: if an upload fails; the step is then not complete in the backup.
                :class:`~mtcfs.tiers.backup.errors.GateError` if the gate was not granted in
                time or its hold ended before the marker.
            Exception: whatever ``read_chunk``, ``progress`` or ``share`` raised.
        """
        t0 = time.monotonic()
        check_step(manifest.step)
        if not share_wait_s >= 0:
            raise ValueError(f"share_wait_s must be >= 0, got {share_wait_s}")
        sizes = unique_chunks(manifest)
        tally = _Tally()
        with self._gc.shared(), ExitStack() as stack:
            hold = self._enter_gate(stack, tally)  # until COMPLETE: no sweep meanwhile
            with self._counting_errors():
                resent = self._sync_generation(sizes) if hold is not None else set()
                meta = self._steps.write_intent(manifest)
                self._counters.add("bytes_uploaded", meta)
                missing = self._index.missing(sizes)
            total = sum(sizes.values())
            done = total - sum(sizes[h] for h in missing)
            if progress is not None:
                progress(done, total)
            mine, theirs = missing, []
            if share is not None:
                ours = {h: bool(share(h)) for h in missing}  # share() once per chunk
                mine = [h for h in missing if ours[h]]
                theirs = [h for h in missing if not ours[h]]
            # With shares, a twin that backed up earlier may have taken over this node's
            # share already (after its wait): ask the bucket before uploading it again.
            for h, n in self._upload_all(mine, read_chunk, remote_check=share is not None):
                tally.uploaded += n > 0
                tally.sent += n
                tally.new += sizes[h] if n else 0
                done += sizes[h]
                if progress is not None:
                    progress(done, total)
            if theirs:
                w0 = time.monotonic()
                found, still = self._await_others(
                    theirs, share_wait_s,
                    partial(self._twins_elsewhere, manifest, tuple(twins)) if twins else None)
                tally.waiting += time.monotonic() - w0
                tally.by_others += len(found)
                for h in found:
                    done += sizes[h]
                    if progress is not None:
                        progress(done, total)
                if still:
                    log.warning("step %s: %d chunks of other nodes' shares are still not in "
                                "%s after %.1f s; uploading them here", manifest.step,
                                len(still), self.describe(), time.monotonic() - w0)
                for h, n in self._upload_all(still, read_chunk, remote_check=True):
                    if n:
                        tally.uploaded += 1
                        tally.taken_over += 1
                        tally.sent += n
                        tally.new += sizes[h]
                    else:
                        tally.by_others += 1
                    done += sizes[h]
                    if progress is not None:
                        progress(done, total)
            tally.resent = len(resent.intersection(missing))
            meta += self._commit(manifest, sizes, hold)
        self._counters.add("chunks_by_others", tally.by_others)
        self._counters.add("chunks_taken_over", tally.taken_over)
        self._counters.add("chunks_resent", tally.resent)
        stats = BackupStats(
            step=manifest.step, chunks_total=len(sizes), chunks_uploaded=tally.uploaded,
            bytes_logical=manifest.total_bytes, bytes_new=tally.new, bytes_uploaded=tally.sent,
            bytes_metadata=meta, seconds=time.monotonic() - t0,
            chunks_by_others=tally.by_others, chunks_taken_over=tally.taken_over,
            chunks_resent=tally.resent, seconds_waiting=tally.waiting)
        log.info("backed up step %s%s to %s: %d of %d chunks uploaded here, %d by other "
                 "nodes, %d bytes sent in %.1f s", manifest.step,
                 "" if self._rank is None else f" of rank {self._rank}", self.describe(),
                 tally.uploaded, len(sizes), tally.by_others, tally.sent + meta, stats.seconds)
        return stats

    def _await_others(self, pending: list[str], wait_s: float,
                      elsewhere: Callable[[], bool] | None = None
                      ) -> tuple[list[str], list[str]]:
        """Poll the bucket for chunks other nodes upload, up to ``wait_s`` seconds, or until
        ``elsewhere()`` (asked once per round that leaves chunks missing) is True: the nodes
        that would upload them are busy with a newer step.

        Returns (found, still missing), each in the order given. Found chunks are added to
        the index. Each round checks the chunks in order and stops after
        :data:`SHARE_POLL_MISSES` absent ones.
        """
        deadline = time.monotonic() + wait_s
        delay, cap = SHARE_POLL_FIRST_S, min(SHARE_POLL_MAX_S, max(SHARE_POLL_FIRST_S, wait_s / 8))
        found: list[str] = []
        while pending:
            hits: set[str] = set()
            misses = i = 0
            with self._counting_errors():
                while i < len(pending) and misses < SHARE_POLL_MISSES:
                    batch = pending[i:i + self._workers]
                    i += len(batch)
                    for h, there in zip(batch, pools.run_map(
                            "backup-upload", lambda x: self._backend.exists(chunk_key(x)), batch,
                            self._workers)):
                        if there:
                            hits.add(h)
                            self._index.add(h)
                        else:
                            misses += 1
            found.extend(h for h in pending if h in hits)
            pending = [h for h in pending if h not in hits]
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            if elsewhere is not None and elsewhere():
                log.info("step's share wait ends after %.1f s: the twins back up newer steps; "
                         "uploading the %d chunks of their shares here",
                         wait_s - left, len(pending))
                break
            time.sleep(min(delay, left))
            delay = min(cap, delay * 2)
        return found, pending

    def steps_begun(self, ranks: Iterable[int]) -> dict[int, set[str]]:
        """The steps each of ``ranks`` has begun in the bucket: those whose directory
        (``steps/<step>/rank-<r>/``) holds a manifest, an intent or a complete one. One
        listing of ``steps/``.

        Returns:
            ``{rank: {step name, ...}}`` with an entry (maybe empty) for every rank asked.

        Raises:
            ValueError: on a bad rank.
            BackupError: if the listing fails.
        """
        want = {check_rank(r) for r in ranks}
        out: dict[int, set[str]] = {r: set() for r in want if r is not None}
        with self._counting_errors():
            _, ranked = scan_layouts(self._backend)
        for step, by_rank in ranked.items():
            for r, objs in by_rank.items():
                if r in out and MANIFEST in objs:
                    out[r].add(step)
        return out

    def _twins_elsewhere(self, manifest: StepManifest, twins: tuple[int, ...]) -> bool:
        """Whether every one of ``twins`` has begun a step numbered above ``manifest``'s and
        not ``manifest``'s own: none of them will upload its share of this step. False when
        the bucket cannot be listed (the wait goes on, bounded by its deadline)."""
        try:
            begun = self.steps_begun(twins)
        except BackupError as exc:
            log.debug("cannot tell where the twins are (%s); waiting on", exc)
            return False
        for names in begun.values():
            if manifest.step in names:
                return False
            nums = (step_number(n) for n in names)
            if not any(n is not None and n > manifest.step_number for n in nums):
                return False
        return True

    def _enter_gate(self, stack: ExitStack, tally: _Tally | None) -> GateHold | None:
        """Take the sweep gate shared into ``stack`` (a multi-node store with a gate), adding
        the wait to ``tally``; None without a gate.

        Raises:
            GateError: the gate was not granted (a sweep held it for the whole wait, or etcd
                did not answer).
        """
        if self._gate is None:
            return None
        w0 = time.monotonic()
        with self._counting_errors():
            hold = stack.enter_context(self._gate.shared())
        if tally is not None:
            tally.waiting += time.monotonic() - w0
        return hold

    def _sync_generation(self, chunks: Iterable[str] = ()) -> set[str]:
        """Holding the gate: if a sweep bumped the sweep generation since the index was last
        true, forget the index (the next use lists ``chunks/`` again). Returns those of
        ``chunks`` the index believed stored before it forgot them (for ``chunks_resent``).

        Raises:
            GateError: the generation could not be read.
        """
        assert self._gate is not None
        with self._sync_lock:
            gen = self._gate.generation()
            if gen == self._synced:
                return set()
            believed: set[str] = set()
            if self._index.size() >= 0:  # loaded: at an older generation, or an unknown one
                if self._synced is not None:
                    wanted = list(chunks)
                    believed = set(wanted).difference(self._index.missing(wanted))
                    log.info("a chunk sweep on another node changed %s (sweep generation %d, "
                             "this node's index is of %d): listing chunks again",
                             self.describe(), gen, self._synced)
                self._index.reset()
                self._counters.add("index_reloads")
            self._synced = gen
            return believed

    def _bumped(self, before: int, after: int) -> None:
        """This store's sweep bumped the generation: its index stays true (it forgets what
        it deletes) if it was true at the generation before."""
        with self._sync_lock:
            if self._synced == before:
                self._synced = after

    def _upload_all(self, missing: list[str], read_chunk: Callable[[str], bytes], *,
                    remote_check: bool = False) -> Iterator[tuple[str, int]]:
        """Upload ``missing`` chunks on up to ``workers`` threads; yield (digest, bytes sent)
        as each finishes (0: it was there already). With ``remote_check``, ask the backend
        first and skip (without reading) chunks another node stored. On the first failure,
        cancel the rest and raise it."""
        if not missing:
            return
        abort = threading.Event()

        def one(h: str) -> int:
            if abort.is_set():
                return 0
            if remote_check:
                with self._counting_errors():
                    if self._backend.exists(chunk_key(h)):
                        self._index.add(h)
                        return 0
            return self._put_chunk(h, read_chunk(h))

        try:
            yield from pools.run_unordered("backup-upload", one, missing, self._workers)
        finally:
            abort.set()

    def begin_step(self, manifest: StepManifest) -> None:
        """Write a step's manifest (this rank's, on a multi-node store) as an intent,
        before its chunks.

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
        uploaded them). A multi-node store with a gate holds it shared meanwhile, and first
        lists ``chunks/`` again if a sweep elsewhere bumped the sweep generation.

        Raises:
            ValueError: on a bad step name or chunk digest.
            BackupError: if a chunk is missing (the step stays incomplete) or the backend
                fails.
        """
        check_step(manifest.step)
        sizes = unique_chunks(manifest)
        with self._gc.shared(), ExitStack() as stack:
            hold = self._enter_gate(stack, None)
            if hold is not None:
                with self._counting_errors():
                    self._sync_generation()
            self._commit(manifest, sizes, hold)

    def _commit(self, manifest: StepManifest, sizes: dict[str, int],
                hold: GateHold | None = None) -> int:
        with self._counting_errors():
            for h in self._index.missing(sizes):
                if not self._backend.exists(chunk_key(h)):
                    raise BackupError(f"step {manifest.step}: chunk {h} is not in "
                                      f"{self.describe()}; not marking the step complete")
                self._index.add(h)
            if hold is not None:
                hold.check()  # a sweep may have run since the hold ended: not complete
            n = self._steps.write_marker(manifest, len(sizes), self._clock_ns(),
                                         self._world_size)
        self._counters.add("bytes_uploaded", n)
        self._counters.add("steps_uploaded")
        return n

    def _catalog(self, rank: int | None) -> StepCatalog:
        if rank is None or rank == self._rank:
            return self._steps
        return StepCatalog(self._backend, self._workers, check_rank(rank))

    def list_steps(self, rank: int | None = None) -> list[StepInfo]:
        """Return the complete steps in the backup, lowest step number first.

        Args:
            rank: whose steps: None for this store's own (its rank's, or the single-node
                layout's for a store without rank); an int for that rank's.

        Raises:
            ValueError: on a bad rank.
            BackupError: if the backend fails.
        """
        cat = self._catalog(rank)
        with self._counting_errors():
            return cat.complete_steps(cat.scan())

    def latest_step(self, rank: int | None = None) -> StepInfo | None:
        """Return the complete step with the highest step number, or None if there is none.

        Args:
            rank: as in :meth:`list_steps`.

        Raises:
            ValueError: on a bad rank.
            BackupError: if the backend fails.
        """
        steps = self.list_steps(rank)
        return steps[-1] if steps else None

    def get_step(self, step: str, rank: int | None = None) -> StepManifest:
        """Return the manifest of a complete step.

        Args:
            step: the step's directory name.
            rank: as in :meth:`list_steps`.

        Raises:
            ValueError: on a bad step name or rank.
            NotFound: if the step is absent or not complete (for that rank).
            BackupError: if the manifest is unreadable or the backend fails.
        """
        check_step(step)
        cat = self._catalog(rank)
        with self._counting_errors():
            if not cat.is_complete(step):
                who = "" if cat.rank is None else f" on rank {cat.rank}"
                raise NotFound(f"step {step!r} is not complete{who} in {self.describe()}")
            return cat.read_manifest(step)

    def complete_ranks(self) -> dict[str, tuple[int, set[int]]]:
        """Which ranks of a multi-node job completed which step.

        One listing of ``steps/`` plus one marker read per step (any store may call it;
        the single-node layout is not included).

        Returns:
            ``{step name: (step number, {ranks whose COMPLETE marker exists})}`` for every
            step at least one rank completed. The newest step complete in the whole job is
            ``max((num, step) for step, (num, ranks) in result.items() if ranks >=
            set(range(world_size)))``.

        Raises:
            BackupError: if the backend fails.
        """
        with self._counting_errors():
            _, ranked = scan_layouts(self._backend)
            return complete_ranks(self._backend, ranked, self._workers)

    def job_complete_steps(self) -> dict[str, tuple[int, set[int]]]:
        """The steps of a multi-node job complete on every rank of the job that wrote them
        (its world size, recorded in their markers), whatever this job's node count: what
        a restore may choose (:func:`mtcfs.tiers.backup.steps.job_complete`).

        Returns:
            ``{step name: (step number, {0..world_size-1})}``.

        Raises:
            BackupError: if the backend fails.
        """
        with self._counting_errors():
            _, ranked = scan_layouts(self._backend)
            return job_complete(self._backend, ranked, self._workers)

    # -- retention -------------------------------------------------------------------------

    def retain(self, keep: int, *, grace_s: float = DEFAULT_GRACE_S,
               sweep: bool | None = None) -> RetentionStats:
        """Keep the newest ``keep`` complete steps, delete the rest, sweep unused chunks.

        Waits for this store's uploads to finish and holds new ones back while it runs; a
        multi-node store sweeps chunks only holding its gate exclusive (without a gate, or
        when the gate is not granted in time, the sweep is skipped and logged). See
        :mod:`mtcfs.tiers.backup.retention` for the procedure and for uploads on other nodes.

        A single-node store keeps its own ``keep`` newest complete steps. A multi-node store
        keeps the ``keep`` newest steps complete on every rank (all ranks' manifests of
        them) and every newer step, deletes all ranks' manifests of older steps, and never
        deletes a chunk any remaining manifest of any rank references; any rank may call it,
        also several at once.

        Args:
            keep: complete steps to keep (>= 1), by step number.
            grace_s: seconds; an incomplete step (rank manifest) is deleted only if it is
                older than every kept step and its manifest was taken more than this long
                ago.
            sweep: whether to sweep chunks: None (default): a single-node store always does,
                a multi-node store only when this call deleted a manifest (so a job sweeps
                about once per retired step, not once per rank); True: always; False: never.

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
            if self._rank is None:
                stats = run_retention(self._steps, self._backend, keep=keep,
                                      grace_ns=int(grace_s * 1e9), now_ns=self._clock_ns(),
                                      forget=self._index.forget, workers=self._workers,
                                      sweep=sweep is not False)
            else:
                stats = run_job_retention(
                    self._backend, self._gate, keep=keep, grace_ns=int(grace_s * 1e9),
                    clock_ns=self._clock_ns, world_size=self._world_size, sweep=sweep,
                    forget=self._index.forget, bumped=self._bumped, workers=self._workers)
        stats = replace(stats, seconds=time.monotonic() - t0)
        self._counters.add("steps_deleted",
                           len(stats.steps_deleted) + len(stats.incomplete_deleted))
        self._counters.add("chunks_deleted", stats.chunks_deleted)
        log.info("retention on %s%s: kept steps %s, deleted %d steps and %d chunks",
                 self.describe(), "" if self._rank is None else f" (rank {self._rank})",
                 stats.steps_kept, len(stats.steps_deleted) + len(stats.incomplete_deleted),
                 stats.chunks_deleted)
        return stats


class _ErrorCounter:
    """Context manager counting BackupErrors that pass through it (they still propagate)."""

    def __init__(self, counters: Counters) -> None:
        self._counters = counters

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> Literal[False]:
        if exc is not None and isinstance(exc, BackupError):
            self._counters.add("errors")
        return False
