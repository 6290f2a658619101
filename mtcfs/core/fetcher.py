"""Fault-in: fetching, verifying and writing chunks that are not in RAM yet.

:class:`FaultIn` owns the fetches: the one fetch in flight per ``(version, chunk)`` that
other readers join, the fetch limiter, the chunk source, the failed fetches and their
refetch window, the deadline, and the last error (``mtcfs status``). It reaches the rest of
the core only through :class:`Host` (its owner, :class:`mtcfs.core.faultin.LocalChunks`),
the :class:`~mtcfs.core.budget.RamBudget` (room for the bytes it writes) and the descriptor
cache.

Verification of chunks already here (the first read since start) is the verifier's
(core/verifier.py); ``LocalChunks.fault_in`` runs it before :meth:`FaultIn.fill`.

Concurrency (docs/architecture.md): every method runs on the trio thread; the chunk write
runs in a worker thread under the core's ``cpu_limiter`` with a leased descriptor and its
bytes held in the budget (``in_flight``). After every ``await`` the code looks again at
``idx in v.missing`` and at whether ``v`` is still registered (a namespace snapshot install
replaces every version object).
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any, Protocol

import trio

from mtcfs.base import pools
from mtcfs.base.chunking import chunk_span
from mtcfs.base.errors import FsError
from mtcfs.base.failpoints import failpoint
from mtcfs.base.fileio import ShortWrite, pwrite_all
from mtcfs.core.budget import RamBudget
from mtcfs.core.model import Inode, Version
from mtcfs.core.records import ChunkSource, Counters
from mtcfs.core.store.fdcache import FdCache
from mtcfs.core.versions import Releaser

__all__ = ["FETCHES", "FETCH_DEADLINE_S", "REFETCH_AFTER_S", "FaultIn", "Host", "Paths"]

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
#: Seconds a read waits for a chunk a bulk restore's stream is bringing before it fetches
#: the chunk itself (the sources' own per-attempt deadline, tiers/peer/sources.py).
ARRIVAL_WAIT_S = 10.0
#: Fetches from sources at a time (the fetch limiter).
FETCHES = pools.POOLS["fetch"].size


def _write_chunk(fd: int, data: bytes | memoryview, off: int) -> None:
    failpoint("fetch.write_chunk")  # tests: chunk writes under way while the tmpfs changes
    pwrite_all(fd, data, off)


class Paths(Protocol):
    """What :class:`FaultIn` reads of the inode table (core/inodes.py): the path of a file
    for its error messages."""

    inodes: dict[int, Inode]

    def path_of(self, ino: Inode) -> str | None: ...


class Host(Protocol):
    """What :class:`FaultIn` may use of its owner (:class:`mtcfs.core.faultin.LocalChunks`)."""

    versions: dict[int, Version]

    @property
    def tree(self) -> Paths: ...
    @property
    def vstore(self) -> Releaser: ...  # core/versions.py: ``release(v)``

    def pin_chunk(self, digest: str) -> tuple[Version, int, int] | None: ...
    def unpin(self, versions: Any) -> None: ...
    def read_chunk_at(self, v: Version, off: int, length: int,
                      digest: str | None) -> bytes | None: ...
    def mark_corrupt(self, v: Version, idx: int, found_by: str) -> None: ...
    def chunk_arrived(self, v: Version, idx: int) -> None: ...
    def check_data_room(self, nbytes: int) -> None: ...
    def report_error(self, msg: str) -> None: ...


class FaultIn:
    """The fetches of one core.

    Args:
        host: its owner (see :class:`Host`).
        budget: the RAM budget; a chunk's bytes are reserved before they are written.
        fds: the core's descriptor cache (chunk writes lease a descriptor).
        counters: the core's counters (``fault_errors``, ``chunks_faulted``,
            ``bytes_faulted``, ``fault_in_over_size``).
        cpu_limiter: the core's worker-thread limiter (chunk writes, local-copy reads).

    Settable by the daemon and tests: :attr:`chunk_source`, :attr:`fetch_deadline_s`
    (seconds), :attr:`refetch_after_s` (seconds).
    """

    def __init__(self, host: Host, budget: RamBudget, fds: FdCache, counters: Counters,
                 cpu_limiter: trio.CapacityLimiter) -> None:
        self._host = host
        self._budget = budget
        self._fds = fds
        self._counters = counters
        self._cpu = cpu_limiter
        #: Where chunks this node does not hold come from (peers, backup); the daemon sets it.
        self.chunk_source: ChunkSource | None = None
        #: Seconds a read waits for a missing chunk before EIO.
        self.fetch_deadline_s = FETCH_DEADLINE_S
        #: Seconds a failed fetch of a chunk is answered at once with its error.
        self.refetch_after_s = REFETCH_AFTER_S
        #: The last fault-in that failed: what it read, why, the sources tried (status).
        self.last_fault_error = ""
        self._limiter = pools.limiter("fetch")
        #: (vid, chunk index) -> the event set when the fetch under way ends.
        self._inflight: dict[tuple[int, int], trio.Event] = {}
        #: (vid, chunk index) -> (trio time, error) of fetches that failed lately.
        self._failed: dict[tuple[int, int], tuple[float, str]] = {}
        #: Bytes of the store's filesystem that chunk writes under way will take (checked
        #: with each new one: ``Host.check_data_room``).
        self._claimed = 0
        #: digest -> set when a delivery under way elsewhere (the bulk restore's streams)
        #: has ended, stored or not: a read of that chunk waits for it instead of fetching
        #: the same bytes a second time over the same link (:meth:`expect`).
        self._arriving: dict[str, trio.Event] = {}

    def expect(self, digests: list[str]) -> None:
        """Chunks ``digests`` are being fetched by someone else (the bulk restore), who
        calls :meth:`settle` for each when it is stored or given up. Call on the loop."""
        for h in digests:
            self._arriving.setdefault(h, trio.Event())

    def settle(self, digests: list[str]) -> None:
        """The deliveries of ``digests`` announced by :meth:`expect` ended (each chunk is
        stored, or a read must fetch it itself). Call on the loop."""
        for h in digests:
            ev = self._arriving.pop(h, None)
            if ev is not None:
                ev.set()

    def fetching(self) -> int:
        """Fetches under way now."""
        return len(self._inflight)

    async def fill(self, v: Version, off: int, size: int) -> None:
        """Wait until the missing chunks of ``v`` that ``[off, off+size)`` touches are in its
        data file, fetched side by side, each within :attr:`fetch_deadline_s`.

        Raises:
            FsError: EIO (the first failure) when a chunk cannot be fetched in time.
        """
        cs = v.chunk_size
        first, last = off // cs, (off + max(size, 1) - 1) // cs
        wanted = [i for i in range(first, last + 1) if i in v.missing]
        if not wanted:
            return
        if len(wanted) == 1:
            await self.fetch_chunk(v, wanted[0])
            return
        errors: list[BaseException] = []

        async def one(i: int) -> None:
            try:
                await self.fetch_chunk(v, i)
            except FsError as exc:
                errors.append(exc)

        async with trio.open_nursery() as n:
            for i in wanted:
                n.start_soon(one, i)
        if errors:
            raise errors[0]

    async def fetch_chunk(self, v: Version, idx: int) -> None:
        """Bring chunk ``idx`` of ``v`` here, or join the fetch already under way.

        Never loops: the fetch this call starts or joins either fills the chunk or fails,
        and a wait for another reader's fetch ends at this reader's own deadline.

        Raises:
            FsError: EIO when the chunk is not here by the deadline, or it failed within
                :attr:`refetch_after_s` before.
        """
        key = (v.vid, idx)
        now = trio.current_time()
        deadline = now + self.fetch_deadline_s
        failed = self._failed.get(key)
        if failed is not None and idx in v.missing and key not in self._inflight:
            if now - failed[0] < self.refetch_after_s:
                raise FsError(errno.EIO, failed[1])
            del self._failed[key]
        while idx in v.missing:
            ev = self._inflight.get(key)
            if ev is not None:
                with trio.move_on_at(deadline):
                    await ev.wait()
                if idx in v.missing and key not in self._inflight:
                    failed = self._failed.get(key)  # the fetch we joined failed
                    raise FsError(errno.EIO, failed[1] if failed else
                                  f"{self._what(v, idx)}: the fetch this read waited for failed")
                if idx in v.missing and trio.current_time() >= deadline:
                    raise FsError(errno.EIO, f"{self._what(v, idx)}: another read's fetch "
                                  f"did not end within {self.fetch_deadline_s:g} s")
                continue
            ev = self._inflight[key] = trio.Event()
            try:
                await self._fetch_once(v, idx, deadline)  # fills the chunk or raises
            finally:
                del self._inflight[key]
                ev.set()
            return

    def _what(self, v: Version, idx: int) -> str:
        """``read of PATH, chunk I (DIGEST)``: what a fault-in error names."""
        tree = self._host.tree
        ino = tree.inodes.get(v.ino)
        path = tree.path_of(ino) if ino is not None else None
        return (f"read of {path if path is not None else f'version {v.vid}'}, chunk {idx}"
                f" ({v.chunks[idx][:16]})")

    async def _fetch_once(self, v: Version, idx: int, deadline: float) -> None:
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
        arriving = self._arriving.get(digest)
        if arriving is not None:  # on its way already (the bulk restore): wait for it, for
            # a while: a stream stuck on a hung holder gives it up only after its timeout
            with trio.move_on_at(min(deadline, trio.current_time() + ARRIVAL_WAIT_S)):
                await arriving.wait()
            if idx not in v.missing:
                return
        tried: list[str] = []  # what each source said in this pass
        last: list[str] = []  # ... and in the last whole pass
        passes = 0
        why = ""
        self._counters.fault_waits += 1
        v.pins += 1
        try:
            with trio.move_on_at(deadline) as scope:
                while True:
                    passes += 1
                    last, tried = tried, []
                    try:
                        async with self._limiter:
                            data = await self._chunk_bytes(digest, length, tried)
                        await self.store_chunk(v, idx, data)
                        return
                    except FsError as exc:
                        why = exc.strerror or "failed"
                        if exc.errno != errno.EAGAIN:
                            break
                    await trio.sleep(min(0.25 * 2 ** (passes - 1), 4.0))
            if scope.cancelled_caught:
                self._counters.fault_timeouts += 1
                why = f"no source served it within {self.fetch_deadline_s:g} s"
                if last:  # the deadline cut this pass: say what the last whole one heard
                    tried = last + [t for t in tried if t not in last]
        finally:
            v.pins -= 1
            self._host.vstore.release(v)
        self._counters.fault_errors += 1
        asked = f" (every source asked {passes} times)" if passes > 1 else ""
        why = (f"{self._what(v, idx)}: {why}{asked}; tried: "
               f"{'; '.join(tried) or 'nothing'}")
        self.last_fault_error = why
        self._host.report_error(why)
        now = trio.current_time()
        for k in [k for k, (t, _w) in self._failed.items() if now - t >= self.refetch_after_s]:
            del self._failed[k]
        self._failed[(v.vid, idx)] = (now, why)
        raise FsError(errno.EIO, why)

    async def store_chunk(self, v: Version, idx: int, data: bytes | memoryview) -> None:
        """Write verified bytes of chunk ``idx`` of ``v`` into its data file, if still missing.

        The caller pins ``v``. A version that is no longer registered (a namespace snapshot
        installed meanwhile replaced every version object; the handle or read that pins it
        still reads it through its open descriptor) gets the bytes in that descriptor and
        nothing else: it is no longer the store's to count or index.

        Raises:
            FsError: EIO when ``v`` was replaced and has no descriptor left to write to,
                or when the bytes cannot be written (:meth:`_write`).
            StoreFull: (an OSError, ENOSPC) before anything is written when the bytes
                would take the metadata's reserve (``Host.check_data_room``).
        """
        if idx not in v.missing:
            return
        versions = self._host.versions
        registered = versions.get(v.vid) is v
        if v.preserved is not None:
            # A replaced version that reads a data file a newer one writes on (core/
            # versions.py, "Shared data files"): the bytes go to its own copy, not the file.
            v.preserved[idx] = bytes(data)
            v.missing.discard(idx)
            self._counters.chunks_faulted += 1
            self._counters.bytes_faulted += len(data)
            if registered:
                self._budget.account(v)
                self._host.chunk_arrived(v, idx)
            return
        claimed = 0
        v.filling += 1  # (no await since the check above)
        try:
            if not registered and v.fd < 0:
                raise FsError(errno.EIO, "the file was replaced while its data was fetched")
            off, length = chunk_span(idx, v.size, v.chunk_size)
            if registered:
                # Bytes brought into RAM count against size= like a write (core/budget.py,
                # the accounting rule): room is made first, by eviction. A read is never
                # refused for room, though: when nothing can be evicted the chunk goes in
                # past size= (logged, counted), and later evictions take it back
                # (docs/usage.md). Held until the bytes are counted: fetches write in
                # threads, side by side.
                need = self._budget.new_bytes(v, off, off + length)
                if need:
                    # (with the bytes of the fetches side by side that are not written yet)
                    self._host.check_data_room(need + self._claimed)
                    claimed = need
                    self._claimed += claimed
                if not await self._budget.reserve(need, best_effort=True):
                    self._counters.fault_in_over_size += 1
                    over = self._counters.fault_in_over_size
                    if over == 1 or over % 1000 == 0:
                        log.warning("RAM tier full and nothing can be evicted: chunks read "
                                    "in go past size= (%d so far)", over)
                if idx not in v.missing:
                    return  # stored by another fetch while we waited
                if versions.get(v.vid) is not v:  # replaced while we waited for room
                    need = 0
                    if v.fd < 0:
                        raise FsError(errno.EIO, "the file was replaced while its data "
                                      "was fetched")
                else:
                    self._fds.get(v)  # cached for the reads that follow
            else:
                need = 0
            with self._budget.hold(need):  # set aside until counted
                fd = self._fds.lease(v)  # stays open while the thread writes
                try:
                    await self._write(v, idx, fd, data, off)
                finally:
                    self._fds.unlease(v, fd)
            if idx in v.missing:
                v.missing.discard(idx)
                self._counters.chunks_faulted += 1
                self._counters.bytes_faulted += length
                if versions.get(v.vid) is v:
                    self._budget.account(v)
                    self._host.chunk_arrived(v, idx)
        finally:
            self._claimed -= claimed
            v.filling -= 1
            if not v.filling and v.fill_done is not None:
                v.fill_done.set()
                v.fill_done = None

    async def _write(self, v: Version, idx: int, fd: int, data: bytes | memoryview,
                     off: int) -> None:
        """Write chunk ``idx`` (``data``, at byte ``off``) into ``v``'s data file ``fd`` in
        a worker thread, all of it.

        A read is never refused for room (docs/usage.md, "Capacity and eviction"): when the
        data tmpfs is full all the same (a passthrough writer took the room the budget saw,
        which it learns of only at that file's seal), it is grown for this chunk and the
        write is made once more.

        Raises:
            FsError: EIO when the chunk cannot be written (the error said).
        """
        for attempt in (1, 2):
            try:
                await trio.to_thread.run_sync(_write_chunk, fd, data, off, limiter=self._cpu)
                return
            except ShortWrite as exc:
                if exc.errno == errno.ENOSPC and attempt == 1 \
                        and self._host.versions.get(v.vid) is v:
                    self._counters.fault_in_over_size += 1
                    log.warning("the store's data tmpfs was full under a chunk read in (%s):"
                                " grown for it", self._what(v, idx))
                    self._budget.grow_data(len(data) - exc.written + self._budget.in_flight)
                    continue
                # (the fetch that called reports and counts it, with the sources tried)
                raise FsError(errno.EIO, f"writing it into the store: {exc.strerror}"
                              ) from None

    async def deliver(self, digest: str, data: bytes | memoryview,
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
            if v.vid not in self._host.versions or idx not in v.missing \
                    or v.chunks[idx] != digest:
                continue
            if len(data) != chunk_span(idx, v.size, v.chunk_size)[1]:
                self._host.report_error(f"chunk {digest[:16]} has {len(data)} bytes, expected "
                                  f"{chunk_span(idx, v.size, v.chunk_size)[1]}")
                continue
            v.pins += 1
            try:
                await self.store_chunk(v, idx, data)
                filled += 1
            finally:
                v.pins -= 1
                self._host.vstore.release(v)
        return filled

    async def _chunk_bytes(self, digest: str, length: int, tried: list[str]) -> bytes:
        """Bytes of chunk ``digest``: a local copy if one exists, else the chunk source.

        ``tried`` collects one line per source asked (for the error at the deadline).

        Raises:
            FsError: EAGAIN when no copy came and some source could not be asked, EIO when
                every source answered and none has a valid copy.
        """
        host = self._host
        local = host.pin_chunk(digest)  # its data file must stay while the thread reads
        if local is not None:
            src, off, _len = local
            try:
                data = await trio.to_thread.run_sync(host.read_chunk_at, src, off, length,
                                                     digest, limiter=self._cpu)
            finally:
                host.unpin([src])
            if data is not None:
                return data
            tried.append("local store: corrupt")
            host.mark_corrupt(src, off // src.chunk_size, "a local copy read for fault-in")
        if self.chunk_source is None:
            raise FsError(errno.EIO, "in no tier this node can reach")
        data = await self.chunk_source.fetch(digest, tried)
        if len(data) != length:
            raise FsError(errno.EIO, f"a source served {len(data)} bytes, expected {length}")
        return data
