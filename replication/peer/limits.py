"""Size limits of the peer protocol, shared by the server and the client.

One fixed message limit, independent of the job's chunk size: chunk payloads are cut into
pieces of at most :data:`PIECE_BYTES`, so every chunk size mtcfs allows (64 KiB .. 256 MiB,
:data:`mtcfs.chunking.MAX_CHUNK_SIZE`) travels under the same limit, and a server never holds
more than one message of that size per call in memory. The default 4 MiB chunk is a single
piece. The limit is what leaves room for the largest manifest: 64 MiB of JSON is about a
million chunk references (4 TiB of data per rank and step at 4 MiB chunks).
"""

from __future__ import annotations

from mtcfs.chunking import MAX_CHUNK_SIZE

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
