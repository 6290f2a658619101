"""Local chunks as reads see them: verified on first read, fetched when missing, repaired
when corrupt.

:class:`LocalChunks` joins the fetches (:class:`mtcfs.core.fetcher.FaultIn`, its
``fetcher``) and the first-read verification and scrub
(:class:`mtcfs.core.verifier.Verifier`, its ``verifier``) to the chunk index and the
version store: it is what both call back when a chunk arrives or is found corrupt, and what
a read, a copy-on-write and a bulk restore call to have bytes in RAM. Policy:
docs/reliability.md; components: docs/architecture.md, "The core".

A chunk that mismatches is treated as missing: marked missing (persisted), its bytes
dropped from the data file, counted (``corrupt_chunks``), logged with its file and chunk,
and faulted in like any missing chunk (another local copy, a peer, the backup tier). With
no other source the read fails with EIO naming the file and chunk; the wrong bytes are
never served.

Every method runs on the trio thread (see core/core.py for the concurrency protocol).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import trio

from mtcfs.base.chunking import chunk_span
from mtcfs.base.space import punch_hole
from mtcfs.core.budget import RamBudget
from mtcfs.core.chunkmap import ChunkIndex
from mtcfs.core.fetcher import FETCH_DEADLINE_S, REFETCH_AFTER_S, FaultIn
from mtcfs.core.inodes import InodeTable
from mtcfs.core.model import ROOT_INO, Inode, Version
from mtcfs.core.records import Counters
from mtcfs.core.store.fdcache import FdCache
from mtcfs.core.store.meta import META_FLOOR_BYTES, META_RESERVE_BYTES, MetaDB
from mtcfs.core.verifier import Verifier
from mtcfs.core.versions import VersionStore

__all__ = ["FETCH_DEADLINE_S", "REFETCH_AFTER_S", "LocalChunks"]

log = logging.getLogger("mtcfs.core.core")


class LocalChunks:
    """The chunks of this node's versions, as reads see them.

    Args:
        db: the store's metadata database (a chunk's arrival or loss is written through).
        tree: the core's inode table (paths in messages, the walk of pending chunks).
        vstore: the core's version store.
        budget: the RAM budget (a fetched chunk's bytes are reserved first; a dropped one
            no longer counts).
        chunk_index: the core's chunk index (where each chunk held here is read).
        fds: the core's descriptor cache.
        counters: the core's counters.
        cpu_limiter: the core's worker-thread limiter (hashing, chunk writes).
        report_error: logs an error and shows it in ``mtcfs status``.
        pin_chunk, unpin: the pins of :class:`~mtcfs.core.checkpoints.Checkpoints` (a
            fetch reads another local copy of a chunk under a pin).

    Owns :attr:`fetcher` and :attr:`verifier`; the daemon sets their settings
    (``fetcher.chunk_source``, ``fetcher.fetch_deadline_s``, ``verifier.interval_s``,
    ``verifier.rate``).
    """

    def __init__(self, *, db: MetaDB, tree: InodeTable, vstore: VersionStore,
                 budget: RamBudget, chunk_index: ChunkIndex, fds: FdCache, counters: Counters,
                 cpu_limiter: trio.CapacityLimiter, report_error: Callable[[str], None],
                 pin_chunk: Callable[[str], tuple[Version, int, int] | None],
                 unpin: Callable[[Iterable[Version]], None]) -> None:
        self._db = db
        self.tree = tree
        self.vstore = vstore
        self.versions: dict[int, Version] = vstore.versions
        self._budget = budget
        self._chunk_index = chunk_index
        self._fds = fds
        self._counters = counters
        self.report_error = report_error
        self.pin_chunk = pin_chunk
        self.unpin = unpin
        self.read_chunk_at = vstore.read_verified
        self._nursery: trio.Nursery | None = None
        #: Fault-in (core/fetcher.py): the fetches in flight, the limiter, the chunk
        #: source, the deadline and the failed fetches.
        self.fetcher = FaultIn(self, budget, fds, counters, cpu_limiter)
        #: First-read verification and the scrub (core/verifier.py).
        self.verifier = Verifier(self, fds, counters, cpu_limiter)

    def start(self, nursery: trio.Nursery) -> None:
        """Repairs of corrupt chunks run in ``nursery`` from now on (before: on next read)."""
        self._nursery = nursery

    async def fault_in(self, v: Version, off: int, size: int) -> None:
        """Wait until bytes ``[off, off+size)`` of ``v`` are in the data file.

        Chunks read for the first time since start are hashed first (core/verifier.py); each
        missing chunk is then fetched at most once at a time (other readers of it wait for
        that fetch) and within ``fetcher.fetch_deadline_s`` seconds of the first ask, every
        source included (core/fetcher.py).

        Raises:
            FsError: EIO when a chunk cannot be fetched in time, from any source, or fails
                verification; the message names the file and the sources tried, and the
                error is counted (``fault_errors``) and listed by ``mtcfs status``.
        """
        if self.verifier.needs(v):  # first read since start: hash before serving
            await self.verifier.verify_range(v, off, size)
        await self.fetcher.fill(v, off, size)

    async def fault_in_all(self, ino: Inode) -> None:
        """Bring every chunk of ``ino``'s current version here (before a copy-on-write)."""
        v = self.versions.get(ino.vid) if ino.vid is not None else None
        if v is not None and (v.missing or self.verifier.needs(v)):
            await self.fault_in(v, 0, v.size)

    def own_missing_below(self, top: Inode) -> list[Version]:
        """The current versions of this rank's files at or below ``top`` (a file, or a
        directory walked whole) that miss chunks (another rank's, in scope=job, left out)."""
        files = [top] if not top.is_dir else [i for _p, i in self.tree.walk(top)]
        out = []
        for f in files:
            v = self.versions.get(f.vid) if f.is_file and f.vid is not None else None
            if v is not None and v.missing and v.origin < 0:
                out.append(v)
        return out

    def fetch_later(self, versions: list[Version], why: str) -> None:
        """Fetch every missing chunk of ``versions`` in the background (pinned meanwhile, so
        eviction does not drop them); a failure is logged and reported with ``why`` (a read
        tries again). Used where nothing may wait: an op applied from the job's log."""
        if not versions or self._nursery is None:
            return
        for v in versions:
            v.pins += 1
        self._nursery.start_soon(self._fetch_all, versions, why)

    async def _fetch_all(self, versions: list[Version], why: str) -> None:
        try:
            for v in versions:
                if self.versions.get(v.vid) is not v:
                    continue  # replaced or deleted meanwhile
                try:
                    await self.fault_in(v, 0, v.size)
                except Exception as exc:  # noqa: BLE001 (reported; a read asks again)
                    ino = self.tree.inodes.get(v.ino)
                    path = self.tree.path_of(ino) if ino is not None else None
                    self.report_error(f"{path or f'version {v.vid}'} ({why}): could not "
                                      f"fetch its data back into RAM: {exc}")
        finally:
            self.unpin(versions)

    async def deliver(self, digest: str, data: bytes | memoryview,
                      where: list[tuple[Version, int]]) -> int:
        """Store a chunk fetched in bulk (a restore from peers) wherever it is missing.

        Args:
            digest: the chunk's blake3; ``data`` must already be verified against it.
            where: the (version, chunk index) pairs that need it.

        Returns:
            how many places were filled (0 if all were filled meanwhile, by reads).
        """
        return await self.fetcher.deliver(digest, data, where)

    def expect(self, digests: list[str]) -> None:
        """Chunks being fetched in bulk: reads of them wait (:meth:`FaultIn.expect`)."""
        self.fetcher.expect(digests)

    def settle(self, digests: list[str]) -> None:
        """The bulk fetches of ``digests`` ended (:meth:`FaultIn.settle`)."""
        self.fetcher.settle(digests)

    def pending(self) -> list[tuple[Version, int]]:
        """(version, chunk index) pairs still missing in current versions, in path order
        (other ranks' files in scope=job are faulted in when read, and not listed)."""
        out: list[tuple[Version, int]] = []
        for _path, ino in self.tree.walk(self.tree.inodes[ROOT_INO]):
            if ino.is_file and ino.vid is not None:
                v = self.versions[ino.vid]
                if v.origin >= 0:
                    continue
                out.extend((v, i) for i in sorted(v.missing))
        return out

    # ------------------------------------------------------------------ the fetcher's and
    # the verifier's callbacks

    def check_data_room(self, nbytes: int) -> None:
        """Raise StoreFull (ENOSPC) unless ``nbytes`` more bytes of data leave
        :data:`META_RESERVE_BYTES` free on the store's filesystem, and
        :data:`META_FLOOR_BYTES` more for the rows each chunk's arrival writes after it
        (:meth:`chunk_arrived`; without them a few chunks written side by side left the
        filesystem 12 KiB under the reserve): a fault-in must not take the room the
        namespace's ops need (a scope=job node would then wait at the job's next op until
        another process freed room: docs/reliability.md)."""
        self._db.ensure_room(f"a fault-in of {nbytes} bytes",
                             META_RESERVE_BYTES + META_FLOOR_BYTES + nbytes)

    def chunk_arrived(self, v: Version, idx: int) -> None:
        """The fetcher wrote chunk ``idx`` of the registered version ``v`` (and counted it):
        index it as a local copy and record that it is no longer missing."""
        self._chunk_index.note(v.chunks[idx], v.vid, idx)
        with self._db.transaction():
            self.vstore.write(v)

    def mark_corrupt(self, v: Version, idx: int, found_by: str) -> None:
        """Chunk ``idx`` of ``v`` does not match its hash: make it missing (fault-in then
        fetches it from another tier), drop its bytes, count it and log it."""
        if idx in v.missing:
            return
        off, length = chunk_span(idx, v.size, v.chunk_size)
        registered = self.versions.get(v.vid) is v
        v.missing.add(idx)
        self.verifier.verified(v.vid, idx)
        if v.preserved is not None:
            # it reads a data file a newer version writes on (core/versions.py, "Shared data
            # files"): drop its own copy of the chunk; the file's bytes are the writer's
            v.preserved.pop(idx, None)
        elif registered or v.fd >= 0:  # (a replaced version's path may name other data)
            # Older versions reading this file lose the same bytes (never kept aside as
            # they are): missing for them too.
            readers = self.vstore.lose_shared(v, off, off + length) if registered else []
            for r, i in readers:
                self.verifier.verified(r.vid, i)
                if self.versions.get(r.vid) is r:
                    self._chunk_index.forget(r.chunks[i], r.vid)
                    with self._db.transaction():
                        self.vstore.write(r)
            punch = True
        else:
            punch = False
        self._counters.corrupt_chunks += 1
        ino = self.tree.inodes.get(v.ino)
        path = self.tree.path_of(ino) if ino is not None and ino.vid == v.vid else None
        self.report_error(f"corrupt chunk in the RAM tier ({found_by}): "
                          f"{path if path is not None else f'version {v.vid}'}, chunk {idx} "
                          f"(bytes {off}..{off + length}) does not match {v.chunks[idx][:16]}; "
                          "dropped, to be fetched from another tier")
        if registered:
            self._chunk_index.forget(v.chunks[idx], v.vid)
            with self._db.transaction():
                self.vstore.write(v)
        if punch:
            # Its bytes go once the row that says the chunk is missing is committed (the
            # order of eviction, core/versions.py: drop_data): a crash in between leaves a
            # missing chunk, never a present one whose bytes are gone.
            self._db.after_commit(lambda: self._drop_bytes(v, off, length, registered))
        if registered and self.fetcher.chunk_source is not None and self._nursery is not None:
            self._nursery.start_soon(self._repair, v, idx)  # repair now, unread

    def _drop_bytes(self, v: Version, off: int, length: int, registered: bool) -> None:
        """The bytes ``[off, off+length)`` of a corrupt chunk of ``v`` leave its data file
        (after the row saying it is missing committed), and no longer count against size=."""
        fd = self._fds.lease(v)
        try:
            punch_hole(fd, off, length)
        finally:
            self._fds.unlease(v, fd)
        if registered:
            self._budget.account(v)  # the punched hole no longer counts against size=

    async def _repair(self, v: Version, idx: int) -> None:
        """Fetch a chunk found corrupt, as a read would (bounded by the fault-in
        deadline; a failure is logged and counted there, and a read asks again)."""
        if self.versions.get(v.vid) is not v:
            return
        off, length = chunk_span(idx, v.size, v.chunk_size)
        v.pins += 1
        try:
            await self.fault_in(v, off, length)
        except Exception as exc:  # noqa: BLE001 (logged by fault-in; a read asks again)
            log.info("scrub could not repair chunk %d of version %d: %s", idx, v.vid, exc)
        finally:
            v.pins -= 1
            self.vstore.release(v)
