"""Fault-in's component (core/fetcher.py) alone: a FaultIn over a fake host, a real RamBudget
and real data files, no Filesystem. What the core adds (verification, the namespace) is in
t3_faultin_test.py.

Each test ends with the consistency check: nothing in flight, the budget's ``used`` is the
sum of the versions' ``alloc`` (what their files hold), every chunk that arrived was
reported to the host and is no longer missing.
"""

from __future__ import annotations

import errno
import os

import pytest
import trio

from mtcfs.base.chunking import chunk_hash, chunk_span
from mtcfs.base.errors import FsError
from mtcfs.core.budget import RamBudget
from mtcfs.core.fetcher import FaultIn
from mtcfs.core.model import Inode, Version
from mtcfs.core.records import Counters
from mtcfs.core.store.fdcache import FdCache

CS = 64 * 1024


class Host:
    """The calls FaultIn makes on the core (fetcher.Host), recorded."""

    def __init__(self, tmp_path) -> None:
        self.dir = tmp_path
        self.versions: dict[int, Version] = {}
        self.inodes: dict[int, Inode] = {}
        self.tree = self  # fetcher.Host.tree (fetcher.Paths): inodes and path_of are here
        self.arrived: list[tuple[int, int]] = []
        self.errors: list[str] = []
        self.released: list[int] = []
        self.local: dict[str, tuple[Version, int, int]] = {}
        self.vstore = self  # fetcher.Host.vstore: release(v) is recorded here

    def open_data(self, vid: int) -> int:
        return os.open(str(self.dir / f"v{vid}"), os.O_RDWR | os.O_CREAT, 0o600)

    def path_of(self, ino: Inode) -> str | None:
        return f"f{ino.ino}"

    def pin_chunk(self, digest: str):
        loc = self.local.get(digest)
        if loc is not None:
            loc[0].pins += 1
        return loc

    def unpin(self, versions) -> None:
        for v in versions:
            v.pins -= 1

    def read_chunk_at(self, v, off, length, digest):
        data = os.pread(os.open(str(self.dir / f"v{v.vid}"), os.O_RDONLY), length, off)
        return data if digest is None or chunk_hash(data) == digest else None

    def mark_corrupt(self, v, idx, found_by) -> None:
        self.errors.append(f"corrupt {v.vid}/{idx}")

    def release(self, v) -> None:
        self.released.append(v.vid)

    def chunk_arrived(self, v, idx) -> None:
        self.arrived.append((v.vid, idx))

    def check_data_room(self, nbytes: int) -> None:
        pass  # (the store's filesystem is never full here)

    def report_error(self, msg: str) -> None:
        self.errors.append(msg)


class Source:
    """A chunk source over a dict; ``gate`` holds every fetch until set."""

    def __init__(self, chunks: dict[str, bytes]) -> None:
        self.chunks = chunks
        self.gate = trio.Event()
        self.gate.set()
        self.fetches = 0

    async def fetch(self, digest: str, tried: list[str] | None = None) -> bytes:
        self.fetches += 1
        await self.gate.wait()
        if digest not in self.chunks:
            if tried is not None:
                tried.append("fake: not here")
            raise FsError(errno.EIO, "nobody has it")
        return self.chunks[digest]


def setup(tmp_path, data: bytes, capacity: int = 1 << 30):
    """A host holding one sealed version (vid 1) of ``data`` with every chunk missing."""
    host = Host(tmp_path)
    fds = FdCache(host.open_data)
    counters = Counters()
    budget = RamBudget(capacity, fd_of=fds.get, counters=counters)
    chunks = tuple(chunk_hash(data[i:i + CS]) for i in range(0, len(data), CS))
    v = Version(vid=1, ino=5, size=len(data), chunk_size=CS, sealed=True, chunks=chunks,
                missing=set(range(len(chunks))))
    os.ftruncate(fds.get(v), len(data))
    budget.account(v)
    host.versions[1] = v
    host.inodes[5] = Inode(5, "file", 0o100644, 0, 0, 1, 0, 0, 0, vid=1)
    fetcher = FaultIn(host, budget, fds, counters, trio.CapacityLimiter(2))
    source = Source({c: data[i * CS:(i + 1) * CS] for i, c in enumerate(chunks)})
    fetcher.chunk_source = source
    return host, fds, budget, counters, fetcher, source, v


def consistent(host, fds, budget, fetcher) -> None:
    assert fetcher.fetching() == 0 and budget.in_flight == 0
    assert budget.used == sum(v.alloc for v in host.versions.values())
    for v in host.versions.values():
        assert v.alloc == os.fstat(fds.get(v)).st_blocks * 512 and v.pins == 0
    assert all(i not in host.versions[vid].missing for vid, i in host.arrived)
    fds.close_all()


def test_fill_fetches_each_missing_chunk_once_and_counts_it(tmp_path):
    data = os.urandom(3 * CS + 100)
    host, fds, budget, counters, fetcher, source, v = setup(tmp_path, data)

    async def main() -> None:
        source.gate = trio.Event()
        async with trio.open_nursery() as n:  # two readers of the same range: one fetch each
            n.start_soon(fetcher.fill, v, 0, len(data))
            n.start_soon(fetcher.fill, v, CS, 10)
            await trio.sleep(0.05)
            assert fetcher.fetching() == 4
            source.gate.set()
        assert source.fetches == 4 and not v.missing

    trio.run(main)
    assert os.pread(fds.get(v), len(data), 0) == data
    assert counters.chunks_faulted == 4 and counters.bytes_faulted == len(data)
    assert counters.fault_waits == 4 and counters.fault_timeouts == 0  # one wait per fetch
    assert sorted(host.arrived) == [(1, i) for i in range(4)]
    consistent(host, fds, budget, fetcher)


def test_a_failed_fetch_fails_again_at_once_within_the_window(tmp_path):
    data = os.urandom(CS)
    host, fds, budget, counters, fetcher, source, v = setup(tmp_path, data)
    source.chunks.clear()

    async def main() -> None:
        with pytest.raises(FsError) as e:
            await fetcher.fetch_chunk(v, 0)
        assert e.value.errno == errno.EIO and "f5, chunk 0" in fetcher.last_fault_error
        assert "fake: not here" in fetcher.last_fault_error
        with pytest.raises(FsError):
            await fetcher.fetch_chunk(v, 0)
        assert source.fetches == 1  # answered from the window
        fetcher.refetch_after_s = 0.0
        source.chunks[v.chunks[0]] = data
        await fetcher.fetch_chunk(v, 0)
        assert source.fetches == 2 and not v.missing

    trio.run(main)
    assert counters.fault_errors == 1 and host.errors and host.released
    assert counters.fault_timeouts == 0  # EIO from every source: not the deadline
    consistent(host, fds, budget, fetcher)


def test_a_source_that_never_answers_ends_at_the_deadline(tmp_path):
    data = os.urandom(CS)
    host, fds, budget, counters, fetcher, source, v = setup(tmp_path, data)
    source.gate = trio.Event()  # never set
    fetcher.fetch_deadline_s = 0.3

    async def main() -> None:
        with trio.fail_after(5):
            with pytest.raises(FsError) as e:
                await fetcher.fill(v, 0, 1)
        assert "within 0.3 s" in str(e.value)

    trio.run(main)
    assert v.missing == {0}
    assert counters.fault_timeouts == counters.fault_errors == counters.fault_waits == 1
    consistent(host, fds, budget, fetcher)


def test_a_local_copy_is_used_first_and_a_corrupt_one_is_reported(tmp_path):
    data = os.urandom(CS)
    host, fds, budget, _counters, fetcher, source, v = setup(tmp_path, data)
    other = Version(vid=2, ino=6, size=CS, chunk_size=CS, sealed=True, chunks=v.chunks)
    os.pwrite(fds.get(other), data, 0)
    budget.account(other)
    host.versions[2] = other
    host.local[v.chunks[0]] = (other, 0, CS)

    async def main() -> None:
        await fetcher.fetch_chunk(v, 0)
        assert source.fetches == 0  # served from the local copy
        v.missing.add(0)
        os.pwrite(fds.get(other), b"\0" * 10, 0)  # the local copy rots
        await fetcher.fetch_chunk(v, 0)
        assert source.fetches == 1 and "corrupt 2/0" in host.errors

    trio.run(main)
    assert os.pread(fds.get(v), CS, 0) == data
    consistent(host, fds, budget, fetcher)


def test_deliver_fills_only_what_is_still_missing_and_counts_past_a_full_budget(tmp_path):
    data = os.urandom(2 * CS)
    host, fds, budget, counters, fetcher, _source, v = setup(tmp_path, data, capacity=CS)

    async def main() -> None:
        d0 = v.chunks[0]
        assert await fetcher.deliver(d0, data[:CS], [(v, 0)]) == 1
        assert await fetcher.deliver(d0, data[:CS], [(v, 0)]) == 0  # already here
        assert await fetcher.deliver(v.chunks[1], b"short", [(v, 1)]) == 0
        assert any("expected" in e for e in host.errors)
        assert len(data[CS:]) == chunk_span(1, v.size, v.chunk_size)[1]
        assert await fetcher.deliver(v.chunks[1], data[CS:], [(v, 1)]) == 1

    trio.run(main)
    assert not v.missing and counters.fault_in_over_size >= 1  # a read is never refused
    consistent(host, fds, budget, fetcher)


def test_a_read_of_a_chunk_on_its_way_waits_for_it_instead_of_fetching_it_again(tmp_path):
    """The bulk restore announces the chunks it streams (``expect``): a read of one of them
    waits for that delivery, and fetches from the sources only what the bulk gives up."""
    data = os.urandom(2 * CS)
    host, fds, budget, counters, fetcher, source, v = setup(tmp_path, data)

    async def main() -> None:
        fetcher.expect([v.chunks[0], v.chunks[1]])
        async with trio.open_nursery() as n:
            n.start_soon(fetcher.fill, v, 0, 10)          # chunk 0: delivered by the bulk
            n.start_soon(fetcher.fill, v, CS, 10)         # chunk 1: the bulk gives it up
            await trio.sleep(0.05)
            assert source.fetches == 0                    # both wait, nothing fetched twice
            assert await fetcher.deliver(v.chunks[0], data[:CS], [(v, 0)]) == 1
            fetcher.settle([v.chunks[0]])
            fetcher.settle([v.chunks[1]])                 # not served: the read fetches it
        assert source.fetches == 1 and not v.missing

    trio.run(main)
    assert os.pread(fds.get(v), len(data), 0) == data
    consistent(host, fds, budget, fetcher)
