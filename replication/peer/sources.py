"""Where a node's chunks come from and go to, seen from the filesystem core.

* :class:`FsLocalChunks` lets the Peer service answer from this node's own files (the
  data-parallel case: a twin asks "do you hold these chunks?" and the answer is yes because
  this node wrote identical bytes itself).
* :class:`PeerChunkSource` fetches a chunk from the peers that hold this rank's data,
  several in parallel (each chunk goes to one holder, spread by digest), verified by the
  client; a holder that sends bad bytes is reported and the next one is asked.
* :class:`TieredChunkSource` tries sources in order (peers, then the backup tier) and counts
  which one served each chunk, so ``mtcfs status`` and tests can tell that a restore never
  touched the backup tier.

The core knows these only as its ``ChunkSource`` protocol (``async fetch(digest) -> bytes``).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Sequence
from typing import Any

import trio

from mtcfs.errors import FsError
from replication.peer.errors import PeerChunkCorrupt, PeerError

log = logging.getLogger(__name__)


class FsLocalChunks:
    """The :class:`~replication.peer.replica_store.LocalChunks` hook over the core.

    ``has_chunk`` reads the core's chunk index directly (thread-safe lookups); ``read_chunk``
    pins the version on the trio loop (a short call through the token), reads it in the
    calling gRPC thread, and unpins it on the loop.

    Args:
        fs: the filesystem core.
        token: the trio token of the loop the core runs on.
    """

    def __init__(self, fs: Any, token: trio.lowlevel.TrioToken) -> None:
        self.fs = fs
        self.token = token

    def has_chunk(self, digest: str) -> bool:
        return bool(self.fs.has_local_chunk(digest))

    def read_chunk(self, digest: str) -> bytes | None:
        try:
            pinned = trio.from_thread.run_sync(self.fs.pin_chunk, digest, trio_token=self.token)
        except trio.RunFinishedError:
            return None
        if pinned is None:
            return None
        v, off, length = pinned
        try:
            return self.fs.read_chunk_at(v, off, length, None)
        finally:
            try:
                trio.from_thread.run_sync(self.fs.unpin, [v], trio_token=self.token)
            except trio.RunFinishedError:
                pass


def get_one(client: Any, digest: str) -> bytes | None:
    """One chunk from one peer, verified by the client; None if the peer does not serve it.

    Reads the stream to its end rather than returning at the chunk: leaving early cancels
    the call, and the server, cut off right after its last piece, may never count the chunk
    as sent.

    Raises:
        PeerChunkCorrupt, PeerError: as :meth:`PeerClient.get_chunks`.
    """
    got = None
    for h, data in client.get_chunks([digest]):
        if h == digest:
            got = data
    return got


class PeerChunkSource:
    """Fetches chunks of this rank's data from the peers holding it.

    Args:
        holders: returns the ranks to ask, best first (those known to hold the step).
        client: returns the :class:`~replication.peer.client.PeerClient` of a rank, or
            raises PeerError when the rank has no known address or is cut off.
        report_bad: called with (rank, message) when a holder serves corrupt data.
        concurrency: fetches in flight at once (each one chunk, one holder).
    """

    def __init__(self, holders: Callable[[], Sequence[int]], client: Callable[[int], Any],
                 report_bad: Callable[[int, str], None], concurrency: int = 8) -> None:
        self.holders = holders
        self.client = client
        self.report_bad = report_bad
        self.limiter = trio.CapacityLimiter(concurrency)
        self.served: dict[int, int] = {}

    async def fetch(self, digest: str) -> bytes:
        ranks = list(self.holders())
        if not ranks:
            raise FsError(errno.EIO, "no peer holds this rank's data")
        start = int(digest[:8], 16) % len(ranks)  # spread chunks over the holders
        return await self.fetch_from(digest, ranks[start:] + ranks[:start])

    async def fetch_from(self, digest: str, order: Sequence[int]) -> bytes:
        """Ask ranks in ``order`` until one serves a valid copy.

        Raises:
            FsError: EIO when none does.
        """
        last = "no peer has it"
        for rank in order:
            try:
                data = await trio.to_thread.run_sync(self._get, rank, digest,
                                                     limiter=self.limiter,
                                                     abandon_on_cancel=True)
            except PeerChunkCorrupt as exc:
                self.report_bad(rank, str(exc))
                last = str(exc)
                continue
            except PeerError as exc:
                log.info("chunk %s from rank %d: %s", digest[:16], rank, exc)
                last = str(exc)
                continue
            if data is not None:
                self.served[rank] = self.served.get(rank, 0) + 1
                return data
        raise FsError(errno.EIO, f"chunk {digest[:16]} from peers: {last}")

    def _get(self, rank: int, digest: str) -> bytes | None:
        return get_one(self.client(rank), digest)


class TieredChunkSource:
    """Asks each source in turn; the first valid copy wins.

    Args:
        sources: (name, source) pairs in order of preference, e.g. ``[("peers", ...),
            ("backup", ...)]``.

    Attributes:
        served: chunks served per source name.
    """

    def __init__(self, sources: Sequence[tuple[str, Any]]) -> None:
        self.sources = list(sources)
        self.served: dict[str, int] = {name: 0 for name, _ in self.sources}

    @property
    def corrupt(self) -> int:
        """Corrupt chunks seen by the sources that count them (the backup tier)."""
        return sum(getattr(src, "corrupt", 0) for _name, src in self.sources)

    async def fetch(self, digest: str) -> bytes:
        errors = []
        for name, src in self.sources:
            try:
                data = await src.fetch(digest)
            except FsError as exc:
                errors.append(f"{name}: {exc.strerror}")
                continue
            self.served[name] += 1
            return data
        raise FsError(errno.EIO, "; ".join(errors) or "no source")


class TwinWait:
    """Waits for a lower data-parallel twin to get a chunk, and takes it from there.

    Sits between the peers and the backup tier in a :class:`TieredChunkSource`. When the
    whole job restarts, twins need the same chunks: the lowest live twin reads each from the
    backup tier (this source has nothing to wait for there and steps aside at once), and a
    higher twin waits for that twin to hold the chunk and takes it over the peer network
    (its ``GetChunks`` serves chunks from its own files), so the bucket serves each chunk
    once. One wait lasts at most ``wait_s``; once a wait fails (the twin is gone, or its data
    is not identical after all) this source steps aside for good and the backup tier is
    read directly.

    Args:
        lower_twins: returns the live twins with a lower rank, lowest first.
        client: returns the PeerClient of a rank.
        wait_s: seconds to wait for one chunk at a twin.
    """

    def __init__(self, lower_twins: Callable[[], Sequence[int]], client: Callable[[int], Any],
                 wait_s: float = 20.0) -> None:
        self.lower_twins = lower_twins
        self.client = client
        self.wait_s = wait_s
        self.waiting = True

    async def fetch(self, digest: str) -> bytes:
        twins = list(self.lower_twins()) if self.waiting else []
        if not twins:
            raise FsError(errno.EIO, "no lower data-parallel twin to wait for")
        with trio.move_on_after(self.wait_s):
            while True:
                data = await trio.to_thread.run_sync(self._ask, twins[0], digest,
                                                     abandon_on_cancel=True)
                if data is not None:
                    return data
                await trio.sleep(0.2)
        log.info("twin rank %d did not get chunk %s within %.0f s; reading the backup tier"
                 " directly from now on", twins[0], digest[:16], self.wait_s)
        self.waiting = False
        raise FsError(errno.EIO, f"twin rank {twins[0]} did not get chunk {digest[:16]}")

    def _ask(self, rank: int, digest: str) -> bytes | None:
        try:
            return get_one(self.client(rank), digest)
        except PeerError:
            return None
