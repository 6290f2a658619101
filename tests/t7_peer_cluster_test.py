"""Tier-8 tests of the peer tier in running daemons: several real mounts on one machine, one
per rank, replicating over real gRPC on loopback (tests/support/cluster.py).

Each test checks what a user of a multi-node job would look at: ``user.mtcfs.state`` of a
step, ``mtcfs status`` (human and ``--json``), the bytes read back from a mount — through a
crash of rank 0, a network partition (``Cluster.partition``: the daemon's ``fault``
control hook) and bad input sent straight to a daemon's Peer port.
"""

from __future__ import annotations

import os
import random
import shutil
import time

import grpc
import pytest

from mtcfs.base.chunking import chunk_hash
from mtcfs.base.manifest import Entry, StepManifest
from mtcfs.tiers.backup.retry import RetryPolicy
from mtcfs.tiers.peer import PeerClient, PeerError
from mtcfs.tiers.peer._pb import mtcfs_peer_pb2 as pb
from mtcfs.tiers.peer._pb import mtcfs_peer_pb2_grpc as pb_grpc
from mtcfs.tiers.peer.limits import MAX_MESSAGE_BYTES
from mtcfs.tiers.peer.tls import server_name
from support.poll import wait_with_logs as wait
from support.prom import value as metric

MiB = 1 << 20
JOB = "testjob"  # Cluster's default job name
FAST = RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.05)


# -- helpers --------------------------------------------------------------------------------

def blob(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def write_files(mount, step: str, files: dict[str, bytes]) -> None:
    d = mount.path(step)
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)


def commit(mount, step: str) -> None:
    """Writing ``commit_success.txt`` into a top-level step dir commits it."""
    (mount.path(step) / "commit_success.txt").write_bytes(b"ok")


def write_step(mount, step: str, files: dict[str, bytes]) -> None:
    write_files(mount, step, files)
    commit(mount, step)


def assert_files(mount, step: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        got = mount.path(step, name).read_bytes()
        assert len(got) == len(data) and got == data, f"{step}/{name} differs"


def peers(cluster, rank: int) -> dict:
    return cluster.status(rank)["peers"]


def link(cluster, rank: int, peer: int) -> dict:
    [row] = [r for r in peers(cluster, rank)["replication"] if r["peer"] == peer]
    return row


def unreachable(cluster, rank: int, peer: int) -> dict | None:
    """The link ``rank`` -> ``peer`` if status shows it unreachable and behind, else None."""
    row = link(cluster, rank, peer)
    return row if row["state"] == "unreachable" and row["lag_steps"] >= 1 else None


def timed_write(mount, rel: str, size: int) -> float:
    """Seconds a write + close of ``size`` bytes takes in the mount."""
    data = blob(size, size)
    t0 = time.monotonic()
    with open(mount.path(rel), "wb") as f:
        f.write(data)
    return time.monotonic() - t0


# -- 1. data-parallel twins ------------------------------------------------------------------

def test_data_parallel_twins_replicate_hashes_and_no_payload(make_cluster):
    c = make_cluster(4, options={"assume_data_parallelism": 2})
    # rank r and r+2 are data-parallel replicas: they write byte-identical shards
    shard = {0: blob(100, 8 * MiB), 1: blob(101, 8 * MiB)}
    files = {r: {"model.bin": shard[r % 2], "optim.bin": blob(200 + r % 2, 300_000)}
             for r in range(4)}
    for r in range(4):
        write_files(c.node(r), "step_10", files[r])
    for r in range(4):
        commit(c.node(r), "step_10")
    for r in range(4):
        assert c.wait_replicated(r, "step_10", timeout=30) == "replicated 1/1"
        assert c.state(r, "step_10/model.bin") == "replicated 1/1"

    for r in range(4):
        p = peers(c, r)
        assert p["placement"].startswith("data-parallel")
        assert p["peers"] == [(r + 2) % 4]
        [row] = p["replication"]
        assert row["data_parallel_twin"] is True
        # only hashes travelled between twins: no chunk payload either way
        assert row["bytes_sent"] == 0 and row["chunks_sent"] == 0, row
        assert row["chunks_skipped"] >= 3, row       # 2 chunks of model.bin, optim.bin, ...
        assert (row["state"], row["lag_steps"], row["lag_bytes"]) == ("ok", 0, 0), row
        assert p["server"]["bytes_received"] == 0, p["server"]
        assert p["server"]["chunks_received"] == 0, p["server"]
        # the twin holds the step's manifest; its chunks are its own files, not copies
        assert p["replica_store"]["manifests"] == 1, p["replica_store"]
        assert p["replica_store"]["chunks"] == 0, p["replica_store"]
    for r in range(4):
        assert_files(c.node(r), "step_10", files[r])


# -- 2. rank 0 dies -----------------------------------------------------------------------------

def alive(c, r) -> list[bool]:
    """Which members rank ``r`` sees alive (its view of etcd's leases), by rank."""
    return [m["alive"] for m in peers(c, r)["members"]]


# One zone and block: topology placement is the ring too, but it needs every rank's labels,
# also those of a rank that died.
@pytest.mark.parametrize("options", [{}, {"topology": "zone=a,block=1"}],
                         ids=["ring", "topology"])
def test_rank_0_dies_and_a_wiped_replacement_restores_from_peers(make_cluster, options):
    c = make_cluster(3, options=options)     # ring: 0 -> 1 -> 2 -> 0
    s10 = {r: {"model.bin": blob(10 + r, 3 * MiB + 12345), "meta.json": b'{"step": 10}'}
           for r in range(3)}
    for r in range(3):
        write_step(c.node(r), "step_10", s10[r])
    for r in range(3):
        c.wait_replicated(r, "step_10", timeout=30)
    wait(lambda: all(alive(c, r) == [True] * 3 for r in range(3)), 10,
         "every rank sees 3 live members", c, range(3))

    c.kill9(0)
    t0 = time.monotonic()
    # its etcd lease (TTL = liveness, 5 s) expires; both survivors' watches see it
    wait(lambda: all(alive(c, r) == [False, True, True] for r in (1, 2)), 15,
         "ranks 1 and 2 see rank 0 dead", c, (1, 2))
    assert time.monotonic() - t0 < 15

    # training goes on: step_20 on ranks 1 and 2
    s20 = {r: {"model.bin": blob(20 + r, 2 * MiB)} for r in (1, 2)}
    for r in (1, 2):
        write_step(c.node(r), "step_20", s20[r])
    c.wait_replicated(1, "step_20", timeout=30)          # rank 1 -> rank 2 is alive
    # rank 2's ring peer is rank 0, which is down: shown as lag, never a hang
    t1 = time.monotonic()
    row = wait(lambda: unreachable(c, 2, 0), 15,
               "rank 2 shows its link to dead rank 0 as unreachable", c, (2,))
    assert time.monotonic() - t1 < 15
    assert row["lag_bytes"] >= 2 * MiB and row["last_error"], row
    assert c.state(2, "step_20") == "local"
    assert c.state(2, "step_10") == "replicated 1/1"
    assert timed_write(c.node(2), "scratch.bin", 4 * MiB) < 1.0
    t2 = time.monotonic()
    c.status(2)
    assert time.monotonic() - t2 < 5

    # a replacement for rank 0, empty store: it restores the newest step complete on all
    # ranks (step_10; rank 0 never wrote step_20) from its holder, rank 1
    m0 = c.restart(0, wipe=True)
    assert sorted(p.name for p in m0.mnt.iterdir()) == ["step_10"]
    assert_files(m0, "step_10", s10[0])
    st = c.status(0)
    assert st["restore"]["step"] == "step_10", st["restore"]
    assert st["restore"]["manifest_from"] == "peer rank 1", st["restore"]
    # the job's decision, read from etcd: the newest step in every rank's record
    assert peers(c, 0)["restore"]["decision"]["step"] == 10, peers(c, 0)["restore"]
    assert st["restore"]["chunks_from"].get("peers", 0) >= 1, st["restore"]
    wait(lambda: c.status(0)["restore"]["pending_chunks"] == 0, 10, "restore finished",
         c, (0,))
    assert c.status(0)["restore"]["corrupt_chunks"] == 0
    # and every rank sees it alive again
    wait(lambda: all(alive(c, r) == [True] * 3 for r in range(3)), 20,
         "every rank sees rank 0 alive again", c, range(3))
    # rank 2's lag towards rank 0 is made up, and every step rank 2 calls replicated is
    # really held by the replacement rank 0 (its replicas died with the old one)
    c.wait_replicated(2, "step_20", timeout=30)

    def held_by_rank0() -> list[str] | None:
        with PeerClient(c.addresses[0], JOB, 2, timeout=5.0, retry=FAST,
                        tls=c.tls_files(2)) as pc:
            held = sorted(i.step for i in pc.list_manifests(2, with_manifest=False)
                          if i.chunks_missing == 0)
        return held if held == ["step_10", "step_20"] else None

    wait(held_by_rank0, 20, "rank 0 holds rank 2's step_10 and step_20 again", c, (0, 2))
    # (rank 2's count of a step can read 0 for a moment while it re-checks the replacement:
    # seen once in a full run under load; the state must settle on replicated, bounded)
    for step in ("step_10", "step_20"):
        c.wait_replicated(2, step, timeout=20)


def test_a_node_killed_in_the_middle_of_replicating_a_step_is_replaced_in_bounded_time(
        make_cluster, monkeypatch):
    """Rank 0 dies while it streams a committed step to rank 1 (each chunk rank 1 stores
    takes 50 ms: the stream is certainly under way, half received, when the kill comes). A
    replacement on an empty store restores the newest step every rank holds in full from
    rank 1, bit-exact, well within one bulk call's 60 s deadline: the half-received step is
    not chosen and nothing waits on it (goodput once saw a replacement take 64 s,
    docs/goodput.md)."""
    monkeypatch.setenv("MTCFS_FAILPOINTS", "peer.put_chunk=sleep(0.05)")
    c = make_cluster(2, options={"chunk_size": "1M"})
    s10 = {r: {"model.bin": blob(10 + r, 3 * MiB + 77)} for r in range(2)}
    for r in range(2):
        write_step(c.node(r), "step_10", s10[r])
    for r in range(2):
        c.wait_replicated(r, "step_10", timeout=30)

    def stored() -> int:
        return c.status(1)["peers"]["replica_store"]["chunks_stored"]

    before = stored()
    write_step(c.node(1), "step_20", {"model.bin": blob(21, 2 * MiB)})
    write_step(c.node(0), "step_20", {"model.bin": blob(20, 64 * MiB)})
    wait(lambda: stored() >= before + 4, 30, "rank 1 receiving rank 0's step_20", c, (0, 1))
    assert stored() < before + 64  # not all of it: the stream is under way
    c.kill9(0)
    monkeypatch.delenv("MTCFS_FAILPOINTS")
    t0 = time.monotonic()
    m0 = c.restart(0, wipe=True)
    assert sorted(p.name for p in m0.mnt.iterdir()) == ["step_10"]
    assert_files(m0, "step_10", s10[0])
    wait(lambda: c.status(0)["restore"]["pending_chunks"] == 0, 30, "restore finished",
         c, (0, 1))
    took = time.monotonic() - t0
    st = c.status(0)["restore"]
    assert st["step"] == "step_10" and st["chunks_from"].get("peers", 0) >= 1, st
    assert took < 30, f"the replacement took {took:.1f} s"


def test_replacement_placed_elsewhere_restores_the_decided_step_not_an_older_one(
        make_cluster):
    """Placement follows the topology, and a replacement node lands where there is room: rank
    0's placement peer was rank 1 (block x), then rank 2 (block y), then rank 1 again. Rank 1
    still holds rank 0's older step_10, and only rank 2 holds rank 0's step_20, which every
    rank completed and etcd's decision names. The replacement must come back at step_20,
    as the other ranks do (not at step_10: a torn checkpoint), fetched from rank 2."""
    labels = {0: "x", 1: "x", 2: "y"}
    c = make_cluster(3, options={"replicas": 1},
                     per_rank_options={r: {"topology": f"zone=a,block={b}"}
                                       for r, b in labels.items()})
    wait(lambda: peers(c, 0)["peers"] == [1], 10, "rank 0's peer is rank 1 (block x)",
         c, (0,))

    def save_all(step: str, seed: int) -> dict[int, dict[str, bytes]]:
        files = {r: {"model.bin": blob(seed + r, 2 * MiB + 7)} for r in range(3)}
        for r in range(3):
            write_step(c.node(r), step, files[r])
        for r in range(3):
            c.wait_replicated(r, step, timeout=30)
        return files

    def replace_rank0(block: str):
        c.kill9(0)
        c.set_rank_options(0, {"topology": f"zone=a,block={block}"})
        return c.restart(0, wipe=True)

    s10 = save_all("step_10", 110)
    # rank 0 is lost; its replacement comes up in block y: its placement peer is rank 2
    m0 = replace_rank0("y")
    assert_files(m0, "step_10", s10[0])  # from rank 1, which is no placement peer now
    wait(lambda: c.status(0)["restore"]["pending_chunks"] == 0, 30, "restore finished",
         c, (0,))
    wait(lambda: peers(c, 0)["peers"] == [2], 10, "rank 0's peer is rank 2 (block y)",
         c, (0,))
    s20 = save_all("step_20", 120)
    # lost again; this replacement is in block x: its placement peer is rank 1 again, which
    # holds rank 0's step_10 only
    m0 = replace_rank0("x")
    st = c.status(0)
    assert st["restore"]["step"] == "step_20", st["restore"]
    assert peers(c, 0)["restore"]["decision"]["step"] == 20, peers(c, 0)["restore"]
    assert sorted(p.name for p in m0.mnt.iterdir()) == ["step_20"]
    assert_files(m0, "step_20", s20[0])
    assert st["restore"]["manifest_from"] == "peer rank 2", st["restore"]
    wait(lambda: c.status(0)["restore"]["pending_chunks"] == 0, 30, "restore finished",
         c, (0,))
    for r in (1, 2):
        assert_files(c.node(r), "step_20", s20[r])


# -- 3. a partition heals ----------------------------------------------------------------------

@pytest.mark.parametrize("options", [{}, {"topology": "zone=a,block=1"}],
                         ids=["ring", "topology"])
def test_partition_heals_and_replication_catches_up(make_cluster, options):
    c = make_cluster(2, options=options)
    wait(lambda: all(peers(c, r)["peers"] == [1 - r] for r in range(2)), 10,
         "both ranks know their peer (topology: once labels are exchanged)", c, range(2))
    c.partition([0], [1])
    s10 = {r: {"model.bin": blob(30 + r, 5 * MiB)} for r in range(2)}
    for r in range(2):
        write_step(c.node(r), "step_10", s10[r])
    # cut off: nothing replicates, status says why; the application is not held up
    row = wait(lambda: unreachable(c, 0, 1), 10,
               "rank 0 shows its link to rank 1 as unreachable", c, (0,))
    assert row["lag_bytes"] >= 5 * MiB and "cut off" in row["last_error"], row
    assert peers(c, 0)["partitioned"] == [1]
    for r in range(2):
        assert c.state(r, "step_10") == "local"
        assert c.state(r, "step_10/model.bin") == "local"
    assert timed_write(c.node(0), "scratch.bin", 4 * MiB) < 1.0
    assert peers(c, 1)["server"]["bytes_received"] == 0
    assert peers(c, 1)["replica_store"]["manifests"] == 0

    c.partition()
    for r in range(2):
        assert c.wait_replicated(r, "step_10", timeout=30) == "replicated 1/1"
    assert peers(c, 0)["partitioned"] == []
    row = link(c, 0, 1)
    assert (row["state"], row["lag_steps"]) == ("ok", 0), row
    assert row["bytes_sent"] >= 5 * MiB
    wait(lambda: all(alive(c, r) == [True, True] for r in range(2)), 15,
         "both ranks see both members alive (etcd never saw a partition)", c, range(2))

    # nothing was lost: a replacement of rank 0 gets step_10 back from rank 1, bit-exact
    c.kill9(0)
    m0 = c.restart(0, wipe=True)
    assert sorted(p.name for p in m0.mnt.iterdir()) == ["step_10"]
    assert_files(m0, "step_10", s10[0])
    assert c.status(0)["restore"]["manifest_from"] == "peer rank 1"


# -- 4. bad input on a running daemon's Peer port ------------------------------------------------

def test_bad_peer_input_is_refused_and_the_daemon_keeps_serving(make_cluster):
    c = make_cluster(2)
    addr = c.addresses[0]
    made: list[PeerClient] = []

    def client(rank: int = 1) -> PeerClient:
        # a member's certificate: bad input from inside the job (outsiders: t8_peer_tls)
        pc = PeerClient(addr, JOB, rank, timeout=10.0, stream_timeout=30.0, retry=FAST,
                        tls=c.tls_files(rank))
        made.append(pc)
        return pc

    ch = grpc.secure_channel(addr, c.tls_files(1).channel_credentials(), options=[
        ("grpc.ssl_target_name_override", server_name(JOB))])  # default limits: sends anything
    stub = pb_grpc.PeerStub(ch)
    try:
        before = peers(c, 0)["server"]

        # bytes that do not hash to their name: DATA_LOSS for that chunk, nothing stored
        liar, named = blob(40, 100_000), chunk_hash(blob(41, 100_000))
        put = client().put_chunks([(named, liar)])
        assert list(put.rejected) == [named] and put.rejected[named].startswith("DATA_LOSS")
        assert not put.accepted
        assert client().has_chunks([named]) == [False]

        # a message above the 65 MiB limit: refused by grpc itself
        big = bytes(MAX_MESSAGE_BYTES + 1)
        req = pb.PutChunksRequest(job=JOB, rank=1, piece=pb.ChunkPiece(
            digest=chunk_hash(big), offset=0, total_size=len(big), data=big))
        with pytest.raises(grpc.RpcError) as exc:
            stub.PutChunks(iter([req]), timeout=30)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        del big, req

        # a rank the job does not have
        with pytest.raises(PeerError) as pe:
            client(rank=2).list_manifests(of_rank=0)
        assert pe.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a rank of this job" in str(pe.value)
        with pytest.raises(PeerError) as pe:
            client(rank=7).put_chunks([(chunk_hash(b"x"), b"x")])
        assert pe.value.code == grpc.StatusCode.INVALID_ARGUMENT

        # a request naming another job: refused without saying which job this is
        with pytest.raises(grpc.RpcError) as exc:
            stub.HasChunks(pb.HasChunksRequest(job="another-job", rank=1,
                                               digests=[chunk_hash(b"x")]), timeout=10)
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert JOB not in (exc.value.details() or "")

        # manifests whose paths escape the job
        escapes = {
            "dot-dot": [Entry(path="step_99", kind="dir", mode=0o755, mtime_ns=1),
                        Entry(path="step_99/../../x", kind="file", mode=0o644, mtime_ns=1)],
            "relative ../x": [Entry(path="../x", kind="file", mode=0o644, mtime_ns=1)],
            "absolute": [Entry(path="/etc/passwd", kind="file", mode=0o644, mtime_ns=1)],
        }
        for what, entries in escapes.items():
            m = StepManifest(job=JOB, step="step_99", step_number=99, created_ns=1,
                             entries=entries, rank=1)
            with pytest.raises(PeerError) as pe:
                client().publish_manifest(m)
            assert pe.value.code == grpc.StatusCode.INVALID_ARGUMENT, what
        with pytest.raises(grpc.RpcError) as exc:          # the step name itself escapes
            good = StepManifest(job=JOB, step="step_99", step_number=99, created_ns=1,
                                entries=[Entry(path="step_99", kind="dir", mode=0o755,
                                               mtime_ns=1)], rank=1)
            stub.PublishManifest(pb.PublishManifestRequest(
                job=JOB, rank=1, step="../step_99", step_number=99,
                manifest=good.to_bytes()), timeout=10)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        after = peers(c, 0)
        srv = after["server"]
        assert srv["calls_refused"] - before["calls_refused"] >= 7, srv
        assert srv["chunks_rejected"] - before["chunks_rejected"] == 1, srv
        # the liar's bytes came in on the wire and were thrown away
        assert srv["chunks_received"] == before["chunks_received"], srv
        assert after["replica_store"]["chunks"] == 0 and after["replica_store"]["manifests"] == 0

        # the daemon still serves: a good put, a listing, ...
        good_data = blob(42, 200_000)
        ok = client().put_chunks([(chunk_hash(good_data), good_data)])
        assert ok.ok and list(ok.accepted) == [chunk_hash(good_data)]
        assert dict(client().get_chunks([chunk_hash(good_data)])) == \
            {chunk_hash(good_data): good_data}
        assert client().list_manifests(of_rank=1) == []
    finally:
        ch.close()
        for pc in made:
            pc.close()

    # ... the mount works, and real replication still goes through
    m0 = c.node(0)
    (m0.path("hello.txt")).write_bytes(b"still here")
    assert m0.path("hello.txt").read_bytes() == b"still here"
    s = {r: {"w.bin": blob(50 + r, MiB)} for r in range(2)}
    for r in range(2):
        write_step(c.node(r), "step_10", s[r])
    for r in range(2):
        c.wait_replicated(r, "step_10", timeout=30)
        assert_files(c.node(r), "step_10", s[r])
    assert c.status(0)["errors"] == []


# -- 5. status ----------------------------------------------------------------------------------

def test_status_shows_members_and_replication(make_cluster):
    c = make_cluster(3)
    for r in range(3):
        write_step(c.node(r), "step_10", {"w.bin": blob(60 + r, MiB)})
    for r in range(3):
        c.wait_replicated(r, "step_10", timeout=30)

    def complete():
        st = [peers(c, r) for r in range(3)]
        ok = all(p["membership"]["registered"] and len(p["members"]) == 3
                 and all(m["alive"] for m in p["members"])
                 and (p["latest_complete"] or {}).get("step") == "step_10" for p in st)
        return st if ok else None

    st = wait(complete, 15, "every rank sees 3 live members and step_10 complete", c,
              range(3))
    for r, p in enumerate(st):
        assert [m["rank"] for m in p["members"]] == [0, 1, 2]
        assert [m["address"] for m in p["members"]] == c.addresses
        assert p["peers"] == [(r + 1) % 3] and p["holds_for"] == [(r - 1) % 3]
        [row] = p["replication"]
        assert (row["peer"], row["state"], row["last_replicated"]) == \
            ((r + 1) % 3, "ok", "step_10")

    out = c.node(0).cli("status", str(c.node(0).mnt)).stdout
    assert f"peer tier: rank 0 of 3, listening on {c.addresses[0]}" in out, out
    assert f"listening on {c.addresses[0]}, registered in etcd" in out, out
    assert "sends to rank 1; holds replicas of rank 2" in out, out
    assert "newest step complete on every rank: step_10" in out, out
    lines = out.splitlines()
    for r in range(3):
        [member] = [ln for ln in lines if ln.split()[:2] == [str(r), c.addresses[r]]
                    and "alive" in ln]
        assert "alive" in member
    assert "replication:" in out
    [repl] = [ln for ln in lines if ln.split()[:2] == ["1", c.addresses[1]] and " ok " in ln]
    assert "step_10" in repl and "0 steps" in repl, repl
    out1 = c.node(1).cli("status", str(c.node(1).mnt)).stdout
    assert "registered in etcd" in out1 and "sends to rank 2; holds replicas of rank 0" in out1
    # mtcfs checkpoints has a PEERS column: peers holding the step of those wanted
    rows = c.node(0).checkpoints()
    assert [(r["step"], r["peers"]) for r in rows] == [("step_10", "1/1")]
    table = c.node(0).cli("checkpoints", str(c.node(0).mnt)).stdout
    assert "PEERS" in table.splitlines()[0] and " 1/1 " in table.splitlines()[1], table
    # ... and mtcfs metrics exposes members and lag for Prometheus
    metrics = c.node(0).cli("metrics", str(c.node(0).mnt)).stdout
    for r in range(3):
        assert metric(metrics, "mtcfs_peer_member_alive", job=JOB, rank=0, member=r) == 1
    assert metric(metrics, "mtcfs_peer_replication_lag_steps", job=JOB, rank=0, peer=1) == 0


def test_etcd_alone_is_enough_to_find_every_peer(make_mount):
    """No peers= list: every node knows only etcd (coord=) and learns the others' addresses
    from their membership records; replication still reaches every ring peer."""
    from support.cluster import free_ports
    from support.etcd import shared_etcd
    ports = free_ports(3)
    prefix = f"/mtcfs-test/{os.urandom(6).hex()}/"
    mounts = [make_mount(f"r{r}", rank=r, nodes=3, listen=f"127.0.0.1:{ports[r]}",
                         coord=shared_etcd().url, coord_prefix=prefix) for r in range(3)]
    data = {r: blob(50 + r, 3 * MiB) for r in range(3)}
    for r, m in enumerate(mounts):
        write_files(m, "step_10", {"w.bin": data[r]})
        commit(m, "step_10")
    for m in mounts:
        m.wait_state("step_10", "replicated 1/1", timeout=60)
    p = mounts[2].status()["peers"]
    assert p["membership"]["registered"]
    assert [(m["rank"], m["address"], m["alive"]) for m in p["members"]] == \
        [(r, f"127.0.0.1:{ports[r]}", True) for r in range(3)]


def test_full_peer_shows_lag_and_catches_up_when_space_frees(make_cluster):
    """One RAM budget: replicas count against the receiving node's size=. A peer without
    room refuses the chunks (RESOURCE_EXHAUSTED), the sender shows the link lagging and the
    application on both nodes goes on; once the peer frees space, the step is replicated."""
    # (rank 1's RAM is smaller than rank 0's step pair: its quota for rank 0 is raised
    # from the fair share, size/2, to all of it)
    c = make_cluster(2, options={"replicas": 1, "keep": 1},
                     per_rank_options={1: {"size": "40M", "replica_quota": "40M"}})
    own = blob(7, 24 * MiB)
    write_files(c[1], "scratch", {"own.bin": own})       # not a step: never evicted
    data = blob(8, 24 * MiB)
    write_files(c[0], "step_10", {"w.bin": data})
    commit(c[0], "step_10")

    def lagging():
        rows = c.status(0)["peers"]["replication"]
        return rows and rows[0]["state"] == "lagging" and \
            "RESOURCE_EXHAUSTED" in (rows[0]["last_error"] or "")
    c[0].wait_for(lagging, 30, "rank 0's link to show the full peer")
    assert c.state(0, "step_10") == "local"
    assert c.status(0)["peers"]["replication"][0]["lag_steps"] == 1
    assert (c[1].path("scratch", "own.bin")).read_bytes() == own   # rank 1 still serves its files
    (c[1].path("scratch", "own.bin")).unlink()                      # make room
    c.wait_replicated(0, "step_10", timeout=60)
    assert c.status(1)["peers"]["replica_store"]["used_bytes"] >= len(data)


def test_restore_pulls_from_every_holder_in_parallel(make_cluster):
    """With two replicas, a replacement node streams its chunks from both holders at once
    (each chunk from one of them), and gets every byte back."""
    c = make_cluster(3, options={"replicas": 2, "chunk_size": "256K"})
    data = {r: blob(90 + r, 8 * MiB) for r in range(3)}
    for r in range(3):
        write_files(c[r], "step_10", {"w.bin": data[r]})
        commit(c[r], "step_10")
    for r in range(3):
        c.wait_replicated(r, "step_10", timeout=60)
    assert c.state(0, "step_10") == "replicated 2/2"
    c.kill9(0)
    c.wipe(0)
    c.restart(0)
    st = c[0].wait_for(lambda: (lambda s: s if s["restore"]["pending_chunks"] == 0 and
                                "bulk_from_peers" in s["restore"] else None)(c.status(0)),
                       60, "the bulk restore")
    assert c[0].path("step_10", "w.bin").read_bytes() == data[0]
    by_rank = st["restore"]["bulk_from_peers"]["by_rank"]
    chunks = 8 * MiB // (256 * 1024) + 1  # w.bin, and commit_success.txt
    assert sum(by_rank.values()) == chunks, by_rank   # every chunk, in bulk
    assert set(by_rank) == {"1", "2"} and min(by_rank.values()) > 0, by_rank
    assert st["restore"]["chunks_from"] == {"peers": chunks}


def test_a_replica_that_counted_on_the_holders_own_copy_survives_its_deletion(make_cluster):
    """Rank 1's step shares a chunk with a file of rank 0's own: rank 0 stores no second
    copy of it for rank 1's replica. When rank 0 deletes its file, the chunk is handed over
    to the replica store first: rank 1's replica stays complete and restores bit-exact."""
    c = make_cluster(2, options={"replicas": 1, "chunk_size": "64K"})
    shared = os.urandom(64 * 1024)
    own = c.node(0).path("step_5")
    own.mkdir()
    (own / "w.bin").write_bytes(shared)
    (own / "commit_success.txt").write_bytes(b"ok")
    c.wait_replicated(0, "step_5")
    d = c.node(1).path("step_7")
    d.mkdir()
    (d / "w.bin").write_bytes(shared + os.urandom(1000))
    (d / "commit_success.txt").write_bytes(b"ok")
    c.wait_replicated(1, "step_7")
    shutil.rmtree(own)  # rank 0's own copy of the shared chunk goes
    c.kill9(1)
    c.restart(1, wipe=True)  # restores step_7 from rank 0's replica store
    got = c.node(1).path("step_7", "w.bin")
    c.node(1).wait_for(lambda: got.exists(), 60, "step_7 restored")
    assert got.read_bytes()[:len(shared)] == shared


def test_a_second_daemon_as_the_same_rank_is_refused_in_one_line(make_cluster, make_mount):
    """Two hosts started as the same rank of one job: the second mount fails with one line
    naming the live holder (its etcd record), after waiting one lease for a dead one; the
    first keeps its rank and its files."""
    from support.cluster import free_ports
    c = make_cluster(2)
    write_step(c.node(1), "step_10", {"w.bin": blob(70, MiB)})
    other = make_mount("twin", start=False, rank=1, nodes=2,
                       listen=f"127.0.0.1:{free_ports(1)[0]}",
                       coord=c.options(1)["coord"], coord_prefix=c.options(1)["coord_prefix"])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as ei:
        other.start()
    assert time.monotonic() - t0 < 60
    first = str(ei.value).splitlines()[0]
    assert "rank 1 is held by another live member" in first, first
    assert c.addresses[1] in first, first
    assert peers(c, 1)["membership"]["registered"]
    assert c.state(1, "step_10") in ("local", "replicated 1/1")
    assert alive(c, 0) == [True, True]
