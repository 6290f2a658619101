"""Where a scope=job node fetches the chunks of files other ranks wrote."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from mtcfs.core.ports import ChunkOriginPort
from mtcfs.tiers.peer.errors import ReplicaError
from mtcfs.tiers.peer.sources import PeerChunkSource

if TYPE_CHECKING:
    from mtcfs.tiers.peer.tier import PeerTier

log = logging.getLogger(__name__)


class JobChunkSource(PeerChunkSource):
    """Fetches a chunk from this node's replica store, the rank that wrote it, that rank's
    replicas, then every other member (each peer once, with a deadline, suspects last: see
    :class:`~mtcfs.tiers.peer.sources.PeerChunkSource`).

    Chunks are spread over the writer and the writer's replicas by digest and by the
    reading rank, so that N nodes reading the same file do not all load one node. Which
    rank wrote a chunk comes from the core's ``chunk_origins`` (rebuilt from the versions at
    start and at a snapshot install); when it is unknown every member is asked.

    Args:
        fs: the core (its ``chunk_origin`` says which rank wrote a chunk).
        tier: the peer tier (placement, clients, bad-peer reports).
    """

    def __init__(self, fs: ChunkOriginPort, tier: PeerTier) -> None:
        super().__init__(holders=list, client=tier.fetch_client, report_bad=tier.report_bad)
        self.fs = fs
        self.tier = tier

    async def fetch(self, digest: str, tried: list[str] | None = None) -> bytes:
        tried = [] if tried is None else tried
        store = self.tier.replica_store
        if store.has(digest):  # this node holds the writer's replica
            try:
                return await trio.to_thread.run_sync(store.get_chunk, digest)
            except (ReplicaError, OSError) as exc:
                log.warning("replica chunk %s: %s", digest[:16], exc)
                tried.append(f"replica store here: {exc}")
        origin = self.fs.chunk_origin(digest)
        first: list[int] = []
        if origin is not None and 0 <= origin < self.tier.cfg.nodes:
            # the writer (another rank), then its replicas; a writer of a step restored
            # from the backup on fewer nodes may be no rank of this job: every member
            first = [r for r in [origin, *self.tier.peers_of(origin)] if r != self.tier.rank]
        if first:
            # by digest and by reader: N nodes reading one chunk (a large .metadata) ask
            # different holders
            start = (int(digest[:8], 16) + self.tier.rank) % len(first)
            first = first[start:] + first[:start]
        rest = [r for r in sorted(self.tier.addresses) if r != self.tier.rank and r not in first]
        return await self.fetch_from(digest, first + rest, tried)
