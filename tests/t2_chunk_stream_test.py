"""Tier-2 tests of the chunk stream (mtcfs/tiers/peer/chunk_stream.py): real Peer servers on
loopback, a real TCP stream beside each, real clients, real TLS where it is on.

What a user relies on: the chunks come back bit-exact and in order; nothing that does not
hash to its name is handed over, whichever side damaged it; a ticket opens one stream for
the rank it was issued to, once; a stream that stalls ends with a clear error instead of
holding a restore; a server without the stream is still read (GetChunks).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from mtcfs.base.chunking import chunk_hash
from mtcfs.base.pki import JobCa
from mtcfs.tiers.backup.retry import RetryPolicy
from mtcfs.tiers.peer import PeerChunkCorrupt, PeerClient, PeerError, PeerUnavailable
from mtcfs.tiers.peer import ReplicaStore, serve
from mtcfs.tiers.peer.chunk_stream import (
    HEADER, OK, ChunkStreamServer, client_context, read_stream,
)
from mtcfs.tiers.peer.replica_store import OpenedChunk
from mtcfs.tiers.peer.tls import TlsFiles
from support.peer import blob

JOB = "job"
NODES = 4
FAST = RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.05)
SIZE = 1 << 20  # 1 MiB chunks: several socket buffers each


def _stored(store: ReplicaStore, n: int, seed: int = 1) -> list[tuple[str, bytes]]:
    out = []
    for i in range(n):
        data = blob(seed * 1000 + i, SIZE + i)  # sizes differ: each chunk is framed right
        h = chunk_hash(data)
        store.put_chunk(h, data)
        out.append((h, data))
    return out


@pytest.fixture
def peer(tmp_path):
    """``peer(chunk_stream=True, tls=None) -> (server, store)``; all stopped at the end."""
    servers = []

    def start(*, chunk_stream: bool = True, tls: TlsFiles | None = None):
        store = ReplicaStore(str(tmp_path / f"store{len(servers)}"), 1 << 30)
        s = serve(store, "127.0.0.1:0", JOB, NODES, workers=4, tls=tls,
                  chunk_stream=chunk_stream)
        servers.append(s)
        return s, store

    yield start
    for s in servers:
        s.stop(None)


@pytest.fixture
def client():
    made = []

    def make(address: str, rank: int = 1, tls: TlsFiles | None = None) -> PeerClient:
        c = PeerClient(address, JOB, rank, timeout=5.0, stream_timeout=5.0, retry=FAST,
                       rng=random.Random(0), tls=tls)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_chunks_come_back_bit_exact_in_order_by_the_stream(peer, client):
    server, store = peer()
    chunks = _stored(store, 6)
    missing = chunk_hash(b"never stored")
    asked = [chunks[3][0], missing, *[h for h, _ in chunks]]
    c = client(server.address)
    got = [(h, None if v is None else bytes(v)) for h, v in c.stream_chunks(asked)]
    want = {h: d for h, d in chunks}
    # each digest once, in the order asked; the one not held is None
    assert [h for h, _ in got] == list(dict.fromkeys(asked))
    assert dict(got) == {**want, missing: None}
    st = server.service.stats()
    assert st["streams"] == 1 and st["chunks_sent"] == 6
    assert st["bytes_sent"] == sum(len(d) for d in want.values())
    assert c.stats()["streams"] == 1


def test_a_view_stays_valid_for_as_many_items_as_there_are_buffers(peer, client):
    server, store = peer()
    chunks = _stored(store, 7)
    c = client(server.address)
    seen: list[tuple[str, memoryview]] = []
    for h, view in c.stream_chunks([h for h, _ in chunks], buffers=3):
        seen.append((h, view))
        # the two items before this one are still intact (3 buffers in turn)
        for h_old, v_old in seen[-3:]:
            assert chunk_hash(v_old) == h_old
    assert len(seen) == 7


def test_a_replica_damaged_on_disk_is_not_sent_and_is_deleted(peer, client):
    server, store = peer()
    chunks = _stored(store, 3)
    bad, _ = chunks[1]
    path = os.path.join(store.root, "chunks", bad[:2], bad)
    with open(path, "r+b") as f:  # one flipped byte in the middle
        f.seek(SIZE // 2)
        b = f.read(1)
        f.seek(SIZE // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    c = client(server.address)
    got = dict((h, None if v is None else bytes(v))
               for h, v in c.stream_chunks([h for h, _ in chunks]))
    assert got[bad] is None
    assert got[chunks[0][0]] == chunks[0][1] and got[chunks[2][0]] == chunks[2][1]
    assert not store.has(bad) and not os.path.exists(path)
    assert store.stats()["corrupt_deleted"] == 1


class _Liar:
    """A store whose open_chunk hands out other bytes than the chunk's (a server bug, or
    memory that flipped after its check)."""

    def __init__(self, digest: str) -> None:
        self.digest = digest

    @contextlib.contextmanager
    def open_chunk(self, h: str) -> Iterator[OpenedChunk]:
        yield OpenedChunk(memoryview(b"x" * 1000), None)


def _ticketed(server: ChunkStreamServer, digests: list[str], rank: int = 1) -> bytes:
    return server.issue(rank, digests)


def test_bytes_that_do_not_hash_to_their_name_are_never_handed_over():
    h = chunk_hash(b"the real bytes")
    s = ChunkStreamServer(_Liar(h), "127.0.0.1", JOB)
    try:
        ticket = _ticketed(s, [h])
        out = []
        with pytest.raises(PeerChunkCorrupt, match="hash to"):
            for item in read_stream("liar", "127.0.0.1", s.port, ticket, [h], job=JOB):
                out.append(item)
        assert out == []
    finally:
        s.stop()


def test_a_ticket_opens_one_stream_and_expires(tmp_path):
    store = ReplicaStore(str(tmp_path / "s"), 1 << 30)
    [(h, data)] = _stored(store, 1)
    now = [100.0]
    s = ChunkStreamServer(store, "127.0.0.1", JOB, clock=lambda: now[0])
    try:
        ticket = _ticketed(s, [h])
        [(got_h, view)] = list(read_stream("p", "127.0.0.1", s.port, ticket, [h], job=JOB))
        assert got_h == h and bytes(view) == data
        with pytest.raises(PeerError, match="unknown, used or expired ticket"):
            list(read_stream("p", "127.0.0.1", s.port, ticket, [h], job=JOB))
        late = _ticketed(s, [h])
        now[0] += 61
        with pytest.raises(PeerError, match="unknown, used or expired ticket"):
            list(read_stream("p", "127.0.0.1", s.port, late, [h], job=JOB))
        # something that is not a chunk stream at all gets a reason, and the server serves on
        with socket.create_connection(("127.0.0.1", s.port), timeout=5) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(10))
            head = raw.recv(HEADER.size, socket.MSG_WAITALL)
            assert HEADER.unpack(head)[0] != OK
        fresh = _ticketed(s, [h])
        assert bytes(list(read_stream("p", "127.0.0.1", s.port, fresh, [h],
                                      job=JOB))[0][1]) == data
        assert s._counters.get("streams_refused") == 3
    finally:
        s.stop()


def test_a_stream_that_stalls_ends_with_a_clear_error():
    """A holder that accepts and then sends nothing (stopped, or behind a partition that
    drops packets) costs the reader its timeout, not forever."""
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    held = []
    t = threading.Thread(target=lambda: held.append(lsock.accept()), daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable, match="timed out"):
            list(read_stream("stuck", "127.0.0.1", port, bytes(16), [chunk_hash(b"a")],
                             job=JOB, timeout=0.5))
        assert time.monotonic() - t0 < 5
    finally:
        lsock.close()
        for conn, _ in held:
            conn.close()


def test_a_closed_port_is_unavailable_not_a_hang():
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(PeerUnavailable, match="chunk stream port"):
        list(read_stream("gone", "127.0.0.1", port, bytes(16), [chunk_hash(b"a")], job=JOB,
                         timeout=2))


def test_a_server_without_the_stream_is_read_by_getchunks(peer, client):
    server, store = peer(chunk_stream=False)
    chunks = _stored(store, 3)
    c = client(server.address)
    got = dict((h, None if v is None else bytes(v))
               for h, v in c.stream_chunks([h for h, _ in chunks]))
    assert got == dict(chunks)
    assert c.stats()["streams"] == 0 and server.service.stats()["streams"] == 0
    assert server.service.stats()["chunks_sent"] == 3  # by GetChunks


def test_with_tls_only_the_ticket_rank_reads(peer, client, tmp_path):
    ca = JobCa(tmp_path / "pki", JOB)
    files = {r: ca.issue_rank(JOB, r) for r in (0, 1, 2)}

    def tls(r: int) -> TlsFiles:
        return TlsFiles(str(files[r].ca), str(files[r].cert), str(files[r].key))

    server, store = peer(tls=tls(0))
    chunks = _stored(store, 2)
    c = client(server.address, rank=1, tls=tls(1))
    got = dict((h, bytes(v)) for h, v in c.stream_chunks([h for h, _ in chunks]))
    assert got == dict(chunks)
    cs = server.service.chunk_stream
    assert cs is not None and cs.tls
    # rank 2's certificate with a ticket issued to rank 1: refused
    ticket = cs.issue(1, [chunks[0][0]])
    host, port = "127.0.0.1", cs.port
    with pytest.raises(PeerError, match="not rank 1's"):
        list(read_stream("p", host, port, ticket, [chunks[0][0]], job=JOB,
                         tls=client_context(tls(2))))
    # no certificate at all: the handshake fails
    ticket = cs.issue(1, [chunks[0][0]])
    with pytest.raises(PeerError):
        list(read_stream("p", host, port, ticket, [chunks[0][0]], job=JOB, tls=None))


# -- puts -------------------------------------------------------------------------------------

def test_a_put_by_the_stream_stores_verified_chunks_and_refuses_the_rest(peer, client):
    server, store = peer()
    good = [blob(50 + i, SIZE) for i in range(4)]
    liar = blob(60, SIZE)
    h_liar = chunk_hash(blob(61, SIZE))

    def unreadable() -> bytes:
        raise OSError(5, "Input/output error")

    h_unread = chunk_hash(b"never read")
    c = client(server.address, rank=1)
    items = [(chunk_hash(d), d) for d in good]
    r = c.put_chunks([items[0], (h_liar, liar), (h_unread, unreadable), *items[1:]])
    assert sorted(r.accepted) == sorted(h for h, _ in items)
    assert r.rejected[h_liar].startswith("DATA_LOSS")
    assert r.rejected[h_unread].startswith("LOCAL_READ_ERROR")
    assert r.chunks_sent == 5 and r.bytes_sent == 5 * SIZE
    for h, d in items:
        with store.open_chunk(h) as got:
            assert bytes(got.view) == d
    assert not store.has(h_liar) and not store.has(h_unread)
    st = server.service.stats()
    assert st["streams"] == 1 and st["chunks_received"] == 4 and st["chunks_rejected"] == 1
    assert store.stats()["used_bytes"] == 4 * SIZE  # nothing of the refused one is kept


def test_a_put_stream_cut_in_the_middle_leaves_nothing_behind(peer):
    server, store = peer()
    data = blob(70, 4 * SIZE)
    h = chunk_hash(data)
    cs = server.service.chunk_stream
    ticket = cs.issue(1, [h], put=True)
    with socket.create_connection(("127.0.0.1", cs.port), timeout=5) as s:
        s.sendall(b"MTCFSCS1" + ticket + HEADER.pack(OK, bytes.fromhex(h), len(data)))
        s.sendall(data[:SIZE])
        deadline = time.monotonic() + 5
        while store.used == 0 and time.monotonic() < deadline:  # the writer is open
            time.sleep(0.01)
        assert store.used == len(data)
    deadline = time.monotonic() + 5
    while store.used and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.used == 0 and not store.has(h)


def test_a_full_store_refuses_a_streamed_chunk_and_serves_on(tmp_path, client):
    store = ReplicaStore(str(tmp_path / "small"), 2 * SIZE)
    server = serve(store, "127.0.0.1:0", JOB, NODES, workers=2)
    try:
        chunks = [blob(80 + i, SIZE) for i in range(3)]
        c = client(server.address)
        r = c.put_chunks([(chunk_hash(d), d) for d in chunks])
        assert len(r.accepted) == 2 and len(r.rejected) == 1
        [(h, why)] = r.rejected.items()
        assert why.startswith("RESOURCE_EXHAUSTED") and not store.has(h)
        assert c.has_chunks([chunk_hash(chunks[0])]) in ([True], [False])  # still serving
    finally:
        server.stop(None)


def test_a_server_without_the_stream_takes_puts_by_putchunks(peer, client):
    server, store = peer(chunk_stream=False)
    d = blob(90, SIZE)
    c = client(server.address)
    r = c.put_chunks([(chunk_hash(d), d), (chunk_hash(b"other"), b"lie")])
    assert list(r.accepted) == [chunk_hash(d)]
    assert list(r.rejected.values())[0].startswith("DATA_LOSS")
    assert c.stats()["streams"] == 0 and server.service.stats()["chunks_received"] == 1


def test_a_truncated_replica_is_corrupt_not_a_crash(peer, client):
    """A chunk file cut short on disk (damage from outside mtcfs) is found by its size
    before it is mapped: never sent, deleted, and the server serves on."""
    server, store = peer()
    chunks = _stored(store, 2)
    bad, _ = chunks[0]
    os.truncate(os.path.join(store.root, "chunks", bad[:2], bad), SIZE // 3)
    c = client(server.address)
    got = dict((h, None if v is None else bytes(v))
               for h, v in c.stream_chunks([h for h, _ in chunks]))
    assert got == {bad: None, chunks[1][0]: chunks[1][1]}
    assert not store.has(bad) and store.stats()["corrupt_deleted"] == 1
