"""Tier-8 tests of who gets in: real daemons whose peers speak mutual TLS on loopback
(docs/security.md), attacked with the generated stubs.

What a user checks: an outsider — no TLS, a certificate of another CA, a certificate of this
CA for another job — reads no byte of a checkpoint and changes nothing a node stores, on
every RPC; a member may act only as its own rank; renewed certificate files are picked up
without a restart; a certificate that would be refused is refused at mount, in one line.
"""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
from collections.abc import Callable

import grpc
import pytest

from mtcfs.base.chunking import chunk_hash
from mtcfs.base.manifest import StepManifest
from mtcfs.base.pki import JobCa
from mtcfs.tiers.peer._pb import mtcfs_peer_pb2 as pb
from mtcfs.tiers.peer._pb import mtcfs_peer_pb2_grpc as pb_grpc
from mtcfs.tiers.peer.tls import TlsFiles, server_name
from support.mount import MTCFS
from support.peer import blob, make_step
from support.poll import wait_for as _wait

JOB = "testjob"
MiB = 1 << 20


def _channel(addr: str, creds: grpc.ChannelCredentials | None,
             name: str = server_name(JOB)) -> grpc.Channel:
    if creds is None:
        return grpc.insecure_channel(addr)
    return grpc.secure_channel(addr, creds, options=[("grpc.ssl_target_name_override", name)])


def _every_rpc(stub: pb_grpc.PeerStub, rank: int, digest: str,
               manifest: bytes) -> dict[str, tuple[grpc.StatusCode | None, int]]:
    """Call each RPC once as ``rank``: RPC -> (status, bytes of chunk or manifest data that
    came back). None: the call succeeded."""
    out: dict[str, tuple[grpc.StatusCode | None, int]] = {}

    def run(name: str, fn: Callable[[], int]) -> None:
        try:
            out[name] = (None, fn())
        except grpc.RpcError as exc:
            out[name] = (exc.code(), 0)

    run("HasChunks", lambda: len(stub.HasChunks(pb.HasChunksRequest(
        job=JOB, rank=rank, digests=[digest]), timeout=10).present) * 0)
    run("GetChunks", lambda: sum(len(r.piece.data) for r in stub.GetChunks(
        pb.GetChunksRequest(job=JOB, rank=rank, digests=[digest]), timeout=10)))
    run("ListManifests", lambda: sum(len(m.manifest) + 1 for m in stub.ListManifests(
        pb.ListManifestsRequest(job=JOB, rank=rank, of_rank=1), timeout=10)))
    junk = blob(99, 70_000)
    run("PutChunks", lambda: len(stub.PutChunks(iter([pb.PutChunksRequest(
        job=JOB, rank=rank, piece=pb.ChunkPiece(digest=chunk_hash(junk), offset=0,
                                                total_size=len(junk), data=junk))]),
        timeout=10).accepted) * 0)
    run("PublishManifest", lambda: stub.PublishManifest(pb.PublishManifestRequest(
        job=JOB, rank=rank, step="999", step_number=999, manifest=manifest),
        timeout=10).chunks_total * 0)
    return out


def _held(c, rank: int) -> tuple:
    """What ``rank``'s replica store holds, as its status reports it."""
    rs = c.status(rank)["peers"]["replica_store"]
    return rs["chunks"], rs["manifests"], rs["used_bytes"]


@pytest.fixture
def job_with_a_replica(make_cluster):
    """Two ranks; rank 1 saved step 10, whose replica rank 0 holds."""
    c = make_cluster(2, options={"replicas": 1})
    data = blob(1, 3 * MiB)
    d = c[1].path("10")
    d.mkdir()
    (d / "w.bin").write_bytes(data)
    (d / "commit_success.txt").write_bytes(b"ok")
    c[1].wait_state("10", "replicated 1/1", timeout=60)
    return c, data


def test_outsiders_read_nothing_and_change_nothing(job_with_a_replica, tmp_path):
    c, _ = job_with_a_replica
    # a digest the replica holds: the first chunk of rank 1's file (its manifest says)
    insider = pb_grpc.PeerStub(_channel(c.addresses[0], c.tls_files(1).channel_credentials()))
    [stored] = list(insider.ListManifests(pb.ListManifestsRequest(job=JOB, rank=1, of_rank=1),
                                          timeout=10))
    m = StepManifest.from_bytes(stored.manifest)
    digest = next(e.chunks[0] for e in m.entries if e.kind == "file" and e.chunks)
    fake = make_step(JOB, 1, 999, {"w.bin": blob(7, 100_000)}).to_bytes()
    before = _held(c, 0)

    other_ca = JobCa(tmp_path / "other", JOB)       # right names, wrong CA
    stranger = other_ca.issue_rank(JOB, 1)
    other_job = c.ca.issue_rank("otherjob", 1)      # this CA, another job
    no_cert = grpc.ssl_channel_credentials(c.ca.ca.read_bytes())  # trusts the CA, shows none
    outsiders = {
        "plaintext": _channel(c.addresses[0], None),
        "no client certificate": _channel(c.addresses[0], no_cert),
        "another CA": _channel(c.addresses[0], TlsFiles(
            str(stranger.ca), str(stranger.cert), str(stranger.key)).channel_credentials()),
        "another job": _channel(c.addresses[0], TlsFiles(
            str(other_job.ca), str(other_job.cert), str(other_job.key)).channel_credentials()),
    }
    denied = {
        "plaintext": {grpc.StatusCode.UNAVAILABLE},
        "no client certificate": {grpc.StatusCode.UNAVAILABLE},
        "another CA": {grpc.StatusCode.UNAVAILABLE},
        "another job": {grpc.StatusCode.PERMISSION_DENIED},
    }
    for who, ch in outsiders.items():
        got = _every_rpc(pb_grpc.PeerStub(ch), 1, digest, fake)
        for rpc, (code, nbytes) in got.items():
            assert code in denied[who], (who, rpc, code)
            assert nbytes == 0, (who, rpc)
        ch.close()
    # nothing changed, and the member still gets its bytes, bit-exact
    assert _held(c, 0) == before
    got = b"".join(r.piece.data for r in insider.GetChunks(
        pb.GetChunksRequest(job=JOB, rank=1, digests=[digest]), timeout=10))
    assert chunk_hash(got) == digest
    assert [s.step for s in insider.ListManifests(
        pb.ListManifestsRequest(job=JOB, rank=1, of_rank=1), timeout=10)] == ["10"]
    assert c.status(0)["peers"]["server"]["calls_denied"] >= 5


def test_a_member_acts_only_as_its_own_rank(job_with_a_replica):
    c, _ = job_with_a_replica
    before = _held(c, 0)
    # rank 1's certificate, calling rank 0's server as rank 0: refused where rank matters
    as_1 = pb_grpc.PeerStub(_channel(c.addresses[0], c.tls_files(1).channel_credentials()))
    posing = _every_rpc(as_1, 0, chunk_hash(b"x"),
                        make_step(JOB, 0, 999, {"w.bin": blob(8, 1000)}).to_bytes())
    assert {rpc: code for rpc, (code, _) in posing.items()} == {
        rpc: grpc.StatusCode.PERMISSION_DENIED for rpc in posing}
    with pytest.raises(grpc.RpcError) as exc:
        as_1.HasChunks(pb.HasChunksRequest(job=JOB, rank=0, digests=[]), timeout=10)
    assert "rank 1" in exc.value.details() and "rank 0" in exc.value.details()
    # as itself it may publish only its own manifests: a manifest of rank 0 is refused
    with pytest.raises(grpc.RpcError) as exc:
        as_1.PublishManifest(pb.PublishManifestRequest(
            job=JOB, rank=1, step="999", step_number=999,
            manifest=make_step(JOB, 0, 999, {"w.bin": blob(8, 1000)}).to_bytes()), timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _held(c, 0) == before


def test_renewed_files_are_used_without_a_restart(make_cluster, tmp_path):
    """A CA rotation done the way docs/security.md says: both CAs trusted, new certificates
    everywhere, then the old CA dropped — the daemons run on, and replicate, throughout."""
    c = make_cluster(2, options={"replicas": 1})
    old_ca = c.ca.ca.read_bytes()
    new = JobCa(tmp_path / "new", "new")
    old_1 = c.issued(1)
    kept = tmp_path / "old-rank-1"  # a node not renewed yet: old certificate, both CAs
    kept.mkdir()
    for f in (old_1.cert, old_1.key):
        shutil.copy(f, kept / f.name)
    (kept / "both.pem").write_bytes(old_ca + new.ca.read_bytes())
    old_client = TlsFiles(str(kept / "both.pem"), str(kept / old_1.cert.name),
                          str(kept / old_1.key.name))
    # 1. every node trusts both CAs, then gets a certificate of the new one (files replaced
    #    in place: the paths in the mount options stay)
    c.ca.ca.write_bytes(old_ca + new.ca.read_bytes())
    for r in range(2):
        fresh = new.issue_rank(JOB, r)
        issued = c.issued(r)
        shutil.copy(fresh.key, issued.key)
        shutil.copy(fresh.cert, issued.cert)
    new_1 = new.issue_rank(JOB, 1)
    new_client = TlsFiles(str(new.ca), str(new_1.cert), str(new_1.key))

    def serves(files: TlsFiles) -> bool:
        ch = _channel(c.addresses[0], files.channel_credentials())
        try:
            pb_grpc.PeerStub(ch).HasChunks(pb.HasChunksRequest(job=JOB, rank=1, digests=[]),
                                           timeout=5)
            return True
        except grpc.RpcError:
            return False
        finally:
            ch.close()

    # a client that trusts only the new CA gets in once rank 0 serves its new certificate
    _wait(lambda: serves(new_client), 30, "rank 0 serves the renewed certificate")
    # and the daemons' own connections use the new files: a step still replicates
    d = c[1].path("20")
    d.mkdir()
    (d / "w.bin").write_bytes(blob(2, MiB))
    (d / "commit_success.txt").write_bytes(b"ok")
    c[1].wait_state("20", "replicated 1/1", timeout=60)
    # 2. the old CA is dropped: a certificate it signed no longer gets in
    assert serves(old_client)
    c.ca.ca.write_bytes(new.ca.read_bytes())
    _wait(lambda: not serves(old_client), 30, "the old CA's certificate is refused")
    d = c[1].path("30")
    d.mkdir()
    (d / "w.bin").write_bytes(blob(3, MiB))
    (d / "commit_success.txt").write_bytes(b"ok")
    c[1].wait_state("30", "replicated 1/1", timeout=60)


@pytest.mark.parametrize("case", ["wrong rank", "expired", "key of another", "another CA",
                                  "no file"])
def test_a_certificate_peers_would_refuse_is_refused_at_mount(case, tmp_path, shm_dir):
    ca = JobCa(tmp_path / "ca", JOB)
    good = ca.issue_rank(JOB, 0)
    cert, key, root = str(good.cert), str(good.key), str(ca.ca)
    if case == "wrong rank":
        cert, key = map(str, (lambda i: (i.cert, i.key))(ca.issue_rank(JOB, 1)))
        want = "needs the subject alternative name URI:mtcfs://testjob/rank/0"
    elif case == "expired":
        old = ca.issue_rank(JOB, 0, valid_from=dt.datetime.now(dt.timezone.utc)
                            - dt.timedelta(days=10), valid_for=dt.timedelta(days=1))
        cert, key = str(old.cert), str(old.key)
        want = "not now"
    elif case == "key of another":
        key = str(ca.issue("x").key)
        want = "is not the private key"
    elif case == "another CA":
        root = str(JobCa(tmp_path / "other", JOB).ca)
        want = "is not signed by the CA"
    else:
        cert = str(tmp_path / "missing.pem")
        want = "No such file"
    mnt = shm_dir / "mnt"
    mnt.mkdir()
    r = subprocess.run(MTCFS + [JOB, str(mnt), "-o",
                                f"store={shm_dir / 'store'},nodes=2,rank=0,listen=127.0.0.1:0,"
                                f"coord=etcd://127.0.0.1:1,tls_ca={root},tls_cert={cert},"
                                f"tls_key={key},insecure"],  # insecure: etcd in plaintext
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    assert want in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (shm_dir / "store").exists()  # refused before anything was made


def test_mtcfs_certs_makes_what_a_mount_accepts(tmp_path):
    r = subprocess.run(MTCFS + ["certs", str(tmp_path / "pki"), "--job", JOB, "--nodes", "3"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for rank in range(3):
        TlsFiles(str(tmp_path / "pki" / f"{JOB}-ca.pem"), str(tmp_path / "pki" / f"rank-{rank}.pem"),
                 str(tmp_path / "pki" / f"rank-{rank}.key")).check_for(JOB, rank)
    assert (tmp_path / "pki" / "rank-0.key").stat().st_mode & 0o077 == 0
    again = subprocess.run(MTCFS + ["certs", str(tmp_path / "pki"), "--job", JOB, "--nodes",
                                    "3"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "never overwritten" in again.stderr


def test_a_member_cannot_fill_a_nodes_ram_tier(make_cluster):
    """The reproduced attack with a member's certificate: junk chunks put into rank 0 until
    it refuses. Rank 1 gets at most its share (size / (1 + replicas)), and rank 0's own
    write of most of the rest still succeeds."""
    from mtcfs.tiers.peer import PeerClient
    from mtcfs.tiers.backup.retry import RetryPolicy
    size = 256 * MiB
    c = make_cluster(2, options={"replicas": 1, "size": "256M"})
    share = c.status(0)["peers"]["replica_store"]["quota_per_rank_bytes"]
    assert share == size // 2
    junk = [blob(1000 + i, 4 * MiB) for i in range(size // (4 * MiB))]
    with PeerClient(c.addresses[0], JOB, 1, timeout=10, stream_timeout=60,
                    retry=RetryPolicy(max_attempts=1), tls=c.tls_files(1)) as as_1:
        put = as_1.put_chunks((chunk_hash(b), b) for b in junk)
    assert put.rejected, "rank 0 took junk worth its whole RAM tier"
    assert all(v.startswith("RESOURCE_EXHAUSTED") and "share" in v
               for v in put.rejected.values()), put.rejected
    held = c.status(0)["peers"]["replica_store"]["held_by_rank"]["1"]
    assert held <= share
    # rank 0's own checkpoint still fits in its own share
    data = blob(5, 100 * MiB)
    d = c[0].path("10")
    d.mkdir()
    (d / "w.bin").write_bytes(data)
    assert (d / "w.bin").read_bytes() == data
