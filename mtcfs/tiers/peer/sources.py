"""Where a node's chunks come from and go to, seen from the filesystem core.

* :class:`FsLocalChunks` lets the Peer service answer from this node's own files (the
  data-parallel case: a twin asks "do you hold these chunks?" and the answer is yes because
  this node wrote identical bytes itself).
* :class:`PeerChunkSource` fetches a chunk from the peers that hold this rank's data, then
  from every other member, several chunks in parallel (each chunk goes to one holder first,
  spread by digest), verified by the client. Every peer is asked once per chunk with a
  deadline; one that fails is skipped at once, reported if it sent bad bytes, and asked last
  for a while.
* :class:`TieredChunkSource` tries sources in order (peers, then the backup tier) and counts
  which one served each chunk, so ``mtcfs status`` and tests can tell that a restore never
  touched the backup tier.

The core knows these only as its ``ChunkSource`` protocol (``async fetch(digest, tried) ->
bytes``); it bounds the whole fetch with its own deadline (mtcfs/core/faultin.py).
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import trio

from mtcfs.base import pools
from mtcfs.base.errors import FsError
from mtcfs.core.ports import ChunkSource, PeerPort
from mtcfs.tiers.peer.errors import PeerChunkCorrupt, PeerError, PeerUnavailable

log = logging.getLogger(__name__)


class FsLocalChunks:
    """The :class:`~mtcfs.tiers.peer.replica_store.LocalChunks` hook over the core.

    ``has_chunk`` reads the core's chunk index directly (thread-safe lookups); ``read_chunk``
    pins the version on the trio loop (a short call through the token), reads it in the
    calling gRPC thread, and unpins it on the loop.

    Args:
        fs: the filesystem core.
        token: the trio token of the loop the core runs on.
    """

    def __init__(self, fs: PeerPort, token: trio.lowlevel.TrioToken) -> None:
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


#: Seconds one peer is given to serve one chunk before the next source is asked. The fetch
#: clients carry the same deadline on their gRPC call, so a thread left behind by a peer
#: that hangs (SIGSTOPped, or behind a partition that drops packets) ends with it.
ATTEMPT_S = 10.0
#: Seconds a peer that failed a fetch (unreachable, no answer in time, corrupt bytes) is
#: asked only after every other source of a chunk.
SUSPECT_S = 30.0


class PeerChunkSource:
    """Fetches chunks from peers: the ranks that hold this rank's data first, then every
    other member.

    Each peer is asked once per fetch, for at most :data:`ATTEMPT_S` seconds; one that
    refuses, does not answer, is unreachable or serves bad bytes is skipped and the next one
    is asked at once. A peer that failed is asked last for :data:`SUSPECT_S` seconds, so a
    dead node costs one failed attempt, not one per chunk.

    Args:
        holders: returns the ranks to ask first, best first (those known to hold the step).
        client: returns the :class:`~mtcfs.tiers.peer.client.PeerClient` to fetch from a
            rank (one attempt, a deadline of about ``attempt_s``), or raises PeerError when
            the rank has no known address or is cut off.
        report_bad: called with (rank, message) when a holder serves corrupt data.
        others: returns every other member's rank, asked after the holders.
        concurrency: fetches in flight at once (each one chunk, one peer).
        attempt_s: seconds one peer is given for one chunk.

    Attributes:
        served: chunks served per rank.
    """

    def __init__(self, holders: Callable[[], Sequence[int]], client: Callable[[int], Any],
                 report_bad: Callable[[int, str], None],
                 others: Callable[[], Sequence[int]] = tuple, concurrency: int = 8,
                 attempt_s: float = ATTEMPT_S) -> None:
        self.holders = holders
        self.client = client
        self.report_bad = report_bad
        self.others = others
        self.attempt_s = attempt_s
        self.limiter = pools.limiter("peer-calls", concurrency)
        self.served: dict[int, int] = {}
        self._suspect_until: dict[int, float] = {}

    async def fetch(self, digest: str, tried: list[str] | None = None) -> bytes:
        ranks = list(self.holders())
        if ranks:
            start = int(digest[:8], 16) % len(ranks)  # spread chunks over the holders
            ranks = ranks[start:] + ranks[:start]
        return await self.fetch_from(digest, ranks + [r for r in self.others()
                                                      if r not in ranks], tried)

    def suspects(self) -> list[int]:
        """Ranks that failed a fetch within the last :data:`SUSPECT_S` seconds."""
        now = time.monotonic()
        return sorted(r for r, until in self._suspect_until.items() if until > now)

    def _best_first(self, order: Sequence[int]) -> list[int]:
        """``order`` with the suspects moved to its end (each group keeps its order)."""
        bad = set(self.suspects())
        return [r for r in order if r not in bad] + [r for r in order if r in bad]

    async def fetch_from(self, digest: str, order: Sequence[int],
                         tried: list[str] | None = None) -> bytes:
        """Ask each rank of ``order`` once (suspects last) until one serves a valid copy.

        Raises:
            FsError: EAGAIN when none did and one could not be reached or did not answer
                in time, else EIO.
        """
        tried = [] if tried is None else tried
        transient = False
        for rank in self._best_first(order):
            data: bytes | None = None
            with trio.move_on_after(self.attempt_s) as scope:
                try:
                    data = await trio.to_thread.run_sync(self._get, rank, digest,
                                                         limiter=self.limiter,
                                                         abandon_on_cancel=True)
                except PeerChunkCorrupt as exc:
                    self.report_bad(rank, str(exc))
                    self._suspect(rank)
                    tried.append(f"rank {rank}: served corrupt bytes")
                    continue
                except PeerError as exc:
                    log.info("chunk %s from rank %d: %s", digest[:16], rank, exc)
                    self._suspect(rank)
                    tried.append(f"rank {rank}: {exc}")
                    transient = transient or isinstance(exc, PeerUnavailable)
                    continue
            if scope.cancelled_caught:
                log.info("chunk %s from rank %d: no answer within %g s", digest[:16], rank,
                         self.attempt_s)
                self._suspect(rank)
                transient = True
                tried.append(f"rank {rank}: no answer within {self.attempt_s:g} s")
                continue
            if data is None:
                tried.append(f"rank {rank}: does not hold it")
                continue
            self._suspect_until.pop(rank, None)
            self.served[rank] = self.served.get(rank, 0) + 1
            return data
        if not order:
            tried.append("peers: none to ask")
        raise FsError(errno.EAGAIN if transient else errno.EIO, "no peer served a valid copy")

    def _suspect(self, rank: int) -> None:
        self._suspect_until[rank] = time.monotonic() + SUSPECT_S

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

    def __init__(self, sources: Sequence[tuple[str, ChunkSource]]) -> None:
        self.sources = list(sources)
        self.served: dict[str, int] = {name: 0 for name, _ in self.sources}

    @property
    def corrupt(self) -> int:
        """Corrupt chunks seen by the sources that count them (the backup tier)."""
        return sum(getattr(src, "corrupt", 0) for _name, src in self.sources)

    async def fetch(self, digest: str, tried: list[str] | None = None) -> bytes:
        tried = [] if tried is None else tried
        transient = False
        for name, src in self.sources:
            before = len(tried)
            try:
                data = await src.fetch(digest, tried)
            except FsError as exc:
                if len(tried) == before:  # the source said nothing of its own
                    tried.append(f"{name}: {exc.strerror}")
                transient = transient or exc.errno == errno.EAGAIN
                continue
            self.served[name] += 1
            return data
        raise FsError(errno.EAGAIN if transient else errno.EIO, "no tier served a valid copy")


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
        client: returns the PeerClient to fetch from a rank (one attempt, a short deadline).
        wait_s: seconds to wait for one chunk at a twin.
    """

    def __init__(self, lower_twins: Callable[[], Sequence[int]], client: Callable[[int], Any],
                 wait_s: float = 20.0) -> None:
        self.lower_twins = lower_twins
        self.client = client
        self.wait_s = wait_s
        self.waiting = True

    async def fetch(self, digest: str, tried: list[str] | None = None) -> bytes:
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
        if tried is not None:
            tried.append(f"twin rank {twins[0]}: did not get it within {self.wait_s:g} s")
        raise FsError(errno.EIO, f"twin rank {twins[0]} did not get chunk {digest[:16]}")

    def _ask(self, rank: int, digest: str) -> bytes | None:
        try:
            return get_one(self.client(rank), digest)
        except PeerError:
            return None
