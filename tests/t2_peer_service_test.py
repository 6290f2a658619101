"""Tier-2 tests of the Peer service: real grpc servers on loopback, real clients, no mocks.

Several servers (one per "node", each with its own replica store) on free 127.0.0.1 ports.
Bad input is sent through the generated stub directly where the client would refuse to send
it; every refusal must be a clear gRPC status, and the server must keep serving afterwards.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from mtcfs.base.chunking import chunk_hash
from mtcfs.base.manifest import Entry, StepManifest
from mtcfs.tiers.backup.retry import RetryPolicy
from mtcfs.tiers.peer import (
    PeerChunkCorrupt, PeerClient, PeerError, PeerUnavailable, ReplicaStore, serve,
)
from mtcfs.tiers.peer._pb import mtcfs_peer_pb2 as pb
from mtcfs.tiers.peer._pb import mtcfs_peer_pb2_grpc as pb_grpc
from mtcfs.tiers.peer.limits import MAX_MESSAGE_BYTES, PIECE_BYTES
from support.peer import CHUNK, LocalTier, blob, chunks_of, make_step
from support.ports import free_port

JOB = "job"
NODES = 4
FAST = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05)


@pytest.fixture
def cluster(tmp_path):
    """``cluster(rank, local=None, capacity=...) -> PeerServer``; all stopped at the end."""
    servers = []

    def start(rank: int, *, local: LocalTier | None = None, capacity: int = 1 << 30):
        store = ReplicaStore(str(tmp_path / f"node{rank}-{len(servers)}"), capacity,
                             local=local)
        s = serve(store, "127.0.0.1:0", JOB, NODES, workers=4)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop(None)


@pytest.fixture
def clients():
    """``clients(address, rank, job=JOB) -> PeerClient``; all closed at the end."""
    made = []

    def make(address: str, rank: int, job: str = JOB) -> PeerClient:
        c = PeerClient(address, job, rank, timeout=5.0, stream_timeout=20.0, retry=FAST,
                       rng=random.Random(0))
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def stub(address: str) -> tuple[grpc.Channel, pb_grpc.PeerStub]:
    ch = grpc.insecure_channel(address)  # default limits: sends anything
    return ch, pb_grpc.PeerStub(ch)


def assert_serving(client: PeerClient) -> None:
    """The server still answers a well-formed call."""
    assert client.has_chunks([chunk_hash(b"still here?")]) == [False]


# -- replication ----------------------------------------------------------------------------

def test_put_sends_only_missing_chunks(cluster, clients):
    b = cluster(1)
    c0 = clients(b.address, 0)
    data = blob(1, 4 * CHUNK)
    chunks = chunks_of(data)
    first_two = dict(list(chunks.items())[:2])
    r1 = c0.put_chunks(first_two.items())
    assert r1.ok and sorted(r1.accepted) == sorted(first_two)
    assert (r1.chunks_sent, r1.bytes_sent) == (2, 2 * CHUNK)

    loads = []

    def lazy(h: str):
        def read() -> bytes:
            loads.append(h)
            return chunks[h]
        return read

    r2 = c0.put_chunks((h, lazy(h)) for h in chunks)
    assert sorted(r2.skipped) == sorted(first_two)
    assert (r2.chunks_sent, r2.bytes_sent) == (2, 2 * CHUNK)
    assert sorted(loads) == sorted(set(chunks) - set(first_two))  # held chunks never read
    assert b.service.stats()["bytes_received"] == 4 * CHUNK
    m = make_step(JOB, 0, 100, {"w.bin": data})
    assert c0.publish_manifest(m).complete


def test_data_parallel_replicas_move_hashes_not_bytes(cluster, clients):
    data = blob(2, 6 * CHUNK)                  # identical on ranks 0 and 2 (D=2, N=4)
    chunks = chunks_of(data)
    # rank 2 wrote the same data itself: its own tier holds it
    node2 = cluster(2, local=LocalTier(chunks))
    c0 = clients(node2.address, 0)
    r = c0.put_chunks(chunks.items())
    assert r.ok and sorted(r.skipped) == sorted(chunks)
    assert (r.chunks_sent, r.bytes_sent) == (0, 0)
    assert node2.service.stats()["bytes_received"] == 0
    assert c0.stats()["bytes_sent"] == 0
    res = c0.publish_manifest(make_step(JOB, 0, 100, {"w.bin": data}))
    assert res.complete and res.chunks_total == 6
    # verified both ways: what rank 2 serves hashes to the names rank 0 has
    got = dict(c0.get_chunks(chunks))
    assert got == chunks

    # a replica already held for another rank also dedups (rank 1 and rank 3 identical)
    node0 = cluster(0)
    c1, c3 = clients(node0.address, 1), clients(node0.address, 3)
    assert c1.put_chunks(chunks.items()).bytes_sent == 6 * CHUNK
    r3 = c3.put_chunks(chunks.items())
    assert r3.bytes_sent == 0 and len(r3.skipped) == 6
    assert node0.service.stats()["bytes_received"] == 6 * CHUNK


def test_get_chunks_is_verified_and_skips_what_the_peer_lacks(cluster, clients):
    b = cluster(1)
    c0 = clients(b.address, 0)
    chunks = chunks_of(blob(3, 5 * CHUNK))
    c0.put_chunks(chunks.items())
    names = list(chunks)
    absent = chunk_hash(b"never stored")
    # corrupt one replica on B's disk
    victim = names[2]
    path = f"{b.service.store.root}/chunks/{victim[:2]}/{victim}"
    with open(path, "r+b") as f:
        f.write(b"\0" * 8)
    got = list(c0.get_chunks(names + [absent]))
    assert [h for h, _ in got] == [h for h in names if h != victim]
    assert all(chunks[h] == d for h, d in got)
    assert c0.stats()["chunks_unavailable"] == 2
    assert b.service.store.stats()["corrupt_deleted"] == 1
    assert c0.has_chunks([victim, names[0]]) == [False, True]


def test_large_chunks_travel_in_pieces(cluster, clients):
    b = cluster(1)
    c0 = clients(b.address, 0)
    big = blob(4, PIECE_BYTES + 12345)
    h = chunk_hash(big)
    r = c0.put_chunks([(h, big)])
    assert r.ok and r.bytes_sent == len(big)
    assert dict(c0.get_chunks([h])) == {h: big}


def test_client_detects_a_peer_serving_bad_bytes(clients):
    good = blob(5, CHUNK)
    h = chunk_hash(good)

    class Rogue(pb_grpc.PeerServicer):
        """A peer whose RAM flipped a bit after it verified the chunk."""

        def GetChunks(self, request, context):
            bad = bytearray(good)
            bad[7] ^= 0x40
            yield pb.GetChunksReply(piece=pb.ChunkPiece(digest=h, offset=0,
                                                        total_size=len(bad), data=bytes(bad)))

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PeerServicer_to_server(Rogue(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        c = clients(f"127.0.0.1:{port}", 0)
        with pytest.raises(PeerChunkCorrupt) as exc:
            list(c.get_chunks([h]))
        assert exc.value.peer == f"127.0.0.1:{port}" and exc.value.chunk == h
        assert f"127.0.0.1:{port}" in str(exc.value)
        assert c.stats()["chunks_corrupt"] == 1
        c.close()
    finally:
        server.stop(None)


def test_manifests_listed_with_completeness(cluster, clients):
    b = cluster(1)
    c2 = clients(b.address, 2)
    files = {"a": blob(6, 2 * CHUNK)}
    m100 = make_step(JOB, 2, 100, files)
    early = c2.publish_manifest(m100)        # before its chunks: lists what is missing
    assert len(early.missing) == 2
    c2.put_chunks(chunks_of(files["a"]).items())
    m200 = make_step(JOB, 2, 200, {"a": files["a"], "b": blob(7, CHUNK)})
    c2.put_chunks(chunks_of(blob(7, CHUNK)).items())
    assert c2.publish_manifest(m200).complete
    infos = c2.list_manifests()
    assert [(i.step, i.chunks_total, i.chunks_missing) for i in infos] == \
        [("100", 2, 0), ("200", 3, 0)]
    assert StepManifest.from_bytes(infos[1].manifest) == m200
    # another rank asks for rank 2's manifests (a coordinator, a restoring node)
    only = clients(b.address, 0).list_manifests(2, step="200", with_manifest=False)
    assert [(i.step, i.manifest) for i in only] == [("200", b"")]
    assert clients(b.address, 0).list_manifests(3) == []


def test_unreachable_peer_is_unavailable_after_retries(clients):
    port = free_port()
    c = clients(f"127.0.0.1:{port}", 0)
    with pytest.raises(PeerUnavailable) as exc:
        c.has_chunks([chunk_hash(b"x")])
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE
    assert c.stats()["retries"] == FAST.max_attempts - 1


def test_a_peer_that_comes_up_late_is_reached_within_seconds(tmp_path):
    """Calls to a peer not listening yet fail for 10 s; once the peer listens, calls reach it
    within 3.5 s (the reconnect backoff is capped at 2 s). With grpc's default backoff (1 s,
    growing by 1.6x up to 120 s) the channel, after those 10 s, failed every call at once for
    about 5 s more (measured 4.7 s), and for minutes after a longer outage."""
    port = free_port()
    c = PeerClient(f"127.0.0.1:{port}", JOB, 1, timeout=5.0, stream_timeout=20.0)
    server = None
    try:
        down_until = time.monotonic() + 10
        while time.monotonic() < down_until:
            with pytest.raises(PeerUnavailable):
                c.has_chunks([chunk_hash(b"x")])
        server = serve(ReplicaStore(str(tmp_path / "late"), 1 << 20), f"127.0.0.1:{port}",
                       JOB, NODES, workers=2)
        up = time.monotonic()
        while True:
            try:
                assert c.has_chunks([chunk_hash(b"x")]) == [False]
                break
            except PeerUnavailable:
                assert time.monotonic() - up < 3.5, "the peer was not reached within 3.5 s"
    finally:
        c.close()
        if server is not None:
            server.stop(None)


# -- bad input ------------------------------------------------------------------------------

def test_wrong_hash_is_rejected_and_not_stored(cluster, clients):
    b = cluster(1)
    c0 = clients(b.address, 0)
    good, liar = blob(8, CHUNK), blob(9, CHUNK)
    h_good, h_liar = chunk_hash(good), chunk_hash(blob(10, CHUNK))
    r = c0.put_chunks([(h_liar, liar), (h_good, good)])
    assert list(r.rejected) == [h_liar] and r.rejected[h_liar].startswith("DATA_LOSS")
    assert list(r.accepted) == [h_good]
    assert c0.has_chunks([h_liar, h_good]) == [False, True]
    assert b.service.stats()["chunks_rejected"] == 1
    assert b.service.store.stats()["chunks"] == 1


def test_oversized_message_is_resource_exhausted(cluster, clients):
    b = cluster(1)
    ch, st = stub(b.address)
    try:
        big = b"\0" * (MAX_MESSAGE_BYTES + 1)
        req = pb.PutChunksRequest(job=JOB, rank=0, piece=pb.ChunkPiece(
            digest=chunk_hash(big), offset=0, total_size=len(big), data=big))
        with pytest.raises(grpc.RpcError) as exc:
            st.PutChunks(iter([req]), timeout=20)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        ch.close()
    assert b.service.store.stats()["chunks"] == 0
    assert_serving(clients(b.address, 0))


def test_unknown_job_is_failed_precondition(cluster, clients):
    b = cluster(1)
    other = clients(b.address, 0, job="another-job")
    for call in (lambda: other.has_chunks([chunk_hash(b"x")]),
                 lambda: other.put_chunks([(chunk_hash(b"x"), b"x")]),
                 lambda: list(other.get_chunks([chunk_hash(b"x")])),
                 lambda: other.list_manifests()):
        with pytest.raises(PeerError) as exc:
            call()
        assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "another job" in str(exc.value)
        assert repr(JOB) not in str(exc.value)  # this job's name is not told to strangers
    assert b.service.stats()["calls_refused"] == 4
    assert b.service.store.stats()["chunks"] == 0
    assert_serving(clients(b.address, 0))


@pytest.mark.parametrize("rank", [NODES, -1])
def test_rank_out_of_range_is_invalid_argument(cluster, clients, rank):
    b = cluster(1)
    bad = clients(b.address, rank)
    with pytest.raises(PeerError) as exc:
        bad.put_chunks([(chunk_hash(b"x"), b"x")])
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(PeerError) as exc:
        bad.list_manifests(of_rank=0)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(PeerError) as exc:
        clients(b.address, 0).list_manifests(of_rank=rank)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert_serving(clients(b.address, 0))


def test_manifest_escaping_the_job_is_invalid_argument(cluster, clients):
    b = cluster(1)
    c0 = clients(b.address, 0)
    escapes = [
        [Entry(path="100", kind="dir", mode=0o755, mtime_ns=1),
         Entry(path="100/../../../etc/cron.d/x", kind="file", mode=0o644, mtime_ns=1)],
        [Entry(path="/etc/passwd", kind="file", mode=0o644, mtime_ns=1)],
        [Entry(path="100", kind="dir", mode=0o755, mtime_ns=1),
         Entry(path="other_step/x", kind="file", mode=0o644, mtime_ns=1)],
    ]
    for entries in escapes:
        m = StepManifest(job=JOB, step="100", step_number=100, created_ns=1, entries=entries,
                         rank=0)
        with pytest.raises(PeerError) as exc:
            c0.publish_manifest(m)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT, entries
    ch, st = stub(b.address)
    try:
        good = make_step(JOB, 0, 100, {"f": b"x"})
        f = {"f": b"x"}
        cases = {  # what: (step, step_number, manifest bytes)
            "step name escaping": ("../100", 100, make_step(JOB, 0, 100, f, step="..")),
            "other job in body": ("100", 100, make_step("other", 0, 100, f)),
            "other rank in body": ("100", 100, make_step(JOB, 3, 100, f)),
            "step mismatch": ("200", 200, good),
            "not json": ("100", 100, None),
        }
        for what, (step, number, m) in cases.items():
            raw = m.to_bytes() if m is not None else b"\x00garbage"
            with pytest.raises(grpc.RpcError) as exc:
                st.PublishManifest(pb.PublishManifestRequest(
                    job=JOB, rank=0, step=step, step_number=number, manifest=raw), timeout=5)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
    finally:
        ch.close()
    assert b.service.store.list_manifests() == []
    assert_serving(c0)
    assert c0.publish_manifest(make_step(JOB, 0, 100, {"f": b"x"})).chunks_total == 1


def test_malformed_requests_are_invalid_argument(cluster, clients):
    b = cluster(1)
    ch, st = stub(b.address)
    data = blob(11, 1000)
    h = chunk_hash(data)

    def put(*pieces_):
        return st.PutChunks(iter(pb.PutChunksRequest(job=JOB, rank=0, piece=p)
                                 for p in pieces_), timeout=5)

    try:
        cases = {
            "bad digest": lambda: st.HasChunks(pb.HasChunksRequest(
                job=JOB, rank=0, digests=["not-a-digest"]), timeout=5),
            "too many digests": lambda: st.HasChunks(pb.HasChunksRequest(
                job=JOB, rank=0, digests=[h] * 65537), timeout=5),
            "piece out of order": lambda: put(
                pb.ChunkPiece(digest=h, offset=0, total_size=1000, data=data[:400]),
                pb.ChunkPiece(digest=h, offset=500, total_size=1000, data=data[500:])),
            "pieces beyond size": lambda: put(
                pb.ChunkPiece(digest=h, offset=0, total_size=10, data=data[:400])),
            "chunk above 256 MiB": lambda: put(
                pb.ChunkPiece(digest=h, offset=0, total_size=(256 << 20) + 1, data=b"")),
            "path as digest": lambda: list(st.GetChunks(pb.GetChunksRequest(
                job=JOB, rank=0, digests=["../../etc/passwd"]), timeout=5)),
        }
        for what, call in cases.items():
            with pytest.raises(grpc.RpcError) as exc:
                call()
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
        # a stream that ends mid-chunk: that chunk is rejected, the call itself succeeds
        reply = put(pb.ChunkPiece(digest=h, offset=0, total_size=1000, data=data[:400]))
        assert [r.digest for r in reply.rejected] == [h] and not reply.accepted
        assert reply.rejected[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    finally:
        ch.close()
    assert b.service.store.stats()["chunks"] == 0
    assert b.service.store.stats()["used_bytes"] == 0
    assert_serving(clients(b.address, 0))


def test_full_peer_rejects_chunks_it_cannot_hold(cluster, clients):
    b = cluster(1, capacity=2 * CHUNK)
    c0 = clients(b.address, 0)
    chunks = chunks_of(blob(12, 3 * CHUNK))
    r = c0.put_chunks(chunks.items())
    assert len(r.accepted) == 2 and len(r.rejected) == 1
    [(h, why)] = r.rejected.items()
    assert why.startswith("RESOURCE_EXHAUSTED") and "full" in why
    assert c0.has_chunks([h]) == [False]
    with pytest.raises(PeerError) as exc:
        c0.publish_manifest(make_step(JOB, 0, 1, {"w": blob(12, 3 * CHUNK)}))
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_serving(c0)


def test_cancelled_put_leaves_nothing_behind(cluster, clients):
    b = cluster(1)
    store = b.service.store
    data = blob(13, 3 * CHUNK)
    h = chunk_hash(data)
    sent = threading.Event()
    release = threading.Event()

    def requests():
        yield pb.PutChunksRequest(job=JOB, rank=0, piece=pb.ChunkPiece(
            digest=h, offset=0, total_size=len(data), data=data[:CHUNK]))
        sent.set()
        release.wait(10)

    ch, st = stub(b.address)
    try:
        fut = st.PutChunks.future(requests(), timeout=20)
        assert sent.wait(5)
        deadline = time.monotonic() + 5
        while store.used == 0 and time.monotonic() < deadline:  # the writer is open
            time.sleep(0.01)
        assert store.used == len(data)
        fut.cancel()
        release.set()
        deadline = time.monotonic() + 5
        while store.used and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        release.set()
        ch.close()
    assert store.used == 0 and store.stats()["chunks"] == 0
    assert os.listdir(f"{store.root}/tmp") == []
    assert_serving(clients(b.address, 0))
