"""The filesystem core driven in-process (no FUSE, no daemon), for the t3 tests."""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from mtcfs.base.chunking import chunk_hash
from mtcfs.base.errors import FsError
from mtcfs.core.core import Filesystem
from mtcfs.core.store import Store

#: Chunk size of the in-process tests: small, so that files of a few chunks stay tiny.
CS = 64 * 1024


def open_fs(path: Path, capacity: int = 1 << 30, rank: int = 0) -> Filesystem:
    """A core on a store at ``path`` (created if new), job "job", chunks of :data:`CS`."""
    return Filesystem(Store(str(path), "job", CS), capacity=capacity, chunk_size=CS,
                      job="job", rank=rank)


def run(fn: Callable[[Filesystem], Awaitable[None]], tmp_path: Path, rank: int = 0,
        capacity: int = 1 << 30) -> None:
    """Run ``fn(fs)`` on a fresh core of ``capacity`` bytes under trio, the core started
    in a nursery (as the daemon does) and closed afterwards whatever happens."""
    async def main() -> None:
        async with trio.open_nursery() as n:
            fs = open_fs(tmp_path / "store", capacity=capacity, rank=rank)
            fs.start(n)
            try:
                await fn(fs)
            finally:
                n.cancel_scope.cancel()
                fs.close()
                fs.store.close()
    trio.run(main)


async def write_file(fs: Filesystem, parent: int, name: bytes, data: bytes,
                     flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC) -> int:
    """Create ``name`` in directory ``parent``, write ``data`` in 100 kB requests (as the
    kernel would), close it; its inode number."""
    fh, attr = await fs.create(parent, name, 0o644, flags, 0, 0)
    for off in range(0, len(data), 100_000):
        await fs.write(fh, off, data[off:off + 100_000])
    await fs.release(fh)
    return attr.ino


async def sealed(fs: Filesystem, ino: int) -> Any:
    """The sealed version of inode ``ino``, waited for at most 10 s."""
    with trio.fail_after(10):
        return await fs.open_files.wait_sealed(fs.inodes[ino])


def run_to_crash(fn: Callable[[Filesystem], Awaitable[None]], tmp_path: Path) -> None:
    """Run ``fn(fs)`` on a core started as :func:`run` does, then "crash" it: its store's
    database and lock are closed with no release, no seal and no clean shutdown recorded,
    as SIGKILL would leave them. A later :func:`run` on ``tmp_path`` is the restart."""
    async def main() -> None:
        async with trio.open_nursery() as n:
            fs = open_fs(tmp_path / "store")
            fs.start(n)
            await fn(fs)
            fs.store.db.conn.close()
            os.close(fs.store._lock_fd)
            fs.store._lock_fd = -1
            fs.store.db = None
            n.cancel_scope.cancel()
    trio.run(main)


class ChunksOf:
    """A ChunkSource (core/fetcher.py) that holds the :data:`CS` chunks of ``data``;
    ``fetches`` counts what it was asked. A digest it lacks is EIO ("nobody has it")."""

    def __init__(self, data: bytes) -> None:
        self.chunks = {chunk_hash(data[i:i + CS]): data[i:i + CS]
                       for i in range(0, len(data), CS)}
        self.fetches = 0

    async def fetch(self, digest: str, tried: list[str] | None = None) -> bytes:
        self.fetches += 1
        if digest not in self.chunks:
            raise FsError(errno.EIO, f"chunk {digest[:16]}: nobody has it")
        return self.chunks[digest]
