"""The filesystem core driven in-process (no FUSE, no daemon), for the t3 tests."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from mtcfs.core.core import Filesystem
from mtcfs.core.store import Store

#: Chunk size of the in-process tests: small, so that files of a few chunks stay tiny.
CS = 64 * 1024


def open_fs(path: Path, capacity: int = 1 << 30, rank: int = 0) -> Filesystem:
    """A core on a store at ``path`` (created if new), job "job", chunks of :data:`CS`."""
    return Filesystem(Store(str(path), "job", CS), capacity=capacity, chunk_size=CS,
                      job="job", rank=rank)


def run(fn: Callable[[Filesystem], Awaitable[None]], tmp_path: Path, rank: int = 0) -> None:
    """Run ``fn(fs)`` on a fresh core under trio, the core started in a nursery (as the
    daemon does) and closed afterwards whatever happens."""
    async def main() -> None:
        async with trio.open_nursery() as n:
            fs = open_fs(tmp_path / "store", rank=rank)
            fs.start(n)
            try:
                await fn(fs)
            finally:
                n.cancel_scope.cancel()
                fs.close()
                fs.store.close()
    trio.run(main)
