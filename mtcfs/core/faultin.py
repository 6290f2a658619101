"""Fault-in, the facade's part: what the rest of the core and the tiers call.

The fetches themselves, with their state, are :class:`mtcfs.core.fetcher.FaultIn`
(``Filesystem.fetcher``); this mixin joins them to the scrub (a first read verifies before
it fetches), the chunk index and the namespace. See docs/architecture.md, "The core".
"""

from __future__ import annotations

import logging
import os

from mtcfs.base.chunking import chunk_hash
from mtcfs.core.fetcher import FETCH_DEADLINE_S, REFETCH_AFTER_S
from mtcfs.core.model import ROOT_INO, Inode, Version
from mtcfs.core.records import ChunkSource

__all__ = ["FETCH_DEADLINE_S", "REFETCH_AFTER_S", "FaultInOps"]

log = logging.getLogger("mtcfs.core.core")


class FaultInOps:
    """Fault-in, the facade's part (the fetches: :class:`~mtcfs.core.fetcher.FaultIn`)."""

    # ------------------------------------------------------------------ the fetcher's settings

    @property
    def chunk_source(self) -> ChunkSource | None:
        """Where chunks this node does not hold come from; set by the daemon."""
        return self.fetcher.chunk_source

    @chunk_source.setter
    def chunk_source(self, source: ChunkSource | None) -> None:
        self.fetcher.chunk_source = source

    @property
    def fetch_deadline_s(self) -> float:
        """Seconds a read waits for a missing chunk before EIO (``read_timeout=``)."""
        return self.fetcher.fetch_deadline_s

    @fetch_deadline_s.setter
    def fetch_deadline_s(self, seconds: float) -> None:
        self.fetcher.fetch_deadline_s = seconds

    @property
    def refetch_after_s(self) -> float:
        """Seconds a failed fetch of a chunk is answered at once with its error."""
        return self.fetcher.refetch_after_s

    @refetch_after_s.setter
    def refetch_after_s(self, seconds: float) -> None:
        self.fetcher.refetch_after_s = seconds

    @property
    def last_fault_error(self) -> str:
        """The last fault-in that failed: what it read, why, the sources tried (status)."""
        return self.fetcher.last_fault_error

    # ------------------------------------------------------------------ fault-in

    async def _fault_in_all(self, ino: Inode) -> None:
        """Bring every chunk of the current version here (before a copy-on-write)."""
        v = self.versions.get(ino.vid) if ino.vid is not None else None
        if v is not None and (v.missing or self.needs_verify(v)):
            await self.fault_in(v, 0, v.size)

    async def fault_in(self, v: Version, off: int, size: int) -> None:
        """Wait until bytes ``[off, off+size)`` of ``v`` are in the data file.

        Chunks read for the first time since start are hashed first (core/verifier.py); each
        missing chunk is then fetched at most once at a time (other readers of it wait for
        that fetch) and within :attr:`fetch_deadline_s` seconds of the first ask, every
        source included (core/fetcher.py).

        Raises:
            FsError: EIO when a chunk cannot be fetched in time, from any source, or fails
                verification; the message names the file and the sources tried, and the
                error is counted (``fault_errors``) and listed by ``mtcfs status``.
        """
        if self.needs_verify(v):  # first read since start: hash before serving (core/verifier.py)
            await self.verifier.verify_range(v, off, size)
        await self.fetcher.fill(v, off, size)

    async def deliver_chunk(self, digest: str, data: bytes,
                            where: list[tuple[Version, int]]) -> int:
        """Store a chunk fetched in bulk (a restore from peers) wherever it is missing.

        Args:
            digest: the chunk's blake3; ``data`` must already be verified against it.
            where: the (version, chunk index) pairs that need it.

        Returns:
            how many places were filled (0 if all were filled meanwhile, by reads).
        """
        return await self.fetcher.deliver(digest, data, where)

    def _chunk_arrived(self, v: Version, idx: int) -> None:
        """The fetcher wrote chunk ``idx`` of the registered version ``v`` (and counted it):
        index it as a local copy and record that it is no longer missing."""
        self.chunk_index.note(v.chunks[idx], v.vid, idx)
        with self.db.transaction():
            self.vstore.write(v)

    def read_chunk_at(self, v: Version, off: int, length: int, digest: str | None) -> bytes | None:
        """Read ``length`` bytes at ``off`` of ``v`` and verify them against ``digest``.

        Thread-safe: the caller pins ``v`` on the loop so that its data file stays; the
        descriptor is leased for the read (fdcache.py). Returns None on a mismatch: a chunk
        whose hash does not match is never served.
        """
        fd = self.fds.lease(v)
        try:
            data = os.pread(fd, length, off)
        finally:
            self.fds.unlease(v, fd)
        if digest is not None and chunk_hash(data) != digest:
            log.error("local chunk %s of version %d does not match its hash", digest[:16], v.vid)
            return None
        return data

    def pending_fault_in(self) -> list[tuple[Version, int]]:
        """(version, chunk index) pairs still missing in current versions, in path order."""
        out = []
        for _path, ino in self.tree.walk(self.inodes[ROOT_INO]):
            if ino.is_file and ino.vid is not None:
                v = self.versions[ino.vid]
                if v.origin >= 0:
                    continue  # scope=job: another rank's file, faulted in when read
                out.extend((v, i) for i in sorted(v.missing))
        return out
