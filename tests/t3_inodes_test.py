"""The inode table (core/inodes.py) alone, on a store in-process (no FUSE, no core).

Each test ends with the consistency check: a table loaded again from the same store holds
every inode, entry and xattr the table in memory holds (its rows match), every entry's
child points back to a name it has, every inode's parent/name is an entry of its parent,
and a directory's nlink is 2 plus its subdirectories.
"""

from __future__ import annotations

import errno
import stat
from pathlib import Path

import pytest
from support.corefs import CS

from mtcfs.base.errors import FsError
from mtcfs.core.inodes import NAME_MAX, InodeTable
from mtcfs.core.model import ROOT_INO, Inode
from mtcfs.core.store import Store

SIZES = {7: 12345}  # vid -> size, what the facade's versions would answer


def open_table(store: Store) -> InodeTable:
    """A table loaded from ``store`` (its root created if the store is new), as
    ``Filesystem._load`` does."""
    t = InodeTable(store.db, size_of=SIZES.__getitem__)
    if store.db.execute("SELECT 1 FROM inodes WHERE ino=?", (ROOT_INO,)).fetchone() is None:
        with store.db.transaction():
            t.create_root()
    t.load()
    return t


@pytest.fixture
def store(tmp_path: Path):
    s = Store(str(tmp_path / "store"), "job", CS)
    yield s
    s.close()


def fields(i: Inode) -> tuple:
    return (i.ino, i.kind, i.mode, i.uid, i.gid, i.nlink, i.atime_ns, i.mtime_ns, i.ctime_ns,
            i.target, i.vid, i.parent, i.name, i.rdev, i.children, i.xattrs)


def consistent(t: InodeTable, store: Store) -> None:
    again = open_table(store)
    assert {n: fields(i) for n, i in again.inodes.items()} == \
        {n: fields(i) for n, i in t.inodes.items()}
    assert again.next_ino == t.next_ino
    rows = {(p, bytes(n), c) for p, n, c in store.db.execute(
        "SELECT parent, name, ino FROM dentries")}
    assert rows == {(d.ino, name, c) for d in t.inodes.values() if d.children
                    for name, c in d.children.items()}
    for d in t.inodes.values():
        for name, num in (d.children or {}).items():
            child = t.inodes[num]
            if child.is_dir:  # one name only
                assert (child.parent, child.name) == (d.ino, name)
            else:  # hard links: the name it records is one of its entries
                assert t.inodes[child.parent].children[child.name] == num
        if d.is_dir and (d.parent or d.ino == ROOT_INO):
            subdirs = sum(t.inodes[c].is_dir for c in d.children.values())
            assert d.nlink == 2 + subdirs, d
    for i in t.inodes.values():
        if i.parent:
            assert t.inodes[i.parent].children[i.name] == i.ino
        assert t.get(i.ino) is i
    for kid, num in t.aliases.items():
        # (a renumbered inode's older kernel numbers name it too, until it goes)
        assert 0 < kid <= t.inodes[num].kid and t.get(kid) is t.inodes[num]


def mkdir(t: InodeTable, db, parent: Inode, name: bytes) -> Inode:
    """What a namespace op does around the table: new, link, counts, rows."""
    with db.transaction():
        t.check_name(name)
        d = t.new("dir", stat.S_IFDIR | 0o755, 0, 0)
        t.link(parent, name, d)
        parent.nlink += 1
        t.write(d)
        t.touch(parent)
    return d


def mkfile(t: InodeTable, db, parent: Inode, name: bytes, vid: int | None = None) -> Inode:
    with db.transaction():
        t.check_name(name)
        f = t.new("file", stat.S_IFREG | 0o644, 1, 2)
        f.vid = vid
        t.link(parent, name, f)
        t.write(f)
        t.touch(parent)
    return f


def unlink(t: InodeTable, db, parent: Inode, name: bytes) -> Inode:
    with db.transaction():
        f = t.child(parent, name)
        t.unlink(parent, name)
        f.nlink -= 1
        if f.parent == parent.ino and f.name == name:
            f.parent, f.name = 0, b""
        t.write(f)
        t.touch(parent)
    return f


def code(exc: pytest.ExceptionInfo[FsError]) -> int:
    return exc.value.errno


def test_new_link_child_and_their_errors(store):
    t = open_table(store)
    db = store.db
    root = t.get(ROOT_INO)
    assert root.is_dir and root.nlink == 2 and root.children == {}
    d = mkdir(t, db, root, b"step_1")
    f = mkfile(t, db, d, b"x.bin", vid=7)
    assert d.ino == 2 and f.ino == 3 and t.next_ino == 4
    assert t.child(root, b"step_1") is d and t.child(d, b"x.bin") is f
    assert t.dir(d.ino) is d and t.get(f.ino) is f
    assert (f.parent, f.name, f.nlink) == (d.ino, b"x.bin", 1) and root.nlink == 3
    with pytest.raises(FsError) as e:
        t.get(999)
    assert code(e) == errno.ENOENT
    with pytest.raises(FsError) as e:
        t.dir(f.ino)
    assert code(e) == errno.ENOTDIR
    with pytest.raises(FsError) as e:
        t.child(d, b"nope")
    assert code(e) == errno.ENOENT
    with pytest.raises(FsError) as e:
        t.child(d, b"n" * (NAME_MAX + 1))
    assert code(e) == errno.ENAMETOOLONG
    for bad in (b"", b".", b"..", b"a/b"):
        with pytest.raises(FsError) as e:
            mkfile(t, db, d, bad)
        assert code(e) == errno.EINVAL, bad
    with pytest.raises(FsError) as e:
        mkdir(t, db, d, b"n" * (NAME_MAX + 1))
    assert code(e) == errno.ENAMETOOLONG
    long = mkfile(t, db, d, b"n" * NAME_MAX)  # the longest name there is
    assert t.child(d, b"n" * NAME_MAX) is long
    with pytest.raises(KeyError):
        t.unlink(d, b"nope")
    # a second name (hard link), then the first goes
    with db.transaction():
        t.link(root, b"other", f)
        f.nlink += 1
        t.write(f)
    unlink(t, db, d, b"x.bin")
    assert f.nlink == 1 and t.child(root, b"other") is f and b"x.bin" not in d.children
    assert t.attr(f).size == 12345 and t.attr(d).size == 4096 and t.attr(f).ino == f.ino
    consistent(t, store)


def test_path_of_and_resolve_round_trip(store):
    t = open_table(store)
    db = store.db
    root = t.get(ROOT_INO)
    a = mkdir(t, db, root, b"a")
    b = mkdir(t, db, a, b"b\xff")  # not UTF-8: surrogateescape both ways
    f = mkfile(t, db, b, b"c")
    assert t.path_of(root) == "" and t.resolve("") is root and t.resolve(".") is root
    for ino in (a, b, f):
        path = t.path_of(ino)
        assert path is not None and t.resolve(path) is ino
        assert t.resolve("./" + path + "/") is ino
    assert t.path_of(f) == "a/b\udcff/c"
    with pytest.raises(FsError) as e:
        t.resolve("a/b\udcff/c/d")
    assert code(e) == errno.ENOTDIR
    with pytest.raises(FsError) as e:
        t.resolve("a/zz")
    assert code(e) == errno.ENOENT
    unlink(t, db, b, b"c")
    assert t.path_of(f) is None  # unlinked, still in the table (open, say)
    with pytest.raises(FsError):
        t.resolve("a/b\udcff/c")
    with db.transaction():  # the last reference went: rows and number go
        assert t.forget(f)
        t.delete_rows(f)
    assert not t.forget(f) and f.ino not in t.inodes
    consistent(t, store)


def test_aliases_name_renumbered_inodes(store):
    t = open_table(store)
    db = store.db
    root = t.get(ROOT_INO)
    f = mkfile(t, db, root, b"f", vid=7)
    g = mkfile(t, db, root, b"g")
    t.renumber(g)  # the kernel never saw it: no kernel number
    assert g.kid == 0 and t.aliases == {}
    f.lookups = 1
    t.renumber(f)
    first = f.kid
    assert first > t.next_ino and t.get(first) is f and t.attr(f).ino == first
    t.renumber(f)  # changed again: a newer number, the older one still names it
    assert f.kid > first and t.get(f.kid) is f and t.get(first) is f
    with pytest.raises(FsError) as e:
        t.dir(f.kid)
    assert code(e) == errno.ENOTDIR
    consistent(t, store)
    unlink(t, db, root, b"f")
    f.lookups = 0
    with db.transaction():
        assert t.forget(f)
        t.delete_rows(f)
    assert t.aliases == {}
    with pytest.raises(FsError) as e:
        t.get(first)
    assert code(e) == errno.ENOENT
    consistent(t, store)


def test_top_dir(store):
    t = open_table(store)
    db = store.db
    root = t.get(ROOT_INO)
    s = mkdir(t, db, root, b"step_5")
    sub = mkdir(t, db, s, b"sub")
    f = mkfile(t, db, sub, b"f")
    top_file = mkfile(t, db, root, b"loose")
    assert t.top_dir(root) is None
    assert t.top_dir(s) is s and t.top_dir(sub) is s and t.top_dir(f) is s
    assert t.top_dir(top_file) is top_file
    unlink(t, db, sub, b"f")
    assert t.top_dir(f) is None
    consistent(t, store)


def test_reload_after_close_frees_orphans(tmp_path):
    path = str(tmp_path / "store")
    s = Store(path, "job", CS)
    t = open_table(s)
    root = t.get(ROOT_INO)
    d = mkdir(t, s.db, root, b"d")
    f = mkfile(t, s.db, d, b"f")
    with s.db.transaction():
        s.db.execute("INSERT INTO xattrs(ino, name, value) VALUES (?,?,?)",
                     (f.ino, b"user.a", b"1"))
    f.xattrs[b"user.a"] = b"1"
    gone = mkfile(t, s.db, d, b"gone")
    unlink(t, s.db, d, b"gone")  # unlinked while open: its row stays until the crash
    consistent(t, s)
    before = {n: fields(i) for n, i in t.inodes.items()}
    s.close()

    s = Store(path, "job", CS)
    try:
        t = open_table(s)
        assert {n: fields(i) for n, i in t.inodes.items()} == before
        with s.db.transaction():
            t.free_orphans()
        assert gone.ino not in t.inodes
        assert s.db.execute("SELECT 1 FROM inodes WHERE ino=?", (gone.ino,)).fetchone() is None
        assert t.get(f.ino).xattrs == {b"user.a": b"1"} and t.path_of(t.get(f.ino)) == "d/f"
        g = mkfile(t, s.db, t.get(d.ino), b"g")
        assert g.ino == gone.ino + 1  # numbers are never reused
        consistent(t, s)
    finally:
        s.close()


def test_clear_and_install(store):
    """What a namespace snapshot install (core/jobns.py) does with the table."""
    t = open_table(store)
    db = store.db
    f = mkfile(t, db, t.get(ROOT_INO), b"f")
    f.lookups = 1
    t.renumber(f)
    old = dict(t.aliases)
    with db.transaction():
        for table in ("inodes", "dentries", "xattrs"):
            db.execute(f"DELETE FROM {table}")
        root = t.clear()
        assert t.inodes == {ROOT_INO: root} and t.aliases == {}
        again = Inode(f.ino, "file", stat.S_IFREG | 0o600, 0, 0, 1, 1, 1, 1, kid=f.kid)
        t.add(again)
        t.link(root, b"f", again)
        t.write(again)
        t.write(root)
        t.keep_aliases(old | {1 << 60: 12345})  # an inode that is not here: dropped
        t.set_next_ino(100)
    assert t.aliases == old and t.get(f.kid) is again
    g = mkfile(t, db, root, b"g")
    assert g.ino == 100 and t.next_ino == 101
    consistent(t, store)


def test_next_ino_not_written_per_inode_is_recovered_past_every_row(tmp_path):
    """scope=node (``exact_next_ino`` False): kv next_ino is not written with each new
    inode; a table loaded again (after a crash: nothing written at close) hands out no
    number that a row of any table still names."""
    path = str(tmp_path / "store")
    s = Store(path, "job", CS)
    t = InodeTable(s.db, size_of=SIZES.__getitem__, exact_next_ino=lambda: False)
    with s.db.transaction():
        t.create_root()
    t.load()
    root = t.get(ROOT_INO)
    d = mkdir(t, s.db, root, b"d")
    f = mkfile(t, s.db, d, b"f")
    last = mkfile(t, s.db, d, b"last")
    with s.db.transaction():  # a version row naming a number past every inode row
        s.db.execute("INSERT INTO versions(vid, ino, size, chunk_size) VALUES (1, ?, 0, ?)",
                     (last.ino + 5, CS))
    assert int(s.db.get_kv("next_ino")) == 2  # not written per inode
    consistent_rows = {n for (n,) in s.db.execute("SELECT ino FROM inodes")}
    assert {ROOT_INO, d.ino, f.ino, last.ino} <= consistent_rows
    s.close()

    s = Store(path, "job", CS)
    try:
        again = InodeTable(s.db, size_of=SIZES.__getitem__, exact_next_ino=lambda: False)
        again.load()
        assert again.next_ino == last.ino + 6
    finally:
        s.close()


def test_metadb_transaction_defers_row_writes_and_begins_only_when_written(store):
    """One row write per key and transaction, run before COMMIT; none on rollback; a
    transaction in which nothing is written sends no BEGIN."""
    db = store.db
    seen: list[str] = []
    db.conn.set_trace_callback(seen.append)
    try:
        with db.transaction():
            with db.transaction():
                pass
        assert seen == []
        with db.transaction():
            db.defer("k", lambda: db.set_kv("x", "1"))
            db.defer("k", lambda: db.set_kv("x", "2"))  # replaces the first
            assert db.get_kv("x") is None  # not yet: at the commit
        assert db.get_kv("x") == "2"
        assert [q for q in seen if "INTO kv" in q] == [
            "INSERT OR REPLACE INTO kv(key, value) VALUES ('x', '2')"]
        with pytest.raises(RuntimeError):
            with db.transaction():
                db.set_kv("y", "1")
                db.defer("k", lambda: db.set_kv("x", "3"))
                raise RuntimeError("refused")
        assert db.get_kv("x") == "2" and db.get_kv("y") is None
        with db.transaction():
            db.defer("k", lambda: db.set_kv("x", "4"))
            db.cancel("k")
        assert db.get_kv("x") == "2"
        db.defer("k", lambda: db.set_kv("x", "5"))  # outside a transaction: at once
        assert db.get_kv("x") == "5"
    finally:
        db.conn.set_trace_callback(None)


def test_metadb_transaction_rolls_back_a_failed_deferred_write_and_inner_errors(store):
    """A deferred write that fails at the commit rolls the whole transaction back, as an
    error in an inner transaction does; after either the connection is out of any
    transaction (the next one commits on its own)."""
    db = store.db

    def fail() -> None:
        raise OSError("disk")
    with pytest.raises(OSError):
        with db.transaction():
            db.set_kv("a", "1")
            db.defer("k", fail)
    assert not db.in_transaction and db.get_kv("a") is None
    with pytest.raises(KeyError):
        with db.transaction():
            db.set_kv("b", "1")
            with db.transaction():
                db.set_kv("c", "1")
                raise KeyError("inner")
    assert not db.in_transaction and db.get_kv("b") is None and db.get_kv("c") is None
    done: list[int] = []
    with db.transaction():
        with db.transaction():
            db.set_kv("d", "1")
            db.after_commit(lambda: done.append(1))
        assert done == [] and db.in_transaction
    assert done == [1] and db.get_kv("d") == "1" and not db.in_transaction


def test_clear_drops_row_writes_still_deferred(store):
    """A snapshot install deletes every row, then clears the table, in one transaction: a
    row write deferred earlier in it must not bring a dropped inode's row back."""
    t = open_table(store)
    db = store.db
    f = mkfile(t, db, t.get(ROOT_INO), b"f")
    with db.transaction():
        f.mtime_ns += 1
        t.write(f)  # deferred to the commit
        for table in ("inodes", "dentries", "xattrs"):
            db.execute(f"DELETE FROM {table}")
        t.clear()
    assert db.execute("SELECT ino FROM inodes").fetchall() == [(ROOT_INO,)]
    consistent(t, store)
