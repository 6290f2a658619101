"""Restore from the backup tier: a chunk source for fault-in, and a background prefetcher.

Restore is lazy: the namespace of the chosen checkpoint appears at once (the core's
``import_step``), the prefetcher pulls chunks in path order in the background, and a read of
a chunk that is not here yet fetches it on demand (verified by blake3 in
:meth:`BackupStore.get_chunk`). A chunk that fails verification is never served: the read
gets EIO and the error is logged and shown by ``mtcfs status``.
"""

from __future__ import annotations

import errno
import logging
from typing import Any

import trio

from mtcfs.base import pools
from mtcfs.base.errors import FsError
from mtcfs.core.ports import RestorePort
from mtcfs.tiers.backup import BackupError, BackupStore, ChunkCorrupt, NotFound

log = logging.getLogger(__name__)


class BackupChunkSource:
    """Fetches verified chunks from the backup tier in worker threads.

    Args:
        store: the backup tier.
        concurrency: downloads in flight at once.
    """

    def __init__(self, store: BackupStore, concurrency: int = 4) -> None:
        self.store = store
        self.limiter = pools.limiter("backup-fetch", concurrency)
        self.corrupt = 0

    async def fetch(self, digest: str, tried: list[str] | None = None) -> bytes:
        try:
            return await trio.to_thread.run_sync(self.store.get_chunk, digest,
                                                 limiter=self.limiter, abandon_on_cancel=True)
        except ChunkCorrupt as exc:
            self.corrupt += 1
            log.error("backup chunk %s failed verification: %s", digest[:16], exc)
            why, code = "corrupt", errno.EIO
        except NotFound:
            why, code = "missing", errno.EIO
        except BackupError as exc:  # unreachable, after the backend's retries
            why, code = str(exc), errno.EAGAIN
        if tried is not None:
            tried.append(f"backup: {why}")
        raise FsError(code, f"backup chunk {digest[:16]}: {why}")


class Prefetcher:
    """Pulls every missing chunk of the current namespace, in path order, in the background.

    Errors are left to the core's error log; a chunk that failed is tried again on the next
    pass (``kick``) or on read.
    """

    def __init__(self, fs: RestorePort, concurrency: int = 4) -> None:
        self.fs = fs
        self.concurrency = concurrency
        self._wake = trio.Event()
        self.passes = 0
        self.failed = 0
        self.idle = False  # True between passes
        #: Set before run() to skip the first pass until kick() (a bulk restore from peers
        #: runs first and kicks the prefetcher for whatever it leaves).
        self.wait_for_kick = False

    def kick(self) -> None:
        self._wake.set()

    def pending(self) -> tuple[int, int]:
        """(chunks, bytes) still missing in current versions."""
        items = self.fs.pending_fault_in()
        total = 0
        for v, i in items:
            off = i * v.chunk_size
            total += max(0, min(v.chunk_size, v.size - off))
        return len(items), total

    async def run(self) -> None:
        if self.wait_for_kick:
            self.idle = True
            await self._wake.wait()
            self._wake = trio.Event()
        while True:
            self.idle = False
            await self._one_pass()
            self.idle = True
            await self._wake.wait()
            self._wake = trio.Event()

    async def _one_pass(self) -> None:
        self.passes += 1
        work = [(v, i) for v, i in self.fs.pending_fault_in() if not v.writers]
        if not work:
            return
        send, recv = trio.open_memory_channel[Any](0)

        async def worker() -> None:
            async for v, i in recv:
                try:
                    await self.fs.fault_in(v, i * v.chunk_size, 1)
                except FsError:
                    self.failed += 1

        async with trio.open_nursery() as n:
            for _ in range(self.concurrency):
                n.start_soon(worker)
            async with send:
                for item in work:
                    await send.send(item)
