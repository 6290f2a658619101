"""The thread budget of hashing in the core (issue 40), without FUSE: a Verifier verifies a
whole version's unverified chunks at once (``verify_version``) with one verification per
chunk, and a seal hashed on several threads that a reopen stops keeps the finished prefix.
The mount-level checks are in t4_hash_threads_test.py."""

from __future__ import annotations

import os

import blake3
import trio

from mtcfs.base import failpoints
from mtcfs.base.chunking import chunk_hash
from mtcfs.core import verifier as verifier_mod
from mtcfs.core.model import ROOT_INO, Version
from mtcfs.core.records import Counters
from mtcfs.core.store.fdcache import FdCache
from mtcfs.core.verifier import INLINE_VERIFY_BYTES, Verifier
from support.corefs import CS, run, sealed, write_file

VCS = 2 * INLINE_VERIFY_BYTES  # hashed in worker threads


from support.verifier_host import VerifierHost as Host  # noqa: E402


def _setup(tmp_path, nchunks: int, threads: int):
    host = Host(tmp_path)
    fds = FdCache(host.open_data)
    data = os.urandom(nchunks * VCS - 10)
    v = Version(vid=1, ino=5, size=len(data), chunk_size=VCS, sealed=True,
                chunks=tuple(chunk_hash(data[i:i + VCS]) for i in range(0, len(data), VCS)))
    os.pwrite(fds.get(v), data, 0)
    host.versions[1] = v
    ver = Verifier(host, fds, Counters(), trio.CapacityLimiter(2))
    ver.threads = threads
    ver.start()
    return host, fds, ver, v


def _count_hashes(monkeypatch) -> list[int]:
    """The chunk index of every hash the verifier makes from now on, in order."""
    hashed: list[int] = []
    real = verifier_mod._hash_matches

    def counted(fds_, v_, off, length, digest):
        hashed.append(off // VCS)
        return real(fds_, v_, off, length, digest)

    monkeypatch.setattr(verifier_mod, "_hash_matches", counted)
    return hashed


def test_verify_version_hashes_every_unverified_chunk_and_marks_the_bad_one(tmp_path,
                                                                           monkeypatch):
    host, fds, ver, v = _setup(tmp_path, 12, 4)
    assert ver.threads == 4 and ver.unverified_chunks() == 12
    hashed = _count_hashes(monkeypatch)
    os.pwrite(fds.get(v), b"rot", 9 * VCS + 3)

    async def main() -> None:
        await ver.verify_range(v, 0, 1)  # a first read of chunk 0 only
        assert await ver.verify_version(v) is False  # chunk 9 does not match
        assert not ver.needs(v) and v.missing == {9}
        assert await ver.verify_version(v) is False  # still missing: fault_in's turn
    trio.run(main)
    assert sorted(hashed) == list(range(12))  # each chunk hashed once
    assert host.corrupt == [(1, 9, "first read after start")]
    assert ver._verifying == {} and v.pins == 0
    fds.close_all()


def test_verify_version_of_a_good_file_is_true_and_costs_nothing_the_second_time(tmp_path):
    host, fds, ver, v = _setup(tmp_path, 6, 3)

    async def main() -> None:
        assert await ver.verify_version(v) is True
        assert await ver.verify_version(v) is True
    trio.run(main)
    assert host.corrupt == [] and ver.unverified_chunks() == 0
    fds.close_all()


def test_a_verify_chunk_beside_verify_version_waits_for_its_verdict(tmp_path, monkeypatch):
    # one thread: verify_version's chunks queue for it, each already "in flight", so the
    # verify_chunk of one of them (a read) waits for that verdict instead of hashing again
    host, fds, ver, v = _setup(tmp_path, 8, 1)
    hashed = _count_hashes(monkeypatch)
    os.pwrite(fds.get(v), b"rot", 6 * VCS + 3)
    got: dict[str, bool] = {}

    async def whole() -> None:
        got["version"] = await ver.verify_version(v)

    async def one() -> None:
        got["chunk"] = await ver.verify_chunk(v, 6)

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(whole)
            n.start_soon(one)
    trio.run(main)
    assert got == {"version": False, "chunk": False}
    assert sorted(hashed) == list(range(8))  # chunk 6 once
    assert host.corrupt == [(1, 6, "first read after start")]
    fds.close_all()


def test_a_reopen_stops_a_seal_on_four_threads_and_keeps_the_finished_prefix(
        tmp_path, monkeypatch):
    monkeypatch.setitem(failpoints._ACTIVE, "seal.chunk", 0.02)
    data = os.urandom(32 * CS)
    new = os.urandom(len(data))

    async def body(fs):
        fs.open_files.hash_threads = 4
        ino = await write_file(fs, ROOT_INO, b"f", data)
        await trio.sleep(0.1)  # a few chunks hashed, most not
        fh, _ = await fs.open(ino, os.O_RDWR)
        v = fs.versions[fs.inodes[ino].vid]
        k = len(v.base_chunks)
        assert 0 < k < 32 and fs.counters.seal_bytes_hashed == k * CS
        assert list(v.base_chunks) == [chunk_hash(data[i * CS:(i + 1) * CS]) for i in range(k)]
        for off in range(0, len(new), 3 * CS):
            await fs.write(fh, off, new[off:off + 3 * CS])
        await fs.release(fh)
        v = await sealed(fs, ino)
        assert list(v.chunks) == [chunk_hash(new[i:i + CS]) for i in range(0, len(new), CS)]
        assert fs.counters.seal_bytes_hashed == k * CS + len(new)
        assert (await fs.getxattr(ino, b"user.mtcfs.blake3")).decode() == \
            blake3.blake3(new).hexdigest()
    run(body, tmp_path)
