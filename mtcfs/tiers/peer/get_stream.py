"""The server side of one GetChunks call: read, verify and encode chunks ahead of the send.

grpcio's synchronous server sends a streamed response message by message: the servicer's
generator is asked for the next message only after the previous one went out. Reading a
chunk, re-hashing it and encoding it in that same thread would leave the connection idle
for that long per chunk, so a second thread does it up to :data:`AHEAD` chunks ahead and
hands over the encoded messages; the call's thread only sends. Measured on loopback
(benchmarks/bench_peer.py) this is the difference between the store and the network
taking turns and working at once.

Messages are handed over already serialized (``bytes``); :func:`encode_reply` is the
response serializer that passes them through (the service registers it for GetChunks).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc

from mtcfs.base.ahead import ahead
from mtcfs.tiers.peer._pb import mtcfs_peer_pb2 as pb
from mtcfs.tiers.peer.errors import ChunkNotFound, ReplicaChunkCorrupt
from mtcfs.tiers.peer.replica_store import ReplicaStore
from mtcfs.tiers.peer.wire import get_replies, status

#: Chunks read, verified and encoded ahead of the one being sent.
AHEAD = 2


def encode_reply(msg: bytes | pb.GetChunksReply) -> bytes:
    """GetChunks response serializer: bytes pass through, messages are serialized."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def stream_chunks(store: ReplicaStore, digests: list[str], context: grpc.ServicerContext,
                  counters: Any) -> Iterator[bytes]:
    """Yield the encoded GetChunks replies for ``digests``, in order.

    A chunk not held (NOT_FOUND) or found corrupt (DATA_LOSS; the store deleted it) becomes
    an ``unavailable`` reply. Raises what the store raised otherwise (OSError).
    """
    def encoded(h: str) -> tuple[str, list[bytes], int]:
        try:
            data = store.get_chunk(h)
        except ChunkNotFound as exc:
            msg = pb.GetChunksReply(unavailable=status(h, grpc.StatusCode.NOT_FOUND, str(exc)))
            return ("unavailable", [msg.SerializeToString()], 0)
        except ReplicaChunkCorrupt as exc:
            msg = pb.GetChunksReply(unavailable=status(h, grpc.StatusCode.DATA_LOSS, str(exc)))
            return ("unavailable", [msg.SerializeToString()], 0)
        return ("chunk", [r.SerializeToString() for r, _n in get_replies(h, data)], len(data))

    for kind, payload, size in ahead(digests, encoded, depth=AHEAD, name="mtcfs-peer-get"):
        if not context.is_active():
            return
        yield from payload
        if kind == "chunk":
            counters.add("chunks_sent")
            counters.add("bytes_sent", size)
        else:
            counters.add("chunks_unavailable")
