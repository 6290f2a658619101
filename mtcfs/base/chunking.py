"""Fixed-size chunking and blake3 hashing of file versions.

A sealed file version is cut into chunks of ``chunk_size`` bytes (the last one may be
shorter). Each chunk is named by the hex blake3 digest of its bytes; the file as a whole
also gets the blake3 digest of its full content, so ``user.mtcfs.blake3`` equals what
``b3sum`` prints for the file. A rewrite of a sealed file hashes only the chunks it changed
(:func:`rehash_fd`); its whole-file digest is computed when asked (core/versions.py:
``hash_data``).

Fixed-size rather than content-defined chunking: tensor files change in place, they do not
shift, so fixed offsets give the same dedup at a fraction of the CPU cost (see
docs/architecture.md).
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import blake3

#: Default chunk size in bytes (4 MiB): large enough to keep per-chunk overhead (an RPC,
#: an object-store request, an index row) small, small enough that an unchanged tensor of
#: a few MiB dedups.
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024

#: Chunk sizes outside this range are rejected by option parsing.
MIN_CHUNK_SIZE = 64 * 1024
MAX_CHUNK_SIZE = 256 * 1024 * 1024

#: The digest of the empty input; the file hash of an empty file.
EMPTY_HASH = blake3.blake3(b"").hexdigest()


def chunk_hash(data: bytes | memoryview) -> str:
    """Return the hex blake3 digest (64 characters) of one chunk's bytes."""
    return blake3.blake3(data).hexdigest()


def chunk_count(size: int, chunk_size: int) -> int:
    """Number of chunks a file of ``size`` bytes has (0 for an empty file)."""
    return (size + chunk_size - 1) // chunk_size


def chunk_span(index: int, size: int, chunk_size: int) -> tuple[int, int]:
    """Return ``(offset, length)`` in bytes of chunk ``index`` of a ``size``-byte file."""
    off = index * chunk_size
    return off, max(0, min(chunk_size, size - off))


@dataclass(frozen=True)
class HashResult:
    """The outcome of hashing one file version.

    Attributes:
        size: bytes hashed.
        chunks: hex blake3 digest of each chunk, in file order.
        file_hash: hex blake3 digest of the whole content; "" when not computed
            (:func:`rehash_fd`).
        hashed: bytes read and hashed to get this result.
    """

    size: int
    chunks: tuple[str, ...]
    file_hash: str
    hashed: int = 0


class HashStopped(Exception):
    """:func:`hash_fd` was told to stop (its ``stop`` returned True) before the end.

    Attributes:
        chunks: hex digests of the chunks hashed before it stopped, in file order (each a
            whole ``chunk_size`` chunk: it stops only before the last one).
        hashed: bytes read and hashed.
    """

    def __init__(self, chunks: tuple[str, ...], hashed: int) -> None:
        super().__init__(f"stopped after {len(chunks)} chunks")
        self.chunks = chunks
        self.hashed = hashed


def hash_fd(fd: int, size: int, chunk_size: int,
            stop: Callable[[], bool] | None = None) -> HashResult:
    """Hash the first ``size`` bytes of the open file ``fd`` chunk by chunk.

    Blocking and CPU-bound (about 2 GB/s on one core, since every byte is hashed twice:
    once for its chunk, once for the whole file); call it from a worker thread.
    Each chunk is read with ``preadv`` into one reused buffer: memory stays flat whatever
    the size, and the store's pages are never mapped into the daemon (a mapping would
    count them in its RSS, which the OOM killer weighs).

    ``stop``: asked before each chunk is hashed (from this thread); True ends the
    hash there, with :class:`HashStopped` (a file reopened for writing while its close is
    being sealed: core/files.py).

    Raises:
        OSError: if the file cannot be read or is shorter than ``size``.
        HashStopped: ``stop`` returned True.
    """
    whole = blake3.blake3()
    digests: list[str] = []
    if size == 0:
        return HashResult(0, (), EMPTY_HASH)
    for piece in _pieces(fd, size, chunk_size):
        if stop is not None and stop():
            raise HashStopped(tuple(digests), len(digests) * chunk_size)
        digests.append(blake3.blake3(piece).hexdigest())
        whole.update(piece)
    return HashResult(size, tuple(digests), whole.hexdigest(), size)


def _pieces(fd: int, size: int, chunk_size: int) -> Iterator[memoryview]:
    """The first ``size`` (> 0) bytes of ``fd``, ``chunk_size`` at a time, each read with
    ``preadv`` into one reused buffer (memory stays flat whatever the size, and the store's
    pages are never mapped into the daemon). A piece is valid until the next is asked for.

    Raises:
        OSError: if the file cannot be read or is shorter than ``size``.
    """
    buf = bytearray(min(chunk_size, size))
    view = memoryview(buf)
    try:
        for off in range(0, size, chunk_size):
            want = min(chunk_size, size - off)
            _read_into(fd, view, off, want, size)
            piece = view[:want]
            try:
                yield piece
            finally:
                piece.release()
    finally:
        view.release()


def _read_into(fd: int, view: memoryview, off: int, want: int, size: int) -> None:
    """Read ``want`` bytes of ``fd`` at ``off`` into ``view`` (OSError if the file ends
    first: shorter than the ``size`` the caller expects)."""
    got = 0
    while got < want:
        n = os.preadv(fd, [view[got:want]], off + got)
        if n == 0:
            raise OSError(f"data file is shorter than {size} bytes")
        got += n


def _is_hole(fd: int, off: int, length: int) -> bool:
    """Whether ``[off, off+length)`` of ``fd`` holds no data extent (reads as zeros)."""
    try:
        return os.lseek(fd, off, os.SEEK_DATA) >= off + length
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # only a hole past off
            return True
        raise


@functools.lru_cache(maxsize=8)
def zero_chunk_hash(length: int) -> str:
    """The hex blake3 digest of ``length`` zero bytes (a chunk that is all hole)."""
    return blake3.blake3(bytes(length)).hexdigest()


def rehash_fd(fd: int, size: int, chunk_size: int, base: tuple[str, ...],
              dirty: set[int]) -> HashResult:
    """The chunk digests of the first ``size`` bytes of ``fd``, hashing only what changed.

    ``base``: the digests of the content the file started from (same ``chunk_size``);
    ``dirty``: indices of the chunks written or resized since. A chunk in ``dirty`` or
    past the end of ``base`` is read and hashed (one that is all hole gets the digest of
    zeros without being read); the others keep their ``base`` digest. The whole-file hash
    is not computed (``file_hash`` is ""; computed when asked: core/files.py, ``file_hash``).
    Blocking; call it from a worker thread for large changes.

    Raises:
        OSError: if the file cannot be read or is shorter than ``size``.
    """
    n = (size + chunk_size - 1) // chunk_size
    digests = list(base[:n])
    todo = {i for i in dirty if i < n} | set(range(len(digests), n))
    digests.extend([""] * (n - len(digests)))
    hashed = 0
    buf: bytearray | None = None
    for i in sorted(todo):
        off = i * chunk_size
        want = min(chunk_size, size - off)
        if _is_hole(fd, off, want):
            digests[i] = zero_chunk_hash(want)
            continue
        if buf is None:
            buf = bytearray(min(chunk_size, size))
        view = memoryview(buf)
        try:
            _read_into(fd, view, off, want, size)
            digests[i] = blake3.blake3(view[:want]).hexdigest()
        finally:
            view.release()
        hashed += want
    return HashResult(size, tuple(digests), "", hashed)
