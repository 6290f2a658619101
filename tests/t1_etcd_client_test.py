"""Tier-1 tests of the etcd client (mtcfs/tiers/coord/etcd.py) against a real etcd on
loopback: KV, create-if-absent transactions, leases that expire, watches that deliver in
revision order and resume, failover between members, and a clear error at the deadline."""

from __future__ import annotations

import threading
import time

import pytest

from mtcfs.tiers.coord.etcd import (
    Etcd, EtcdCompacted, EtcdUnavailable, absent, prefix_end, put_op,
)
from support.etcd import EtcdCluster, etcd_prefix, etcd_server  # noqa: F401 (fixtures)


@pytest.fixture
def client(etcd_server):  # noqa: F811
    c = Etcd(etcd_server.endpoints)
    yield c
    c.close()


def test_prefix_end():
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


def test_put_get_range_delete(client, etcd_prefix):  # noqa: F811
    p = etcd_prefix.encode()
    r1 = client.put(p + b"k1", b"v1")
    r2 = client.put(p + b"k2", b"v2")
    assert r2 > r1
    kv, rev = client.get(p + b"k1")
    assert kv is not None and kv.value == b"v1" and kv.create_revision == r1 and rev >= r2
    kvs, _rev, more, _n = client.range(p, prefix_end(p), sort_create=True)
    assert [k.key for k in kvs] == [p + b"k1", p + b"k2"] and not more
    assert client.delete(p, prefix_end(p)) == 2
    assert client.get(p + b"k1")[0] is None
    assert client.revision() >= r2


def test_create_if_absent_has_one_winner(client, etcd_prefix):  # noqa: F811
    key = (etcd_prefix + "decision").encode()
    wins = []

    def claim(i: int) -> None:
        r = client.txn([absent(key)], [put_op(key, str(i).encode())], retry=True)
        if r.succeeded:
            wins.append(i)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert client.get(key)[0].value == str(wins[0]).encode()


def test_a_lease_keeps_its_key_until_it_expires(client, etcd_prefix):  # noqa: F811
    key = (etcd_prefix + "member").encode()
    lease, ttl = client.grant(2)
    assert ttl == 2
    client.put(key, b"alive", lease=lease)
    for _ in range(3):
        time.sleep(1)
        assert client.keepalive(lease) > 0
    assert client.get(key)[0] is not None
    deadline = time.monotonic() + 10
    while client.get(key)[0] is not None:
        assert time.monotonic() < deadline, "a lease not renewed never expired"
        time.sleep(0.2)
    assert client.keepalive(lease) <= 0


def test_watch_delivers_in_order_from_a_revision(client, etcd_prefix):  # noqa: F811
    p = etcd_prefix.encode()
    first = client.put(p + b"0", b"0")
    for i in range(1, 20):
        client.put(p + str(i).encode(), str(i).encode())
    stop = threading.Event()
    seen: list[bytes] = []
    for batch in client.watch(p, prefix_end(p), first, stop=stop):
        seen += [e.kv.value for e in batch.events]
        if len(seen) >= 20:
            stop.set()
    assert seen == [str(i).encode() for i in range(20)]


def test_watch_of_compacted_history_says_so(client, etcd_prefix):  # noqa: F811
    p = etcd_prefix.encode()
    old = client.put(p + b"a", b"1")
    client.put(p + b"a", b"2")
    now = client.put(p + b"a", b"3")
    client.compact(now)
    with pytest.raises(EtcdCompacted):
        for _ in client.watch(p, prefix_end(p), old):
            pass


def test_no_endpoint_is_a_clear_error_at_the_deadline():
    c = Etcd(["127.0.0.1:1"], timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(EtcdUnavailable) as ei:
        c.put(b"/x", b"y")
    assert time.monotonic() - t0 < 5
    assert "127.0.0.1:1" in str(ei.value) and "\n" not in str(ei.value)
    c.close()


def test_three_members_survive_the_leader_killed(shm_dir):
    cluster = EtcdCluster(shm_dir / "etcd3", 3).start()
    c = Etcd(cluster.endpoints)
    try:
        stop = threading.Event()
        seen: list[int] = []
        start = c.put(b"/t/seq", b"0")

        def watcher() -> None:
            try:
                for b in c.watch(b"/t/", prefix_end(b"/t/"), start + 1, stop=stop):
                    seen.extend(int(e.kv.value) for e in b.events)
            except Exception as exc:  # noqa: BLE001 (reported through the assertion)
                seen.append(-1)
                raise exc

        w = threading.Thread(target=watcher, daemon=True)
        w.start()
        for i in range(1, 11):
            c.put(b"/t/seq", str(i).encode())
        cluster.kill_member(cluster.leader())
        for i in range(11, 21):
            c.put(b"/t/seq", str(i).encode())  # idempotent: retried on another member
        deadline = time.monotonic() + 20
        while seen[-1:] != [20]:
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
        stop.set()
        assert sorted(set(seen)) == list(range(1, 21)) and -1 not in seen
        assert seen == sorted(seen)
    finally:
        c.close()
        cluster.stop()
