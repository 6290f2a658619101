"""Namespace ops and the NamespaceLog interface (docs/architecture.md, "Namespace operations").

* The wire form of every op kind: typed op -> dict -> JSON -> typed op, the exact dict
  nodes store in etcd, and malformed dicts refused with EINVAL and a message.
* A conformance suite run against every NamespaceLog: scope=node's LocalLog and scope=job's
  EtcdNamespace on a real etcd (one member on loopback), the same test bodies for both.
* The apply path driven through the core's FUSE-facing methods in both scopes, ending with
  a consistency check of inodes, dentries and SQLite (and a reload of the store).
* The job-scope side of the core (core/jobns.py) in process: several cores share a
  replicated log kept in memory, so ops, publishes, the log position, snapshots and their
  install are driven without etcd or FUSE, every core checked consistent at the end.
"""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest
import trio

from mtcfs.base.errors import FsError
from mtcfs.base.ns_ops import (
    OP_TYPES, Create, Link, MalformedOp, Mkdir, Mknod, Noop, NsOp, Publish, Rename, Rmdir,
    SetAttr, Symlink, Unlink, from_wire,
)
from mtcfs.core.model import ROOT_INO
from mtcfs.core.ns_log import LocalLog, NamespaceLog
from support.corefs import open_fs
from support.jobcore import (
    check_consistent, published_on, read_all, run_job, tree_of, write_sealed,
)
from support.etcd import etcd_prefix, etcd_server  # noqa: F401 (fixtures)

# ---------------------------------------------------------------------------- wire form

#: One op of every kind, and the dict stored in etcd for it (key order included: the JSON
#: bytes in etcd are those of this dict).
SAMPLES: list[tuple[NsOp, dict]] = [
    (Mkdir(parent=1, name=b"step_1", mode=0o755, uid=10, gid=20, rank=0, id="b.1"),
     {"op": "mkdir", "parent": 1, "name": "step_1", "mode": 0o755, "uid": 10, "gid": 20,
      "rank": 0, "id": "b.1"}),
    (Create(parent=2, name=b"\xff.bin", mode=0o644, uid=0, gid=0, excl=True, rank=3,
            id="b.2"),
     {"op": "create", "parent": 2, "name": "\udcff.bin", "mode": 0o644, "uid": 0, "gid": 0,
      "excl": True, "rank": 3, "id": "b.2"}),
    (Symlink(parent=1, name=b"latest", target=b"step_1", uid=0, gid=0, rank=1, id="b.3"),
     {"op": "symlink", "parent": 1, "name": "latest", "target": "step_1", "uid": 0,
      "gid": 0, "rank": 1, "id": "b.3"}),
    (Mknod(parent=1, name=b"fifo", mode=stat.S_IFIFO | 0o600, rdev=0, uid=0, gid=0, rank=0,
           id="b.4"),
     {"op": "mknod", "parent": 1, "name": "fifo", "mode": stat.S_IFIFO | 0o600, "rdev": 0,
      "uid": 0, "gid": 0, "rank": 0, "id": "b.4"}),
    (Link(ino=5, new_parent=1, new_name=b"hard", rank=0, id="b.5"),
     {"op": "link", "ino": 5, "new_parent": 1, "new_name": "hard", "rank": 0, "id": "b.5"}),
    (Unlink(parent=1, name=b"x", rank=0, id="b.6"),
     {"op": "unlink", "parent": 1, "name": "x", "rank": 0, "id": "b.6"}),
    (Rmdir(parent=1, name=b"d", rank=0, id="b.7"),
     {"op": "rmdir", "parent": 1, "name": "d", "rank": 0, "id": "b.7"}),
    (Rename(parent=1, name=b"a", new_parent=2, new_name=b"b", flags=1, rank=0, id="b.8"),
     {"op": "rename", "parent": 1, "name": "a", "new_parent": 2, "new_name": "b",
      "flags": 1, "rank": 0, "id": "b.8"}),
    (SetAttr(ino=5, mode=0o600, mtime_ns=7, rank=0, id="b.9"),
     {"op": "setattr", "ino": 5, "mode": 0o600, "uid": None, "gid": None, "mtime_ns": 7,
      "atime_ns": None, "rank": 0, "id": "b.9"}),
    (Publish(ino=5, vid=9, size=3, chunk_size=65536, chunks=("d1",), blake3="h",
             mtime_ns=11, data=b"abc", rank=2, id="b.10"),
     {"op": "publish", "ino": 5, "vid": 9, "size": 3, "chunk_size": 65536, "chunks": ["d1"],
      "blake3": "h", "mtime_ns": 11, "data": "YWJj", "rank": 2, "id": "b.10"}),
    (Publish(ino=5, vid=9, size=1 << 20, chunk_size=65536, chunks=("d1", "d2"), blake3="h",
             mtime_ns=11, expect="e", rank=2, id="b.11"),
     {"op": "publish", "ino": 5, "vid": 9, "size": 1 << 20, "chunk_size": 65536,
      "chunks": ["d1", "d2"], "blake3": "h", "mtime_ns": 11, "expect": "e", "rank": 2,
      "id": "b.11"}),
    (Noop(rank=0, id="b.12"), {"op": "noop", "rank": 0, "id": "b.12"}),
]


def test_every_op_kind_has_a_sample():
    assert {type(op) for op, _ in SAMPLES} == set(OP_TYPES.values())


@pytest.mark.parametrize(("op", "wire"), SAMPLES, ids=[w["op"] for _, w in SAMPLES])
def test_wire_form_round_trips(op, wire):
    assert op.to_wire() == wire
    assert list(op.to_wire()) == list(wire)  # the key order of the JSON stored in etcd
    body = json.dumps(op.to_wire(), separators=(",", ":"))
    assert body == json.dumps(wire, separators=(",", ":"))
    assert from_wire(json.loads(body)) == op


def test_envelope_is_left_out_until_submitted():
    op = Unlink(parent=1, name=b"x")
    assert op.to_wire() == {"op": "unlink", "parent": 1, "name": "x"}
    assert from_wire(op.to_wire()) == op


def test_unknown_keys_are_ignored():
    assert from_wire({"op": "rmdir", "parent": 1, "name": "d", "later": 1}) == \
        Rmdir(parent=1, name=b"d")


@pytest.mark.parametrize(("wire", "says"), [
    ([1, 2], "JSON object"),
    ({"parent": 1}, "unknown namespace op None"),
    ({"op": "chmod", "ino": 1}, "unknown namespace op 'chmod'"),
    ({"op": "mkdir", "parent": 1, "name": "d", "mode": 0o755, "uid": 0}, "lacks field 'gid'"),
    ({"op": "unlink", "parent": "1", "name": "x"}, "field 'parent' must be an integer"),
    ({"op": "unlink", "parent": True, "name": "x"}, "field 'parent' must be an integer"),
    ({"op": "unlink", "parent": 1, "name": b"x"}, "field 'name' must be a string"),
    ({"op": "create", "parent": 1, "name": "f", "mode": 0, "uid": 0, "gid": 0, "excl": 1},
     "field 'excl' must be true or false"),
    ({"op": "setattr", "ino": 1, "mode": "rw", "uid": None, "gid": None, "mtime_ns": None,
      "atime_ns": None}, "field 'mode' must be an integer"),
    ({"op": "publish", "ino": 1, "vid": 1, "size": 1, "chunk_size": 1, "chunks": "d1",
      "blake3": "h", "mtime_ns": 1}, "field 'chunks' must be a list of strings"),
    ({"op": "publish", "ino": 1, "vid": 1, "size": 1, "chunk_size": 1, "chunks": [],
      "blake3": "h", "mtime_ns": 1, "data": "a"}, "field 'data' must be base64"),
    ({"op": "rmdir", "parent": 1, "name": "d", "rank": "0"}, "field 'rank' must be"),
])
def test_malformed_wire_dicts_are_refused(wire, says):
    with pytest.raises(MalformedOp) as got:
        from_wire(wire)
    assert got.value.errno == errno.EINVAL
    assert isinstance(got.value, FsError)
    assert says in str(got.value)


# ---------------------------------------------------------------------------- the logs

@pytest.fixture(params=["local", "etcd"])
def log_kind(request):
    if request.param == "etcd":
        request.getfixturevalue("etcd_server")
    return request.param


def _run(kind, tmp_path, request, body, rank=0):
    """Run ``body(fs, log)`` on a fresh core whose namespace log is of ``kind``."""
    async def main():
        etcd = None
        async with trio.open_nursery() as n:
            fs = open_fs(tmp_path / "store", rank=rank)
            try:
                if kind == "etcd":
                    from mtcfs.tiers.coord.etcd import Etcd
                    from mtcfs.tiers.namespace.etcd_log import EtcdNamespace
                    server = request.getfixturevalue("etcd_server")
                    prefix = request.getfixturevalue("etcd_prefix")
                    etcd = Etcd(server.endpoints, timeout_s=5.0)
                    fs.ns_log = EtcdNamespace(fs.tier_api, etcd, prefix, rank, timeout_s=10.0, nodes=1)
                    with trio.fail_after(30):
                        await fs.ns_log.join(timeout=20.0)
                    n.start_soon(fs.ns_log.run)
                fs.start(n)
                with trio.fail_after(60):
                    await body(fs, fs.ns_log)
                check_consistent(fs)
            finally:
                n.cancel_scope.cancel()
                fs.close()
                fs.store.close()
                if etcd is not None:
                    etcd.close()
    trio.run(main)


async def _errno(coro) -> int:
    try:
        await coro
    except FsError as exc:
        return exc.errno
    return 0



def test_both_logs_satisfy_the_protocol(log_kind, tmp_path, request):
    async def body(fs, log):
        assert isinstance(log, NamespaceLog)
        assert log.replicated is (log_kind == "etcd")
        assert fs.job_scope is log.replicated
        assert isinstance(log, LocalLog) is (log_kind == "local")
        assert log.unavailable is False
    _run(log_kind, tmp_path, request, body)


def test_ops_apply_and_answer(log_kind, tmp_path, request):
    async def body(fs, log):
        d = (await log.submit(Mkdir(parent=ROOT_INO, name=b"step_1", mode=0o750, uid=5,
                                    gid=6)))["ino"]
        assert fs.inodes[ROOT_INO].children[b"step_1"] == d
        assert stat.S_IMODE(fs.inodes[d].mode) == 0o750 and fs.inodes[d].is_dir
        res = await log.submit(Create(parent=d, name=b"f", mode=0o640, uid=5, gid=6,
                                      excl=True))
        assert res == {"ino": res["ino"], "existed": False}
        f = res["ino"]
        assert await log.submit(Create(parent=d, name=b"f", mode=0o600, uid=0, gid=0,
                                       excl=False)) == {"ino": f, "existed": True}
        s = (await log.submit(Symlink(parent=d, name=b"s", target=b"f", uid=0, gid=0)))["ino"]
        assert await fs.readlink(s) == b"f"
        p = (await log.submit(Mknod(parent=d, name=b"p", mode=stat.S_IFIFO | 0o600, rdev=0,
                                    uid=0, gid=0)))["ino"]
        assert fs.inodes[p].kind == "special"
        assert await log.submit(Link(ino=f, new_parent=ROOT_INO, new_name=b"hard")) == {}
        assert fs.inodes[f].nlink == 2
        assert await log.submit(Rename(parent=d, name=b"f", new_parent=d,
                                       new_name=b"g")) == {}
        assert b"g" in fs.inodes[d].children and b"f" not in fs.inodes[d].children
        assert await log.submit(SetAttr(ino=f, mode=0o604, uid=7)) == {}
        assert stat.S_IMODE(fs.inodes[f].mode) == 0o604 and fs.inodes[f].uid == 7
        assert await log.submit(Unlink(parent=ROOT_INO, name=b"hard")) == {}
        assert fs.inodes[f].nlink == 1
        e = (await log.submit(Mkdir(parent=d, name=b"e", mode=0o755, uid=0, gid=0)))["ino"]
        assert await log.submit(Rmdir(parent=d, name=b"e")) == {}
        assert e not in fs.inodes or not fs.inodes[e].parent
        assert await log.submit(Noop()) == {}
        await log.fresh()
        assert sorted(fs.inodes[d].children) == [b"g", b"p", b"s"]
    _run(log_kind, tmp_path, request, body)


def test_refusals_carry_the_errno_and_change_nothing(log_kind, tmp_path, request):
    async def body(fs, log):
        d = (await log.submit(Mkdir(parent=ROOT_INO, name=b"d", mode=0o755, uid=0,
                                    gid=0)))["ino"]
        f = (await log.submit(Create(parent=d, name=b"f", mode=0o644, uid=0, gid=0,
                                     excl=True)))["ino"]
        before = {n: (i.nlink, dict(i.children or {})) for n, i in fs.inodes.items()}
        refused = [
            (Mkdir(parent=ROOT_INO, name=b"d", mode=0o755, uid=0, gid=0), errno.EEXIST),
            (Create(parent=d, name=b"f", mode=0o644, uid=0, gid=0, excl=True), errno.EEXIST),
            (Mkdir(parent=d, name=b"a/b", mode=0o755, uid=0, gid=0), errno.EINVAL),
            (Mkdir(parent=f, name=b"x", mode=0o755, uid=0, gid=0), errno.ENOTDIR),
            (Rmdir(parent=ROOT_INO, name=b"d"), errno.ENOTEMPTY),
            (Rmdir(parent=d, name=b"f"), errno.ENOTDIR),
            (Unlink(parent=ROOT_INO, name=b"d"), errno.EISDIR),
            (Unlink(parent=d, name=b"missing"), errno.ENOENT),
            (Rename(parent=d, name=b"f", new_parent=d, new_name=b"g", flags=2), errno.EINVAL),
            (Rename(parent=ROOT_INO, name=b"d", new_parent=d, new_name=b"in"), errno.EINVAL),
            (Symlink(parent=d, name=b"s", target=b"/etc/passwd", uid=0, gid=0), errno.EPERM),
            (Symlink(parent=d, name=b"s", target=b"../../x", uid=0, gid=0), errno.EPERM),
            (Link(ino=d, new_parent=ROOT_INO, new_name=b"l"), errno.EPERM),
            (Link(ino=f, new_parent=d, new_name=b"f"), errno.EEXIST),
            (Mknod(parent=d, name=b"n", mode=stat.S_IFREG | 0o644, rdev=0, uid=0, gid=0),
             errno.EINVAL),
            (SetAttr(ino=10**9, mode=0o600), errno.ENOENT),
        ]
        for op, err in refused:
            assert await _errno(log.submit(op)) == err, op
        await log.fresh()
        assert {n: (i.nlink, dict(i.children or {})) for n, i in fs.inodes.items()} == before
    _run(log_kind, tmp_path, request, body)


def test_inode_numbers_are_allocated_by_applying(log_kind, tmp_path, request):
    """Only applying allocates inode numbers: the same ops from the same start give the
    same numbers in both scopes (every node of a job holds the same namespace)."""
    async def body(fs, log):
        got = []
        for i in range(5):
            got.append((await log.submit(Mkdir(parent=ROOT_INO, name=b"d%d" % i, mode=0o755,
                                               uid=0, gid=0)))["ino"])
        start = got[0]
        assert got == list(range(start, start + 5))
        assert start == ROOT_INO + 1
    _run(log_kind, tmp_path, request, body)


def test_etcd_stores_the_wire_form(tmp_path, request, etcd_server, etcd_prefix):  # noqa: F811
    """The JSON in etcd is the op's wire form with this node's envelope (rank, id)."""
    async def body(fs, log):
        await log.submit(Mkdir(parent=ROOT_INO, name=b"step_7", mode=0o755, uid=1, gid=2))
        from mtcfs.tiers.coord.etcd import prefix_end
        p = log.op_prefix
        kvs, _at, _more, _n = log.etcd.range(p, prefix_end(p))
        assert len(kvs) == 1
        wire = json.loads(kvs[0].value)
        assert list(wire) == ["op", "parent", "name", "mode", "uid", "gid", "rank", "id"]
        assert wire["rank"] == 3 and wire["id"].startswith(log._boot + ".")
        assert kvs[0].key == p + f"{3:06d}/{wire['id']}".encode()
        assert from_wire(wire) == Mkdir(parent=ROOT_INO, name=b"step_7", mode=0o755, uid=1,
                                        gid=2, rank=3, id=wire["id"])
    _run("etcd", tmp_path, request, body, rank=3)


def test_a_malformed_op_in_etcd_is_refused_on_every_node(tmp_path, request, etcd_server,  # noqa: F811
                                                         etcd_prefix):  # noqa: F811
    """An op no node can read is skipped by all (EINVAL, not a divergence of this node)."""
    async def body(fs, log):
        from mtcfs.tiers.coord.etcd import put_op
        bad = json.dumps({"op": "mkdir", "parent": ROOT_INO, "name": "x"}).encode()
        key = log.op_prefix + b"000009/x.1"
        log.etcd.txn([], [put_op(key, bad), put_op(log.last_key, key)])
        await log.fresh()
        assert log.diverged == ""
        assert b"x" not in fs.inodes[ROOT_INO].children
        assert (await log.submit(Mkdir(parent=ROOT_INO, name=b"y", mode=0o755, uid=0,
                                       gid=0)))["ino"]
    _run("etcd", tmp_path, request, body)


# ------------------------------------------------------------------ the core, both scopes

def test_core_operations_go_through_the_log(log_kind, tmp_path, request):
    """The FUSE-facing methods in both scopes: every namespace change is an applied op; the
    result is consistent in memory and in SQLite, and a reload of the store finds it."""
    snapshot = {}

    async def body(fs, log):
        d = (await fs.mkdir(ROOT_INO, b"step_3", 0o755, 0, 0)).ino
        fh, attr = await fs.create(d, b"w.bin", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
        await fs.write(fh, 0, b"x" * 70_000)
        await fs.flush(fh)
        await fs.release(fh)
        with trio.fail_after(10):
            await fs.open_files.wait_sealed(fs.inodes[attr.ino])
        await fs.symlink(d, b"link", b"w.bin", 0, 0)
        await fs.link(attr.ino, ROOT_INO, b"hard", )
        await fs.mknod(d, b"fifo", stat.S_IFIFO | 0o644, 0, 0, 0)
        await fs.rename(d, b"w.bin", d, b"v.bin")
        await fs.setattr(attr.ino, mode=0o600)
        await fs.unlink(ROOT_INO, b"hard")
        sub = (await fs.mkdir(d, b"sub", 0o700, 0, 0)).ino
        await fs.rmdir(d, b"sub")
        assert await _errno(fs.mkdir(d, b"fifo", 0o755, 0, 0)) == errno.EEXIST
        assert await _errno(fs.rmdir(ROOT_INO, b"step_3")) == errno.ENOTEMPTY
        assert await _errno(fs.unlink(d, b"gone")) == errno.ENOENT
        assert await _errno(fs.symlink(d, b"out", b"/etc", 0, 0)) == errno.EPERM
        assert (await fs.lookup(d, b"v.bin")).ino == attr.ino
        assert stat.S_IMODE((await fs.getattr(attr.ino)).mode) == 0o600
        assert sub not in fs.inodes or not fs.inodes[sub].parent
        assert sorted(fs.inodes[d].children) == [b"fifo", b"link", b"v.bin"]
        snapshot.update(tree_of(fs))

    _run(log_kind, tmp_path, request, body)
    fs = open_fs(tmp_path / "store")  # what SQLite holds, read back
    try:
        assert tree_of(fs) == snapshot
        check_consistent(fs)
    finally:
        fs.close()
        fs.store.close()


# ------------------------------------------------ the job-scope apply path, in process
#
# Several cores in one trio run share a replicated log kept in memory (support/jobcore.py):
# every op is applied by every core in one order through ``ns_apply`` (as EtcdNamespace does
# from its watch), without etcd and without FUSE. It drives the namespace component
# (core/jobns.py): apply in scope=job, publish, the log position, snapshot and install.


def test_job_nodes_apply_the_same_ops_and_hold_the_same_namespace(tmp_path):
    """Two ranks change one namespace: every op applied on both, in one order, gives the
    same tree (inode numbers included), the same log position, and on the reader the
    writer's published content: small files inline (read at once), larger ones as chunks
    missing here whose origin is the writer's rank."""
    small, large = os.urandom(5000), os.urandom(300 * 1024)  # INLINE_BYTES is 256 KiB

    async def body(cores, job):
        a, b = cores
        d = (await a.mkdir(ROOT_INO, b"step_1", 0o755, 0, 0)).ino
        f_small = await write_sealed(a, d, b"small.bin", small)
        f_large = await write_sealed(a, d, b"large.bin", large)
        await published_on(b, f_small, len(small))
        await published_on(b, f_large, len(large))
        assert await read_all(b, f_small) == small  # came inside the publish op
        v = b.versions[b.inodes[f_large].vid]
        assert v.origin == 0 and v.missing and v.size == len(large)
        assert {b.tier_api.chunk_origin(c) for c in v.chunks} == {0}
        assert await read_all(a, f_large) == large  # the writer reads its own
        # rank 1 changes the namespace too; rank 0 applies it
        await b.rename(d, b"small.bin", d, b"renamed.bin")
        await b.symlink(d, b"latest", b"renamed.bin", 0, 0)
        e = (await b.mkdir(d, b"sub", 0o700, 0, 0)).ino
        await b.rmdir(d, b"sub")
        await b.unlink(d, b"large.bin")
        assert await _errno(a.mkdir(d, b"latest", 0o755, 0, 0)) == errno.EEXIST
        assert await _errno(b.unlink(d, b"gone")) == errno.ENOENT
        assert e not in a.inodes or not a.inodes[e].parent
        assert sorted(a.inodes[d].children) == [b"latest", b"renamed.bin"]
        assert tree_of(a) == tree_of(b)
        assert a.tier_api.ns_position() == b.tier_api.ns_position() == (1, job.seq)
        assert await read_all(a, f_small) == await read_all(b, f_small) == small

    run_job(tmp_path, body)


def test_a_refused_op_moves_the_position_and_it_survives_a_restart(tmp_path):
    """The position (epoch, seq) is recorded with each op applied, and moved by a refused
    one; a reopened store has it."""
    got = {}

    async def body(cores, job):
        a, _b = cores
        await a.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
        assert a.tier_api.ns_position() == (1, 1)
        assert await _errno(a.mkdir(ROOT_INO, b"d", 0o755, 0, 0)) == errno.EEXIST
        assert [fs.tier_api.ns_position() for fs in cores] == [(1, 2), (1, 2)]
        job.epoch = 4  # a new incarnation of the job's log
        await a.mkdir(ROOT_INO, b"e", 0o755, 0, 0)
        got.update({fs.rank: fs.tier_api.ns_position() for fs in cores})

    run_job(tmp_path, body)
    assert got == {0: (4, 3), 1: (4, 3)}
    for r in (0, 1):
        fs = open_fs(tmp_path / f"store{r}", rank=r)
        try:
            assert fs.tier_api.ns_position() == (4, 3)
            assert sorted(fs.inodes[ROOT_INO].children) == [b"d", b"e"]
            check_consistent(fs)
        finally:
            fs.close()
            fs.store.close()


def test_snapshot_installs_the_same_namespace_on_a_joining_node(tmp_path):
    """A node that joins installs another's snapshot: the same tree, position and steps,
    every chunk missing (origin: the writer); ops applied after it keep the nodes equal.
    The writer installing its own snapshot (a rejoin with its store) keeps its data: its
    files read back bit-exact without a fetch."""
    data = os.urandom(400 * 1024)

    async def body(cores, job):
        a, b, c = cores
        job.members.remove(c)  # c joins later, from a snapshot
        d = (await a.mkdir(ROOT_INO, b"step_2", 0o755, 0, 0)).ino
        f = await write_sealed(a, d, b"w.bin", data)
        await write_sealed(a, d, b"commit_success.txt", b"ok")  # a step's commit marker
        await a.link(f, ROOT_INO, b"hard")
        await a.symlink(d, b"s", b"w.bin", 0, 0)
        await published_on(b, f, len(data))
        assert sorted(b.steps) == sorted(a.steps) == ["step_2"]
        snap = b.tier_api.ns_snapshot()
        assert (snap["epoch"], snap["seq"]) == b.tier_api.ns_position() == a.tier_api.ns_position()
        c.tier_api.ns_install(json.loads(json.dumps(snap)))  # as it travels: JSON
        assert tree_of(c) == tree_of(a) == tree_of(b)
        assert c.tier_api.ns_position() == a.tier_api.ns_position()
        assert sorted(c.steps) == sorted(a.steps)
        v = c.versions[c.inodes[f].vid]
        assert v.missing and v.origin == 0
        assert {c.tier_api.chunk_origin(x) for x in v.chunks} == {0}
        check_consistent(c)
        # ops after the snapshot apply on the joined node as on the others
        job.members.append(c)
        await b.unlink(ROOT_INO, b"hard")
        await c.rename(d, b"s", ROOT_INO, b"latest")
        assert tree_of(a) == tree_of(b) == tree_of(c)
        assert a.tier_api.ns_position() == b.tier_api.ns_position() == c.tier_api.ns_position() == (1, job.seq)
        # the writer rejoins with its store: its own data stays, read without a fetch
        a.tier_api.ns_install(a.tier_api.ns_snapshot())
        assert not a.versions[a.inodes[f].vid].missing
        assert await read_all(a, f) == data
        assert tree_of(a) == tree_of(c)

    run_job(tmp_path, body, ranks=(0, 1, 2))


def test_an_empty_commit_marker_commits_the_step_on_every_node(tmp_path):
    """``touch step_N/commit_success.txt`` on one rank commits step_N on every rank."""
    async def body(cores, job):
        a, b = cores
        d = (await a.mkdir(ROOT_INO, b"step_5", 0o755, 0, 0)).ino
        await write_sealed(a, d, b"commit_success.txt", b"")
        assert sorted(a.steps) == ["step_5"]
        assert sorted(b.steps) == ["step_5"]

    run_job(tmp_path, body)
