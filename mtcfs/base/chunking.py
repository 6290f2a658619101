"""Fixed-size chunking and blake3 hashing of file versions.

A sealed file version is cut into chunks of ``chunk_size`` bytes (the last one may be
shorter). Each chunk is named by the hex blake3 digest of its bytes; the file as a whole
also has the blake3 digest of its full content, so ``user.mtcfs.blake3`` equals what
``b3sum`` prints for the file. A seal hashes each byte once, its chunks on up to
``hash_threads`` threads at once (:func:`hash_fd`); a rewrite of a sealed file hashes only
the chunks it changed (:func:`rehash_fd`). The whole-file digest of a file of more than one
chunk is computed when asked (core/versions.py: ``hash_data``).

Fixed-size rather than content-defined chunking: tensor files change in place, they do not
shift, so fixed offsets give the same dedup at a fraction of the CPU cost (see
docs/architecture.md).
"""

from __future__ import annotations

import errno
import functools
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import wait
from dataclasses import dataclass

import blake3

from mtcfs.base import pools
from mtcfs.base.scratch import scratch

#: Default chunk size in bytes (4 MiB): large enough to keep per-chunk overhead (an RPC,
#: an object-store request, an index row) small, small enough that an unchanged tensor of
#: a few MiB dedups.
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024

#: Chunk sizes outside this range are rejected by option parsing.
MIN_CHUNK_SIZE = 64 * 1024
MAX_CHUNK_SIZE = 256 * 1024 * 1024

#: Default threads that hash at once (mount option ``hash_threads``): a seal's chunks, the
#: first-read verification of a file. Four, as GKE's checkpoint replicator, so that the
#: training on the same node is not slowed; fewer on a smaller machine.
DEFAULT_HASH_THREADS = min(4, os.cpu_count() or 1)
#: ``hash_threads`` outside 1..this are rejected by option parsing.
MAX_HASH_THREADS = 64

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
            (more than one chunk: :func:`hash_fd`, :func:`rehash_fd`).
        hashed: bytes read and hashed to get this result.
    """

    size: int
    chunks: tuple[str, ...]
    file_hash: str
    hashed: int = 0


class HashStopped(Exception):
    """:func:`hash_fd` was told to stop (its ``stop`` returned True) before the end.

    Attributes:
        chunks: hex digests of the chunks before the one it stopped at, in file order
            (each a whole ``chunk_size`` chunk: it stops only before the last one), all
            finished, whatever ``threads`` was.
        hashed: bytes read and hashed.
    """

    def __init__(self, chunks: tuple[str, ...], hashed: int) -> None:
        super().__init__(f"stopped after {len(chunks)} chunks")
        self.chunks = chunks
        self.hashed = hashed


def hash_fd(fd: int, size: int, chunk_size: int,
            stop: Callable[[], bool] | None = None, *, threads: int = 1,
            whole: bool = False, pool: str = "hash") -> HashResult:
    """Hash the first ``size`` bytes of the open file ``fd`` chunk by chunk.

    Blocking and CPU-bound; call it from a worker thread. Each byte is read once, with
    ``preadv`` into a buffer of the thread that hashes it: memory stays flat whatever the
    size (``threads`` chunk buffers), and the store's pages are never mapped into the
    daemon (a mapping would count them in its RSS, which the OOM killer weighs).

    ``threads``: chunks hashed at once, the calling thread and ``threads - 1`` helpers of
    the executor pool ``pool`` (base/pools.py: ``hash``, background threads, or
    ``hash-now`` for a hash a request waits for; blake3 and ``preadv`` release the GIL).
    The digests do not depend on it.

    ``file_hash`` is the whole-file digest when it costs nothing: an empty file, or one of
    a single chunk (its digest is the chunk's). For more chunks it is "" (computed when
    asked: core/files.py, ``file_hash``), so each byte is hashed once, unless ``whole``:
    then it is computed in the same pass, one chunk after the other, each hash using up to
    ``threads`` threads of blake3's own (every byte hashed twice; benchmarks only).

    ``stop``: asked before each chunk is hashed (from a hashing thread, one ask at a
    time); True ends the hash there, with :class:`HashStopped` carrying the chunks before
    that one, all finished (a file reopened for writing while its close is being sealed:
    core/files.py).

    Raises:
        OSError: if the file cannot be read or is shorter than ``size``.
        HashStopped: ``stop`` returned True.
    """
    if size == 0:
        return HashResult(0, (), EMPTY_HASH)
    n = chunk_count(size, chunk_size)
    if whole and n > 1:
        return _hash_whole(fd, size, chunk_size, stop, threads)
    job = ChunkHasher(fd, size, chunk_size, range(n), stop)
    run_workers(job.work, min(threads, n), pool)
    digests = job.result()
    return HashResult(size, digests, digests[0] if n == 1 else "", size)


def _hash_whole(fd: int, size: int, chunk_size: int, stop: Callable[[], bool] | None,
                threads: int) -> HashResult:
    """:func:`hash_fd` with ``whole``: chunk digests and the whole-file digest, in order."""
    whole = blake3.blake3(max_threads=threads)
    digests: list[str] = []
    for piece in _pieces(fd, size, chunk_size):
        if stop is not None and stop():
            raise HashStopped(tuple(digests), len(digests) * chunk_size)
        digests.append(blake3.blake3(piece, max_threads=threads).hexdigest())
        whole.update(piece)
    return HashResult(size, tuple(digests), whole.hexdigest(), size)


class ChunkHasher:
    """The chunks ``indices`` (ascending) of the first ``size`` bytes of ``fd``, hashed by
    every thread that calls :meth:`work` at once, each with a buffer of its own.

    The threads take the chunks in order, one at a time, under a lock, asking ``stop``
    before each; once it says True (or a read fails) no chunk is started any more, and the
    ones started finish. So the chunks hashed are always a prefix of ``indices``.
    """

    def __init__(self, fd: int, size: int, chunk_size: int, indices: Iterable[int],
                 stop: Callable[[], bool] | None = None, *,
                 holes: bool = False) -> None:
        self._fd, self._size, self._cs = fd, size, chunk_size
        self._todo = list(indices)
        self._stop = stop
        self._holes = holes
        self._lock = threading.Lock()
        self._next = 0
        self._halted: int | None = None  # position of the first chunk not started
        self._error: OSError | None = None
        #: index -> hex digest of the chunks hashed.
        self.digests: dict[int, str] = {}
        #: bytes read and hashed (a hole is not read).
        self.hashed = 0

    def work(self) -> None:
        """Hash chunks until none is left, ``stop`` said so or a read failed (a thread's
        whole life; errors are kept for :meth:`result`)."""
        buf: mmap.mmap | None = None  # (unmapped when this returns)
        while True:
            with self._lock:
                pos = self._next
                if self._halted is not None or pos >= len(self._todo):
                    return
                if self._stop is not None and self._stop():
                    self._halted = pos
                    return
                self._next = pos + 1
            i = self._todo[pos]
            off = i * self._cs
            want = min(self._cs, self._size - off)
            try:
                if self._holes and _is_hole(self._fd, off, want):
                    digest, read = zero_chunk_hash(want), 0
                else:
                    if buf is None:
                        buf = scratch(min(self._cs, self._size))
                    view = memoryview(buf)
                    try:
                        _read_into(self._fd, view, off, want, self._size)
                        digest = blake3.blake3(view[:want]).hexdigest()
                    finally:
                        view.release()
                    read = want
            except OSError as exc:
                with self._lock:
                    if self._error is None:
                        self._error = exc
                    if self._halted is None or self._halted > pos:
                        self._halted = pos
                return
            with self._lock:
                self.digests[i] = digest
                self.hashed += read

    def result(self) -> tuple[str, ...]:
        """The digests in the order of ``indices``, once every :meth:`work` returned.

        Raises:
            OSError: a read failed.
            HashStopped: ``stop`` said True; it carries the digests of the chunks before.
        """
        if self._error is not None:
            raise self._error
        if self._halted is not None:
            done = tuple(self.digests[i] for i in self._todo[:self._halted])
            raise HashStopped(done, self.hashed)
        return tuple(self.digests[i] for i in self._todo)


def run_workers(work: Callable[[], None], threads: int, pool: str = "hash") -> None:
    """Run ``work`` in the calling thread and in ``threads - 1`` helpers of the executor
    pool ``pool`` at once; return when all returned (their exceptions are raised)."""
    if threads <= 1:
        work()
        return
    ex = pools.pool(pool)
    futs = [ex.submit(work) for _ in range(threads - 1)]
    try:
        work()
    finally:
        wait(futs)
    for f in futs:
        f.result()


def _pieces(fd: int, size: int, chunk_size: int) -> Iterator[memoryview]:
    """The first ``size`` (> 0) bytes of ``fd``, ``chunk_size`` at a time, each read with
    ``preadv`` into one reused buffer (memory stays flat whatever the size, and the store's
    pages are never mapped into the daemon). A piece is valid until the next is asked for.

    Raises:
        OSError: if the file cannot be read or is shorter than ``size``.
    """
    view = memoryview(scratch(min(chunk_size, size)))
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
              dirty: set[int], *, threads: int = 1, pool: str = "hash") -> HashResult:
    """The chunk digests of the first ``size`` bytes of ``fd``, hashing only what changed.

    ``base``: the digests of the content the file started from (same ``chunk_size``);
    ``dirty``: indices of the chunks written or resized since. A chunk in ``dirty`` or
    past the end of ``base`` is read and hashed (one that is all hole gets the digest of
    zeros without being read); the others keep their ``base`` digest. ``threads``: as for
    :func:`hash_fd`, ``pool`` too. The whole-file hash is not computed (``file_hash`` is ""; computed
    when asked: core/files.py, ``file_hash``).
    Blocking; call it from a worker thread for large changes.

    Raises:
        OSError: if the file cannot be read or is shorter than ``size``.
    """
    n = chunk_count(size, chunk_size)
    digests = list(base[:n])
    todo = sorted({i for i in dirty if i < n} | set(range(len(digests), n)))
    digests.extend([""] * (n - len(digests)))
    job = ChunkHasher(fd, size, chunk_size, todo, holes=True)
    run_workers(job.work, min(threads, len(todo)), pool)
    for i, d in zip(todo, job.result()):
        digests[i] = d
    return HashResult(size, tuple(digests), "", job.hashed)
