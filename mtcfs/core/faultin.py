"""Fault-in: waiting for, fetching, verifying and writing chunks that are not in RAM yet.

A part of :class:`mtcfs.core.core.Filesystem` (mixed in); see that module for the
concurrency protocol every method follows.
"""

from __future__ import annotations

import errno
import logging
import os

import trio

from mtcfs.base.chunking import chunk_hash, chunk_span
from mtcfs.base.errors import FsError
from mtcfs.core.model import ROOT_INO, Inode, Version

log = logging.getLogger("mtcfs.core.core")

#: Seconds a read waits for one missing chunk, every source included (the local replica
#: store, the writer, its replicas, every other member, the backup tier), before it fails
#: with EIO. Each source is asked once per fetch and a source that does not answer is given
#: up on after its own, shorter, deadline (mtcfs/tiers/peer/sources.py), so this bound is
#: reached only when every source is slow or gone. docs/reliability.md.
FETCH_DEADLINE_S = 60.0
#: Seconds after a failed fetch of a chunk during which a new fetch of it fails at once with
#: the same error. The kernel sends a READ again right after one failed (a readahead, then
#: the read itself); without this, one read(2) could wait the deadline twice.
REFETCH_AFTER_S = 2.0


class FaultInOps:
    """Fault-in: waiting for, fetching, verifying and writing chunks that are not in RAM yet."""

    # ------------------------------------------------------------------ fault-in

    async def _fault_in_all(self, ino: Inode) -> None:
        """Bring every chunk of the current version here (before a copy-on-write)."""
        v = self.versions.get(ino.vid) if ino.vid is not None else None
        if v is not None and (v.missing or self.needs_verify(v)):
            await self.fault_in(v, 0, v.size)

    async def fault_in(self, v: Version, off: int, size: int) -> None:
        """Wait until bytes ``[off, off+size)`` of ``v`` are in the data file.

        Each missing chunk is fetched at most once at a time (other readers of it wait for
        that fetch) and within :attr:`fetch_deadline_s` seconds of the first ask, every
        source included.

        Raises:
            FsError: EIO when a chunk cannot be fetched in time, from any source, or fails
                verification; the message names the file and the sources tried, and the
                error is counted (``fault_errors``) and listed by ``mtcfs status``.
        """
        if self.needs_verify(v):  # first read since start: hash before serving (core/scrub.py)
            await self._verify_range(v, off, size)
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
        """Bring chunk ``idx`` of ``v`` here, or join the fetch already under way.

        Never loops: the fetch this call starts or joins either fills the chunk or fails,
        and a wait for another reader's fetch ends at this reader's own deadline.
        """
        key = (v.vid, idx)
        now = trio.current_time()
        deadline = now + self.fetch_deadline_s
        failed = self._failed_fetches.get(key)
        if failed is not None and idx in v.missing and key not in self._inflight:
            if now - failed[0] < self.refetch_after_s:
                raise FsError(errno.EIO, failed[1])
            del self._failed_fetches[key]
        while idx in v.missing:
            ev = self._inflight.get(key)
            if ev is not None:
                with trio.move_on_at(deadline):
                    await ev.wait()
                if idx in v.missing and key not in self._inflight:
                    failed = self._failed_fetches.get(key)  # the fetch we joined failed
                    raise FsError(errno.EIO, failed[1] if failed else
                                  f"{self._what(v, idx)}: the fetch this read waited for failed")
                if idx in v.missing and trio.current_time() >= deadline:
                    raise FsError(errno.EIO, f"{self._what(v, idx)}: another read's fetch "
                                  f"did not end within {self.fetch_deadline_s:g} s")
                continue
            ev = self._inflight[key] = trio.Event()
            try:
                await self._fetch_chunk_once(v, idx, deadline)  # fills the chunk or raises
            finally:
                del self._inflight[key]
                ev.set()
            return

    def _what(self, v: Version, idx: int) -> str:
        """``read of PATH, chunk I (DIGEST)``: what a fault-in error names."""
        ino = self.inodes.get(v.ino)
        path = self.path_of(ino) if ino is not None else None
        return (f"read of {path if path is not None else f'version {v.vid}'}, chunk {idx}"
                f" ({v.chunks[idx][:16]})")

    async def _fetch_chunk_once(self, v: Version, idx: int, deadline: float) -> None:
        """Fetch, verify and store chunk ``idx`` of ``v`` before ``deadline`` (trio time).

        One pass asks every source once. When a pass ends with no copy and some source could
        not be asked (EAGAIN from the chunk source: unreachable, no answer in time), passes
        repeat after a short pause (0.25 s doubling to 4 s) until the deadline: a node that
        restarts, a partition that heals. When every source answered and none holds a
        valid copy (EIO), the read fails at once.

        Raises:
            FsError: EIO, logged and counted, when no source served it in time.
        """
        digest = v.chunks[idx]
        _off, length = chunk_span(idx, v.size, v.chunk_size)
        tried: list[str] = []  # what each source said in this pass
        last: list[str] = []  # ... and in the last whole pass
        passes = 0
        why = ""
        v.pins += 1
        try:
            with trio.move_on_at(deadline) as scope:
                while True:
                    passes += 1
                    last, tried = tried, []
                    try:
                        async with self._fetch_limiter:
                            data = await self._chunk_bytes(digest, length, tried)
                        await self._store_chunk(v, idx, data)
                        return
                    except FsError as exc:
                        why = exc.strerror or "failed"
                        if exc.errno != errno.EAGAIN:
                            break
                    await trio.sleep(min(0.25 * 2 ** (passes - 1), 4.0))
            if scope.cancelled_caught:
                why = f"no source served it within {self.fetch_deadline_s:g} s"
                if last:  # the deadline cut this pass: say what the last whole one heard
                    tried = last + [t for t in tried if t not in last]
        finally:
            v.pins -= 1
            self._release_version(v)
        self.counters.fault_errors += 1
        asked = f" (every source asked {passes} times)" if passes > 1 else ""
        why = (f"{self._what(v, idx)}: {why}{asked}; tried: "
               f"{'; '.join(tried) or 'nothing'}")
        self.last_fault_error = why
        self._error(why)
        now = trio.current_time()
        for k in [k for k, (t, _w) in self._failed_fetches.items()
                  if now - t >= self.refetch_after_s]:
            del self._failed_fetches[k]
        self._failed_fetches[(v.vid, idx)] = (now, why)
        raise FsError(errno.EIO, why)

    async def _store_chunk(self, v: Version, idx: int, data: bytes) -> None:
        """Write verified bytes of chunk ``idx`` of ``v`` into its data file, if still missing.

        The caller pins ``v``. A version that is no longer registered (a namespace snapshot
        installed meanwhile replaced every version object; the handle or read that pins it
        still reads it through its open descriptor) gets the bytes in that descriptor and
        nothing else: it is no longer the store's to count or index.
        """
        if idx not in v.missing:
            return
        registered = self.versions.get(v.vid) is v
        if not registered and v.fd < 0:
            raise FsError(errno.EIO, "the file was replaced while its data was fetched")
        off, length = chunk_span(idx, v.size, v.chunk_size)
        if registered:
            # Bytes brought into RAM count against size= like a write (core/budget.py, the
            # accounting rule): room is made first, by eviction. A read is never refused
            # for room, though: when nothing can be evicted the chunk goes in past size=
            # (logged, counted), and later evictions take it back (docs/usage.md).
            # Held until the bytes are counted: fetches write in threads, side by side.
            need = self.budget.new_bytes(v, off, off + length)
            if not await self.budget.reserve(need, best_effort=True):
                self.counters.fault_in_over_size += 1
                if self.counters.fault_in_over_size == 1 or \
                        self.counters.fault_in_over_size % 1000 == 0:
                    log.warning("RAM tier full and nothing can be evicted: chunks read in "
                                "go past size= (%d so far)", self.counters.fault_in_over_size)
            if idx not in v.missing:
                return  # stored by another fetch while we waited
            if self.versions.get(v.vid) is not v:  # replaced while we waited for room
                need = 0
                if v.fd < 0:
                    raise FsError(errno.EIO, "the file was replaced while its data was fetched")
            else:
                self._fd(v)  # cached for the reads that follow
        else:
            need = 0
        with self.budget.hold(need):  # set aside until counted (core/budget.py)
            fd = self.fds.lease(v)  # stays open while the thread writes
            try:
                await trio.to_thread.run_sync(os.pwrite, fd, data, off, limiter=self.cpu_limiter)
            finally:
                self.fds.unlease(v, fd)
        if idx in v.missing:
            v.missing.discard(idx)
            self.counters.chunks_faulted += 1
            self.counters.bytes_faulted += length
            if self.versions.get(v.vid) is v:
                self.budget.account(v)
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

    async def _chunk_bytes(self, digest: str, length: int, tried: list[str]) -> bytes:
        """Bytes of chunk ``digest``: a local copy if one exists, else the chunk source.

        ``tried`` collects one line per source asked (for the error at the deadline).

        Raises:
            FsError: EAGAIN when no copy came and some source could not be asked, EIO when
                every source answered and none has a valid copy.
        """
        loc = self._chunk_locations.get(digest)
        if loc is not None:
            src = self.versions.get(loc[0])
            if src is not None and loc[1] not in src.missing:
                off, _ = chunk_span(loc[1], src.size, src.chunk_size)
                self._fd(src)
                src.pins += 1  # its data file must stay while the thread reads
                try:
                    data = await trio.to_thread.run_sync(self.read_chunk_at, src, off, length,
                                                         digest, limiter=self.cpu_limiter)
                finally:
                    self.unpin([src])
                if data is not None:
                    return data
                tried.append("local store: corrupt")
                self._mark_corrupt(src, loc[1], "a local copy read for fault-in")
        if self.chunk_source is None:
            raise FsError(errno.EIO, "in no tier this node can reach")
        data = await self.chunk_source.fetch(digest, tried)
        if len(data) != length:
            raise FsError(errno.EIO, f"a source served {len(data)} bytes, expected {length}")
        return data

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
        for _path, ino in self.walk(self.inodes[ROOT_INO]):
            if ino.is_file and ino.vid is not None:
                v = self.versions[ino.vid]
                if v.origin >= 0:
                    continue  # scope=job: another rank's file, faulted in when read
                out.extend((v, i) for i in sorted(v.missing))
        return out
