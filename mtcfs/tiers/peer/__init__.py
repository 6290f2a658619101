"""The peer tier: replicas of other ranks' data in this node's RAM tier, served over gRPC.

* :mod:`~mtcfs.tiers.peer.replica_store` — chunks and manifests held for other ranks, verified
  on the way in and out, capacity-limited, reference-counted.
* :mod:`~mtcfs.tiers.peer.service` — the Peer gRPC service (grpcio's synchronous server in its
  own thread pool) and :func:`serve`.
* :mod:`~mtcfs.tiers.peer.client` — :class:`PeerClient`, one per peer address.
* :mod:`~mtcfs.tiers.peer.placement` — which ranks hold whose data (ring, Gemini groups,
  data-parallel pairs, topology).
* :mod:`~mtcfs.tiers.peer.tier` — the peer tier of one node (membership in etcd, replication,
  replica gc).

The wire protocol is ``proto/mtcfs_peer.proto`` (package ``mtcfs.peer.v1``), generated into
``_pb/`` by ``scripts/gen_proto.sh``; docs/peer-protocol.md describes it. Everything here
blocks: call it from worker threads, never from the trio loop.

Typical use::

    store = ReplicaStore("/dev/shm/mtcfs/job/replicas", capacity=64 << 30)
    server = serve(store, "0.0.0.0:7070", job="llama", nodes=16)
    with PeerClient("node4:7070", job="llama", rank=3) as peer:
        peer.put_chunks((h, read_chunk_fn(h)) for h in manifest.chunk_set())
        result = peer.publish_manifest(manifest)   # result.complete: replicated
"""

from mtcfs.tiers.peer.client import PeerClient
from mtcfs.tiers.peer.errors import (
    ChunkMismatch, ChunkNotFound, PeerChunkCorrupt, PeerError, PeerUnavailable,
    ReplicaChunkCorrupt, ReplicaError, ReplicaFull,
)
from mtcfs.tiers.peer.records import (
    GcStats, ManifestInfo, MemberInfo, PublishResult, PutResult, StepRef,
)
from mtcfs.tiers.peer.replica_store import ChunkWriter, LocalChunks, ReplicaStore
from mtcfs.tiers.peer.service import PeerServer, PeerService, serve

__all__ = [
    "ChunkMismatch", "ChunkNotFound", "ChunkWriter", "GcStats",
    "LocalChunks", "ManifestInfo", "MemberInfo", "PeerChunkCorrupt",
    "PeerClient", "PeerError", "PeerServer", "PeerService", "PeerUnavailable",
    "PublishResult", "PutResult", "ReplicaChunkCorrupt", "ReplicaError", "ReplicaFull",
    "ReplicaStore", "StepRef", "serve",
]
