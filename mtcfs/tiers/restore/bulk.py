"""Bulk restore from peers: stream every missing chunk of a restored step from its holders.

Fault-in asks for one chunk at a time, which suits reads of data not here yet. A replacement
node needs all of its data, so after the namespace of the step is imported this task asks
each holder for a share of the missing chunks in long ``GetChunks`` streams (several holders
in parallel; each chunk from one of them, spread by digest), and stores each verified chunk
wherever the core still misses it. A read that needs a chunk first still faults it in on its
own. Chunks a holder does not serve (lost, corrupt, the holder died) are asked of the next
holder; what no holder serves is left to the prefetcher, which reads the backup tier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from mtcfs.core.ports import RestorePort, Version
from mtcfs.tiers.peer.errors import PeerChunkCorrupt, PeerError

if TYPE_CHECKING:
    from mtcfs.tiers.peer.tier import PeerTier

log = logging.getLogger(__name__)

#: Chunks per GetChunks call of the bulk restore (at 4 MiB, 64 MiB per stream).
BATCH = 16
#: Concurrent GetChunks streams per holder: one is being served while the other's chunks
#: are verified and stored here.
STREAMS_PER_HOLDER = 2


async def restore_from_peers(fs: RestorePort, tier: PeerTier, *,
                             on_chunk: Callable[[], None] | None = None) -> dict[str, Any]:
    """Fetch every chunk the core misses from the holders of this rank's data.

    Args:
        fs: the filesystem core (``pending_fault_in``, ``deliver_chunk``).
        tier: the node's PeerTier (``restore_holders``, ``peer_ranks``, ``bulk_client``,
            ``report_bad``).
        on_chunk: called on the loop for each chunk stored (status counters).

    Returns:
        ``{"chunks": stored, "bytes": ..., "seconds": ..., "left": chunks no holder served,
        "by_rank": {rank: chunks}}``.
    """
    t0 = time.monotonic()
    where: dict[str, list[tuple[Version, int]]] = {}
    for v, i in fs.pending_fault_in():
        where.setdefault(v.chunks[i], []).append((v, i))
    todo = list(where)
    holders = [r for r in (tier.restore_holders or tier.peer_ranks()) if r != tier.rank]
    token = trio.lowlevel.current_trio_token()
    stats: dict[str, Any] = {"chunks": 0, "bytes": 0, "by_rank": {}}

    async def store(h: str, data: bytes, rank: int) -> None:
        if await fs.deliver_chunk(h, data, where.get(h, [])):
            stats["chunks"] += 1
            stats["bytes"] += len(data)
            stats["by_rank"][rank] = stats["by_rank"].get(rank, 0) + 1
            if on_chunk is not None:
                on_chunk()

    def stream(rank: int, digests: list[str], got: set[str]) -> None:
        """Worker thread: one holder, a list of digests, batch by batch."""
        client = tier.bulk_client(rank)
        for i in range(0, len(digests), BATCH):
            for h, data in client.get_chunks(digests[i:i + BATCH]):
                got.add(h)
                trio.from_thread.run(store, h, data, rank, trio_token=token)

    round_ = 0
    while todo and holders:
        got: set[str] = set()
        bad: set[int] = set()
        shares: dict[int, list[str]] = {r: [] for r in holders}
        for h in todo:
            shares[holders[(int(h[:8], 16) + round_) % len(holders)]].append(h)

        async def one(rank: int, digests: list[str], got: set[str], bad: set[int]) -> None:
            try:
                await trio.to_thread.run_sync(stream, rank, digests, got,
                                              abandon_on_cancel=True)
            except PeerChunkCorrupt as exc:
                tier.report_bad(rank, str(exc))
                bad.add(rank)
            except PeerError as exc:
                log.warning("bulk restore from rank %d: %s", rank, exc)
                bad.add(rank)

        async with trio.open_nursery() as n:
            for rank, digests in shares.items():
                for k in range(STREAMS_PER_HOLDER):
                    part = digests[k::STREAMS_PER_HOLDER]
                    if part:
                        n.start_soon(one, rank, part, got, bad)
        todo = [h for h in todo if h not in got]
        holders = [r for r in holders if r not in bad] if bad else holders
        round_ += 1
        if round_ >= 3:
            break
    stats["left"] = len(todo)
    stats["seconds"] = round(time.monotonic() - t0, 3)
    log.info("bulk restore from peers: %d chunks (%d bytes) in %.2f s, %d left for the other"
             " tiers", stats["chunks"], stats["bytes"], stats["seconds"], len(todo))
    return stats
