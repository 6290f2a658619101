"""Whom the CLI talks to (issue 39, item 8; docs/security-local.md).

A subcommand finds its daemon through the ``user.mtcfs.control`` xattr of a mount's root.
Any user may set that xattr on a directory of their own and point it at a socket of their
own, so the CLI uses it only on a real ``fuse.mtcfs`` mount (its line in
/proc/self/mountinfo, read as text), and only a socket that the mount's user owns, in a
directory no one else may write, served by a process of that user or root (SO_PEERCRED).
Every refusal, and every answer it cannot use (not JSON, wrong types, too long), is one
line on stderr and exit status 1, never a traceback.

The fake daemons here are forked children, most of them running as uid 65534 (nobody),
that write down every connection and what it sent; a marker connection made after the
command, and answered after it is written down, shows that the list is complete.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from mtcfs import cli, control
from mtcfs.base import mountinfo
from support.mount import MTCFS, is_mounted

NOBODY = 65534
XATTR = "user.mtcfs.control"
root_only = pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch users")
pytestmark = root_only

#: A status answer that prints with --json (the fake daemon's "this is mine" reply).
FAKE_STATUS = (b'{"ok": true, "result": {"job": "not-yours", "pid": 1, "mountpoint": "/x"}}'
               b"\n")
MARK = "MARK"


class FakeDaemon:
    """A Unix socket server in a forked child, answering every connection with ``reply``.

    Args:
        path: the socket's path.
        reply: the bytes sent to every connection, after what it sent (up to a newline)
            is written down; None: none is ever sent (the connection is kept open).
        uid: the child's uid and gid (0: stays root).
        bind_first: bind (as root) before switching to ``uid``, then listen as ``uid``
            (a root-owned socket file served by another user).
        xattr_on: a directory the child sets ``user.mtcfs.control`` on (as ``uid``),
            naming ``path``.
    """

    def __init__(self, path: Path, reply: bytes | None, uid: int = 0, bind_first: bool = False,
                 xattr_on: Path | None = None) -> None:
        self.path, self.reply, self.uid = path, reply, uid
        self.bind_first, self.xattr_on = bind_first, xattr_on
        self.log = Path(f"{path}.log")

    def __enter__(self) -> "FakeDaemon":
        logfd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            try:
                os.close(r)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                if self.bind_first:
                    s.bind(str(self.path))
                if self.uid:
                    os.setgroups([])
                    os.setgid(self.uid)
                    os.setuid(self.uid)
                if not self.bind_first:
                    s.bind(str(self.path))
                if self.xattr_on is not None:
                    os.setxattr(self.xattr_on, XATTR, os.fsencode(self.path))
                s.listen(16)
                held: list[socket.socket] = []
                os.write(w, b"ready")
                while True:
                    c, _ = s.accept()
                    c.settimeout(10)
                    got = b""
                    try:
                        while b"\n" not in got and len(got) < 1 << 20:
                            data = c.recv(65536)
                            if not data:
                                break
                            got += data
                    except OSError:
                        pass
                    os.write(logfd, json.dumps(got.decode(errors="replace")).encode() + b"\n")
                    if self.reply is None and not got.startswith(MARK.encode()):
                        held.append(c)  # accepted, read, never answered
                        continue
                    try:
                        c.sendall(self.reply or b"")
                    except OSError:
                        pass
                    c.close()
            except BaseException as exc:  # noqa: BLE001 (told to the parent)
                try:
                    os.write(w, repr(exc).encode())
                except OSError:
                    pass
            finally:
                os._exit(0)
        os.close(w)
        os.close(logfd)
        try:
            assert select.select([r], [], [], 10)[0], "the fake daemon did not start"
            said = os.read(r, 4096)
        finally:
            os.close(r)
        if said != b"ready":
            self.__exit__()
            raise RuntimeError(f"the fake daemon failed: {said!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        for p in (self.path, self.log):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def received(self) -> list[str]:
        """What each connection so far sent, in order ("" for one that sent nothing), but
        the markers.
        Complete: a marker connection is made now and its answer waited for, and the child
        serves connections one by one, in the order they came."""
        m = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        m.settimeout(10)
        m.connect(str(self.path))
        m.sendall(MARK.encode() + b"\n")
        while m.recv(65536):
            pass
        m.close()
        got = [json.loads(line) for line in self.log.read_text().splitlines()]
        assert got[-1] == MARK + "\n", got
        return [g for g in got if g != MARK + "\n"]


def run(capsys, *args: str) -> tuple[int, str, str]:
    """``mtcfs ARGS`` in this process: (exit status, stdout, stderr). An exception that is
    not SystemExit (a traceback, for a user) fails the test where it is raised."""
    try:
        cli.main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mtcfs: ") and lines[0].isprintable(), err
    return lines[0]


@pytest.fixture
def fake_mount(shm_dir, monkeypatch):
    """``fake_mount(dir, user_id)``: from now on /proc/self/mountinfo (as the CLI reads it)
    also lists ``dir`` as a fuse.mtcfs mount of uid ``user_id`` (its name escaped as the
    kernel does), on top of the real lines. ``dir`` stays a plain directory."""
    path = shm_dir / "mountinfo"

    def make(d: Path, user_id: int) -> Path:
        with open("/proc/self/mountinfo") as f:
            real = f.read()
        esc = str(d).replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011")
        # the device the directory is on (the CLI reads the xattr from that device only)
        dev = os.stat(d if d.exists() else d.parent).st_dev
        path.write_text(real + f"9999 1 {os.major(dev)}:{os.minor(dev)} / {esc} rw,nosuid,"
                        "nodev,relatime - fuse.mtcfs "
                        f"fake rw,user_id={user_id},group_id={user_id},default_permissions\n")
        monkeypatch.setattr(mountinfo, "MOUNTINFO", str(path))
        return d
    return make


def nobody_home(shm_dir: Path) -> Path:
    """A directory of uid 65534 that it may write (and root's shm_dir opened to reach it)."""
    os.chmod(shm_dir, 0o755)
    home = shm_dir / "home"
    home.mkdir(mode=0o700)
    os.chown(home, NOBODY, NOBODY)
    return home


# ---------------------------------------------------------------------- the reproduction

def test_a_users_forged_xattr_gets_no_request_from_root(shm_dir, capsys):
    """The issue's reproduction: uid 65534 sets user.mtcfs.control on its own directory,
    naming its own socket. Root's `mtcfs status DIR` and `mtcfs seal DIR/step` (and every
    other subcommand) say in one line that DIR is not on an mtcfs mount, and the fake
    daemon gets no connection at all."""
    home = nobody_home(shm_dir)
    with FakeDaemon(home / "evil.sock", FAKE_STATUS, uid=NOBODY, xattr_on=home) as fake:
        assert os.getxattr(home, XATTR) == os.fsencode(home / "evil.sock")
        for args in (["status", str(home)], ["status", str(home), "--json"],
                     ["seal", str(home / "step_1")]):
            r = subprocess.run(MTCFS + args, capture_output=True, text=True, timeout=60)
            assert (r.returncode, r.stdout) == (1, ""), (args, r)
            assert r.stderr.splitlines() == [f"mtcfs: {args[1]} is not on an mtcfs mount"], \
                (args, r.stderr)
        for args in (["metrics", str(home)], ["checkpoints", str(home)], ["gc", str(home)],
                     ["verify", str(home)], ["backup", str(home)],
                     ["restore", str(home), "--no-wait"], ["status", str(home / "a" / "b")]):
            code, out, err = run(capsys, *args)
            assert (code, out) == (1, ""), (args, out, err)
            assert one_line(err) == f"mtcfs: {args[1]} is not on an mtcfs mount"
        code, out, err = run(capsys, "umount", str(home))
        assert (code, out) == (1, "")
        assert one_line(err) == f"mtcfs: {home} is not mounted"
        assert fake.received() == []


# ---------------------------------------------------------------------- the socket's owner

def test_only_a_socket_of_the_mounts_user_is_used(shm_dir, fake_mount, capsys):
    """On a fuse.mtcfs mount (here: as mountinfo lists it, with a space in its name) the
    socket its root names is used only if the mount's user owns it, in a directory no one
    else may write, and a process of that user or root serves it: else one line, exit 1,
    and no request reaches that socket. Root may use the daemon of another user's mount."""
    home = nobody_home(shm_dir)
    mnt = shm_dir / "mnt x"
    mnt.mkdir()

    def status(*more: str) -> tuple[int, str, str]:
        return run(capsys, "status", str(mnt), *more)

    # Another user's socket on root's mount: refused before any connection.
    fake_mount(mnt, 0)
    with FakeDaemon(home / "s", FAKE_STATUS, uid=NOBODY) as fake:
        os.setxattr(mnt, XATTR, os.fsencode(home / "s"))
        for args in (["status", str(mnt)], ["seal", str(mnt / "step_1")]):
            code, out, err = run(capsys, *args)
            assert (code, out) == (1, "")
            assert one_line(err) == (
                f"mtcfs: refusing {home}/s, the control socket the mtcfs mount at {mnt} "
                f"names: it is owned by uid {NOBODY}, not by uid 0, the user who mounted it")
        assert fake.received() == []

        # The same socket on that user's own mount: root may use it (and gets its answer).
        fake_mount(mnt, NOBODY)
        code, out, err = status("--json")
        assert (code, err) == (0, "")
        assert json.loads(out)["job"] == "not-yours"
        code, out, err = run(capsys, "seal", str(mnt / "step_1"))
        assert (code, out) == (1, "")  # its answer has no step: one line, no traceback
        one_line(err)
        assert [json.loads(r) for r in fake.received()] == [
            {"cmd": "status"}, {"cmd": "seal", "path": "step_1"}]

    # Root's socket file, but listened on by another user: refused after connect(), before
    # a byte of the request is sent.
    fake_mount(mnt, 0)
    private = shm_dir / "store"
    private.mkdir(mode=0o700)
    with FakeDaemon(private / "control.sock", FAKE_STATUS, uid=NOBODY, bind_first=True) \
            as fake:
        assert os.stat(private / "control.sock").st_uid == 0
        os.setxattr(mnt, XATTR, os.fsencode(private / "control.sock"))
        code, out, err = status()
        assert (code, out) == (1, "")
        assert one_line(err) == (f"mtcfs: refusing the control socket {private}/control.sock:"
                                 f" the process serving it runs as uid {NOBODY}, not as root")
        assert fake.received() == [""]

    with FakeDaemon(private / "control.sock", FAKE_STATUS) as fake:
        os.setxattr(mnt, XATTR, os.fsencode(private / "control.sock"))
        # A directory that others may write: the socket in it could be anyone's.
        os.chmod(private, 0o777)
        code, out, err = status()
        assert (code, out) == (1, "")
        assert one_line(err) == (
            f"mtcfs: refusing {private}/control.sock, the control socket the mtcfs mount at "
            f"{mnt} names: its directory {private} may be written by other users (mode 0777)")
        os.chmod(private, 0o700)
        # A symlink to the socket, a relative name, a path inside the mount itself.
        os.symlink(private / "control.sock", shm_dir / "link")
        for named, why in ((str(shm_dir / "link"), "it is not a socket"),
                           ("control.sock", "not an absolute path"),
                           (str(mnt / "control.sock"), "it is inside the mount itself")):
            os.setxattr(mnt, XATTR, named.encode())
            code, out, err = status()
            assert (code, out) == (1, "")
            assert one_line(err).endswith(why), err
        assert fake.received() == []
        # All in order: root's socket in root's 0700 directory, served by root.
        os.setxattr(mnt, XATTR, os.fsencode(private / "control.sock"))
        code, out, err = status("--json")
        assert (code, err) == (0, "")
        assert json.loads(out)["job"] == "not-yours"
        assert [json.loads(r) for r in fake.received()] == [{"cmd": "status"}]


# ---------------------------------------------------------------------- hostile answers

HOSTILE = {
    "not JSON": b"<html>hello</html>\n",
    "a list": b"[1, 2]\n",
    "a number for a result": b'{"ok": true, "result": 5}\n',
    "wrong types": (b'{"ok": true, "result": {"step": [1], "ram": "x", "pid": "x", "job": {},'
                    b' "mismatches": 3, "errors": 5, "imported": 1, "bytes": "x",'
                    b' "evicted": 7, "last_step": [], "last_seconds": "x"}}\n'),
    "an error of wrong types": b'{"ok": false, "error": {"a": 1}, "errno": "EIO"}\n',
    "bad progress": b'{"progress": "x"}\n{"ok": true, "result": {}}\n',
    "deep nesting": b"[" * 100000 + b"\n",
    "too long": b'{"ok": true, "result": "' + b"x" * 5000 + b'"}\n',
    "nothing": b"",
    "terminal escapes": b'{"ok": false, "error": "bad\\n\\u001b[2Jnews\\r"}\n',
}


def _root_owned_fake(shm_dir: Path, fake_mount) -> tuple[Path, Path]:
    """A fake mtcfs mount of root whose control xattr names a socket in a 0700 directory
    of root: every check passes, so what answers there is what the CLI talks to. Returns
    (mount point, socket path)."""
    mnt = fake_mount(shm_dir / "mnt", 0)
    mnt.mkdir()
    private = shm_dir / "store"
    private.mkdir(mode=0o700)
    sock = private / "control.sock"
    os.setxattr(mnt, XATTR, os.fsencode(sock))
    return mnt, sock


def test_a_hostile_answer_is_one_line_and_no_traceback(shm_dir, fake_mount, capsys,
                                                         monkeypatch):
    """A daemon that passes every check may still answer nonsense (a bug, or a user's own
    fake FUSE mount named mtcfs): every subcommand then exits 1 with one printable line on
    stderr and prints nothing on stdout (but `--json`, which prints a JSON object of the
    right kind as it came)."""
    monkeypatch.setattr(control, "MAX_REPLY", 1024)
    mnt, sock = _root_owned_fake(shm_dir, fake_mount)
    commands = [["status", str(mnt)], ["status", str(mnt), "--json"], ["metrics", str(mnt)],
                ["checkpoints", str(mnt)], ["checkpoints", str(mnt), "--json"],
                ["restore", str(mnt)], ["seal", str(mnt / "step_1")], ["gc", str(mnt)],
                ["verify", str(mnt)], ["backup", str(mnt)], ["umount", str(mnt)]]
    for name, reply in HOSTILE.items():
        with FakeDaemon(sock, reply) as fake:
            for args in commands:
                code, out, err = run(capsys, *args)
                if name == "wrong types" and "--json" in args and args[0] == "status":
                    # --json passes an object on as it came (its consumer reads the fields)
                    assert (code, err) == (0, "") and json.loads(out)["ram"] == "x"
                    continue
                assert (code, out) == (1, ""), (name, args, code, out, err)
                line = one_line(err)
                assert "\x1b" not in line and len(line) < 1000, (name, args, line)
            assert len(fake.received()) == len(commands), name


def test_a_daemon_that_never_answers_status_ends_the_command(shm_dir, fake_mount, capsys,
                                                            monkeypatch):
    """A daemon (a stuck one, or a user's own FUSE mount calling itself mtcfs) that accepts
    `status` and `checkpoints` and never answers: the command ends with one line and exit 1
    after cli.QUICK_ANSWER_S (60 s; 0.5 s here). Before, root's `mtcfs status` waited for
    good."""
    monkeypatch.setattr(cli, "QUICK_ANSWER_S", {"status": 0.5, "checkpoints": 0.5})
    mnt, sock = _root_owned_fake(shm_dir, fake_mount)
    with FakeDaemon(sock, None):
        for args in (["status", str(mnt)], ["metrics", str(mnt)], ["checkpoints", str(mnt)]):
            t0 = time.monotonic()
            code, out, err = run(capsys, *args)
            assert (code, out) == (1, ""), (args, code, out, err)
            assert "did not arrive" in one_line(err) and time.monotonic() - t0 < 10, err


# ---------------------------------------------------------------------- a real mount

def test_a_real_mount_with_a_space_in_its_name(make_mount, capsys, monkeypatch):
    """A real mount (mountinfo writes its name with ``\\040``): the subcommands find its
    daemon, also from a path below it that does not exist; one whose daemon is stopped
    is reported in one line after a bounded wait; `umount --force` finds the mount."""
    m = make_mount(name="a b")
    assert " " in str(m.mnt) and m.status()["pid"] == m.pid
    r = m.cli("status", str(m.path("no", "such")))
    assert r.stdout.startswith(f"job testjob at {m.mnt} ")
    d = cli.find_control_socket(str(m.path("no", "such")))
    assert (d.sock, d.root, d.owner) == (str(m.store / "control.sock"), str(m.mnt), 0)

    monkeypatch.setattr(cli, "XATTR_TIMEOUT_S", 0.5)
    os.kill(m.pid, signal.SIGSTOP)
    try:
        m.wait_for(lambda: all_stopped(m.pid), 10, "every thread of the daemon to stop")
        code, out, err = run(capsys, "status", str(m.mnt))
        assert (code, out) == (1, "")
        assert one_line(err) == (
            f"mtcfs: the mtcfs mount at {m.mnt} does not answer (nothing in 0.5 s): its daemon "
            f"is stopped or stuck; `mtcfs umount --force {m.mnt}` clears it")
    finally:
        os.kill(m.pid, signal.SIGCONT)
    os.kill(m.pid, signal.SIGKILL)
    m.wait_for(lambda: not os.path.exists(f"/proc/{m.pid}"), 10, "the daemon to die")
    r = m.cli("umount", "--force", str(m.mnt), check=False)
    assert (r.returncode, r.stderr) == (0, "")
    assert not is_mounted(str(m.mnt))
    m.pid = None


def all_stopped(pid: int) -> bool:
    """Every thread of process ``pid`` is stopped (state T in /proc/PID/task/*/stat)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return all(st == "T" for st in states)


def test_umount_force_leaves_other_filesystems_alone(shm_dir):
    """`mtcfs umount --force` of a mount that is not mtcfs (here a tmpfs) refuses in one
    line and leaves it mounted (it used to detach whatever was there)."""
    d = shm_dir / "t"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "none", str(d)], check=True)
    try:
        (d / "f").write_bytes(b"kept")
        for args in (["umount", "--force", str(d)], ["umount", str(d)]):
            r = subprocess.run(MTCFS + args, capture_output=True, text=True, timeout=60)
            assert (r.returncode, r.stdout) == (1, "")
            assert r.stderr.splitlines() == [
                f"mtcfs: {d} is not an mtcfs mount (it is tmpfs): mtcfs umount leaves it "
                "alone"], r.stderr
            assert is_mounted(str(d)) and (d / "f").read_bytes() == b"kept"
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_mountinfo_lines_are_read_as_the_kernel_writes_them(tmp_path, monkeypatch):
    """Escapes undone in every field, the super options parsed, the mount on top of a stack
    chosen, and a line not of the form skipped."""
    info = tmp_path / "mountinfo"
    info.write_text(
        "1 0 0:1 / / rw - overlay overlay rw\n"
        "2 1 0:2 / /m\\040x rw shared:1 - tmpfs tmpfs rw,size=1k\n"
        "3 2 0:3 / /m\\040x rw - fuse.mtcfs j\\040b rw,user_id=1000,group_id=1000,"
        "default_permissions\n"
        "garbage line\n"
        "4 1 0:4 / /n rw - fuse.mtcfs j rw,user_id=x\n")
    monkeypatch.setattr(mountinfo, "MOUNTINFO", str(info))
    top = mountinfo.entry_at("/m x")
    assert top is not None
    assert (top.device, top.mount_point, top.fstype, top.source, top.owner) == \
        ("0:3", "/m x", "fuse.mtcfs", "j b", 1000)
    assert top.super_options == {"rw": None, "user_id": "1000", "group_id": "1000",
                                 "default_permissions": None}
    assert mountinfo.entry_of("/m x/a/b") == top
    assert mountinfo.entry_of("/m xy").mount_point == "/"
    assert mountinfo.is_mounted("/m x") and mountinfo.device_of("/m x") == "0:3"
    assert mountinfo.entry_at("/n").owner is None
    assert [mp for mp, _ in mountinfo.mounts()] == ["/", "/m x", "/m x", "/n"]


def test_the_peer_check_of_the_control_client(tmp_path):
    """control.request on its own: by default only a daemon of root or of the caller's own
    uid is talked to; a socket served by another uid gets no request."""
    sock = tmp_path / "s"
    os.chmod(tmp_path, 0o755)
    with FakeDaemon(sock, FAKE_STATUS, uid=NOBODY, bind_first=True) as fake:
        with pytest.raises(control.ControlError) as ei:
            control.call(str(sock), "status", timeout=10)
        assert str(ei.value) == (f"refusing the control socket {sock}: the process serving "
                                 f"it runs as uid {NOBODY}, not as root")
        assert control.call(str(sock), "status", timeout=10,
                            peer_uids=frozenset({0, NOBODY}))["job"] == "not-yours"
        assert fake.received() == ["", '{"cmd": "status"}\n']
