"""Where a scope=job node fetches the chunks of files other ranks wrote."""

from __future__ import annotations

from typing import Any

from replication.peer.sources import PeerChunkSource


class JobChunkSource(PeerChunkSource):
    """Fetches a chunk from the rank that wrote it, then that rank's replicas, then any
    other member.

    Chunks of one file are spread over its writer and the writer's replicas (by digest), so
    that N nodes reading the same file do not all load one node.

    Args:
        fs: the core (its ``chunk_origins`` says which rank wrote a chunk).
        tier: the peer tier (placement, clients, bad-peer reports).
    """

    def __init__(self, fs: Any, tier: Any) -> None:
        super().__init__(holders=lambda: [], client=tier.client, report_bad=tier.report_bad)
        self.fs = fs
        self.tier = tier

    async def fetch(self, digest: str) -> bytes:
        origin = self.fs.chunk_origins.get(digest)
        first: list[int] = []
        if origin is not None and origin != self.tier.rank:
            first = [origin] + [r for r in self.tier.peers_of(origin) if r != self.tier.rank]
            start = int(digest[:8], 16) % len(first)
            first = first[start:] + first[:start]
        rest = [r for r in sorted(self.tier.addresses) if r != self.tier.rank and r not in first]
        return await self.fetch_from(digest, first + rest)
