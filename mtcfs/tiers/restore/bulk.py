"""Bulk restore from peers: stream every missing chunk of a restored step from its holders.

Fault-in asks for one chunk at a time, which suits reads of data not here yet. A replacement
node needs all of its data, so after the namespace of the step is imported this task asks
every holder at once for a share of the missing chunks (spread by digest), in batches over
chunk streams (raw bytes, tiers/peer/chunk_stream.py; GetChunks where a holder has none),
:data:`STREAMS_PER_HOLDER` per holder; a stream whose holder's share is done takes batches
of the largest share left, so a fast holder takes over from a slow one. Each verified chunk
is stored wherever the core still misses it, while the next ones arrive. A read that needs a
chunk first still faults it in on its own. Chunks a holder does not serve (lost, corrupt,
the holder died) are asked of the next holder; what no holder serves is left to the
prefetcher, which reads the backup tier.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from mtcfs.core.ports import RestorePort, Version
from mtcfs.tiers.peer.client import GET_BATCH
from mtcfs.tiers.peer.errors import PeerChunkCorrupt, PeerError

if TYPE_CHECKING:
    from mtcfs.tiers.peer.tier import PeerTier

log = logging.getLogger(__name__)

#: Concurrent streams per holder: one is being served while the other's chunks are
#: verified and stored here.
STREAMS_PER_HOLDER = 2
#: Chunks a holder's share must still have for another holder's stream to take some of it
#: (at most half, from its end): a small restore still asks every holder for its share.
STEAL_AFTER = GET_BATCH
#: Chunks of one stream being written into the store while the next ones arrive.
STORE_AHEAD = 2
#: Seconds a stream waits for the store to take a chunk before the restore gives up (the
#: prefetcher then brings the rest).
STORE_WAIT_S = 60.0


class _Shares:
    """The chunks of one round, a share per holder (spread by digest). A stream takes its
    next batch from the front of its holder's share, then half of what is left at the end of
    the largest share while that has :data:`STEAL_AFTER` or more (a fast holder takes over
    from a slow one); a failed holder's share is left to the next round. Thread-safe."""

    def __init__(self, holders: list[int], todo: list[str], round_: int,
                 needed: Callable[[str], bool] = lambda h: True) -> None:
        self._lock = threading.Lock()
        self._needed = needed
        #: chunks left out of every batch: a read brought them meanwhile
        self.skipped: set[str] = set()
        self._shares: dict[int, collections.deque[str]] = {
            r: collections.deque() for r in holders}
        for h in todo:
            self._shares[holders[(int(h[:8], 16) + round_) % len(holders)]].append(h)
        self._failed: set[int] = set()

    def take(self, rank: int) -> list[str]:
        """The next batch (at most :data:`~mtcfs.tiers.peer.client.GET_BATCH` chunks) for a
        stream from ``rank``; empty when nothing is left or ``rank`` failed."""
        with self._lock:
            if rank in self._failed:
                return []
            q = self._shares[rank]
            steal = not q
            if steal:
                # Take over from the holder with the most left, but only past what its own
                # streams are about to take: a small restore asks every holder for its
                # share (a holder's damaged copies are found and deleted on the way).
                q = max(self._shares.values(), key=len)
                if len(q) < STEAL_AFTER:
                    return []
            want = min(GET_BATCH, len(q) // 2) if steal else GET_BATCH
            batch: list[str] = []
            while q and len(batch) < want:
                h = q.pop() if steal else q.popleft()
                if self._needed(h):
                    batch.append(h)
                else:
                    self.skipped.add(h)
            return batch[::-1] if steal else batch

    def drop(self, rank: int) -> None:
        """``rank`` failed: its streams take no more batches."""
        with self._lock:
            self._failed.add(rank)


async def restore_from_peers(fs: RestorePort, tier: PeerTier, *,
                             on_chunk: Callable[[], None] | None = None) -> dict[str, Any]:
    """Fetch every chunk the core misses from the holders of this rank's data.

    Args:
        fs: the filesystem core (``pending_fault_in``, ``deliver_chunk``).
        tier: the node's PeerTier (``restore_holders``, ``peer_ranks``, ``bulk_client``,
            ``report_bad``).
        on_chunk: called on the loop for each chunk stored (status counters).

    Returns:
        ``{"chunks": stored, "bytes": ..., "seconds": ..., "gbps": bytes/s / 1e9, "left":
        chunks no holder served, "by_rank": {rank: chunks}, "bytes_by_rank": {rank: bytes}}``
        (``mtcfs status``: restore.bulk_from_peers).
    """
    t0 = time.monotonic()
    where: dict[str, list[tuple[Version, int]]] = {}
    for v, i in fs.pending_fault_in():
        where.setdefault(v.chunks[i], []).append((v, i))
    todo = list(where)
    holders = [r for r in (tier.restore_holders or tier.peer_ranks()) if r != tier.rank]
    token = trio.lowlevel.current_trio_token()
    stats: dict[str, Any] = {"chunks": 0, "bytes": 0, "by_rank": {}, "bytes_by_rank": {}}

    def needed(h: str) -> bool:
        """Whether chunk ``h`` is still missing somewhere (read from a stream thread: a
        read that fills it at the same moment costs one chunk fetched twice, no more)."""
        return any(idx in v.missing for v, idx in where.get(h, ()))

    async def store(h: str, data: bytes | memoryview, rank: int,
                    done: threading.Event) -> None:
        try:
            if await fs.deliver_chunk(h, data, where.get(h, [])):
                stats["chunks"] += 1
                stats["bytes"] += len(data)
                stats["by_rank"][rank] = stats["by_rank"].get(rank, 0) + 1
                stats["bytes_by_rank"][rank] = stats["bytes_by_rank"].get(rank, 0) + len(data)
                if on_chunk is not None:
                    on_chunk()
        finally:
            fs.settle_chunks([h])
            done.set()

    def submit(nursery: trio.Nursery, h: str, data: bytes | memoryview, rank: int,
               done: threading.Event) -> None:
        """On the loop: start the write of one received chunk."""
        try:
            nursery.start_soon(store, h, data, rank, done)
        except RuntimeError:  # the restore was cancelled: nothing to write into
            fs.settle_chunks([h])
            done.set()

    def soon(fn: Callable[..., object], *args: object) -> bool:
        """Queue ``fn(*args)`` on the loop without waiting for it; False once it ended."""
        try:
            token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            return False
        return True

    def stream(rank: int, work: _Shares, got: set[str],
               nursery: trio.Nursery) -> None:
        """Worker thread: batches of chunks from ``rank`` (its share first, then what is
        left of the others'), by chunk stream where the holder has one (raw bytes;
        tiers/peer/chunk_stream.py), else by GetChunks. Up to :data:`STORE_AHEAD` chunks
        are written into the core while the next ones arrive, each from a receive buffer
        of its own: before a buffer is received into again, the write of the chunk it held
        has ended (the writes end in any order; ``writing`` is waited on oldest first)."""
        client = tier.bulk_client(rank)
        writing: collections.deque[threading.Event] = collections.deque()

        def wait_oldest() -> None:
            if not writing.popleft().wait(timeout=STORE_WAIT_S):
                raise TimeoutError(f"a restored chunk was not written into the store within"
                                   f" {STORE_WAIT_S:g} s")

        try:
            while batch := work.take(rank):
                # A read of one of these chunks now waits for this stream instead of
                # fetching the same bytes again over the same link (each is settled when
                # stored, or when this stream gives it up).
                soon(fs.expect_chunks, batch)
                unsettled = set(batch)
                try:
                    for h, data in client.stream_chunks(batch, buffers=STORE_AHEAD + 1):
                        unsettled.discard(h)
                        if data is None:
                            soon(fs.settle_chunks, [h])
                            continue
                        got.add(h)
                        done = threading.Event()
                        # queued without waiting for the loop: the next chunk is received
                        # meanwhile
                        if not soon(submit, nursery, h, data, rank, done):
                            done.set()  # the daemon is ending: nothing to write into
                        writing.append(done)
                        while len(writing) >= STORE_AHEAD:
                            wait_oldest()
                finally:
                    if unsettled:
                        soon(fs.settle_chunks, sorted(unsettled))
        finally:
            while writing:  # no write may outlive the buffers it reads
                wait_oldest()

    round_ = 0
    while todo and holders:
        got: set[str] = set()
        bad: set[int] = set()
        work = _Shares(holders, todo, round_, needed)

        async def one(rank: int, work: _Shares, got: set[str], bad: set[int]) -> None:
            async with trio.open_nursery() as stores:  # the writes of received chunks
                try:  # (caught inside: the nursery would wrap it in an ExceptionGroup)
                    await trio.to_thread.run_sync(stream, rank, work, got, stores,
                                                  abandon_on_cancel=True)
                except PeerChunkCorrupt as exc:
                    tier.report_bad(rank, str(exc))
                    bad.add(rank)
                    work.drop(rank)
                except PeerError as exc:
                    log.warning("bulk restore from rank %d: %s", rank, exc)
                    bad.add(rank)
                    work.drop(rank)

        async with trio.open_nursery() as n:
            for rank in holders:
                for _k in range(STREAMS_PER_HOLDER):
                    n.start_soon(one, rank, work, got, bad)
        todo = [h for h in todo if h not in got and h not in work.skipped]
        holders = [r for r in holders if r not in bad] if bad else holders
        round_ += 1
        if round_ >= 3:
            break
    stats["left"] = len(todo)
    stats["seconds"] = round(time.monotonic() - t0, 3)
    stats["gbps"] = round(stats["bytes"] / stats["seconds"] / 1e9, 3) if stats["seconds"] \
        else None
    log.info("bulk restore from peers: %d chunks (%d bytes) in %.2f s, %d left for the other"
             " tiers", stats["chunks"], stats["bytes"], stats["seconds"], len(todo))
    return stats
