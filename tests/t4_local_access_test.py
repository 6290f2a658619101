"""The local attack surface of a real mount: symlinks that leave the mount, users other
than the one who mounted (allow_other, default_permissions, size=), and the control socket.

See docs/security-local.md. Every test mounts for real (``make_mount``, ``make_cluster``)
and asserts what a user sees: the errno of the system call, the bytes read, and that
nothing was created outside the mount.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import stat
import sys

import pytest

from mtcfs import cli, control
from support.poll import err

#: The other, unprivileged local user of these tests (nobody); no user is created.
NOBODY = 65534
MiB = 1 << 20
root_only = pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch users")


def as_nobody(fn) -> dict:
    """Run ``fn()`` in a forked child as uid/gid 65534 with no supplementary groups.

    Returns:
        ``{"value": what fn returned, "errno": the errno of an OSError or ControlError
        (0: none) and "message" its text, "exit": the code of a SystemExit (None: none),
        "stderr": what it printed there}``.
    """
    r, w = os.pipe()
    er, ew = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(r)
        os.close(er)
        out = {"value": None, "errno": 0, "exit": None}
        try:
            sys.stderr = io.TextIOWrapper(os.fdopen(ew, "wb"), write_through=True)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out["value"] = fn()
        except SystemExit as exc:
            out["exit"] = exc.code
        except (OSError, control.ControlError) as exc:
            out["errno"], out["message"] = exc.errno, str(exc)
        except BaseException as exc:  # noqa: BLE001 (reported to the parent)
            out["error"] = repr(exc)
        sys.stderr.flush()
        os.write(w, pickle.dumps(out))
        os._exit(0)
    os.close(w)
    os.close(ew)
    with os.fdopen(r, "rb") as f:
        raw = f.read()
    with os.fdopen(er, "rb") as f:
        err_text = f.read().decode(errors="replace")
    os.waitpid(pid, 0)
    out = pickle.loads(raw)
    assert "error" not in out, out["error"]
    return {**out, "stderr": err_text}


def open_to_others(path) -> None:
    """Let another user walk from /dev/shm down to ``path`` (mkdtemp makes 0700)."""
    path = os.path.abspath(path)
    while path not in ("/dev/shm", "/"):
        os.chmod(path, os.stat(path).st_mode | 0o005)
        path = os.path.dirname(path)


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


# ---------------------------------------------------------------------- the control socket

def test_the_control_socket_is_the_mounting_users(make_mount):
    """The socket is 0600 and its store 0700 (even one made 0755 beforehand), owned by the
    daemon's user, and no bind directory is left behind; ``fault`` is refused unless the
    daemon has test_faults."""
    m = make_mount(start=False)
    m.store.mkdir(parents=True, mode=0o755)
    os.chmod(m.store, 0o755)
    m.start()
    sock = m.store / "control.sock"
    st = os.stat(sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()
    assert stat.S_IMODE(os.stat(m.store).st_mode) == 0o700
    assert not os.path.lexists(m.store / ".ctl")
    with pytest.raises(control.ControlError) as ei:
        control.call(str(sock), "fault", timeout=10, partition=[1])
    assert ei.value.errno == errno.EPERM
    assert "test_faults" in str(ei.value)
    assert m.status()["pid"] == m.pid  # still serving


def test_test_faults_lets_the_fault_command_in(make_mount):
    """With test_faults the command passes the gate (on one node it has nothing to cut:
    EINVAL), and the daemon says in its log that it runs with a test option."""
    m = make_mount(test_faults=True)
    with pytest.raises(control.ControlError) as ei:
        control.call(str(m.store / "control.sock"), "fault", timeout=10, partition=[])
    assert ei.value.errno == errno.EINVAL and "multi-node" in str(ei.value)
    assert "test_faults" in m.log()


# ---------------------------------------------------------------------- other local users

@root_only
def test_another_user_with_allow_other(make_mount, shm_dir):
    """allow_other: another user reads what the modes allow and nothing else, cannot reach
    the control socket, and cannot fill the RAM tier past size= (ENOSPC)."""
    m = make_mount(allow_other=True, size="64M")
    open_to_others(m.mnt)
    mnt = m.mnt
    (mnt / "public").write_bytes(b"p" * 100)
    (mnt / "secret").write_bytes(b"s" * 100)
    os.chmod(mnt / "public", 0o644)
    os.chmod(mnt / "secret", 0o600)
    (mnt / "rootdir").mkdir(mode=0o755)
    (mnt / "shared").mkdir()
    os.chown(mnt / "shared", NOBODY, NOBODY)

    assert as_nobody(lambda: (mnt / "public").read_bytes())["value"] == b"p" * 100
    assert as_nobody(lambda: (mnt / "secret").read_bytes())["errno"] == errno.EACCES
    assert as_nobody(lambda: (mnt / "rootdir" / "f").write_bytes(b"x"))["errno"] \
        == errno.EACCES
    assert as_nobody(lambda: (mnt / "public").write_bytes(b"x"))["errno"] == errno.EACCES
    assert as_nobody(lambda: os.symlink("/etc", mnt / "shared" / "l"))["errno"] \
        == errno.EPERM
    assert sorted(os.listdir(mnt / "rootdir")) == []
    assert (mnt / "public").read_bytes() == b"p" * 100

    # The control socket: its directory is closed to other users...
    sock = str(m.store / "control.sock")
    got = as_nobody(lambda: control.call(sock, "status", timeout=10))
    assert got["errno"] == errno.EACCES and got["value"] is None
    got = as_nobody(lambda: cli.main(["status", str(mnt)]))
    assert got["exit"] == 1
    assert "permission denied: only root and the user who mounted it may use this " \
        "mount's control socket" in got["stderr"], got["stderr"]
    # ...and were the socket world-writable by mistake, the daemon refuses them itself.
    os.chmod(m.store, 0o755)
    os.chmod(sock, 0o666)
    try:
        got = as_nobody(lambda: cli.main(["status", str(mnt)]))
        assert got["exit"] == 1
        assert f"permission denied: only root may use this mount's control socket (you are " \
            f"uid {NOBODY})" in got["stderr"], got["stderr"]
        got = as_nobody(lambda: control.call(sock, "gc", timeout=10))
        assert got["errno"] == errno.EACCES and "only root" in got["message"]
    finally:
        os.chmod(sock, 0o600)
        os.chmod(m.store, 0o700)
    assert m.status()["pid"] == m.pid

    # A directory it may write: bounded by size= (64 MiB), not by the host's memory.
    def fill() -> int:
        written = 0
        block = b"\xa5" * MiB
        with open(mnt / "shared" / "big", "wb") as f:
            for _ in range(256):
                f.write(block)
                written += len(block)
            f.flush()
            os.fsync(f.fileno())
        return written
    got = as_nobody(fill)
    assert got["errno"] == errno.ENOSPC
    assert os.stat(mnt / "shared" / "big").st_uid == NOBODY
    ram = m.status()["ram"]
    assert ram["capacity"] == 64 * MiB and ram["used"] <= 64 * MiB
    held = sum(os.stat(m.store / "data" / n).st_blocks * 512
               for n in os.listdir(m.store / "data"))
    assert held <= 64 * MiB
    # The space is given back: the owner of the directory removes its file.
    assert as_nobody(lambda: os.unlink(mnt / "shared" / "big"))["errno"] == 0


@root_only
def test_without_allow_other_another_user_gets_nothing(make_mount):
    """Without allow_other the kernel lets no other user into the mount, whatever the
    modes: EACCES on the mount point itself."""
    m = make_mount()
    open_to_others(m.mnt)
    (m.mnt / "public").write_bytes(b"p")
    os.chmod(m.mnt / "public", 0o644)
    assert as_nobody(lambda: os.stat(m.mnt))["errno"] == errno.EACCES
    assert as_nobody(lambda: os.listdir(m.mnt))["errno"] == errno.EACCES
    assert as_nobody(lambda: (m.mnt / "public").read_bytes())["errno"] == errno.EACCES
    got = as_nobody(lambda: cli.main(["status", str(m.mnt)]))
    assert got["exit"] == 1
    assert got["stderr"].strip() == (f"mtcfs: cannot read the mtcfs mount at {m.mnt}: "
                                     "Permission denied (EACCES)")


def test_scope_job_refuses_them_on_every_node(make_cluster, shm_dir):
    """scope=job: the same rule on the job-wide namespace; a link that stays inside is
    seen on the other node, one that leaves is refused and reaches no node."""
    c = make_cluster(2, options={"scope": "job", "replicas": 1, "chunk_size": "1M"})
    outside = shm_dir / "outside"
    outside.mkdir()
    a, b = c.node(0).mnt, c.node(1).mnt
    assert err(os.symlink, str(outside), a / "step_30") == errno.EPERM
    (a / "step_29").mkdir()
    assert err(os.symlink, "../..", a / "step_29" / "up") == errno.EPERM
    os.symlink("../step_29", a / "step_29" / "self")
    assert os.readlink(b / "step_29" / "self") == "../step_29"
    assert not os.path.lexists(b / "step_30")
    os.makedirs(b / "step_30", exist_ok=True)
    (b / "step_30" / "w").write_bytes(b"x")
    assert os.listdir(outside) == []
    assert (a / "step_30" / "w").read_bytes() == b"x"
