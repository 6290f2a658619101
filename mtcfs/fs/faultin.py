"""Fault-in: waiting for, fetching, verifying and writing chunks that are not in RAM yet.

A part of :class:`mtcfs.fs.core.Filesystem` (mixed in); see that module for the
concurrency protocol every method follows.
"""

from __future__ import annotations

import errno
import logging
import os

import trio

from mtcfs.chunking import chunk_hash, chunk_span
from mtcfs.errors import FsError
from mtcfs.fs.model import ROOT_INO, Inode, Version

log = logging.getLogger("mtcfs.fs.core")


class FaultInOps:
    """Fault-in: waiting for, fetching, verifying and writing chunks that are not in RAM yet."""

    # ------------------------------------------------------------------ fault-in

    async def _fault_in_all(self, ino: Inode) -> None:
        """Bring every chunk of the current version here (before a copy-on-write)."""
        v = self.versions.get(ino.vid) if ino.vid is not None else None
        if v is not None and v.missing:
            await self.fault_in(v, 0, v.size)

    async def fault_in(self, v: Version, off: int, size: int) -> None:
        """Wait until bytes ``[off, off+size)`` of ``v`` are in the data file.

        Raises:
            FsError: EIO when a chunk cannot be fetched or fails verification.
        """
        cs = v.chunk_size
        first, last = off // cs, (off + max(size, 1) - 1) // cs
        wanted = [i for i in range(first, last + 1) if i in v.missing]
        if not wanted:
            return
        if len(wanted) == 1:
            await self._fetch_chunk(v, wanted[0])
            return
        errors: list[BaseException] = []

        async def one(i: int) -> None:
            try:
                await self._fetch_chunk(v, i)
            except FsError as exc:
                errors.append(exc)

        async with trio.open_nursery() as n:
            for i in wanted:
                n.start_soon(one, i)
        if errors:
            raise errors[0]

    async def _fetch_chunk(self, v: Version, idx: int) -> None:
        key = (v.vid, idx)
        while idx in v.missing:
            ev = self._inflight.get(key)
            if ev is not None:
                await ev.wait()
                if idx in v.missing and key not in self._inflight:
                    raise FsError(errno.EIO, f"chunk {idx} of version {v.vid} unavailable")
                continue
            ev = self._inflight[key] = trio.Event()
            try:
                await self._fetch_chunk_once(v, idx)
            finally:
                del self._inflight[key]
                ev.set()

    async def _fetch_chunk_once(self, v: Version, idx: int) -> None:
        digest = v.chunks[idx]
        _off, length = chunk_span(idx, v.size, v.chunk_size)
        v.pins += 1
        try:
            async with self._fetch_limiter:
                data = await self._chunk_bytes(digest, length)
            await self._store_chunk(v, idx, data)
        finally:
            v.pins -= 1
            self._release_version(v)

    async def _store_chunk(self, v: Version, idx: int, data: bytes) -> None:
        """Write verified bytes of chunk ``idx`` of ``v`` into its data file, if still missing.

        The caller pins ``v``.
        """
        if idx not in v.missing or v.vid not in self.versions:
            return
        off, length = chunk_span(idx, v.size, v.chunk_size)
        await trio.to_thread.run_sync(os.pwrite, self._fd(v), data, off,
                                      limiter=self.cpu_limiter)
        if idx in v.missing:
            v.missing.discard(idx)
            self.used += length
            self.counters.chunks_faulted += 1
            self.counters.bytes_faulted += length
            self._note_chunk(v.chunks[idx], v.vid, idx)
            with self.db.transaction():
                self._write_version(v)

    async def deliver_chunk(self, digest: str, data: bytes,
                            where: list[tuple[Version, int]]) -> int:
        """Store a chunk fetched in bulk (a restore from peers) wherever it is missing.

        Args:
            digest: the chunk's blake3; ``data`` must already be verified against it.
            where: the (version, chunk index) pairs that need it.

        Returns:
            how many places were filled (0 if all were filled meanwhile, by reads).
        """
        filled = 0
        for v, idx in where:
            if v.vid not in self.versions or idx not in v.missing or v.chunks[idx] != digest:
                continue
            if len(data) != chunk_span(idx, v.size, v.chunk_size)[1]:
                self._error(f"chunk {digest[:16]} has {len(data)} bytes, expected "
                            f"{chunk_span(idx, v.size, v.chunk_size)[1]}")
                continue
            v.pins += 1
            try:
                await self._store_chunk(v, idx, data)
                filled += 1
            finally:
                v.pins -= 1
                self._release_version(v)
        return filled

    async def _chunk_bytes(self, digest: str, length: int) -> bytes:
        """Bytes of chunk ``digest``: a local copy if one exists, else the chunk source."""
        loc = self._chunk_locations.get(digest)
        if loc is not None:
            src = self.versions.get(loc[0])
            if src is not None and loc[1] not in src.missing:
                off, _ = chunk_span(loc[1], src.size, src.chunk_size)
                self._fd(src)
                src.pins += 1  # its descriptor must stay open while the thread reads
                try:
                    data = await trio.to_thread.run_sync(self.read_chunk_at, src, off, length,
                                                         digest, limiter=self.cpu_limiter)
                finally:
                    self.unpin([src])
                if data is not None:
                    return data
        if self.chunk_source is None:
            self.counters.fault_errors += 1
            raise FsError(errno.EIO, f"chunk {digest[:16]} is in no tier this node can reach")
        try:
            data = await self.chunk_source.fetch(digest)
        except FsError as exc:
            self.counters.fault_errors += 1
            self._error(f"fault-in of chunk {digest[:16]} failed: {exc.strerror}")
            raise
        if len(data) != length:
            self.counters.fault_errors += 1
            self._error(f"chunk {digest[:16]} has {len(data)} bytes, expected {length}")
            raise FsError(errno.EIO, "chunk length mismatch")
        return data

    def read_chunk_at(self, v: Version, off: int, length: int, digest: str | None) -> bytes | None:
        """Read ``length`` bytes at ``off`` of ``v`` and verify them against ``digest``.

        Thread-safe: the caller opens ``v``'s descriptor on the loop and pins ``v`` so that it
        stays open. Returns None on a mismatch: a chunk whose hash does not match is never
        served.
        """
        data = os.pread(v.fd, length, off)
        if digest is not None and chunk_hash(data) != digest:
            log.error("local chunk %s of version %d does not match its hash", digest[:16], v.vid)
            return None
        return data

    def pending_fault_in(self) -> list[tuple[Version, int]]:
        """(version, chunk index) pairs still missing in current versions, in path order."""
        out = []
        for _path, ino in self.walk(self.inodes[ROOT_INO]):
            if ino.is_file and ino.vid is not None:
                v = self.versions[ino.vid]
                if v.origin >= 0:
                    continue  # scope=job: another rank's file, faulted in when read
                out.extend((v, i) for i in sorted(v.missing))
        return out
