"""Fault-in driven in-process (no FUSE): a read of missing chunks ends with the right bytes or
EIO within its deadline, whatever happens to the namespace or the sources meanwhile.

The sources here are small in-memory ChunkSource fakes, so that a fetch can be held at an
exact point; the same paths run for real through FUSE and gRPC in t9 and t11.
"""

from __future__ import annotations

import errno
import os

import pytest
import trio

from mtcfs.base.chunking import chunk_hash
from mtcfs.base.errors import FsError
from mtcfs.core.core import Filesystem
from mtcfs.core.jobns import EMPTY_BLAKE3
from mtcfs.core.model import ROOT_INO
from support.corefs import CS, run



class HeldSource:
    """A ChunkSource that serves ``chunks`` once ``release`` is set; counts fetches."""

    def __init__(self, chunks: dict[str, bytes]) -> None:
        self.chunks = chunks
        self.release = trio.Event()
        self.asked = trio.Event()
        self.fetches = 0

    async def fetch(self, digest: str, tried: list[str] | None = None) -> bytes:
        self.fetches += 1
        self.asked.set()
        await self.release.wait()
        if digest not in self.chunks:
            raise FsError(errno.EIO, f"chunk {digest[:16]}: nobody has it")
        return self.chunks[digest]


def snapshot_with(data: bytes, writer: int, seq: int) -> dict:
    """A job namespace snapshot holding ``step_5/f``, written by rank ``writer``."""
    chunks = [chunk_hash(data[i:i + CS]) for i in range(0, len(data), CS)]
    version = {"size": len(data), "chunk_size": CS, "chunks": chunks,
               "blake3": EMPTY_BLAKE3, "rank": writer}
    entry = {"mode": 0o40755, "uid": 0, "gid": 0, "mtime_ns": 1, "target": ""}
    return {"epoch": 1, "seq": seq, "next_ino": 10, "steps": [],
            "entries": [dict(entry, ino=2, parent=ROOT_INO, name="step_5", kind="dir"),
                        dict(entry, ino=3, parent=2, name="f", kind="file", mode=0o100644,
                             version=version)]}


async def open_remote(fs: Filesystem, data: bytes, source) -> int:
    """Install a snapshot where ``step_5/f`` (inode 3) holds ``data``, written by rank 2
    (every chunk missing here), set ``source`` as the chunk source; open it for reading."""
    fs.tier_api.ns_install(snapshot_with(data, writer=2, seq=5))
    fs.fetcher.chunk_source = source
    fh, _keep = await fs.open(3, os.O_RDONLY)
    return fh


def test_a_snapshot_install_during_a_fetch_does_not_make_the_read_fetch_forever(tmp_path):
    """The hang of ../shared/evidence/dead-writer-hang: a read of another rank's file was
    faulting a chunk in when the node installed the job's snapshot. The install replaced
    every Version object; the fetched bytes were dropped because the read's version was no
    longer registered, and the fetch loop asked again, forever (each time the dead writer
    first). The read must get its bytes, fetched once."""
    data = os.urandom(2 * CS + 5)
    chunks = {chunk_hash(data[i:i + CS]): data[i:i + CS] for i in range(0, len(data), CS)}

    async def body(fs: Filesystem) -> None:
        fh = await open_remote(fs, data, src := HeldSource(chunks))
        got: list[bytes] = []

        async def reader() -> None:
            got.append(await fs.read(fh, 0, len(data)))

        async with trio.open_nursery() as n:
            n.start_soon(reader)
            await src.asked.wait()
            fs.tier_api.ns_install(snapshot_with(data, writer=2, seq=9))  # the same file, new objects
            src.release.set()
            with trio.fail_after(10):
                while not got:
                    await trio.sleep(0.01)
        assert got == [data]
        assert src.fetches == len(chunks)  # each chunk once: nothing fetched again
        await fs.release(fh)
        # A new open reads the installed version, which the fetches filled too or fetch again.
        fh, _keep = await fs.open(3, os.O_RDONLY)
        with trio.fail_after(10):
            assert await fs.read(fh, 0, len(data)) == data
        await fs.release(fh)
    run(body, tmp_path, rank=1)


def test_a_fetch_that_never_answers_fails_the_read_with_eio_within_the_deadline(tmp_path):
    """A source that hangs (a SIGSTOPped peer behind a partition) costs a read the fault-in
    deadline, then EIO naming the file, never more."""
    data = os.urandom(CS)

    async def body(fs: Filesystem) -> None:
        fs.fetcher.fetch_deadline_s = 0.5
        fh = await open_remote(fs, data, HeldSource({}))  # never released
        with trio.fail_after(10):
            with pytest.raises(FsError) as exc:
                await fs.read(fh, 0, len(data))
        assert exc.value.errno == errno.EIO
        assert "step_5/f" in fs.errors[-1] and "0.5 s" in fs.errors[-1]
        assert fs.counters.fault_errors == 1
        await fs.release(fh)
    run(body, tmp_path, rank=1)


def test_a_failed_read_is_tried_again_by_the_next_read(tmp_path):
    data = os.urandom(CS)
    chunks = {chunk_hash(data): data}

    async def body(fs: Filesystem) -> None:
        fh = await open_remote(fs, data, src := HeldSource({}))
        src.release.set()
        with pytest.raises(FsError) as exc:
            await fs.read(fh, 0, len(data))
        assert exc.value.errno == errno.EIO and "step_5/f" in fs.errors[-1]
        src.chunks = chunks  # the source came back
        # The kernel's READ again right after the failure (readahead, then the read
        # itself) fails at once, not after a second deadline...
        with pytest.raises(FsError):
            await fs.read(fh, 0, len(data))
        assert src.fetches == 1
        # ...and a read after refetch_after_s asks again.
        fs.fetcher.refetch_after_s = 0.2
        await trio.sleep(0.3)
        assert await fs.read(fh, 0, len(data)) == data
        await fs.release(fh)
    run(body, tmp_path, rank=1)


class FlakySource:
    """A ChunkSource whose sources are unreachable (EAGAIN) for the first ``down`` asks."""

    def __init__(self, chunks: dict[str, bytes], down: int) -> None:
        self.chunks = chunks
        self.down = down
        self.fetches = 0

    async def fetch(self, digest: str, tried: list[str] | None = None) -> bytes:
        self.fetches += 1
        if self.fetches <= self.down:
            if tried is not None:
                tried.append("rank 2: unreachable")
            raise FsError(errno.EAGAIN, "no peer served a valid copy")
        return self.chunks[digest]


def test_a_source_that_comes_back_within_the_deadline_serves_the_read(tmp_path):
    """Unreachable sources (a node restarting) are asked again, after short pauses, until
    the deadline; a source that answers 'not here' (EIO) is not (the previous test)."""
    data = os.urandom(CS)

    async def body(fs: Filesystem) -> None:
        fh = await open_remote(fs, data, src := FlakySource({chunk_hash(data): data}, down=3))
        with trio.fail_after(10):
            assert await fs.read(fh, 0, len(data)) == data
        assert src.fetches == 4 and fs.counters.fault_errors == 0
        await fs.release(fh)
    run(body, tmp_path, rank=1)


def test_unreachable_sources_until_the_deadline_are_eio_naming_them(tmp_path):
    data = os.urandom(CS)

    async def body(fs: Filesystem) -> None:
        fs.fetcher.fetch_deadline_s = 2.0
        fh = await open_remote(fs, data, src := FlakySource({}, down=10 ** 6))
        with trio.fail_after(10):
            with pytest.raises(FsError) as exc:
                await fs.read(fh, 0, len(data))
        assert exc.value.errno == errno.EIO
        assert 2 < src.fetches < 10  # passes repeat, with pauses between them
        assert "rank 2: unreachable" in fs.fetcher.last_fault_error and "step_5/f" in fs.fetcher.last_fault_error
        await fs.release(fh)
    run(body, tmp_path, rank=1)
