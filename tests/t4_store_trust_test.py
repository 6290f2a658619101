"""What the daemon reads back from its store is checked before it acts on it (issue 39, items
1, 6 and 7): a store whose marker, metadata, data files or reap/ leftovers do not check out
is refused with one line, exit 2, and nothing in it is created, changed or deleted.

- Item 1: a STORE marker without its metadata (meta.sqlite3 missing, empty, not SQLite, a
  SQLite file without mtcfs's tables) was taken for a new store and every data file deleted.
- Item 6: a mount point inside the store was accepted (the first write then hung the daemon
  and the writer in D state). The tests here never write into such a mount: on code that
  accepts it they fail on "mount succeeded" and the fixture clears it at once.
- Item 7: a foreign directory holding an entry named STORE (not a valid marker) was made
  0700 and given ``lock`` and ``mtcfs.log`` before the mount failed with a traceback's text.

One real store (a mount, a checkpoint written, a clean unmount) is made once per module and
copied for each test; the refusals come from the real ``mtcfs`` command.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from support.mount import (MTCFS, Mount, force_unmount, is_mounted, one_line_error,
                           remove_tree)
from support.tree import snapshot

JOB = "trustjob"


def _mtcfs(job: str, mnt: Path, opts: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(MTCFS + [job, str(mnt), "-o", opts], capture_output=True, text=True,
                          timeout=timeout)


def _kill_mount(mnt: Path) -> None:
    """End whatever daemon serves ``mnt`` (found by its command line) and clear the mount,
    without touching anything through it."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(mnt) in cmd and "mtcfs" in cmd and int(d) != os.getpid():
            try:
                os.kill(int(d), signal.SIGKILL)
            except ProcessLookupError:
                pass
    if is_mounted(str(mnt)):
        force_unmount(str(mnt))


@pytest.fixture
def leftovers():
    """Mount points a test's raw ``mtcfs`` calls may have mounted (on code that accepts what
    it should refuse): killed and cleared afterwards, nothing read or written through them."""
    mnts: list[Path] = []
    yield mnts
    for mnt in mnts:
        _kill_mount(mnt)


@pytest.fixture(scope="module")
def template():
    """A real store: ``step_1`` with two files written through a mount, cleanly unmounted.
    Yields (store directory, {name: bytes})."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing")
    root = Path(tempfile.mkdtemp(prefix="mtcfs-trust-", dir="/dev/shm"))
    m = Mount(root / "m", job=JOB, options={"size": "256M"})
    files = {"a.bin": os.urandom(70_000), "b.bin": os.urandom(5_000)}
    try:
        m.start()
        m.path("step_1").mkdir()
        for name, body in files.items():
            m.path("step_1", name).write_bytes(body)
        m.stop()
        assert len(os.listdir(m.store / "data")) == 2
        yield m.store, files
    finally:
        try:
            m.cleanup()
        finally:
            remove_tree(root)  # its data tmpfs first


@pytest.fixture
def store(template, shm_dir):
    """A copy of the template store in this test's directory."""
    src, _ = template
    dst = shm_dir / "store"
    shutil.copytree(src, dst, symlinks=True)
    os.chmod(dst, 0o700)
    return dst


def _refused_untouched(store: Path, mnt: Path, leftovers: list, *words: str,
                       job: str = JOB) -> str:
    """Mount ``store`` on ``mnt``: it must be refused (exit 2, one line naming ``words``) with
    the store byte for byte as it was. Returns the line."""
    before = snapshot(store)
    mnt.mkdir(exist_ok=True)
    leftovers.append(mnt)
    r = _mtcfs(job, mnt, f"store={store},size=256M")
    assert not is_mounted(str(mnt)), f"mount succeeded: {r.stderr}"
    line = one_line_error(r, 2, *words)
    assert snapshot(store) == before
    return line


# ---------------------------------------------------------------------- item 1

def _remove(p: Path) -> None:
    p.unlink()


def _truncate(p: Path) -> None:
    os.truncate(p, 0)


def _junk_header(p: Path) -> None:
    p.write_bytes(b"x" * 8192)


def _other_sqlite(p: Path) -> None:  # a SQLite database without mtcfs's tables
    p.unlink()
    c = sqlite3.connect(p)
    c.execute("CREATE TABLE t(x)")
    c.commit()
    c.close()


def _tables_dropped(p: Path) -> None:  # mtcfs's database, its namespace tables gone
    c = sqlite3.connect(p)
    c.execute("DROP TABLE inodes")
    c.execute("DROP TABLE versions")
    c.commit()
    c.close()
    for extra in ("-wal", "-shm"):
        Path(str(p) + extra).unlink(missing_ok=True)


def _root_gone(p: Path) -> None:  # the tables are there, empty: it looks like a new store
    c = sqlite3.connect(p)
    c.execute("DELETE FROM inodes")
    c.execute("DELETE FROM dentries")
    c.execute("DELETE FROM versions")
    c.commit()
    c.close()
    for extra in ("-wal", "-shm"):
        Path(str(p) + extra).unlink(missing_ok=True)


def _versions_gone(p: Path) -> None:  # the inodes name versions that have no row
    c = sqlite3.connect(p)
    c.execute("DELETE FROM versions")
    c.commit()
    c.close()
    for extra in ("-wal", "-shm"):
        Path(str(p) + extra).unlink(missing_ok=True)


def _symlink_out(p: Path) -> None:
    outside = p.parent.parent / "outside.sqlite3"
    shutil.copy(p, outside)
    p.unlink()
    p.symlink_to(outside)


def _a_directory(p: Path) -> None:
    p.unlink()
    p.mkdir()


@pytest.mark.parametrize("damage", [_remove, _truncate, _junk_header, _other_sqlite,
                                    _tables_dropped, _root_gone, _versions_gone, _symlink_out, _a_directory],
                         ids=lambda f: f.__name__.strip("_"))
def test_store_without_its_metadata_is_refused_and_kept(store, shm_dir, leftovers, damage):
    damage(store / "meta.sqlite3")
    assert len(os.listdir(store / "data")) == 2
    line = _refused_untouched(store, shm_dir / "mnt", leftovers, str(store), "meta.sqlite3")
    assert "damaged" in line and "mv " in line  # and says how to recover


def test_data_file_that_is_not_a_file_refuses_the_store(store, shm_dir, leftovers):
    # A version's data file replaced by a link to a file outside the store: never followed
    # (it would be served, truncated or deleted as the version's bytes).
    outside = shm_dir / "precious"
    outside.write_bytes(b"not mtcfs's" * 100)
    vid = sorted(os.listdir(store / "data"))[0]
    (store / "data" / vid).unlink()
    (store / "data" / vid).symlink_to(outside)
    _refused_untouched(store, shm_dir / "mnt", leftovers, str(store), f"data/{vid}")
    assert outside.read_bytes() == b"not mtcfs's" * 100


def test_data_directory_entry_that_is_a_directory_refuses_the_store(store, shm_dir, leftovers):
    (store / "data" / "999").mkdir()
    (store / "data" / "999" / "x").write_text("kept")
    _refused_untouched(store, shm_dir / "mnt", leftovers, str(store), "data/999")


def test_reap_directory_linked_out_of_the_store_is_refused(store, shm_dir, leftovers):
    # reap/ is emptied at every start: a link to another directory must not empty that one.
    victim = shm_dir / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    shutil.rmtree(store / "reap", ignore_errors=True)
    (store / "reap").symlink_to(victim)
    _refused_untouched(store, shm_dir / "mnt", leftovers, str(store), "reap")
    assert (victim / "thesis.tex").read_text() == "years of work"


def test_reap_leftovers_that_are_not_data_files_are_kept(template, store, shm_dir):
    # What a crash left to free is freed; anything else in reap/ is not mtcfs's: kept.
    _, files = template
    (store / "reap").mkdir(exist_ok=True)
    (store / "reap" / "7.0").write_bytes(b"r" * 100)  # a data file a crash left to free
    (store / "reap" / "notes").mkdir()
    (store / "reap" / "notes" / "keep.txt").write_text("kept")
    (store / "reap" / "link").symlink_to(shm_dir)
    m = Mount(shm_dir / "m", job=JOB, store=store, options={"size": "256M"})
    try:
        m.start()
        assert m.path("step_1", "a.bin").read_bytes() == files["a.bin"]
        m.stop()
    finally:
        m.cleanup()
    assert sorted(os.listdir(store / "reap")) == ["link", "notes"]
    assert (store / "reap" / "notes" / "keep.txt").read_text() == "kept"


def test_data_directory_missing_keeps_the_namespace(template, store, shm_dir):
    # data/ gone while the metadata lists sealed versions: the files stay, their chunks
    # missing (another tier brings them back), and the metadata is not taken for a new store.
    shutil.rmtree(store / "data")
    m = Mount(shm_dir / "m", job=JOB, store=store, options={"size": "256M"})
    try:
        m.start()
        assert sorted(os.listdir(m.path("step_1"))) == ["a.bin", "b.bin"]
        assert os.stat(m.path("step_1", "a.bin")).st_size == len(template[1]["a.bin"])
        m.stop()
    finally:
        m.cleanup()


# ---------------------------------------------------------------------- item 6

@pytest.mark.parametrize("where", ["data", "subdir", "symlink"])
def test_mount_point_inside_the_store_is_refused(store, shm_dir, leftovers, where):
    if where == "data":
        mnt = store / "data"
    elif where == "subdir":
        mnt = store / "sub"
        mnt.mkdir()
    else:  # a path outside the store that resolves into it
        mnt = shm_dir / "elsewhere"
        mnt.symlink_to(store / "data")
    before = snapshot(store)
    leftovers.append(mnt)
    leftovers.append(store / "data")
    r = _mtcfs(JOB, mnt, f"store={store},size=256M")
    # Never write into it: on code that accepts it, the first write hangs in D state.
    assert not is_mounted(str(mnt)) and not is_mounted(str(store / "data")), \
        f"mount succeeded: {r.stderr}"
    one_line_error(r, 2, "mount point", "inside the store")
    assert snapshot(store) == before


# ---------------------------------------------------------------------- item 7

def _text(p: Path) -> None:
    p.write_text("Shopping list: eggs, milk\n")


def _forty_two(p: Path) -> None:
    p.write_text("42")


def _array(p: Path) -> None:
    p.write_text("[1, 2]")


def _directory(p: Path) -> None:
    p.mkdir()
    (p / "inside.txt").write_text("mine")


def _wrong_types(p: Path) -> None:
    p.write_text(json.dumps({"format": 1, "job": JOB, "chunk_size": "4M", "created": 1.0}))


def _nan(p: Path) -> None:
    p.write_text('{"format": 1, "job": "%s", "chunk_size": 4194304, "created": NaN}' % JOB)


def _link_to_marker(p: Path) -> None:  # a link to a valid marker elsewhere
    real = p.parent.parent / "real-STORE"
    real.write_text(json.dumps({"format": 1, "job": JOB, "chunk_size": 4 << 20,
                                "created": 1.0}))
    p.symlink_to(real)


def _huge(p: Path) -> None:
    p.write_text(json.dumps({"format": 1, "job": JOB, "chunk_size": 4 << 20, "created": 1.0,
                             "pad": "x" * 100_000}))


@pytest.mark.parametrize("marker", [_text, _forty_two, _array, _directory, _wrong_types, _nan,
                                    _link_to_marker, _huge],
                         ids=lambda f: f.__name__.strip("_"))
def test_foreign_directory_with_a_STORE_entry_is_refused_untouched(shm_dir, leftovers, marker):
    foreign = shm_dir / "photos"
    foreign.mkdir()
    os.chmod(foreign, 0o755)
    (foreign / "holiday.jpg").write_bytes(b"\xff\xd8\xff\xe0" + os.urandom(3000))
    marker(foreign / "STORE")
    line = _refused_untouched(foreign, shm_dir / "mnt", leftovers, str(foreign), "STORE")
    assert "Traceback" not in line and "Error:" not in line
    assert stat.S_IMODE(os.stat(foreign).st_mode) == 0o755
    assert not (foreign / "lock").exists() and not (foreign / "mtcfs.log").exists()


def test_store_of_another_job_is_refused_untouched(store, shm_dir, leftovers):
    _refused_untouched(store, shm_dir / "mnt", leftovers, str(store), JOB, "otherjob",
                       job="otherjob")


# ---------------------------------------------------------------------- what a first start leaves

@pytest.mark.parametrize("marker", [False, True], ids=["before-marker", "old-order"])
def test_first_start_that_stopped_early_is_taken_as_new(shm_dir, marker):
    # A first start that stopped before its root directory leaves empty metadata: with no
    # marker yet (this version writes it last) or with it (older versions wrote it first).
    # Nothing in it is anyone's data: it mounts as a new store.
    from mtcfs.core.store.meta import SCHEMA
    store = shm_dir / "store"
    (store / "data").mkdir(parents=True)
    (store / "reap").mkdir()
    (store / "lock").touch()
    (store / "mtcfs.log").write_text("")
    c = sqlite3.connect(store / "meta.sqlite3")
    c.executescript(SCHEMA)
    c.execute("INSERT INTO kv VALUES ('schema_version', '2')")
    c.commit()
    c.close()
    if marker:
        (store / "STORE").write_text(json.dumps({"format": 1, "job": JOB,
                                                 "chunk_size": 4 << 20, "created": 1.0}))
    m = Mount(shm_dir / "m", job=JOB, store=store, options={"size": "256M"})
    try:
        m.start()
        m.path("f").write_bytes(b"new")
        m.stop()
    finally:
        m.cleanup()
    assert json.loads((store / "STORE").read_text())["job"] == JOB
