"""Review of issue 39's etcd side: what a job member with etcdctl, or an unlucky operator,
could still do after the strict decoders went in (each test failed before its fix).

* A bad record read again on every periodic read (the step records every ~10 s) is one
  refusal: ``mtcfs status``'s ``etcd: N records refused`` and the metric do not climb for
  ever, and the record refused once (a member's) is still among the last shown.
* A namespace snapshot whose entry names no file a node could ever make (``a/b``, ``..``)
  is refused at join with one line, instead of being installed: a name with a ``/`` makes
  every listing of its directory fail with EIO, on every node that installs it.
* A topology label the mount accepts is one every peer's member view accepts: before, a
  label value over 256 characters was mounted, and the node's own member record was then
  refused by every view (the node invisible to its peers, taken for dead).
* An op in the namespace log whose envelope names no rank of a job (none, or 10**12) is
  refused like any malformed op: before, a publish without a rank gave the file a version
  of origin None, and ``mtcfs status`` (and eviction, and the fold) failed with TypeError.
* A base naming a revision after its own write is refused at join: before, the nodes
  installed it and skipped every later op as already held: every change EIO, for good.
* A base whose snapshot gives an entry the mode of another kind (a directory with a
  regular file's mode) is refused at join: before, it left a name no node could remove.
* A base whose snapshot lists a step that is no directory of it is installed without that
  step: before, every daemon that installed it died (KeyError in the step rules).
* A seeding candidate under ``ns/seeders/`` that no live node of the job wrote (a rank
  not of the job, a key not its rank's, no lease) is left out of the election: before, a
  new job's mounts all waited for it for good.
* A live rank whose member record someone deletes or spoils (``etcdctl put/del``) writes
  it again: before, every peer took it for dead for good while it kept renewing its lease.
"""

from __future__ import annotations

import errno
import json
import os
import time
import uuid

import pytest

from mtcfs.base import untrusted
from mtcfs.options import OptionError, parse_mount_options
from mtcfs.tiers.coord.membership import MemberRecord, Membership, MemberView, member_key
from mtcfs.tiers.coord.steps import StepRecords
from mtcfs.tiers.namespace import records
from support.etcd import etcd_client, etcd_prefix, etcd_server  # noqa: F401 (fixtures)


def test_a_bad_record_read_on_every_round_is_one_refusal(client, etcd_prefix,  # noqa: F811
                                                         monkeypatch):
    """Before: the membership loop's read of the step records (every ~10 s) counted the
    same bad record again each time: 31 refusals after 30 reads, and the last ten shown in
    status were all that one record, pushing out the member record refused before it."""
    rejected = untrusted.RejectedRecords()
    monkeypatch.setattr(untrusted, "REJECTED", rejected)
    client.put(member_key(etcd_prefix, 5), b"[5]")
    view = MemberView(client, etcd_prefix)
    view._load_view()  # the member view's first read (and its reload after a failure)
    view._load_view()
    steps = StepRecords(client, etcd_prefix, 0)
    steps.record([1, 2])
    client.put(f"{etcd_prefix}steps/000001".encode(), b'{"rank":1,"steps":[1e400]}')
    for _ in range(30):  # five minutes of the membership loop
        assert steps.newest_complete_everywhere(2) is None
    snap = rejected.snapshot()
    assert snap["total"] == 2 and snap["by_kind"] == {"member": 1, "steps": 1}, snap
    assert sorted(x["kind"] for x in snap["last"]) == ["member", "steps"], snap["last"]
    # a record that changes and is refused again, for another reason, counts again
    client.put(f"{etcd_prefix}steps/000001".encode(), b'{"rank":1,"steps":"x"}')
    steps.newest_complete_everywhere(2)
    assert rejected.snapshot()["by_kind"] == {"member": 1, "steps": 2}


def _snapshot(name: str, kind: str = "dir", mode: int = 0o40755) -> bytes:
    return json.dumps({"next_ino": 3, "steps": [], "entries": [
        {"ino": 2, "parent": 1, "name": name, "kind": kind, "mode": mode, "uid": 0,
         "gid": 0, "mtime_ns": 0, "target": ""}]}).encode()


@pytest.mark.parametrize(("kind", "mode"), [
    ("dir", 0o100644), ("file", 0o40755), ("symlink", 0o40755), ("special", 0o100644),
    ("dir", 0o755)])
def test_snapshot_modes_of_another_kind_are_refused(kind, mode):
    with pytest.raises(untrusted.BadRecord) as got:
        records.decode_snapshot(_snapshot("x", kind, mode))
    assert len(str(got.value).splitlines()) == 1
    for kind, mode in (("dir", 0o40755), ("file", 0o100600), ("symlink", 0o120777),
                       ("special", 0o10644), ("special", 0o20600)):
        records.decode_snapshot(_snapshot("x", kind, mode))


def _scope_job(make_cluster, etcd_server, start: bool = False, kind: str = "nr"):
    """A 2-node scope=job cluster of a new job on the tests' etcd (``start``: mounted).
    Returns (cluster, the job's key prefix ending in ``/``)."""
    c = make_cluster(2, start=start, job=f"{kind}{uuid.uuid4().hex[:8]}",
                     options={"scope": "job", "replicas": 1, "coord": etcd_server.url,
                              "coord_timeout": "5s"})
    return c, c.coord_prefix.rstrip("/") + "/"


def _put_base(etcd_server, prefix: str, snapshot: str, base: str | None = None) -> None:
    """Put a base (``base``, by default rev 0 of tag ``evil``) and its one-part snapshot
    under ``prefix``, as etcdctl would."""
    etcd_server.etcdctl("put", prefix + "ns/snap/evil/0", snapshot)
    etcd_server.etcdctl("put", prefix + "ns/base",
                        base or '{"incarnation":7,"rev":0,"parts":1,"tag":"evil"}')


def _join_refused(c, key: str) -> bool:
    """Start rank 0 of ``c``: True when the mount was refused with a first line saying
    that ``key`` in etcd is malformed (asserted), False when it mounted."""
    try:
        c.start([0])
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        assert f"{key} in etcd is malformed" in first, first
        return True
    return False


def test_a_base_with_a_directory_of_a_file_s_mode_is_refused_at_join(  # noqa: F811
        make_cluster, etcd_server):
    """Before: a base whose directory ``step_9`` had a regular file's mode was installed;
    every node then had a name nobody could remove (rmdir: ENOTDIR, unlink: EISDIR) nor
    list, and the next fold kept it. Now the mount fails at once with one line."""
    c, prefix = _scope_job(make_cluster, etcd_server)
    _put_base(etcd_server, prefix, _snapshot("step_9", "dir", 0o100644).decode())
    if _join_refused(c, f"{prefix}ns/snap/evil/"):
        return
    with pytest.raises(OSError) as got:  # what a user saw before
        os.rmdir(c[0].path("step_9"))
    pytest.fail(f"the base was installed: rmdir step_9 -> "
                f"{errno.errorcode.get(got.value.errno)}")


@pytest.mark.parametrize("name", ["a/b", ".", "..", "/"])
def test_snapshot_names_no_node_could_make_are_refused(name):
    with pytest.raises(untrusted.BadRecord) as got:
        records.decode_snapshot(_snapshot(name))
    assert len(str(got.value).splitlines()) == 1
    records.decode_snapshot(_snapshot("a" * 255))  # the longest legal name is kept


def test_a_base_naming_a_slash_is_refused_at_join(make_cluster, etcd_server):  # noqa: F811
    """Before: a base whose snapshot has a directory ``a/b`` at the root was installed;
    listing the mount's root then failed with EIO (the kernel refuses a name with a
    ``/``), and nothing on the node could remove it. Now the mount fails at once with one
    line naming the snapshot."""
    c, prefix = _scope_job(make_cluster, etcd_server)
    _put_base(etcd_server, prefix, _snapshot("a/b").decode())
    if _join_refused(c, f"{prefix}ns/snap/evil/"):
        return
    with pytest.raises(OSError) as got:  # what a user saw before
        os.listdir(c[0].mnt)
    pytest.fail(f"the base was installed: listdir of the root -> "
                f"{errno.errorcode.get(got.value.errno)}")


@pytest.mark.parametrize("topology", [
    "zone=" + "a" * 300,                             # a value over 256 characters
    "k" * 300 + "=a",                                # a name over 256 characters
    ";".join(f"k{i}=v" for i in range(65)),          # more than 64 labels
    "zone=a\u200bb",                                 # a character that is not printable
    ";".join(f"k{i}=" + "\U0001F600" * 200 for i in range(64)),  # a record over 64 KiB
])
def test_topology_labels_a_mount_takes_are_ones_its_peers_take(topology):
    try:
        o = parse_mount_options("job", "/mnt/x", [f"topology={topology}"])
    except OptionError as exc:  # refused at mount (exit 2), one line
        assert "topology" in str(exc) and len(str(exc).splitlines()) == 1, exc
        return
    rec = MemberRecord(rank=0, address="10.0.0.1:7470", labels=dict(o.topology))
    MemberRecord.decode(rec.encode(), 0)  # before: BadRecord: the node invisible to peers


def _until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(0.02)


def test_a_live_rank_whose_record_is_spoiled_or_deleted_is_seen_again(  # noqa: F811
        client, etcd_prefix):
    """``etcdctl put <prefix>members/000000 '[0]'`` (or ``del``) while rank 0 runs: the
    views rightly leave the record out, but before, rank 0 never wrote it again (its lease
    still renewed, nothing else looks), so every peer took a live rank for dead for good
    while its own status said registered. Now it registers again within a few renewals,
    on its lease (killed, it is seen dead)."""
    ttl = 2
    ms = [Membership(client, etcd_prefix, r, f"10.0.0.{r}:7000", ttl_s=ttl) for r in (0, 1)]
    try:
        for m in ms:
            m.join(wait_s=10)
        ms[1].wait_for(2, timeout=5)
        for spoil in (lambda: client.put(member_key(etcd_prefix, 0), b"[0]"),
                      lambda: client.delete(member_key(etcd_prefix, 0))):
            spoil()
            _until(lambda: not ms[1].alive(0), 5, "the spoiled record left out")
            _until(lambda: ms[1].alive(0), 4 * ttl, "live rank 0 seen again by rank 1")
            assert ms[1].view()[0].address == "10.0.0.0:7000"
        ms[0].stop()  # as kill -9: its record goes with its lease
        _until(lambda: not ms[1].alive(0), 3 * ttl + 5, "rank 0 seen dead")
    finally:
        for m in ms:
            m.leave()


@pytest.mark.parametrize("envelope", [{}, {"rank": 10**12, "id": "x"}, {"rank": 1},
                                      {"id": "x"}, {"rank": -1, "id": "x"}])
def test_an_op_whose_envelope_names_no_rank_of_a_job_does_not_decode(envelope):
    op = {"op": "mkdir", "parent": 1, "name": "d", "mode": 0o755, "uid": 0, "gid": 0,
          **envelope}
    with pytest.raises(untrusted.BadRecord):
        records.decode_op(json.dumps(op).encode())
    records.decode_op(json.dumps({**op, "rank": 65535, "id": "b.1"}).encode())


def test_an_op_without_a_rank_of_the_job_is_refused(make_cluster, etcd_server):  # noqa: F811
    """An op under ``ns/op/`` whose envelope names no rank of the job (none at all, or
    rank 10**12): before, from_wire took it (the envelope is optional in the wire form)
    and a publish gave the file a version whose origin was None: ``mtcfs status`` failed
    with "TypeError: '>=' not supported between 'NoneType' and 'int'" (so did eviction
    and the log's fold) and reads of the file failed. Now it is refused like any
    malformed op: the file keeps its content, status works and names the op."""
    c, prefix = _scope_job(make_cluster, etcd_server, start=True)
    (c[0].mnt / "f").write_bytes(b"x" * 100)
    assert c[1].path("f").read_bytes() == b"x" * 100
    op = {"op": "publish", "ino": 2, "vid": 7, "size": 100, "chunk_size": 4 << 20,
          "chunks": ["ab" * 32], "blake3": "ab" * 32, "mtime_ns": 0}
    etcd_server.etcdctl("put", prefix + "ns/op/000009/p1", json.dumps(op))
    os.mkdir(c[1].path("after"))  # (ordered after it: every node applied it)
    for r in range(2):
        assert c[r].path("f").read_bytes() == b"x" * 100, r
        st = c[r].status()
        assert st["namespace"]["diverged"] == "", st["namespace"]
        assert any(x["key"] == prefix + "ns/op/000009/p1" and x["kind"] == "ns_op"
                   for x in st["rejected_records"]["last"]), st["rejected_records"]


def test_a_seeding_candidate_no_live_rank_wrote_holds_no_mount(make_cluster,  # noqa: F811
                                                               etcd_server):
    """A new scope=job job (empty keyspace) whose ``ns/seeders/`` holds a candidate no live
    node of the job wrote (``etcdctl put <prefix>ns/seeders/000099
    '{"rank":99,"newest_step":5,"entries":5}'``, no lease): before, every node waited for
    that 'best' candidate to seed, and an empty node never takes over from one that holds
    files, so no mount of the job came up (still waiting after 30 s). Now it is refused
    (its key's rank is not its body's, or no rank of the job, or it has no lease) and the
    job mounts at once."""
    c, prefix = _scope_job(make_cluster, etcd_server, kind="ns")
    etcd_server.etcdctl("put", prefix + "ns/seeders/000099",
                        '{"rank":99,"newest_step":5,"entries":5}')
    etcd_server.etcdctl("put", prefix + "ns/seeders/000001",
                        '{"rank":1,"newest_step":5,"entries":5}')
    t0 = time.monotonic()
    c.start(timeout=30)
    assert time.monotonic() - t0 < 25
    (c[0].mnt / "f").write_bytes(b"seeded")
    assert c[1].path("f").read_bytes() == b"seeded"


def test_a_base_whose_step_names_no_directory_of_it_kills_no_daemon(  # noqa: F811
        make_cluster, etcd_server):
    """A base whose snapshot lists a step at an inode it does not hold (``"ino": 99``):
    before, it was installed as is and the step rules' first look at it raised KeyError:
    99, and every daemon that joined died ("daemon failed"). Now such a step is left out
    (a step is a directory of the snapshot); the step that is one stays."""
    c, prefix = _scope_job(make_cluster, etcd_server)
    snap = json.loads(_snapshot("step_2"))
    snap["steps"] = [{"name": "step_1", "number": 1, "ino": 99, "source": ".metadata",
                      "committed_ns": 0},
                     {"name": "step_2", "number": 2, "ino": 2, "source": ".metadata",
                      "committed_ns": 0}]
    _put_base(etcd_server, prefix, json.dumps(snap))
    c.start()
    (c[0].mnt / "step_2" / "f").write_bytes(b"kept")
    for r in range(2):
        assert c[r].path("step_2/f").read_bytes() == b"kept", r
        assert [x["step"] for x in c[r].checkpoints()] == ["step_2"], r
        assert c[r].status()["namespace"]["diverged"] == ""


def test_a_step_survives_the_fold_into_a_base_a_wiped_node_installs(  # noqa: F811
        make_cluster, etcd_server, monkeypatch):
    """The other side of the test above: every step a running job records is a directory
    at the root under its name, so a base folded from it keeps its steps for a node that
    installs it (a replacement, its store wiped, lists the step)."""
    monkeypatch.setenv("MTCFS_NS_TRIM_OPS", "4")
    c, _prefix = _scope_job(make_cluster, etcd_server, start=True)
    os.mkdir(c[0].path("step_1"))
    (c[0].mnt / "step_1" / "w").write_bytes(b"weights")
    (c[0].mnt / "step_1" / "commit_success.txt").write_bytes(b"")
    for i in range(3):
        (c[0].mnt / f"f{i}").write_bytes(b"x")
    c[0].wait_for(lambda: c[0].status()["namespace"].get("log_trims", 0) >= 1,
                  timeout=30, what="a fold of the log")
    c.kill9(1)
    c.restart(1, wipe=True)
    assert [x["step"] for x in c[1].checkpoints()] == ["step_1"]
    assert c[1].path("step_1/w").read_bytes() == b"weights"


def test_a_base_from_the_future_is_refused_at_join(make_cluster, etcd_server):  # noqa: F811
    """A base naming a revision after its own write (``"rev": 10**12``): before, the nodes
    installed it, took every later op for one the base already held (their position was
    past it) and skipped it: each change then failed with EIO on every node ("folded into
    a snapshot before this node applied it"), for good. A base always names a revision
    before the one it was written at: now the join is refused with one line."""
    c, prefix = _scope_job(make_cluster, etcd_server)
    _put_base(etcd_server, prefix, _snapshot("d").decode(), json.dumps(
        {"incarnation": 7, "rev": 10**12, "parts": 1, "tag": "evil"}))
    if _join_refused(c, f"{prefix}ns/base"):
        return
    with pytest.raises(OSError) as got:  # what a user saw before
        os.mkdir(c[0].path("new"))
    pytest.fail(f"the base was installed: mkdir -> {errno.errorcode.get(got.value.errno)}")
