"""The local attack surface of a real mount: symlinks that leave the mount, users other
than the one who mounted (allow_other, default_permissions, size=), and the control socket.

See docs/security-local.md. Every test mounts for real (``make_mount``) and asserts what a
user sees: the errno of the system call, the bytes read, and that nothing was created
outside the mount.
"""

from __future__ import annotations

import errno
import os

import pytest


def err(fn, *args, **kwargs) -> int:
    """The errno ``fn(*args)`` fails with, 0 if it succeeds."""
    try:
        fn(*args, **kwargs)
    except OSError as exc:
        return exc.errno
    return 0


# ---------------------------------------------------------------------- symlinks

def test_symlinks_that_leave_the_mount_are_refused(make_mount, shm_dir):
    """The reproduced attack: ``step_30 -> /dir/outside`` made DCP's ``makedirs(exist_ok)``
    plus a write create a file outside the mount, as root. Absolute targets and relative
    ones that climb above the mount's root get EPERM; one that stays inside works."""
    m = make_mount()
    mnt = m.mnt
    outside = shm_dir / "outside"
    outside.mkdir()

    assert err(os.symlink, str(outside), mnt / "step_30") == errno.EPERM
    assert not os.path.lexists(mnt / "step_30")
    # What DCP does next: the directory is made in the mount, never outside it.
    os.makedirs(mnt / "step_30", exist_ok=True)
    (mnt / "step_30" / "__0_0.distcp").write_bytes(b"weights")
    assert os.listdir(outside) == []
    assert (mnt / "step_30" / "__0_0.distcp").read_bytes() == b"weights"

    assert err(os.symlink, "../../..", mnt / "x") == errno.EPERM
    assert err(os.symlink, "..", mnt / "x") == errno.EPERM
    assert err(os.symlink, "../sibling", mnt / "x") == errno.EPERM  # from the root: out
    assert err(os.symlink, "/", mnt / "x") == errno.EPERM
    assert not os.path.lexists(mnt / "x")
    (mnt / "a" / "b").mkdir(parents=True)
    assert err(os.symlink, "../../..", mnt / "a" / "b" / "x") == errno.EPERM
    assert err(os.symlink, "./../../../etc", mnt / "a" / "b" / "x") == errno.EPERM
    # `..` after a name follows whatever that name is (perhaps a symlink): refused.
    os.symlink(".", mnt / "dot")
    assert err(os.symlink, "dot/..", mnt / "x") == errno.EPERM
    assert err(os.symlink, "a/../..", mnt / "x") == errno.EPERM

    # Inside the mount: these work, and resolve inside it.
    (mnt / "sibling").mkdir()
    (mnt / "sibling" / "f").write_bytes(b"in")
    os.symlink("../sibling", mnt / "a" / "x")
    os.symlink("../../sibling/f", mnt / "a" / "b" / "f")
    os.symlink("sibling/f", mnt / "rel")
    assert os.readlink(mnt / "a" / "x") == "../sibling"
    assert (mnt / "a" / "x" / "f").read_bytes() == b"in"
    assert (mnt / "a" / "b" / "f").read_bytes() == b"in"
    assert (mnt / "rel").read_bytes() == b"in"
    assert os.listdir(outside) == []


def test_a_link_may_not_move_out_of_reach(make_mount, shm_dir):
    """A rename or hard link that would put a symlink too close to the root for its
    ``..`` gets EPERM and changes nothing; moves at the same depth or deeper work."""
    m = make_mount()
    mnt = m.mnt
    (mnt / "sibling").mkdir()
    (mnt / "sibling" / "f").write_bytes(b"in")
    (mnt / "a" / "b").mkdir(parents=True)
    os.symlink("../../sibling/f", mnt / "a" / "b" / "l")
    assert err(os.rename, mnt / "a" / "b" / "l", mnt / "l") == errno.EPERM
    assert err(os.rename, mnt / "a" / "b", mnt / "c") == errno.EPERM
    assert err(os.link, mnt / "a" / "b" / "l", mnt / "hl", follow_symlinks=False) \
        == errno.EPERM
    assert sorted(os.listdir(mnt)) == ["a", "sibling"]
    assert os.listdir(mnt / "a" / "b") == ["l"]
    os.rename(mnt / "a" / "b", mnt / "a" / "c")          # same depth
    (mnt / "d" / "e").mkdir(parents=True)
    os.rename(mnt / "a" / "c" / "l", mnt / "d" / "e" / "l")  # same depth, elsewhere
    assert (mnt / "d" / "e" / "l").read_bytes() == b"in"
    os.rename(mnt / "d", mnt / "a" / "d")                # deeper: it names a/sibling/f now
    assert os.readlink(mnt / "a" / "d" / "e" / "l") == "../../sibling/f"
    assert not (mnt / "a" / "d" / "e" / "l").exists()
