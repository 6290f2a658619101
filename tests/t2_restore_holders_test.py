"""Which peers a restoring rank asks for its replicas (``from_peers.list_holders``): real
Peer servers on loopback, each with its own replica store, and real clients.

The placement's ranks are asked first and, when they hold a complete replica of the step
the rank means to restore, nobody else (the fast path). When they hold only older steps, a
rank outside the placement (a holder under an earlier placement: a replacement node in
another topology domain, another node count) is asked too, so the newer step is found
rather than an older one restored (the multi-daemon form is in t7_peer_cluster_test.py).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from mtcfs.tiers.backup.retry import RetryPolicy
from mtcfs.tiers.peer import PeerClient, PeerUnavailable, ReplicaStore, serve
from mtcfs.tiers.restore.from_peers import list_holders
from support.peer import blob, chunks_of, make_step

JOB = "job"
NODES = 4
ME = 0
FAST = RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.05)


class Asker:
    """What ``list_holders`` reads of the restoring rank's PeerTier: its rank, the node
    count, its placement and a client per rank (real gRPC clients calling as rank 0)."""

    def __init__(self, placement: list[int], clients: dict[int, PeerClient]) -> None:
        self.rank = ME
        self.cfg = SimpleNamespace(nodes=NODES)
        self.placement = placement
        self.clients = clients
        self.asked: list[int] = []

    def peer_ranks(self) -> list[int]:
        return list(self.placement)

    def client(self, rank: int) -> PeerClient:
        self.asked.append(rank)
        if rank not in self.clients:
            raise PeerUnavailable(f"rank {rank}", "no address known yet")
        return self.clients[rank]


@pytest.fixture
def job(tmp_path):
    """Ranks 1..3 serving; rank 1 holds rank 0's step 10 complete, rank 2 its step 20
    complete (and step 10), rank 3 nothing of it."""
    servers, clients = [], {}
    for r in (1, 2, 3):
        store = ReplicaStore(str(tmp_path / f"r{r}"), 1 << 30)
        s = serve(store, "127.0.0.1:0", JOB, NODES, workers=4)
        servers.append(s)
        clients[r] = PeerClient(s.address, JOB, ME, timeout=5.0, stream_timeout=10.0,
                                retry=FAST, rng=random.Random(0))
    for r, steps in {1: (10,), 2: (10, 20)}.items():
        for n in steps:
            data = blob(n, 3 * 64 * 1024 + 5)
            assert clients[r].put_chunks(chunks_of(data).items()).ok
            got = clients[r].publish_manifest(make_step(JOB, ME, n, {"w.bin": data}))
            assert not got.missing
    yield clients
    for c in clients.values():
        c.close()
    for s in servers:
        s.stop(None)


def test_placement_holding_the_wanted_step_is_the_only_one_asked(job) -> None:
    asker = Asker([1], job)
    assert list_holders(asker, 10) == {"10": (10, [1])}
    assert asker.asked == [1]
    asker = Asker([1], job)
    assert list_holders(asker) == {"10": (10, [1])}  # nothing wanted: as before
    assert asker.asked == [1]


def test_a_newer_step_held_outside_the_placement_is_found(job) -> None:
    """Before the fix, the other ranks were never asked once the placement's rank held any
    complete replica: step 20 was not restorable and rank 0 restored step 10."""
    asker = Asker([1], job)
    got = list_holders(asker, 20)
    assert got == {"10": (10, [1, 2]), "20": (20, [2])}, got
    assert sorted(asker.asked) == [1, 2, 3]


def test_nothing_in_the_placement_asks_everyone(job) -> None:
    asker = Asker([3], job)
    got = list_holders(asker)
    assert got == {"10": (10, [1, 2]), "20": (20, [2])}, got
