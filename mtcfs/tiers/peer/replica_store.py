"""The replica store: chunks and step manifests this node holds for OTHER ranks.

It lives in a directory of the RAM tier (tmpfs) next to the node's own store, and is counted
against its own capacity. Layout below the root::

    chunks/<h[0:2]>/<h>              one chunk, named by the hex blake3 of its bytes
    manifests/<rank>/<step>.json     StepManifest.to_bytes() of one step of one rank
    tmp/                             files being written; emptied at open

The rules:

* **Verified in, verified out.** A chunk is hashed before it becomes visible (written to
  ``tmp/``, checked, then ``os.replace``d into place) and again on every read. A stored chunk
  that no longer matches its name is deleted and reported (:class:`ReplicaChunkCorrupt`,
  counter ``corrupt_deleted``); its bytes are never returned.
* **Capacity.** Chunk bytes, manifest bytes and the sizes of chunks being written count
  against ``capacity``. An operation that would pass it raises :class:`ReplicaFull` and stores
  nothing.
* **Reference counts.** A chunk is referenced by every held manifest that lists it.
  :meth:`ReplicaStore.gc` drops old manifests and deletes chunks no manifest references,
  but only once they have been left alone for a grace period: a sender puts a step's chunks
  (or learns from ``has`` that they are here) *before* it publishes the step's manifest, and
  those chunks must survive until it does. Storing a chunk, offering it again or answering
  ``has`` for it restarts its grace period.
* **The node's own data.** Given a :class:`LocalChunks`, the store also answers ``has`` and
  ``get`` from the node's own RAM tier. That is how data-parallel replicas cost hashes only:
  a peer that wrote identical chunks itself says it has them, and they are not sent. Such
  chunks are neither counted nor reference-counted here (see docs/peer-protocol.md for the
  pinning question this leaves open).

Thread-safe: one lock guards the in-memory index; hashing and bulk file I/O run outside it.
All methods block (file I/O on tmpfs, hashing at about 2 GB/s); call them from worker threads.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, NoReturn, Protocol, Self

import blake3

from mtcfs.base.chunking import chunk_hash
from mtcfs.base.manifest import ManifestError, StepManifest
from mtcfs.base.counters import Counters
from mtcfs.tiers.backup.layout import check_hash, check_step
from mtcfs.tiers.peer.errors import (
    ChunkMismatch, ChunkNotFound, ReplicaChunkCorrupt, ReplicaError, ReplicaFull,
    ReplicaQuotaExceeded,
)
from mtcfs.tiers.peer.limits import MAX_CHUNK_BYTES, MAX_STEP_NAME_BYTES
from mtcfs.tiers.peer.records import GcStats, ManifestInfo, PublishResult

log = logging.getLogger(__name__)

#: Default grace period of unreferenced chunks, seconds: longer than the time between a
#: sender putting a step's first chunk and publishing its manifest (a whole save).
DEFAULT_ORPHAN_GRACE_S = 3600.0

_MANIFEST_SUFFIX = ".json"


@dataclass(frozen=True)
class OpenedChunk:
    """A verified chunk, open for as long as :meth:`ReplicaStore.open_chunk`'s context lasts.

    Attributes:
        view: its bytes (a read-only mapping of its file, or bytes read from the node's
            own tier).
        file: the file holding exactly these bytes from offset 0 (for ``sendfile(2)``), or
            None when the bytes came from elsewhere.
    """

    view: memoryview
    file: BinaryIO | None


class LocalChunks(Protocol):
    """Read access to the node's own RAM tier, for chunks this node wrote itself.

    Both methods are called from gRPC worker threads, concurrently: they must be thread-safe
    and must not wait long on the filesystem's event loop.
    """

    def has_chunk(self, digest: str) -> bool:
        """Return whether the node's own store holds chunk ``digest`` (hex blake3)."""
        ...

    def read_chunk(self, digest: str) -> bytes | None:
        """Return the chunk's bytes, or None if the node no longer has it. Need not be
        verified: the replica store checks the hash."""
        ...


@dataclass
class _Manifest:
    """In-memory record of one held manifest."""

    step_number: int
    created_ns: int
    total_bytes: int
    size: int                  # bytes of the JSON file
    chunks: frozenset[str]     # interned digests, for reference counting


class ReplicaStore:
    """Chunks and manifests held for other ranks, content-addressed on disk.

    Args:
        root: directory of the store (created if missing); on tmpfs in production.
        capacity: bytes the store may use (chunks + manifests + writes in progress), or a
            function returning it, read at every check: the daemon passes "the node's RAM
            budget minus what its own files use", so replicas and own files share one budget.
        local: the node's own RAM tier, consulted by :meth:`has` and :meth:`get_chunk` for
            chunks the node wrote itself; None for none.
        clock: monotonic seconds, for the gc grace period (injectable for tests).
        quota: bytes one sender rank may hold here (chunks it brought first, its manifests,
            its writes in progress), read at every check; None: no per-rank limit. Chunks
            found at start belong to the first rank whose manifest lists them.

    Raises:
        ValueError: if ``capacity`` is negative.
        OSError: if the directory cannot be created or read.
    """

    def __init__(self, root: str, capacity: int | Callable[[], int], *,
                 local: LocalChunks | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 quota: Callable[[], int] | None = None) -> None:
        if not callable(capacity) and capacity < 0:
            raise ValueError(f"capacity must be >= 0 bytes, got {capacity}")
        self._root = os.path.abspath(root)
        self._capacity_fn: Callable[[], int] = (
            capacity if callable(capacity) else (lambda: capacity))
        self._local = local
        self._clock = clock
        self._lock = threading.Lock()
        self._chunks: dict[str, int] = {}         # digest -> size in bytes
        self._touched: dict[str, float] = {}      # digest -> last store/offer/has, clock()
        self._refs: dict[str, int] = {}           # digest -> manifests referencing it
        self._manifests: dict[tuple[int, str], _Manifest] = {}
        self._chunk_bytes = 0
        self._manifest_bytes = 0
        self._reserved = 0
        self._quota = quota
        self._owner: dict[str, int] = {}          # digest -> the rank that brought it
        self._by_rank: dict[int, int] = {}        # rank -> bytes it holds (see quota)
        self._counters = Counters((
            "chunks_stored", "bytes_stored", "chunks_already_present", "chunks_mismatched",
            "chunks_read", "bytes_read", "corrupt_deleted", "corrupt_local", "manifests_stored",
            "chunks_adopted",
            "manifests_deleted", "chunks_deleted", "full_refusals", "quota_refusals",
        ))
        for sub in ("manifests", "tmp"):
            os.makedirs(os.path.join(self._root, sub), exist_ok=True)
        for fan in range(256):
            os.makedirs(os.path.join(self._root, "chunks", f"{fan:02x}"), exist_ok=True)
        self._load()

    # -- paths and start-up -----------------------------------------------------------------

    @property
    def root(self) -> str:
        return self._root

    def _chunk_path(self, h: str) -> str:
        return os.path.join(self._root, "chunks", h[:2], h)

    def _manifest_path(self, rank: int, step: str) -> str:
        return os.path.join(self._root, "manifests", str(rank), step + _MANIFEST_SUFFIX)

    def _tmp_path(self, what: str) -> str:
        return os.path.join(self._root, "tmp", f"{what}.{uuid.uuid4().hex}")

    def _load(self) -> None:
        """Empty tmp/, index chunks/ and manifests/ (every chunk gets a fresh grace period)."""
        tmp = os.path.join(self._root, "tmp")
        for name in os.listdir(tmp):
            p = os.path.join(tmp, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
        now = self._clock()
        chunks = os.path.join(self._root, "chunks")
        for fan in os.listdir(chunks):
            d = os.path.join(chunks, fan)
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                try:
                    check_hash(name)
                except ValueError:
                    log.warning("replica store %s: ignoring stray file %s", self._root,
                                os.path.join(d, name))
                    continue
                if name[:2] != fan:
                    continue
                h = sys.intern(name)
                size = os.stat(os.path.join(d, name)).st_size
                self._chunks[h] = size
                self._touched[h] = now
                self._chunk_bytes += size
        mroot = os.path.join(self._root, "manifests")
        for rank_dir in os.listdir(mroot):
            if not rank_dir.isdigit():
                continue
            for name in os.listdir(os.path.join(mroot, rank_dir)):
                if not name.endswith(_MANIFEST_SUFFIX):
                    continue
                path = os.path.join(mroot, rank_dir, name)
                try:
                    with open(path, "rb") as f:
                        raw = f.read()
                    m = StepManifest.from_bytes(raw)
                    if m.rank != int(rank_dir) or m.step + _MANIFEST_SUFFIX != name:
                        raise ManifestError(f"manifest of rank {m.rank}, step {m.step!r} "
                                            f"is filed under {rank_dir}/{name}")
                except (OSError, ManifestError) as exc:
                    log.error("replica store %s: dropping unreadable manifest %s: %s",
                              self._root, path, exc)
                    os.unlink(path)
                    continue
                self._add_manifest_locked((m.rank, m.step), m, len(raw))
        for (r, _), record in sorted(self._manifests.items()):
            for h in record.chunks:
                if h in self._chunks and h not in self._owner:
                    self._owner[h] = r
                    self._charge(r, self._chunks[h])
        log.info("replica store %s: %d chunks (%d bytes), %d manifests, capacity %d bytes",
                 self._root, len(self._chunks), self._chunk_bytes, len(self._manifests),
                 self.capacity)

    # -- accounting -------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Bytes the store may use now."""
        return max(0, self._capacity_fn())

    @property
    def used(self) -> int:
        """Bytes in use: chunks, manifests and chunk writes in progress."""
        with self._lock:
            return self._used_locked()

    @property
    def used_estimate(self) -> int:
        """:attr:`used` without taking the lock (three int reads, each atomic): for the
        filesystem's trio loop, which must not wait while a gc holds the lock."""
        return self._chunk_bytes + self._manifest_bytes + self._reserved

    def _used_locked(self) -> int:
        return self._chunk_bytes + self._manifest_bytes + self._reserved

    def _charge(self, rank: int | None, n: int) -> None:
        """Count ``n`` bytes (negative: release) against ``rank``'s quota; lock held."""
        if rank is not None:
            self._by_rank[rank] = self._by_rank.get(rank, 0) + n

    def _check_quota_locked(self, rank: int | None, n: int) -> None:
        if rank is None or self._quota is None:
            return
        quota, held = self._quota(), self._by_rank.get(rank, 0)
        if held + n > quota:
            self._counters.add("quota_refusals")
            raise ReplicaQuotaExceeded(rank, n, held, quota)

    def held_by_rank(self) -> dict[int, int]:
        """Bytes each sender rank holds here (what its quota is checked against)."""
        with self._lock:
            return {r: n for r, n in sorted(self._by_rank.items()) if n}

    def _check_fits_locked(self, n: int) -> None:
        cap = self.capacity
        free = cap - self._used_locked()
        if n > free:
            self._counters.add("full_refusals")
            raise ReplicaFull(n, max(free, 0), cap)

    def stats(self) -> dict[str, int]:
        """Return counters and gauges.

        Counters: ``chunks_stored``, ``bytes_stored``, ``chunks_already_present`` (offered
        again, not rewritten), ``chunks_mismatched`` (offered bytes that did not match),
        ``chunks_read``, ``bytes_read``, ``corrupt_deleted`` (stored chunks found corrupt and
        deleted), ``corrupt_local`` (bad bytes from the node's own tier), ``manifests_stored``,
        ``manifests_deleted``, ``chunks_deleted``, ``full_refusals``. Gauges: ``chunks``,
        ``manifests``, ``used_bytes``, ``capacity_bytes``.
        """
        out = self._counters.snapshot()
        with self._lock:
            out.update(chunks=len(self._chunks), manifests=len(self._manifests),
                       used_bytes=self._used_locked(), capacity_bytes=self.capacity)
        return out

    # -- chunks -----------------------------------------------------------------------------

    def has(self, h: str) -> bool:
        """Return whether chunk ``h`` is held here (or in the node's own tier, if given).

        A held replica chunk's grace period restarts: the caller may now rely on it.

        Raises:
            ValueError: if ``h`` is not a hex blake3 digest.
        """
        return self.has_many([h])[0]

    def has_many(self, digests: Iterable[str]) -> list[bool]:
        """:meth:`has` for many digests at once, in order.

        Raises:
            ValueError: if a digest is malformed.
        """
        hs = [check_hash(h) for h in digests]
        now = self._clock()
        out: list[bool] = []
        with self._lock:
            for h in hs:
                held = h in self._chunks
                if held:
                    self._touched[h] = now
                out.append(held)
        if self._local is not None:
            for i, h in enumerate(hs):
                if not out[i]:
                    out[i] = bool(self._local.has_chunk(h))
        return out

    def wants(self, h: str) -> bool:
        """Whether a held manifest references chunk ``h`` that this store does not hold
        itself (it counted on the node's own copy, which is about to go)."""
        with self._lock:
            return h in self._refs and h not in self._chunks

    def keep(self, h: str, data: bytes | memoryview) -> None:
        """Store chunk ``h`` handed over by the node's own tier (see :meth:`wants`).

        Raises:
            ChunkMismatch, ReplicaFull, OSError: as :meth:`put_chunk`.
        """
        if self.put_chunk(h, data):
            self._counters.add("chunks_adopted")

    def put_chunk(self, h: str, data: bytes | memoryview) -> bool:
        """Verify and store one chunk.

        Returns:
            True if it was stored now, False if it was already held (the bytes were still
            verified).

        Raises:
            ValueError: if ``h`` is malformed or ``data`` is longer than the largest chunk.
            ChunkMismatch: if ``data`` does not hash to ``h`` (nothing is stored).
            ReplicaFull: if it does not fit.
            OSError: if the file cannot be written.
        """
        w = self.chunk_writer(h, len(data))
        try:
            w.write(data)
            return w.commit()
        finally:
            w.abort()

    def chunk_writer(self, h: str, size: int, rank: int | None = None) -> ChunkWriter:
        """Start storing a chunk that arrives in pieces; ``size`` bytes are reserved now.

        If the chunk is already held, the writer only hashes what it is given (so a sender's
        bad bytes are still refused) and stores nothing. ``rank``: the sender, whose quota
        the chunk counts against (None: the node's own tier handing chunks over).

        Raises:
            ValueError: if ``h`` is malformed or ``size`` is negative or above the largest
                chunk size.
            ReplicaFull: if ``size`` bytes do not fit (ReplicaQuotaExceeded: not in
                ``rank``'s quota).
            OSError: if the temporary file cannot be created.
        """
        check_hash(h)
        if not 0 <= size <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk size {size} is outside 0..{MAX_CHUNK_BYTES} bytes")
        with self._lock:
            if h in self._chunks:
                self._touched[h] = self._clock()
                return ChunkWriter(self, h, size, None)
            self._check_quota_locked(rank, size)
            self._check_fits_locked(size)
            self._reserved += size
            self._charge(rank, size)
        try:
            path = self._tmp_path(h)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except BaseException:
            with self._lock:
                self._reserved -= size
                self._charge(rank, -size)
            raise
        return ChunkWriter(self, h, size, (fd, path), rank)

    def _commit(self, h: str, size: int, tmp: str | None, rank: int | None = None) -> bool:
        """Make a verified chunk visible; called by ChunkWriter.commit with the reservation
        still held (and charged to ``rank``, which keeps it if the chunk is new here)."""
        now = self._clock()
        with self._lock:
            if tmp is not None:
                self._reserved -= size
                self._charge(rank, -size)
            self._touched[h] = now
            if h in self._chunks:
                self._counters.add("chunks_already_present")
                new = False
            elif tmp is None:
                # Held when the writer started, deleted by a gc with no grace period since.
                raise ReplicaError(f"chunk {h} was deleted while it was being offered; "
                                   f"send it again")
            else:
                os.replace(tmp, self._chunk_path(h))
                h = sys.intern(h)
                self._chunks[h] = size
                self._touched[h] = now
                self._chunk_bytes += size
                if rank is not None:
                    self._owner[h] = rank
                    self._charge(rank, size)
                new = True
        if tmp is not None and not new:
            _unlink_quiet(tmp)
        if new:
            self._counters.add("chunks_stored")
            self._counters.add("bytes_stored", size)
        return new

    def _cancel(self, size: int, tmp: str | None, rank: int | None = None) -> None:
        if tmp is None:
            return
        _unlink_quiet(tmp)
        with self._lock:
            self._reserved -= size
            self._charge(rank, -size)

    def get_chunk(self, h: str) -> bytes:
        """Return the bytes of chunk ``h``, verified.

        Replica chunks come first, then the node's own tier (if given).

        Raises:
            ValueError: if ``h`` is malformed.
            ChunkNotFound: if neither holds it.
            ReplicaChunkCorrupt: if the stored bytes do not hash to ``h``; a replica copy is
                deleted (and no longer counted), a copy in the node's own tier is left to its
                owner.
            OSError: on other read errors.
        """
        check_hash(h)
        with self._lock:
            held = h in self._chunks
        if held:
            data = self._read_replica(h)
            if data is not None:
                return data
        if self._local is not None:
            data = self._local.read_chunk(h)
            if data is not None:
                actual = chunk_hash(data)
                if actual != h:
                    self._counters.add("corrupt_local")
                    log.error("chunk %s in this node's own tier hashes to %s", h, actual)
                    raise ReplicaChunkCorrupt(h, f"own-tier copy hashes to {actual}")
                self._counters.add("chunks_read")
                self._counters.add("bytes_read", len(data))
                return bytes(data)
        raise ChunkNotFound(h)

    def _read_replica(self, h: str) -> bytes | None:
        """Read and verify a replica chunk; None if it vanished (deleted meanwhile)."""
        path = self._chunk_path(h)
        try:
            with open(path, "rb") as f:
                ino = os.fstat(f.fileno()).st_ino
                data = f.read()
        except FileNotFoundError:
            return None
        actual = chunk_hash(data)
        if actual == h:
            self._counters.add("chunks_read")
            self._counters.add("bytes_read", len(data))
            return data
        self._drop_corrupt(h, path, ino, f"{len(data)} bytes on disk hash to {actual}")

    def _drop_corrupt(self, h: str, path: str, ino: int, reason: str) -> NoReturn:
        """Delete replica chunk ``h`` found corrupt at ``path`` (unless a good copy replaced
        it meanwhile: inode ``ino`` is the one read), count and log it; raise."""
        with self._lock:
            try:
                same = os.lstat(path).st_ino == ino
            except FileNotFoundError:
                same = False
            if same and h in self._chunks:  # not replaced by a good copy meanwhile
                os.unlink(path)
                size = self._chunks.pop(h)
                self._chunk_bytes -= size
                self._charge(self._owner.pop(h, None), -size)
                self._touched.pop(h, None)
        self._counters.add("corrupt_deleted")
        log.error("replica chunk %s in %s is corrupt (%s); deleted", h, self._root, reason)
        raise ReplicaChunkCorrupt(h, reason)

    @contextlib.contextmanager
    def open_chunk(self, h: str) -> Iterator[OpenedChunk]:
        """Chunk ``h``, verified, open while the context lasts: what :meth:`get_chunk`
        returns, without copying a replica chunk into this process (its file is mapped and
        hashed in place; the chunk stream sends it with ``sendfile(2)``). A file whose size
        is not the one stored is corrupt before it is mapped (a mapping past a truncated
        file's end would fault); replica files are only ever replaced whole, never changed
        in place, so nothing of mtcfs shrinks one while it is mapped.

        Raises:
            as :meth:`get_chunk`.
        """
        check_hash(h)
        with self._lock:
            size = self._chunks.get(h)
        f = None
        if size is not None:
            path = self._chunk_path(h)
            with contextlib.suppress(FileNotFoundError):
                f = open(path, "rb")  # noqa: SIM115 (closed below)
        if f is None:
            yield OpenedChunk(memoryview(self.get_chunk(h)), None)
            return
        with f:
            st = os.fstat(f.fileno())
            if st.st_size != size:  # damaged (truncated or grown): never mapped
                self._drop_corrupt(h, path, st.st_ino,
                                   f"{st.st_size} bytes on disk, {size} stored")
            if st.st_size == 0:
                mapped: mmap.mmap | bytes = b""
            else:
                mapped = mmap.mmap(f.fileno(), st.st_size, prot=mmap.PROT_READ)
            try:
                view = memoryview(mapped)
                try:
                    actual = chunk_hash(view)
                    if actual != h:
                        self._drop_corrupt(h, path, st.st_ino,
                                           f"{st.st_size} bytes on disk hash to {actual}")
                    self._counters.add("chunks_read")
                    self._counters.add("bytes_read", st.st_size)
                    yield OpenedChunk(view, f)
                finally:
                    view.release()
            finally:
                if isinstance(mapped, mmap.mmap):
                    mapped.close()

    def scrub(self) -> list[str]:
        """Re-hash every replica chunk; delete the corrupt ones.

        Returns:
            Digests of the chunks found corrupt (and deleted).
        """
        with self._lock:
            digests = list(self._chunks)
        bad = []
        for h in digests:
            try:
                self._read_replica(h)
            except ReplicaChunkCorrupt:
                bad.append(h)
        return bad

    # -- manifests --------------------------------------------------------------------------

    def put_manifest(self, manifest: StepManifest, raw: bytes | None = None) -> PublishResult:
        """Hold one step manifest of one rank, replacing an earlier one of the same step.

        The manifest is stored whether or not its chunks are here yet: from now on it
        protects the chunks it references from :meth:`gc`. The result says which are
        missing.

        Args:
            manifest: the step manifest; ``manifest.rank`` is whose it is.
            raw: the bytes ``manifest`` was parsed from with :meth:`StepManifest.from_bytes`
                (which validated it), if the caller has them; otherwise the manifest is
                serialised and validated here.

        Raises:
            ValueError: if the rank is negative, the step name cannot be a file name (or is
                longer than :data:`~mtcfs.tiers.peer.limits.MAX_STEP_NAME_BYTES`), or the
                manifest is invalid (ManifestError: a path escaping the job or the step).
            ReplicaFull: if the manifest does not fit.
            OSError: if it cannot be written.
        """
        if raw is None:
            raw = manifest.to_bytes()
            StepManifest.from_bytes(raw)  # validates every path
        if manifest.rank < 0:
            raise ValueError(f"bad rank {manifest.rank}")
        check_step(manifest.step)
        if len(manifest.step.encode(errors="surrogateescape")) > MAX_STEP_NAME_BYTES:
            raise ValueError(f"step name {manifest.step[:32]!r}... is longer than "
                             f"{MAX_STEP_NAME_BYTES} bytes")
        key = (manifest.rank, manifest.step)
        tmp = self._tmp_path("manifest")
        with open(tmp, "wb") as f:
            f.write(raw)
        try:
            with self._lock:
                old = self._manifests.get(key)
                grow = len(raw) - (old.size if old else 0)
                if grow > 0:
                    self._check_quota_locked(manifest.rank, grow)
                    self._check_fits_locked(grow)
                path = self._manifest_path(*key)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.replace(tmp, path)
                if old is not None:
                    self._remove_manifest_locked(key)
                record = self._add_manifest_locked(key, manifest, len(raw))
                missing = tuple(sorted(h for h in record.chunks if h not in self._chunks))
        finally:
            _unlink_quiet(tmp)
        if missing and self._local is not None:
            missing = tuple(h for h in missing if not self._local.has_chunk(h))
        self._counters.add("manifests_stored")
        return PublishResult(chunks_total=len(record.chunks), missing=missing,
                             replaced=old is not None)

    def _add_manifest_locked(self, key: tuple[int, str], m: StepManifest,
                             size: int) -> _Manifest:
        chunks = frozenset(sys.intern(h) for h in m.chunk_set())
        record = _Manifest(m.step_number, m.created_ns, m.total_bytes, size, chunks)
        self._manifests[key] = record
        self._manifest_bytes += size
        self._charge(key[0], size)
        for h in chunks:
            self._refs[h] = self._refs.get(h, 0) + 1
        return record

    def _remove_manifest_locked(self, key: tuple[int, str]) -> _Manifest:
        record = self._manifests.pop(key)
        self._manifest_bytes -= record.size
        self._charge(key[0], -record.size)
        for h in record.chunks:
            n = self._refs[h] - 1
            if n:
                self._refs[h] = n
            else:
                del self._refs[h]
        return record

    def get_manifest(self, rank: int, step: str) -> bytes:
        """Return the manifest JSON of ``(rank, step)``.

        Raises:
            KeyError: if it is not held.
        """
        with self._lock:
            if (rank, step) not in self._manifests:
                raise KeyError(f"no manifest of rank {rank}, step {step!r}")
        try:
            with open(self._manifest_path(rank, step), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise KeyError(f"no manifest of rank {rank}, step {step!r}") from None

    def list_manifests(self, rank: int | None = None, *, step: str | None = None,
                       with_bytes: bool = False) -> list[ManifestInfo]:
        """Describe the manifests held, by rank then step number.

        Args:
            rank: only this rank's; None for all.
            step: only this step; None for all.
            with_bytes: fill :attr:`ManifestInfo.manifest` (reads each file).
        """
        with self._lock:
            rows = []
            for (r, s), m in self._manifests.items():
                if (rank is None or r == rank) and (step is None or s == step):
                    missing = [h for h in m.chunks if h not in self._chunks]
                    rows.append((r, s, m, missing))
        rows.sort(key=lambda row: (row[0], row[2].step_number, row[1]))
        out = []
        for r, s, m, missing in rows:
            if missing and self._local is not None:
                missing = [h for h in missing if not self._local.has_chunk(h)]
            raw = b""
            if with_bytes:
                try:
                    raw = self.get_manifest(r, s)
                except KeyError:
                    continue  # dropped meanwhile
            out.append(ManifestInfo(rank=r, step=s, step_number=m.step_number,
                                    created_ns=m.created_ns, total_bytes=m.total_bytes,
                                    chunks_total=len(m.chunks), chunks_missing=len(missing),
                                    manifest_bytes=m.size, manifest=raw))
        return out

    def missing_chunks(self, rank: int, step: str) -> list[str]:
        """Digests ``(rank, step)``'s manifest references that are not held, sorted.

        Raises:
            KeyError: if the manifest is not held.
        """
        with self._lock:
            m = self._manifests.get((rank, step))
            if m is None:
                raise KeyError(f"no manifest of rank {rank}, step {step!r}")
            missing = sorted(h for h in m.chunks if h not in self._chunks)
        if self._local is not None:
            missing = [h for h in missing if not self._local.has_chunk(h)]
        return missing

    def drop_manifest(self, rank: int, step: str) -> bool:
        """Forget one manifest (its chunks stay until :meth:`gc`). Returns whether it was
        held."""
        with self._lock:
            if (rank, step) not in self._manifests:
                return False
            self._remove_manifest_locked((rank, step))
            _unlink_quiet(self._manifest_path(rank, step))
        self._counters.add("manifests_deleted")
        return True

    # -- garbage collection -----------------------------------------------------------------

    def gc(self, keep_steps_per_rank: int, *, protect_steps: Collection[int] = (),
           orphan_grace_s: float = DEFAULT_ORPHAN_GRACE_S) -> GcStats:
        """Drop old manifests, then delete chunks that no manifest references.

        Args:
            keep_steps_per_rank: newest manifests (by step number) kept for each rank (>= 1).
            protect_steps: step numbers kept for every rank whatever their age: the newest
                step complete on all ranks, steps being backed up (the caller knows).
            orphan_grace_s: seconds; an unreferenced chunk is deleted only if it was last
                stored, offered or asked for (``has``) longer ago than this.

        Returns:
            What was deleted (:class:`GcStats`).

        Raises:
            ValueError: if ``keep_steps_per_rank < 1`` or ``orphan_grace_s < 0``.
        """
        if keep_steps_per_rank < 1:
            raise ValueError(f"gc must keep at least 1 step per rank, got "
                             f"{keep_steps_per_rank}")
        if orphan_grace_s < 0:
            raise ValueError(f"orphan_grace_s must be >= 0, got {orphan_grace_s}")
        protect = set(protect_steps)
        deleted_manifests: list[tuple[int, str]] = []
        chunks_deleted = freed = 0
        with self._lock:
            by_rank: dict[int, list[tuple[int, str]]] = {}
            for key, m in self._manifests.items():
                by_rank.setdefault(key[0], []).append((m.step_number, key[1]))
            for r, steps in by_rank.items():
                steps.sort(reverse=True)
                for number, s in steps[keep_steps_per_rank:]:
                    if number in protect:
                        continue
                    freed += self._remove_manifest_locked((r, s)).size
                    _unlink_quiet(self._manifest_path(r, s))
                    deleted_manifests.append((r, s))
            cutoff = self._clock() - orphan_grace_s
            doomed = [h for h in self._chunks
                      if h not in self._refs and self._touched.get(h, 0.0) <= cutoff]
            for h in doomed:
                _unlink_quiet(self._chunk_path(h))
                size = self._chunks.pop(h)
                self._touched.pop(h, None)
                self._chunk_bytes -= size
                self._charge(self._owner.pop(h, None), -size)
                freed += size
                chunks_deleted += 1
            stats = GcStats(manifests_deleted=sorted(deleted_manifests),
                            manifests_kept=len(self._manifests), chunks_deleted=chunks_deleted,
                            chunks_kept=len(self._chunks), bytes_freed=freed)
        self._counters.add("manifests_deleted", len(deleted_manifests))
        self._counters.add("chunks_deleted", chunks_deleted)
        if deleted_manifests or chunks_deleted:
            log.info("replica gc in %s: dropped %d manifests and %d chunks, freed %d bytes",
                     self._root, len(deleted_manifests), chunks_deleted, freed)
        return stats


class ChunkWriter:
    """Writes one chunk that arrives in pieces; see :meth:`ReplicaStore.chunk_writer`.

    Use from one thread. Call :meth:`write` for each piece in order, then :meth:`commit`;
    :meth:`abort` (also called on leaving a ``with`` block) discards an uncommitted chunk and
    releases its reservation.

    Attributes:
        digest: the chunk's name.
        size: its announced length, bytes.
        written: bytes given so far.
    """

    def __init__(self, store: ReplicaStore, digest: str, size: int,
                 tmp: tuple[int, str] | None, rank: int | None = None) -> None:
        self._store = store
        self._rank = rank
        self.digest = digest
        self.size = size
        self.written = 0
        self._hasher = blake3.blake3()
        self._fd = tmp[0] if tmp else None
        self._path = tmp[1] if tmp else None
        self._done = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    @property
    def stores(self) -> bool:
        """False when the chunk was already held: pieces are only hashed."""
        return self._path is not None

    def write(self, data: bytes | memoryview) -> None:
        """Append the next piece.

        Raises:
            ValueError: if the pieces would exceed the announced size, or after commit/abort.
            OSError: if the temporary file cannot be written.
        """
        if self._done:
            raise ValueError(f"chunk {self.digest}: write after commit or abort")
        n = len(data)
        if self.written + n > self.size:
            raise ValueError(f"chunk {self.digest}: pieces exceed the announced "
                             f"{self.size} bytes")
        self._hasher.update(data)
        if self._fd is not None:
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(self._fd, view):]
        self.written += n

    def commit(self) -> bool:
        """Verify the chunk and make it visible.

        Returns:
            True if stored now, False if it was already held.

        Raises:
            ValueError: if fewer bytes than announced were written.
            ReplicaError: if the chunk was held when the writer started and a gc without
                grace period deleted it since (offer it again).
            ChunkMismatch: if the bytes do not hash to the digest (the chunk is discarded;
                the store's ``chunks_mismatched`` counter goes up).
            ReplicaError: after commit or abort.
        """
        if self._done:
            raise ReplicaError(f"chunk {self.digest}: commit after commit or abort")
        if self.written != self.size:
            raise ValueError(f"chunk {self.digest}: {self.written} of {self.size} bytes "
                             f"written")
        actual = self._hasher.hexdigest()
        if actual != self.digest:
            self._store._counters.add("chunks_mismatched")
            self.abort()
            raise ChunkMismatch(self.digest, actual)
        self._close()
        self._done = True
        return self._store._commit(self.digest, self.size, self._path, self._rank)

    def abort(self) -> None:
        """Discard the chunk unless committed; idempotent."""
        if self._done:
            return
        self._done = True
        self._close()
        self._store._cancel(self.size, self._path, self._rank)

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
