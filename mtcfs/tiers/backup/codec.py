"""The stored form of one chunk: a single zstd frame that records its content size.

Decoding never returns bytes that do not hash to the chunk's name: a bad frame, trailing
garbage, an absurd declared size or a hash mismatch all raise :class:`ChunkCorrupt`.
"""

from __future__ import annotations

import threading

import zstandard

from mtcfs.base.chunking import MAX_CHUNK_SIZE, chunk_hash
from mtcfs.tiers.backup.errors import ChunkCorrupt

#: Default zstd level: about 300-500 MB/s per core on tensor data; higher levels buy little
#: on float weights and cost CPU the training host needs.
DEFAULT_LEVEL = 3

_local = threading.local()  # zstd contexts are not thread-safe; one per thread and level


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    comp = cache.get(level)
    if comp is None:
        comp = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True,
                                                       write_checksum=False)
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dec = getattr(_local, "decompressor", None)
    if dec is None:
        dec = _local.decompressor = zstandard.ZstdDecompressor()
    return dec


def encode_chunk(data: bytes | memoryview, level: int = DEFAULT_LEVEL) -> bytes:
    """Compress one chunk's bytes into its stored form.

    Args:
        data: the uncompressed chunk (at most 256 MiB).
        level: zstd level, 1..22 (negative levels are zstd's fast modes).

    Returns:
        One zstd frame.
    """
    return _compressor(level).compress(data)


def decode_chunk(h: str, blob: bytes) -> bytes:
    """Decompress a stored chunk and check it hashes to ``h``.

    Args:
        h: the hex blake3 digest the chunk was stored under.
        blob: the stored bytes.

    Returns:
        The uncompressed chunk, guaranteed to hash to ``h``.

    Raises:
        ChunkCorrupt: if the frame is undecodable, declares no or an impossible size
            (> 256 MiB), has trailing bytes, or its content does not hash to ``h``.
    """
    try:
        size = zstandard.frame_content_size(blob)
    except zstandard.ZstdError as exc:
        raise ChunkCorrupt(h, f"not a zstd frame ({exc})") from None
    if size < 0 or size > MAX_CHUNK_SIZE:
        raise ChunkCorrupt(h, f"frame declares an unusable content size {size}")
    try:
        data = _decompressor().decompress(blob, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise ChunkCorrupt(h, f"undecodable zstd data ({exc})") from None
    if len(data) != size:
        raise ChunkCorrupt(h, f"decoded {len(data)} bytes, frame declares {size}")
    got = chunk_hash(data)
    if got != h:
        raise ChunkCorrupt(h, f"content hashes to {got}")
    return data
