"""First-read verification and the scrub (core/verifier.py) alone: a Verifier over a fake
host and real data files, no Filesystem. What the core does with a corrupt chunk
(``LocalChunks.mark_corrupt``: a hole, the budget, a repair) is in t3_core_test.py and t6_corrupt.

Each test ends with the consistency check: no verification in flight, nothing pinned, and
every chunk still unverified is held (not missing) by a registered version.
"""

from __future__ import annotations

import os

import trio

from mtcfs.base.chunking import chunk_hash
from mtcfs.core.model import Version
from mtcfs.core.records import Counters
from mtcfs.core.store.fdcache import FdCache
from mtcfs.core.verifier import INLINE_VERIFY_BYTES, Verifier

CS = 2 * INLINE_VERIFY_BYTES  # hashed in a worker thread


from support.verifier_host import VerifierHost as Host  # noqa: E402


def setup(tmp_path, nchunks: int = 3):
    host = Host(tmp_path)
    fds = FdCache(host.open_data)
    data = os.urandom(nchunks * CS)
    v = Version(vid=1, ino=5, size=len(data), chunk_size=CS, sealed=True,
                chunks=tuple(chunk_hash(data[i:i + CS]) for i in range(0, len(data), CS)))
    os.pwrite(fds.get(v), data, 0)
    host.versions[1] = v
    verifier = Verifier(host, fds, Counters(), trio.CapacityLimiter(2))
    verifier.start()
    return host, fds, verifier, v


def consistent(host, fds, verifier) -> None:
    assert verifier._verifying == {}
    for vid, todo in verifier._unverified.items():
        v = host.versions[vid]
        assert todo and not (todo & v.missing) and v.pins == 0
    assert verifier.unverified_chunks() == sum(len(t) for t in verifier._unverified.values())
    fds.close_all()


def test_a_first_read_hashes_what_it_touches_and_hands_a_mismatch_over(tmp_path):
    host, fds, verifier, v = setup(tmp_path)
    assert verifier.needs(v) and verifier.unverified_chunks() == 3
    os.pwrite(fds.get(v), b"rot", 2 * CS + 7)

    async def main() -> None:
        await verifier.verify_range(v, 0, 1)  # chunk 0 only
        assert verifier._unverified[1] == {1, 2}
        await verifier.verify_range(v, CS, 2 * CS)  # chunks 1 and 2, side by side
        assert not verifier.needs(v)

    trio.run(main)
    assert host.corrupt == [(1, 2, "first read after start")]
    consistent(host, fds, verifier)


def test_two_callers_of_one_chunk_share_one_verdict(tmp_path):
    host, fds, verifier, v = setup(tmp_path, nchunks=1)
    os.pwrite(fds.get(v), b"rot", 0)
    verdicts: list[bool] = []

    async def main() -> None:
        async def one() -> None:
            verdicts.append(await verifier.verify_chunk(v, 0))
        async with trio.open_nursery() as n:
            n.start_soon(one)
            n.start_soon(one)

    trio.run(main)
    assert verdicts == [False, False] and len(host.corrupt) == 1  # marked once
    consistent(host, fds, verifier)


def test_a_scrub_pass_hashes_everything_held_and_reports(tmp_path):
    host, fds, verifier, v = setup(tmp_path)
    verifier.rate = 0
    verifier.drop(1)  # hashed whole already (e.g. mtcfs verify): the scrub hashes anyway
    v.missing.add(0)  # not held: not hashed
    os.pwrite(fds.get(v), b"rot", CS)

    async def main() -> None:
        assert await verifier.scrub_pass() == 1

    trio.run(main)
    st = verifier.state
    assert st["passes"] == 1 and st["last_chunks"] == 2 and st["last_corrupt"] == 1
    assert not st["running"] and host.corrupt == [(1, 1, "scrub")]
    consistent(host, fds, verifier)


def test_a_version_that_takes_the_data_file_over_carries_what_is_unverified(tmp_path):
    host, fds, verifier, v = setup(tmp_path)
    new = Version(vid=2, ino=5, size=v.size, chunk_size=CS, sealed=True, chunks=v.chunks)
    del host.versions[1]
    host.versions[2] = new
    verifier.carry(v, new)  # v is held by nothing: its entry moves
    assert verifier.needs(new) and not verifier.needs(v)
    fds.close_all()
    host.versions[1] = v
    verifier.drop(1)
    consistent(host, FdCache(host.open_data), verifier)


def test_the_start_pass_hashes_newest_first_skips_what_a_read_verified_and_marks_rot(
        tmp_path, monkeypatch):
    from mtcfs.core import verifier as verifier_mod
    host, fds, verifier, old = setup(tmp_path)  # vid 1, 3 chunks
    data = os.urandom(2 * CS)
    new = Version(vid=2, ino=6, size=len(data), chunk_size=CS, sealed=True,
                  chunks=tuple(chunk_hash(data[i:i + CS]) for i in range(0, len(data), CS)))
    os.pwrite(fds.get(new), data, 0)
    host.versions[2] = new
    verifier.start()
    verifier.threads = 1  # one at a time: the order is the pass's
    os.pwrite(fds.get(new), b"rot", CS + 1)
    hashed: list[tuple[int, int]] = []
    real = verifier_mod._hash_matches

    def counted(fds_, v_, off, length, digest):
        hashed.append((v_.vid, off // CS))
        return real(fds_, v_, off, length, digest)
    monkeypatch.setattr(verifier_mod, "_hash_matches", counted)

    async def main() -> None:
        await verifier.verify_range(old, 0, 1)  # a first read before the pass: chunk 0
        assert await verifier.start_pass() == 4
    trio.run(main)
    assert hashed == [(1, 0), (2, 0), (2, 1), (1, 1), (1, 2)]  # newest version first
    assert host.corrupt == [(2, 1, "verification at start")]
    st = verifier.state
    assert not st["start_running"] and st["start_chunks"] == 4
    assert st["start_done_bytes"] == st["start_total_bytes"] == 4 * CS
    assert verifier.unverified_chunks() == 0
    consistent(host, fds, verifier)


def test_the_start_pass_follows_a_version_that_took_the_data_file_over(tmp_path):
    host, fds, verifier, v = setup(tmp_path)
    new = Version(vid=2, ino=5, size=v.size, chunk_size=CS, sealed=True, chunks=v.chunks)

    async def main() -> None:
        async def take_over() -> None:  # a snapshot install while the pass runs
            await trio.sleep(0)
            del host.versions[1]
            host.versions[2] = new
            verifier.carry(v, new)
        async with trio.open_nursery() as n:
            n.start_soon(take_over)
            n.start_soon(verifier.start_pass)
    trio.run(main)
    assert not verifier.needs(new) and verifier.unverified_chunks() == 0
    verifier.drop(1)  # (the core frees the replaced version once nothing pins it)
    consistent(host, fds, verifier)
