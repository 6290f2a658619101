"""A review of issue 39's store and CLI checks (items 1, 6, 7 and 8), as an unlucky operator
and a hostile local user would try them: each test here failed on the merged code.

- A store left by a crash and then copied or restored without SQLite's ``-shm`` index (its
  WAL kept): the mount command's check skipped its metadata, so a damaged one was refused
  only by the daemon, with exit 1 (docs/usage.md: exit 2) and a ``-shm`` created in it.

Real mounts through the ``mtcfs`` command; one crash-left store is made once per module and
copied for each test.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import sqlite3
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from support.mount import MTCFS, Mount, force_unmount, is_mounted, remove_tree
from support.tree import snapshot

JOB = "reviewjob"


def _mount_cmd(mnt: Path, store: Path) -> subprocess.CompletedProcess:
    mnt.mkdir(exist_ok=True)
    try:
        return subprocess.run(MTCFS + [JOB, str(mnt), "-o", f"store={store},size=256M"],
                              capture_output=True, text=True, timeout=60)
    finally:
        if is_mounted(str(mnt)):  # accepted what it should refuse: clear it, touch nothing
            subprocess.run(MTCFS + ["umount", str(mnt)], capture_output=True, timeout=60)
            if is_mounted(str(mnt)):
                force_unmount(str(mnt))


@pytest.fixture(scope="module")
def crashed():
    """A store left by kill -9 just after ``step_1`` was written (its WAL and -shm there).
    Yields (store directory, {name: bytes})."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing")
    root = Path(tempfile.mkdtemp(prefix="mtcfs-review-", dir="/dev/shm"))
    m = Mount(root / "m", job=JOB, options={"size": "256M"})
    files = {"a.bin": os.urandom(70_000), "b.bin": os.urandom(5_000)}
    try:
        m.start()
        m.path("step_1").mkdir()
        for name, body in files.items():
            m.path("step_1", name).write_bytes(body)
        for name in files:
            m.wait_state(f"step_1/{name}", "local", timeout=20)
        m.kill9()
        assert os.path.exists(m.store / "meta.sqlite3-wal")
        yield m.store, files
    finally:
        try:
            m.cleanup()
        finally:
            remove_tree(root)  # its data tmpfs first


def _copy_without_shm(src: Path, dst: Path) -> None:
    """``src`` copied as a backup tool that skips SQLite's ``-shm`` index would."""
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("*-shm", "control.sock"))
    os.chmod(dst, 0o700)


# ------------------------------------------------- a WAL without its -shm (copied, restored)

def test_restored_store_with_a_wal_and_no_shm_mounts_with_every_file(crashed, shm_dir):
    src, files = crashed
    store = shm_dir / "store"
    _copy_without_shm(src, store)
    m = Mount(shm_dir / "m", job=JOB, store=store, options={"size": "256M"})
    try:
        m.start()
        for name, body in files.items():
            assert m.path("step_1", name).read_bytes() == body
        m.stop()
    finally:
        m.cleanup()


def test_damaged_store_with_a_wal_and_no_shm_is_refused_exit_2_untouched(crashed, shm_dir):
    # The damage (every version row gone) is in the WAL only; the copy has no -shm. Before:
    # the mount command skipped the metadata (reading it would create -shm), the daemon
    # refused it after its lock: exit 1, and a -shm created in the store.
    src, _ = crashed
    work = shm_dir / "work"
    shutil.copytree(src, work, symlinks=True, ignore=shutil.ignore_patterns("control.sock"))
    c = sqlite3.connect(work / "meta.sqlite3", isolation_level=None)
    try:
        c.execute("PRAGMA wal_autocheckpoint=0")
        c.execute("DELETE FROM versions")
        store = shm_dir / "store"
        _copy_without_shm(work, store)  # while the change is in the WAL only
    finally:
        c.close()
    assert not (store / "meta.sqlite3-shm").exists()
    assert (store / "meta.sqlite3-wal").stat().st_size > 0
    before = snapshot(store)
    r = _mount_cmd(shm_dir / "mnt", store)
    lines = r.stderr.strip().splitlines()
    assert (r.returncode, len(lines)) == (2, 1), (r.returncode, r.stderr)
    assert "damaged" in lines[0] and "has no row" in lines[0], lines[0]
    assert snapshot(store) == before


# ------------------------------------------------- a store another local user can replace

NOBODY = 65534


@pytest.mark.parametrize("how", ["parent-of-another-user", "parent-writable-by-all",
                                 "store-of-another-user"])
def test_store_another_user_can_replace_is_refused_untouched(crashed, shm_dir, how):
    parent = shm_dir / "parent"
    parent.mkdir()
    store = parent / "store"
    if how == "parent-of-another-user":  # /dev/shm/mtcfs made by a local user beforehand
        os.chown(parent, NOBODY, NOBODY)
    elif how == "parent-writable-by-all":
        os.chmod(parent, 0o777)
    else:  # a store (a real one) whose directory that user owns
        shutil.copytree(crashed[0], store, symlinks=True,
                        ignore=shutil.ignore_patterns("control.sock"))
        os.chown(store, NOBODY, NOBODY)
    before = snapshot(parent)
    r = _mtcfs_refused(shm_dir / "mnt", store)
    assert "another user could replace" in r, r
    assert ("uid 65534" if "another-user" in how else "written by other users") in r, r
    assert snapshot(parent) == before


def _mtcfs_refused(mnt: Path, store: Path) -> str:
    """Mount ``store`` on ``mnt``: exit 2 and one line, which it returns."""
    r = _mount_cmd(mnt, store)
    lines = r.stderr.strip().splitlines()
    assert (r.returncode, len(lines)) == (2, 1), (r.returncode, r.stderr)
    return lines[0]


# ------------------------------------------------- a mount covered by another one

def _serve_once_per_connection(sock: Path, reply: bytes, got: list[bytes]) -> socket.socket:
    """A root daemon of another kind at ``sock``: each connection's request goes to ``got``,
    then ``reply`` is sent. Returns the listening socket (close it to stop)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock))
    srv.listen(4)

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                c.settimeout(10)
                try:
                    got.append(c.recv(65536))
                    c.sendall(reply)
                except OSError:
                    pass
    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_a_covered_mount_is_not_answered_for_by_what_covers_it(shm_dir):
    # Root's mtcfs mount at P/a/ckpt; something else is then mounted on P/a (here a bind
    # mount; a user's own FUSE filesystem with allow_other does the same), holding a ckpt
    # directory whose user.mtcfs.control names another root daemon's socket. mountinfo
    # still lists the mtcfs mount at P/a/ckpt. Before: `mtcfs status P/a/ckpt` printed that
    # other daemon's answer (exit 0), which got root's request.
    m = Mount(shm_dir / "m", job=JOB, mnt=shm_dir / "p" / "a" / "ckpt",
              options={"size": "256M"})
    cover = shm_dir / "cover"
    (cover / "ckpt").mkdir(parents=True)
    private = shm_dir / "other"
    private.mkdir(mode=0o700)
    got: list[bytes] = []
    srv = _serve_once_per_connection(
        private / "control.sock",
        b'{"ok": true, "result": {"job": "impostor", "pid": 1, "mountpoint": "/x"}}\n', got)
    os.setxattr(cover / "ckpt", "user.mtcfs.control", os.fsencode(private / "control.sock"))
    covered = False
    try:
        m.start()
        subprocess.run(["mount", "--bind", str(cover), str(shm_dir / "p" / "a")], check=True)
        covered = True
        r = subprocess.run(MTCFS + ["status", str(m.mnt), "--json"], capture_output=True,
                           text=True, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert (r.returncode, r.stdout, len(lines)) == (1, "", 1), (r.returncode, r.stdout,
                                                                    r.stderr)
        assert str(m.mnt) in lines[0] and "covered" in lines[0], lines[0]
        assert got == []
    finally:
        if covered:
            subprocess.run(["umount", "-l", str(shm_dir / "p" / "a")], capture_output=True)
        srv.close()
        m.cleanup()


# ------------------------------------------------- a first start killed while making its schema

@pytest.mark.parametrize("stopped", ["after-first-table", "before-schema-version"])
def test_first_start_killed_while_making_its_schema_is_taken_as_new(shm_dir, stopped):
    # What MetaDB leaves when killed there (no marker yet: it is written last): the tables
    # created so far, committed one by one, no schema_version in kv; lock, mtcfs.log and
    # empty data/ and reap/. Before: refused, "damaged, ... lacks mtcfs's tables (...)" or
    # "... records no schema version", exit 2, on every mount until moved aside by hand.
    from mtcfs.core.store.meta import SCHEMA
    store = shm_dir / "store"
    (store / "data").mkdir(parents=True)
    (store / "reap").mkdir()
    (store / "lock").touch()
    (store / "mtcfs.log").write_text("")
    c = sqlite3.connect(store / "meta.sqlite3", isolation_level=None)
    c.execute("PRAGMA journal_mode=WAL")
    c.executescript(SCHEMA)
    if stopped == "after-first-table":  # only the first CREATE TABLE committed
        for (name,) in c.execute("SELECT name FROM sqlite_master WHERE type='table'"
                                 " AND name != 'inodes'").fetchall():
            c.execute(f"DROP TABLE {name}")
    c.close()
    m = Mount(shm_dir / "m", job=JOB, store=store, options={"size": "256M"})
    try:
        m.start()
        m.path("f").write_bytes(b"new")
        m.stop()
    finally:
        m.cleanup()
    assert json.loads((store / "STORE").read_text())["job"] == JOB  # a store of its own now


def test_the_store_check_knows_every_table_of_the_schema():
    # (in-process) a first start's partial schema is told from a foreign database by name
    from mtcfs.core.store import _MTCFS_TABLES
    from mtcfs.core.store.meta import SCHEMA
    c = sqlite3.connect(":memory:")
    c.executescript(SCHEMA)
    assert {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='table'")} \
        == _MTCFS_TABLES


# ------------------------------------------------- a mount point inside the store, by a bind mount

def test_mount_point_inside_the_store_through_a_bind_mount_is_refused(crashed, shm_dir):
    # T is a shared tmpfs (mounts below it propagate to its bind mounts, as under systemd);
    # the store is T/store, given as B, a bind mount of it; the mount point T/store/data.
    # Never written through: on code that accepts it, the first write hangs in D state.
    t, b = shm_dir / "t", shm_dir / "b"
    t.mkdir()
    b.mkdir()
    mnt = t / "store" / "data"
    mounted: list[Path] = []
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "review", str(t)],
                       check=True)
        mounted.append(t)
        subprocess.run(["mount", "--make-shared", str(t)], check=True)
        shutil.copytree(crashed[0], t / "store", symlinks=True,
                        ignore=shutil.ignore_patterns("control.sock"))
        subprocess.run(["mount", "--bind", str(t / "store"), str(b)], check=True)
        mounted.append(b)
        before = snapshot(t / "store")
        r = subprocess.run(MTCFS + [JOB, str(mnt), "-o", f"store={b},size=32M"],
                           capture_output=True, text=True, timeout=60)
        accepted = is_mounted(str(mnt)) or is_mounted(str(b / "data"))
        for p in (mnt, b / "data"):
            if is_mounted(str(p)):
                force_unmount(str(p))
        lines = r.stderr.strip().splitlines()
        assert not accepted and (r.returncode, len(lines)) == (2, 1), (r.returncode, r.stderr)
        assert "mount point" in lines[0] and "inside the store" in lines[0], lines[0]
        assert snapshot(t / "store") == before
    finally:
        for p in reversed(mounted):
            subprocess.run(["umount", "-l", str(p)], capture_output=True)


# ------------------------------------------------- entries of the store that another user made

@pytest.mark.parametrize("how", ["new-store-data-planted", "store-data-of-another-user"])
def test_store_entries_of_another_user_are_refused_untouched(crashed, shm_dir, how):
    if how == "new-store-data-planted":
        # store= is the root of a tmpfs mounted for it (mode 1777, root's); before the first
        # mount another user made data/ there, empty.
        store = shm_dir / "ram"
        store.mkdir()
        os.chmod(store, 0o1777)
        for name in ("data", "reap"):
            (store / name).mkdir()
            os.chown(store / name, NOBODY, NOBODY)
    else:
        store = shm_dir / "store"
        shutil.copytree(crashed[0], store, symlinks=True,
                        ignore=shutil.ignore_patterns("control.sock"))
        os.chown(store / "data", NOBODY, NOBODY)
    before = snapshot(store)
    line = _mtcfs_refused(shm_dir / "mnt", store)
    assert "data" in line and f"uid {NOBODY}" in line, line
    assert snapshot(store) == before


def test_a_store_directory_others_may_write_is_closed_before_it_is_checked(shm_dir):
    # store= is the 1777 root of a tmpfs mounted for it. The daemon is held (failpoint)
    # after its check under the lock; uid 65534 then tries to make data/ in it. Before: the
    # directory was made 0700 only after that check, so data/ was made and the daemon kept
    # its data files there. Now it is closed before the lock is even taken.
    os.chmod(shm_dir, 0o755)  # others may reach it, as /dev/shm's children
    store = shm_dir / "ram"
    store.mkdir()
    os.chmod(store, 0o1777)
    mnt = shm_dir / "mnt"
    mnt.mkdir()
    env = dict(os.environ, MTCFS_FAILPOINTS="store.checked=sleep(2)")
    cmd = subprocess.Popen(MTCFS + [JOB, str(mnt), "-o", f"store={store},size=32M"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 30
        while True:  # until the daemon holds the store's lock
            assert time.monotonic() < deadline and cmd.poll() is None, cmd.poll()
            try:
                fd = os.open(store / "lock", os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                break
            finally:
                os.close(fd)
        pid = os.fork()
        if pid == 0:  # uid 65534 tries to make data/ in the store
            code = 1
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                os.mkdir(store / "data")
                code = 0
            except OSError as exc:
                code = 13 if exc.errno == errno.EACCES else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out, err = cmd.communicate(timeout=60)
        assert (cmd.returncode, err) == (0, ""), (cmd.returncode, err)
        assert os.waitstatus_to_exitcode(status) == 13  # EACCES: the store was closed
        assert os.stat(store / "data").st_uid == 0
    finally:
        if cmd.poll() is None:
            cmd.kill()
            cmd.wait()
        if is_mounted(str(mnt)):
            subprocess.run(MTCFS + ["umount", str(mnt)], capture_output=True, timeout=60)
            if is_mounted(str(mnt)):
                force_unmount(str(mnt))


# ------------------------------------------------- the daemon's log in its store

def test_the_daemons_log_never_follows_a_link_planted_in_its_store(shm_dir):
    # (in-process) The mount command's child opens <store>/mtcfs.log before the store is
    # checked under its lock and closed: in a store directory others may write, another
    # user can put a link there after the command's check. Before: it was followed, and
    # root's log lines were appended to the file it names.
    import logging

    from mtcfs import cli
    victim = shm_dir / "victim"
    victim.write_bytes(b"root:x:0:0\n")
    log = shm_dir / "mtcfs.log"
    log.symlink_to(victim)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    raised = None
    try:
        try:
            cli._setup_logging(False, str(log))
            logging.getLogger("mtcfs").warning("a line of root's log")
        except OSError as exc:
            raised = exc
    finally:
        for h in root.handlers:
            if h not in saved[0]:
                h.close()
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert victim.read_bytes() == b"root:x:0:0\n"
    assert raised is not None and "mtcfs.log" in str(raised), raised
