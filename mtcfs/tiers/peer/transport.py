"""What the peer tier needs from a connection to another node: the :class:`Transport` protocol.

The tier (tier.py, tier_replication.py, sources.py) and the restores (restore/from_peers.py,
restore/bulk.py) call another node's Peer service only through these methods, the five data
RPCs of docs/peer-protocol.md with the client-side rules on top (only missing chunks travel,
every chunk received is re-hashed, transient failures are retried). Two implementations:

* :class:`~mtcfs.tiers.peer.client.PeerClient`: gRPC to a real server (plaintext or mutual
  TLS), the one the daemon uses;
* :class:`~mtcfs.tiers.peer.memory.MemoryTransport`: in process, straight into another
  node's :class:`~mtcfs.tiers.peer.service.PeerService` handlers, for fast tests.

``tests/t2_transport_conformance_test.py`` runs one set of test bodies against both
(docs/conformance.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from mtcfs.base.manifest import StepManifest
from mtcfs.tiers.peer.records import ManifestInfo, PublishResult, PutResult

__all__ = ["ChunkData", "Transport"]

#: A chunk's bytes, or a function that reads them (called only if the peer lacks the chunk).
ChunkData = bytes | memoryview | Callable[[], bytes | memoryview]


@runtime_checkable
class Transport(Protocol):
    """Calls to the Peer service of one other node, as one rank of one job.

    Every method blocks (call it from a worker thread, never from the trio loop). Errors,
    the same for every implementation:

    * :class:`ValueError`: a malformed digest, or a manifest of another job or rank, refused
      before anything is sent;
    * :class:`~mtcfs.tiers.peer.errors.PeerUnavailable`: the peer cannot be reached, or
      answered UNAVAILABLE / DEADLINE_EXCEEDED, after the retries;
    * :class:`~mtcfs.tiers.peer.errors.PeerError` with ``code``: the peer refused the whole
      call (FAILED_PRECONDITION another job, INVALID_ARGUMENT bad input, RESOURCE_EXHAUSTED
      no room or over quota, PERMISSION_DENIED a certificate of another rank);
    * :class:`~mtcfs.tiers.peer.errors.PeerChunkCorrupt`: the peer sent bytes that do not
      hash to their digest.

    Attributes:
        address: the peer, for messages and error reports.
        job: the job every request names.
        rank: the rank every request names (this node's).
    """

    address: str
    job: str
    rank: int

    def has_chunks(self, digests: Sequence[str]) -> list[bool]:
        """One flag per digest, in order: whether the peer holds the chunk (as a replica or
        in its own RAM tier)."""
        ...

    def put_chunks(self, chunks: Iterable[tuple[str, ChunkData]]) -> PutResult:
        """Give the peer the chunks it lacks; ``(digest, bytes or reader)`` pairs, readers
        called only for chunks sent. Per-chunk refusals (DATA_LOSS: bytes do not match the
        digest; RESOURCE_EXHAUSTED: no room or over quota) are in ``PutResult.rejected`` as
        ``"CODE: reason"``; ``bytes_sent`` counts payload bytes streamed."""
        ...

    def get_chunks(self, digests: Iterable[str]) -> Iterator[tuple[str, bytes]]:
        """Yield ``(digest, bytes)`` in request order for each chunk the peer holds, each
        verified; chunks it lacks, or found corrupt in its store, are left out."""
        ...

    def publish_manifest(self, manifest: StepManifest) -> PublishResult:
        """Store this rank's manifest of one step on the peer (replacing an earlier one of
        the step); ``missing`` lists the chunks the peer still lacks."""
        ...

    def list_manifests(self, of_rank: int | None = None, *, step: str | None = None,
                       with_manifest: bool = True) -> list[ManifestInfo]:
        """The manifests the peer holds for ``of_rank`` (default: this rank), oldest first,
        optionally of one step only, and without their bytes when ``with_manifest`` is
        False."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters of this transport (names as :meth:`PeerClient.stats`)."""
        ...

    def close(self) -> None:
        """Release the connection; calls in progress are cancelled."""
        ...
