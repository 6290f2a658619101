"""The exceptions of the peer tier.

Two families. :class:`ReplicaError` is raised by the local
:class:`~mtcfs.tiers.peer.replica_store.ReplicaStore` (this node holding other ranks' data);
:class:`PeerError` by :class:`~mtcfs.tiers.peer.client.PeerClient` (a call to another node).
The service turns the first into gRPC status codes; the client turns status codes into the
second. Callers tell apart: the peer cannot be reached (:class:`PeerUnavailable`, worth trying
again later or elsewhere), the peer sent bytes that do not match their name
(:class:`PeerChunkCorrupt`, fetch from the next source and report the peer), and everything
else (:class:`PeerError` with the status code: a bug or a misconfiguration).
"""

from __future__ import annotations

import errno

import grpc


class ReplicaError(Exception):
    """A replica-store operation failed; the message names the chunk or manifest."""


class ReplicaFull(ReplicaError):
    """Storing would take the replica store past its capacity (the ENOSPC of this tier).

    Attributes:
        errno: :data:`errno.ENOSPC`.
        needed: bytes the operation needed.
        free: bytes that were free.
    """

    def __init__(self, needed: int, free: int, capacity: int) -> None:
        super().__init__(f"replica store full: {needed} bytes needed, {free} of {capacity} "
                         f"bytes free")
        self.errno = errno.ENOSPC
        self.needed = needed
        self.free = free


class ChunkNotFound(ReplicaError, KeyError):
    """The replica store does not hold the chunk.

    Attributes:
        chunk: hex blake3 digest asked for.
    """

    def __init__(self, chunk: str) -> None:
        super().__init__(f"chunk {chunk} is not held here")
        self.chunk = chunk

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


class ChunkMismatch(ReplicaError, ValueError):
    """Bytes offered for a chunk do not hash to its name; nothing was stored.

    Attributes:
        chunk: the digest the bytes were offered as.
        actual: the digest they have.
    """

    def __init__(self, chunk: str, actual: str) -> None:
        super().__init__(f"data offered as chunk {chunk} hashes to {actual}: not stored")
        self.chunk = chunk
        self.actual = actual


class ReplicaChunkCorrupt(ReplicaError):
    """A stored chunk no longer hashes to its name. It has been deleted, never returned.

    Attributes:
        chunk: hex blake3 digest of the chunk.
    """

    def __init__(self, chunk: str, reason: str) -> None:
        super().__init__(f"stored replica chunk {chunk} is corrupt ({reason}); deleted")
        self.chunk = chunk


class PeerError(Exception):
    """A call to a peer failed.

    Attributes:
        peer: the peer's address (host:port).
        code: the gRPC status code, or None when the failure was found on this side.
    """

    def __init__(self, peer: str, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"peer {peer}: {message}")
        self.peer = peer
        self.code = code


class PeerUnavailable(PeerError):
    """The peer could not be reached, or did not answer in time, after every retry
    (UNAVAILABLE or DEADLINE_EXCEEDED)."""


class PeerChunkCorrupt(PeerError):
    """The peer sent bytes for a chunk that do not hash to the chunk's name.

    The bytes were dropped. Fetch the chunk from the next source and report the peer.

    Attributes:
        chunk: the digest asked for.
    """

    def __init__(self, peer: str, chunk: str, reason: str) -> None:
        super().__init__(peer, f"served corrupt data for chunk {chunk}: {reason}",
                         grpc.StatusCode.DATA_LOSS)
        self.chunk = chunk


class ReplicaQuotaExceeded(ReplicaFull):
    """Storing would take one sender rank past its share of the replica store (its quota),
    although the store itself may have room: one peer cannot fill a node's RAM tier.

    Attributes:
        rank: the sender.
        held: bytes it holds here now (reservations included).
        quota: bytes it may hold.
    """

    def __init__(self, rank: int, needed: int, held: int, quota: int) -> None:
        ReplicaError.__init__(self, f"rank {rank}'s share of this replica store is full: "
                                    f"{needed} bytes needed, {held} of its {quota} bytes "
                                    f"used")
        self.errno = errno.ENOSPC
        self.needed = needed
        self.free = max(0, quota - held)
        self.rank = rank
        self.held = held
        self.quota = quota
