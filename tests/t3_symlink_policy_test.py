"""The symlink rule in the core, in-process (no FUSE): no way of making a symlink leaves
one that points outside the mount (docs/security-local.md).

Real mounts check the same through system calls in t4_local_access; here are the paths no
local system call reaches: scope=job ops from other nodes, namespace snapshots, manifests
from the backup or peer tier, and a link already in an older store.
"""

from __future__ import annotations

import errno

import pytest
from support.corefs import run

from mtcfs.base.errors import FsError
from mtcfs.core.model import ROOT_INO
from mtcfs.core.symlinks import MAX_TARGET, escapes
from mtcfs.base.manifest import Entry, StepManifest


@pytest.mark.parametrize("target,depth,out", [
    (b"/etc", 5, True), (b"/", 0, True), (b"//x", 1, True),
    (b"..", 0, True), (b"../x", 0, True), (b"../../..", 2, True),
    (b"./../../../etc", 2, True), (b"a/../..", 3, True), (b"dot/..", 1, True),
    (b"x/./../y", 2, True),
    (b"x", 0, False), (b"a/b/c", 0, False), (b"./x", 0, False), (b"../x", 1, False),
    (b"../../x/y", 2, False), (b".//..//./x", 1, False), (b".", 0, False),
    (b"", 0, False),
])
def test_which_targets_escape(target, depth, out):
    assert escapes(target, depth) is out


def _err(fn, *args) -> int:
    try:
        fn(*args)
    except FsError as exc:
        return exc.errno
    return 0


def test_ops_of_other_nodes_cannot_make_one(tmp_path):
    """scope=job: a symlink op that another node submitted is refused when applied, with
    the same errno on every node (the submitter's system call gets it)."""
    async def body(fs):
        op = {"op": "symlink", "parent": ROOT_INO, "name": "step_30", "uid": 0, "gid": 0,
              "rank": 1}
        for target in ("/dev/shm/outside", "..", "../../x", "sub/.."):
            assert _err(fs.tier_api.ns_apply, dict(op, target=target), 1, 1) == errno.EPERM
        assert _err(fs.tier_api.ns_apply, dict(op, target="x" * (MAX_TARGET + 1)), 1, 1) \
            == errno.ENAMETOOLONG
        assert _err(fs.tier_api.ns_apply, dict(op, target="a\0b"), 1, 1) == errno.EINVAL
        assert fs.inodes[ROOT_INO].children == {}
        res, _keep = fs.tier_api.ns_apply(dict(op, target="step_29/x"), 2, 1)
        assert await fs.readlink(res["ino"]) == b"step_29/x"
    run(body, tmp_path)


def test_a_snapshot_cannot_install_one(tmp_path):
    """A namespace snapshot (a joining node's, or one made from the backup tier's manifests)
    naming a symlink that leaves the mount: that link is not installed, the rest is."""
    async def body(fs):
        e = {"mode": 0o120777, "uid": 0, "gid": 0, "mtime_ns": 1, "kind": "symlink"}
        fs.tier_api.ns_install({"epoch": 1, "seq": 3, "next_ino": 10, "steps": [], "entries": [
            dict(e, ino=2, parent=ROOT_INO, name="step_30", target="/dev/shm/outside"),
            dict(e, ino=3, parent=ROOT_INO, name="d", kind="dir", mode=0o40755, target=""),
            dict(e, ino=4, parent=3, name="up", target="../../x"),
            dict(e, ino=5, parent=3, name="ok", target="../step_29")]})
        root = fs.inodes[ROOT_INO]
        assert sorted(root.children) == [b"d"]
        assert sorted(fs.inodes[3].children) == [b"ok"]
        assert await fs.readlink(5) == b"../step_29"
    run(body, tmp_path)


def test_a_manifest_cannot_restore_one(tmp_path):
    """A step manifest from the backup or peer tier naming a symlink that leaves the
    mount: the step is restored without it."""
    async def body(fs):
        m = StepManifest(job="job", step="step_30", step_number=30, created_ns=1, entries=[
            Entry("step_30", "dir", 0o755, 1),
            Entry("step_30/out", "symlink", 0o777, 1, target="/dev/shm/outside"),
            Entry("step_30/up", "symlink", 0o777, 1, target="../../x"),
            Entry("step_30/sub", "dir", 0o755, 1),
            Entry("step_30/sub/ok", "symlink", 0o777, 1, target="../../step_29/f")])
        fs.tier_api.import_step(m, backed_up=False)
        top = fs.tree.resolve("step_30")
        assert sorted(top.children) == [b"sub"]
        assert await fs.readlink(fs.tree.resolve("step_30/sub/ok").ino) == b"../../step_29/f"
    run(body, tmp_path)


def test_a_link_from_an_older_store_is_not_followed(tmp_path):
    """A symlink that leaves the mount and was made before the rule (an older store):
    readlink refuses it with EPERM, so the kernel resolves no path through it."""
    async def body(fs):
        a = await fs.symlink(ROOT_INO, b"l", b"inside", 0, 0)
        fs.inodes[a.ino].target = b"/dev/shm/outside"  # as an older version stored it
        with pytest.raises(FsError) as ei:
            await fs.readlink(a.ino)
        assert ei.value.errno == errno.EPERM
    run(body, tmp_path)
