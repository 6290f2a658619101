"""The job-scope side of the core in process, for tests: several cores in one trio run
share a replicated namespace log kept in memory (:class:`JobLog`); every op is applied by
every core in one order through ``ns_apply`` (as EtcdNamespace does from its watch), without
etcd and without FUSE. It drives core/jobns.py: apply in scope=job, publish, the log
position, snapshot and install. A fake beside the real EtcdNamespace, never instead of it
(t3_nslog_conformance_test runs both against one suite; t7_* mount real daemons on etcd).
"""

from __future__ import annotations

import os

import trio

from mtcfs.base.errors import FsError
from mtcfs.base.ns_ops import NsOp
from mtcfs.core.model import ROOT_INO
from support.corefs import open_fs, write_file


def check_consistent(fs):
    """Memory and SQLite agree on every named inode and every dentry; link counts add up."""
    named = {}  # ino -> names
    for d in fs.inodes.values():
        if d.is_dir and (d.ino == ROOT_INO or d.parent):
            for name, num in d.children.items():
                assert num in fs.inodes, (d.ino, name)
                named.setdefault(num, set()).add((d.ino, name))
    rows = {(p, bytes(n)): i for p, n, i in fs.db.execute(
        "SELECT parent, name, ino FROM dentries").fetchall()}
    mem = {(p, n): i for i, names in named.items() for p, n in names}
    assert rows == mem
    for num in [ROOT_INO, *named]:
        ino = fs.inodes[num]
        row = fs.db.execute("SELECT kind, mode, uid, gid, nlink, vid, rdev, target FROM "
                            "inodes WHERE ino=?", (num,)).fetchone()
        assert row is not None, num
        assert tuple(row[:7]) == (ino.kind, ino.mode, ino.uid, ino.gid, ino.nlink, ino.vid,
                                  ino.rdev)
        assert bytes(row[7] or b"") == ino.target
        if ino.is_dir:
            subdirs = sum(fs.inodes[c].is_dir for c in ino.children.values())
            assert ino.nlink == 2 + subdirs, num
        else:
            assert ino.nlink == len(named[num]), num
        if ino.is_file:
            assert fs.db.execute("SELECT ino FROM versions WHERE vid=?",
                                 (ino.vid,)).fetchone() == (num,)
        if num != ROOT_INO and ino.parent:
            assert (ino.parent, ino.name) in named[num]


def tree_of(fs) -> dict:
    """path -> (ino, kind, mode, nlink, target, size) of every name in ``fs``."""
    out = {}
    stack = [(b"", ROOT_INO)]
    while stack:
        path, num = stack.pop()
        ino = fs.inodes[num]
        size = fs.versions[ino.vid].size if ino.is_file else None
        out[path] = (num, ino.kind, ino.mode, ino.nlink, ino.target, size)
        for name, child in (ino.children or {}).items():
            stack.append((path + b"/" + name, child))
    return out


class JobLog:
    """A replicated :class:`NamespaceLog` in memory for the cores in ``members`` (a fake
    beside the real EtcdNamespace, which t3_nslog_conformance_test runs): ``submit`` gives the op
    this node's envelope, takes it through its wire form, and has every member apply it at
    the next position; a refused op still moves every member's position (as the etcd log
    does); the submitter gets its own result or errno."""

    replicated = True
    unavailable = False

    def __init__(self, members: list, epoch: int = 1) -> None:
        self.members = members
        self.epoch = epoch
        self.seq = 0
        self.ids = 0

    def for_node(self, fs) -> "NodeLog":
        return NodeLog(self, fs)

    def apply(self, op: NsOp) -> dict:
        """Order ``op`` and apply it on every member: ``{rank: result or errno}``."""
        self.seq += 1
        out: dict = {}
        for fs in self.members:
            try:
                out[fs.rank], _keep = fs.tier_api.ns_apply(op.to_wire(), self.seq, self.epoch)
            except FsError as exc:
                fs.tier_api.ns_set_position(self.epoch, self.seq)
                out[fs.rank] = exc.errno
        return out


class NodeLog:
    replicated = True
    unavailable = False

    def __init__(self, job: JobLog, fs) -> None:
        self.job, self.fs = job, fs

    async def submit(self, op: NsOp) -> dict:
        import dataclasses
        self.job.ids += 1
        op = dataclasses.replace(op, rank=self.fs.rank, id=f"t.{self.job.ids}")
        got = self.job.apply(op)[self.fs.rank]
        if isinstance(got, int):
            raise FsError(got)
        return got

    async def fresh(self) -> None:
        return None

    def status(self) -> dict:
        return {"engine": "memory", "seq": self.job.seq}


def run_job(tmp_path, body, ranks=(0, 1), capacity: int = 1 << 30):
    """Run ``body(cores, job_log)`` on fresh cores of ``ranks`` (RAM tiers of ``capacity``
    bytes) sharing one JobLog; every core is checked consistent afterwards."""
    async def main():
        async with trio.open_nursery() as n:
            cores = [open_fs(tmp_path / f"store{r}", capacity=capacity, rank=r) for r in ranks]
            job = JobLog(cores)
            try:
                for fs in cores:
                    fs.ns_log = job.for_node(fs)
                    assert fs.job_scope
                    fs.start(n)
                with trio.fail_after(60):
                    await body(cores, job)
                for fs in cores:
                    check_consistent(fs)
            finally:
                n.cancel_scope.cancel()
                for fs in cores:
                    fs.close()
                    fs.store.close()
    trio.run(main)


async def published_on(fs, ino: int, size: int) -> None:
    """Wait (10 s at most) until ``fs`` holds the published version of ``ino`` of ``size``."""
    with trio.fail_after(10):
        while not (fs.inodes[ino].published and fs.inodes[ino].published["size"] == size):
            await trio.sleep(0.01)


async def write_sealed(fs, parent: int, name: bytes, data: bytes) -> int:
    """Write ``data`` as ``name`` in ``parent`` on ``fs`` and wait (10 s at most) until it
    is sealed; its inode number."""
    ino = await write_file(fs, parent, name, data)
    with trio.fail_after(10):
        await fs.open_files.wait_sealed(fs.inodes[ino])
    return ino


async def read_all(fs, ino: int) -> bytes:
    """The whole content of file ``ino`` on ``fs``, read through a handle."""
    fh, _keep = await fs.open(ino, os.O_RDONLY)
    try:
        return await fs.read(fh, 0, 1 << 30)
    finally:
        await fs.release(fh)


