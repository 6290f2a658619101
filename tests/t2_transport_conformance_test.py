"""One conformance suite for :class:`mtcfs.tiers.peer.transport.Transport`, run against every
implementation:

==============  =========================================================================
``grpc``        PeerClient to a real gRPC server (``serve``) on loopback, plaintext
``grpc-tls``    the same with mutual TLS: the job CA of support/pki.py, certificates per
                rank, the server authenticating every call
``memory``      MemoryTransport into a MemoryPeer (mtcfs/tiers/peer/memory.py), in process
``memory-auth`` the same with the peer checking the caller's identity as a TLS server does
==============  =========================================================================

Each body is one promise of the peer protocol (docs/peer-protocol.md) seen from the node that
calls: chunks round-trip bit-exact, only missing chunks travel, manifests are stored and
listed, missing and corrupt chunks are left out, bad bytes and full or over-quota stores are
refused per chunk, whole calls are refused with the status the protocol names. A new
transport joins by adding one entry to :data:`KINDS` (docs/conformance.md).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from mtcfs.base.chunking import chunk_hash
from mtcfs.base.manifest import StepManifest
from mtcfs.tiers.backup.retry import RetryPolicy
from mtcfs.tiers.peer import (
    PeerChunkCorrupt, PeerClient, PeerError, PeerUnavailable, ReplicaStore, serve,
)
from mtcfs.tiers.peer.limits import PIECE_BYTES
from mtcfs.tiers.peer.memory import MemoryPeer, MemoryTransport
from mtcfs.tiers.peer.service import PeerService
from mtcfs.tiers.peer.tls import TlsFiles
from mtcfs.tiers.peer.transport import Transport
from support.peer import CHUNK, LocalTier, blob, chunks_of, make_step
from support.pki import TestCa

JOB = "job"
NODES = 4
SERVER_RANK = 1
FAST = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05)


@dataclass
class Node:
    """One node's Peer service, and how to call it as some rank."""

    store: ReplicaStore
    service: PeerService
    #: connect(rank, job=JOB, as_rank=rank) -> Transport; ``as_rank`` is the rank the
    #: caller's certificate names (where the kind has certificates)
    connect: Callable[..., Transport]
    #: whether the peer checks the caller's identity (a rank mismatch is refusable)
    authenticates: bool
    made: list[Transport] = field(default_factory=list)


def _grpc(tmp_path, store: ReplicaStore, tls: bool) -> tuple[Node, Callable[[], None]]:
    ca = TestCa(tmp_path / "ca", JOB) if tls else None
    issued: dict[int, Any] = {}

    def files(rank: int) -> TlsFiles | None:
        if ca is None:
            return None
        if rank not in issued:
            issued[rank] = ca.issue_rank(JOB, rank)
        i = issued[rank]
        return TlsFiles(str(i.ca), str(i.cert), str(i.key))

    server = serve(store, "127.0.0.1:0", JOB, NODES, workers=4, tls=files(SERVER_RANK))

    def connect(rank: int, job: str = JOB, as_rank: int | None = None) -> Transport:
        return PeerClient(server.address, job, rank, timeout=5.0, stream_timeout=20.0,
                          retry=FAST, rng=random.Random(0),
                          tls=files(rank if as_rank is None else as_rank))

    return Node(store, server.service, connect, tls), lambda: server.stop(None)


def _memory(tmp_path, store: ReplicaStore, auth: bool) -> tuple[Node, Callable[[], None]]:
    peer = MemoryPeer(store, JOB, NODES, authenticate=auth, name=f"rank-{SERVER_RANK}")

    def connect(rank: int, job: str = JOB, as_rank: int | None = None) -> Transport:
        return MemoryTransport(peer, job, rank, retry=FAST, rng=random.Random(0),
                               identity=(job, rank if as_rank is None else as_rank))

    return Node(store, peer.service, connect, auth), lambda: None


#: kind -> factory(tmp_path, store) -> (node, stop)
KINDS: dict[str, Callable[[Any, ReplicaStore], tuple[Node, Callable[[], None]]]] = {
    "grpc": lambda t, s: _grpc(t, s, tls=False),
    "grpc-tls": lambda t, s: _grpc(t, s, tls=True),
    "memory": lambda t, s: _memory(t, s, auth=False),
    "memory-auth": lambda t, s: _memory(t, s, auth=True),
}


@pytest.fixture(params=sorted(KINDS))
def start(request: pytest.FixtureRequest, tmp_path):
    """``start(capacity=..., quota=..., local=...) -> Node``: the peer of rank 1 of a job of
    4, of this kind; stopped and its transports closed at the end."""
    stops: list[Callable[[], None]] = []
    nodes: list[Node] = []

    def make(*, capacity: int = 1 << 30, quota: int | None = None,
             local: LocalTier | None = None) -> Node:
        store = ReplicaStore(str(tmp_path / f"replicas-{len(nodes)}"), capacity, local=local,
                             quota=None if quota is None else (lambda: quota))
        node, stop = KINDS[request.param](tmp_path, store)
        raw_connect = node.connect

        def connect(rank: int, job: str = JOB, as_rank: int | None = None) -> Transport:
            t = raw_connect(rank, job, as_rank)
            node.made.append(t)
            return t

        node.connect = connect
        nodes.append(node)
        stops.append(stop)
        return node

    yield make
    for node in nodes:
        for t in node.made:
            t.close()
    for stop in stops:
        stop()


def assert_serving(t: Transport) -> None:
    assert t.has_chunks([chunk_hash(b"still serving?")]) == [False]


def test_both_implementations_satisfy_the_protocol(start) -> None:
    t = start().connect(0)
    assert isinstance(t, Transport)
    assert (t.job, t.rank) == (JOB, 0) and t.address


# -- chunks ----------------------------------------------------------------------------------

def test_put_then_get_is_bit_exact(start) -> None:
    node = start()
    t = node.connect(0)
    data = blob(1, 5 * CHUNK + 123)
    chunks = chunks_of(data)
    r = t.put_chunks(chunks.items())
    assert r.ok and sorted(r.accepted) == sorted(chunks) and not r.skipped
    assert (r.chunks_sent, r.bytes_sent) == (len(chunks), len(data))
    assert t.has_chunks(list(chunks)) == [True] * len(chunks)
    got = list(t.get_chunks(chunks))
    assert [h for h, _ in got] == list(chunks)            # request order
    assert b"".join(d for _, d in got) == data
    assert all(type(d) is bytes for _, d in got)
    assert node.service.stats()["bytes_received"] == len(data)
    # another rank reads them too (a restoring node asks whoever holds its data)
    assert dict(node.connect(3).get_chunks(chunks)) == chunks


def test_a_chunk_above_one_piece_travels_in_pieces(start) -> None:
    t = start().connect(0)
    big = blob(2, PIECE_BYTES + 4097)
    h = chunk_hash(big)
    assert t.put_chunks([(h, big)]).accepted == (h,)
    assert dict(t.get_chunks([h])) == {h: big}


def test_only_missing_chunks_travel_and_readers_are_called_only_for_them(start) -> None:
    node = start()
    t = node.connect(0)
    chunks = chunks_of(blob(3, 4 * CHUNK))
    first = dict(list(chunks.items())[:2])
    t.put_chunks(first.items())
    read: list[str] = []

    def reader(h: str):
        def read_it() -> bytes:
            read.append(h)
            return chunks[h]
        return read_it

    r = t.put_chunks((h, reader(h)) for h in chunks)
    assert sorted(r.skipped) == sorted(first)
    assert sorted(read) == sorted(set(chunks) - set(first))
    assert (r.chunks_sent, r.bytes_sent) == (2, 2 * CHUNK)
    assert node.service.stats()["bytes_received"] == 4 * CHUNK
    again = t.put_chunks(chunks.items())
    assert again.bytes_sent == 0 and len(again.skipped) == 4
    assert t.stats()["chunks_skipped"] == 2 + 4


def test_chunks_of_the_peers_own_tier_are_held_without_bytes(start) -> None:
    chunks = chunks_of(blob(4, 3 * CHUNK))
    node = start(local=LocalTier(chunks))
    t = node.connect(0)
    r = t.put_chunks(chunks.items())
    assert r.ok and (r.chunks_sent, r.bytes_sent) == (0, 0)
    assert dict(t.get_chunks(chunks)) == chunks


def test_missing_chunks_are_left_out(start) -> None:
    t = start().connect(0)
    held = chunks_of(blob(5, 2 * CHUNK))
    t.put_chunks(held.items())
    absent = chunk_hash(b"never stored")
    a, b = list(held)
    got = list(t.get_chunks([a, absent, b]))
    assert [h for h, _ in got] == [a, b]
    assert t.has_chunks([a, absent, b]) == [True, False, True]
    assert list(t.get_chunks([absent])) == []
    assert t.stats()["chunks_unavailable"] == 2


def test_bytes_that_do_not_match_their_digest_are_refused(start) -> None:
    node = start()
    t = node.connect(0)
    good = blob(6, CHUNK)
    h = chunk_hash(good)
    bad = bytearray(good)
    bad[100] ^= 1
    r = t.put_chunks([(h, bytes(bad))])
    assert not r.ok and r.accepted == () and r.rejected[h].startswith("DATA_LOSS")
    assert t.has_chunks([h]) == [False]
    assert list(t.get_chunks([h])) == []
    ok = t.put_chunks([(h, good)])                   # the good bytes are still welcome
    assert ok.accepted == (h,)
    r2 = t.put_chunks([(h, bytes(bad))])             # held now: skipped, nothing sent
    assert r2.skipped == (h,)
    assert dict(t.get_chunks([h])) == {h: good}


def test_a_copy_that_rotted_on_the_peer_is_never_served(start) -> None:
    node = start()
    t = node.connect(0)
    chunks = chunks_of(blob(7, 2 * CHUNK))
    t.put_chunks(chunks.items())
    rotten, fine = list(chunks)
    path = os.path.join(node.store.root, "chunks", rotten[:2], rotten)
    with open(path, "r+b") as f:
        f.seek(10)
        f.write(b"\xff\x00\xff")
    got = dict(t.get_chunks([rotten, fine]))
    assert got == {fine: chunks[fine]}                  # left out, not sent
    assert t.has_chunks([rotten]) == [False]            # and deleted by the peer
    assert node.store.stats()["corrupt_deleted"] == 1


def test_a_full_peer_refuses_the_chunks_that_do_not_fit(start) -> None:
    node = start(capacity=2 * CHUNK)
    t = node.connect(0)
    chunks = chunks_of(blob(8, 3 * CHUNK))
    r = t.put_chunks(chunks.items())
    assert len(r.accepted) == 2 and len(r.rejected) == 1
    [(h, why)] = r.rejected.items()
    assert why.startswith("RESOURCE_EXHAUSTED")
    assert t.has_chunks([h]) == [False]
    assert_serving(t)


def test_the_quota_of_a_sender_rank_is_enforced(start) -> None:
    node = start(quota=2 * CHUNK + 100)
    t0, t2 = node.connect(0), node.connect(2)
    chunks = chunks_of(blob(9, 3 * CHUNK))
    r = t0.put_chunks(chunks.items())
    assert len(r.accepted) == 2 and len(r.rejected) == 1
    [(h, why)] = r.rejected.items()
    assert why.startswith("RESOURCE_EXHAUSTED") and "rank 0's share" in why
    assert node.store.stats()["quota_refusals"] >= 1
    # another rank has its own quota: it may store the chunk rank 0 could not
    assert t2.put_chunks([(h, chunks[h])]).accepted == (h,)
    # a manifest that would take rank 0 over its quota is refused as a whole call
    with pytest.raises(PeerError) as exc:
        t0.publish_manifest(make_step(JOB, 0, 1, {"w": blob(9, 3 * CHUNK)}))
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert t0.list_manifests() == []
    assert_serving(t0)


# -- manifests -------------------------------------------------------------------------------

def test_manifests_are_stored_replaced_and_listed(start) -> None:
    t2 = start().connect(2)
    a, b = blob(10, 2 * CHUNK), blob(11, CHUNK)
    m100 = make_step(JOB, 2, 100, {"a": a})
    early = t2.publish_manifest(m100)                 # before its chunks
    assert early.chunks_total == 2 and len(early.missing) == 2 and not early.complete
    t2.put_chunks(chunks_of(a).items())
    again = t2.publish_manifest(m100)
    assert again.complete and again.replaced
    m200 = make_step(JOB, 2, 200, {"a": a, "b": b})
    t2.put_chunks(chunks_of(b).items())
    assert t2.publish_manifest(m200).complete
    infos = t2.list_manifests()
    assert [(i.rank, i.step, i.step_number, i.chunks_total, i.chunks_missing)
            for i in infos] == [(2, "100", 100, 2, 0), (2, "200", 200, 3, 0)]
    assert StepManifest.from_bytes(infos[1].manifest) == m200
    assert infos[1].manifest_bytes == len(m200.to_bytes())
    assert infos[1].total_bytes == len(a) + len(b)


def test_manifests_of_another_rank_and_of_one_step(start) -> None:
    node = start()
    t2, t0 = node.connect(2), node.connect(0)
    for n in (5, 6):
        m = make_step(JOB, 2, n, {"x": blob(n, CHUNK)})
        t2.put_chunks(chunks_of(blob(n, CHUNK)).items())
        t2.publish_manifest(m)
    only = t0.list_manifests(2, step="6", with_manifest=False)
    assert [(i.step, i.manifest) for i in only] == [("6", b"")]
    assert [i.step for i in t0.list_manifests(2)] == ["5", "6"]
    assert t0.list_manifests() == [] and t0.list_manifests(3) == []
    assert t0.list_manifests(2, step="7") == []


def test_a_manifest_of_another_rank_or_job_is_not_sent(start) -> None:
    t = start().connect(0)
    with pytest.raises(ValueError):
        t.publish_manifest(make_step(JOB, 3, 1, {"w": b"x"}))
    with pytest.raises(ValueError):
        t.publish_manifest(make_step("otherjob", 0, 1, {"w": b"x"}))
    with pytest.raises(ValueError):
        t.has_chunks(["not-a-digest"])
    with pytest.raises(ValueError):
        list(t.get_chunks(["ABC"]))
    assert_serving(t)


# -- whole calls refused ---------------------------------------------------------------------

def test_another_job_is_failed_precondition(start) -> None:
    node = start()
    if node.authenticates:
        # a certificate names its job: the caller is refused before the job is compared
        pytest.skip("with authentication the certificate of another job is refused first")
    t = node.connect(0, job="otherjob")
    for call in (lambda: t.has_chunks([chunk_hash(b"x")]), lambda: t.list_manifests(),
                 lambda: list(t.get_chunks([chunk_hash(b"x")])),
                 lambda: t.put_chunks([(chunk_hash(b"x"), b"x")])):
        with pytest.raises(PeerError) as exc:
            call()
        assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert_serving(node.connect(0))


@pytest.mark.parametrize("rank", [-1, NODES])
def test_a_rank_outside_the_job_is_invalid_argument(start, rank: int) -> None:
    node = start()
    if node.authenticates:
        pytest.skip("no certificate names a rank outside the job")
    t = node.connect(rank)
    with pytest.raises(PeerError) as exc:
        t.has_chunks([chunk_hash(b"x")])
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(PeerError) as exc:
        node.connect(0).list_manifests(rank)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert_serving(node.connect(0))


def test_a_rank_calls_only_as_itself(start) -> None:
    node = start()
    if not node.authenticates:
        pytest.skip("without authentication a request's rank is taken as it says")
    liar = node.connect(2, as_rank=3)                # rank 3's certificate, says rank 2
    chunks = chunks_of(blob(12, CHUNK))
    for call in (lambda: liar.has_chunks(list(chunks)),
                 lambda: liar.put_chunks(chunks.items()),
                 lambda: liar.list_manifests(2),
                 lambda: list(liar.get_chunks(chunks))):
        with pytest.raises(PeerError) as exc:
            call()
        assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert node.store.stats()["chunks"] == 0
    assert node.service.stats()["calls_denied"] >= 4
    assert_serving(node.connect(3))


def test_a_cut_off_rank_is_unavailable_after_the_retries(start) -> None:
    node = start()
    t = node.connect(0)
    node.service.partitioned.add(0)
    with pytest.raises(PeerUnavailable) as exc:
        t.has_chunks([chunk_hash(b"x")])
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE
    assert t.stats()["retries"] == FAST.max_attempts - 1
    node.service.partitioned.discard(0)
    assert_serving(t)


def test_a_peer_serving_bad_bytes_is_caught_by_the_caller(start) -> None:
    """The caller re-hashes what arrives. A peer's own tier that hands out wrong bytes
    (the replica store checks them too) is the one way to make an honest server send any:
    both sides must refuse, so the caller sees no bytes, or PeerChunkCorrupt."""
    good = blob(13, CHUNK)
    h = chunk_hash(good)
    node = start(local=LocalTier({h: good[:-1] + b"\x00"}))
    t = node.connect(0)
    try:
        got = dict(t.get_chunks([h]))
    except PeerChunkCorrupt as exc:
        assert exc.chunk == h
    else:
        assert got == {}
