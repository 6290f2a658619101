"""Size limits of the peer protocol, shared by the server and the client.

One fixed message limit, independent of the job's chunk size: chunk payloads are cut into
pieces of at most :data:`PIECE_BYTES`, so every chunk size mtcfs allows (64 KiB .. 256 MiB,
:data:`mtcfs.base.chunking.MAX_CHUNK_SIZE`) travels under the same limit, and a server never holds
more than one message of that size per call in memory. The default 4 MiB chunk is a single
piece. The limit is what leaves room for the largest manifest: 64 MiB of JSON is about a
million chunk references (4 TiB of data per rank and step at 4 MiB chunks).
"""

from __future__ import annotations

from mtcfs.base.chunking import MAX_CHUNK_SIZE

MiB = 1024 * 1024

#: Largest payload of one ChunkPiece message, bytes. Chunks up to this size are one piece.
PIECE_BYTES = 16 * MiB

#: Largest manifest PublishManifest accepts, bytes (StepManifest.to_bytes()).
MAX_MANIFEST_BYTES = 64 * MiB

#: grpc's max send and receive message length on both sides, bytes: the largest payload
#: (a manifest) plus 1 MiB for the fields around it. grpc refuses a larger message with
#: RESOURCE_EXHAUSTED before the server code sees it.
MAX_MESSAGE_BYTES = MAX_MANIFEST_BYTES + 1 * MiB

#: Largest chunk, bytes (the largest chunk_size option).
MAX_CHUNK_BYTES = MAX_CHUNK_SIZE

#: Most digests in one HasChunks or GetChunks request (about 4.3 MB of hex digests).
MAX_DIGESTS_PER_CALL = 65536

#: Most chunks in one PutChunks stream: the reply names each one (accepted or rejected), so
#: a stream of many tiny chunks is bounded in what the server keeps for it, not only in
#: bytes. The client starts a new stream after this many.
MAX_CHUNKS_PER_PUT = 65536

#: Longest step name PublishManifest accepts, bytes of UTF-8: the replica store keeps a
#: manifest as ``<step>.json``, one file name (NAME_MAX 255).
MAX_STEP_NAME_BYTES = 250


#: Client keepalive: ping every 10 s while a call is in progress and fail it when no answer
#: comes within 5 s (grpc's ping pacing makes it about a minute in practice, measured
#: against a SIGSTOPped server).
KEEPALIVE_CLIENT = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_time_between_pings_ms", 10_000),
)
#: Reconnect soon after a refused or lost connection. grpc waits 1 s after the first
#: failure, growing to 120 s, and fails every call at once in between: a node that started
#: a moment before its peer (or whose peer was replaced) then failed its reads for longer
#: than a call's retries last (about 1.5 s). Found by a scope=job test that read another
#: node's file right after the mounts started.
RECONNECT_CLIENT = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)
#: Server side of KEEPALIVE_CLIENT: accept its pings (grpc's default minimum interval is 5 min,
#: and a client pinging more often would be sent away with ENHANCE_YOUR_CALM).
KEEPALIVE_SERVER = (
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
)
