"""Fault-in's peer chunk source over in-memory peers: the fallback order of
:class:`mtcfs.tiers.peer.sources.PeerChunkSource`, in milliseconds and one process.

These situations were checked only with several daemons (t7_failover_test.py: a holder's
copy corrupt, a holder gone; those tests stay). Here each node is a
:class:`~mtcfs.tiers.peer.memory.MemoryPeer` (the real service handlers and replica store)
reached through :class:`~mtcfs.tiers.peer.memory.MemoryTransport` (the real client logic),
so the errors the source sees are the ones a gRPC client raises.
"""

from __future__ import annotations

import errno
import os
import random

import pytest
import trio

from mtcfs.base.errors import FsError
from mtcfs.tiers.backup.retry import RetryPolicy
from mtcfs.tiers.peer import PeerUnavailable, ReplicaStore
from mtcfs.tiers.peer.memory import MemoryPeer, MemoryTransport
from mtcfs.tiers.peer.sources import PeerChunkSource
from support.peer import CHUNK, blob, chunks_of

JOB = "job"
NODES = 4
READER = 0
ONE_ATTEMPT = RetryPolicy(max_attempts=1, base_delay=0.01, max_delay=0.01)


@pytest.fixture
def job(tmp_path):
    """Ranks 1..3 as in-memory peers, each holding rank 0's chunks; and the source rank 0
    reads them through."""
    peers = {r: MemoryPeer(ReplicaStore(str(tmp_path / f"r{r}"), 1 << 30), JOB, NODES,
                           name=f"rank-{r}") for r in (1, 2, 3)}
    transports = {r: MemoryTransport(p, JOB, READER, retry=ONE_ATTEMPT, rng=random.Random(0))
                  for r, p in peers.items()}
    chunks = chunks_of(blob(1, 6 * CHUNK))
    for t in transports.values():
        assert t.put_chunks(chunks.items()).ok
    bad: list[tuple[int, str]] = []

    def client(rank: int) -> MemoryTransport:
        if rank not in transports:
            raise PeerUnavailable(f"rank {rank}", "no address known yet")
        return transports[rank]

    source = PeerChunkSource(holders=lambda: [1, 2], client=client,
                             report_bad=lambda r, m: bad.append((r, m)),
                             others=lambda: [1, 2, 3], attempt_s=5.0)
    yield peers, transports, chunks, source, bad
    for t in transports.values():
        t.close()


def fetch_all(source: PeerChunkSource, digests: list[str]) -> dict[str, bytes]:
    async def main() -> dict[str, bytes]:
        return {h: await source.fetch(h) for h in digests}
    return trio.run(main)


def test_chunks_come_from_the_holders(job) -> None:
    peers, _, chunks, source, bad = job
    assert fetch_all(source, list(chunks)) == chunks
    assert set(source.served) <= {1, 2} and sum(source.served.values()) == len(chunks)
    assert not bad and source.suspects() == []


def test_a_holder_with_a_corrupt_copy_is_passed_over(job) -> None:
    """t7_failover_test's "the writer's replica is corrupt": the next source serves."""
    peers, _, chunks, source, bad = job
    for h in chunks:                                # rank 1's copies rot on its disk
        path = os.path.join(peers[1].store.root, "chunks", h[:2], h)
        with open(path, "r+b") as f:
            f.write(b"rot")
    assert fetch_all(source, list(chunks)) == chunks
    assert source.served.get(1, 0) == 0
    assert peers[1].store.stats()["corrupt_deleted"] > 0
    assert not bad                                  # the peer refused to send: not "bad"


def test_a_holder_that_is_down_is_suspect_and_asked_last(job) -> None:
    peers, transports, chunks, source, bad = job
    peers[1].up = False
    assert fetch_all(source, list(chunks)) == chunks
    assert source.served.get(1, 0) == 0
    assert source.suspects() == [1]
    # one failed attempt, then asked last: a single call reached the dead rank
    assert transports[1].stats()["failures"] == 1


def test_no_source_is_eagain_when_one_was_unreachable_else_eio(job) -> None:
    peers, _, chunks, source, _ = job
    absent = chunks_of(b"nobody has this")
    with pytest.raises(FsError) as exc:
        fetch_all(source, list(absent))
    assert exc.value.errno == errno.EIO              # every peer answered "not held"
    peers[3].up = False
    with pytest.raises(FsError) as exc:
        fetch_all(source, list(absent))
    assert exc.value.errno == errno.EAGAIN           # one could not be asked: try later
