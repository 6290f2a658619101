"""The version store (core/versions.py) alone: a VersionStore over a real Store (on tmpfs,
as in production: holes are exact there), a real RamBudget and ChunkIndex, and a fake
verifier and chunk keeper; no Filesystem. The same code through the core is covered by
t3_core_test.py, t3_budget_test.py and the t4 tests.

Each test ends with the consistency check (:func:`check`): every registered version has
its row in SQLite, equal field by field, and no other row exists; every data file on disk
belongs to a registered version and each of those has one; the budget's ``used`` is the
sum of the versions' ``alloc``, which is what their data files hold; ``next_vid`` is past
every vid.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import trio

from mtcfs.base.chunking import chunk_hash
from mtcfs.core.budget import RamBudget
from mtcfs.core.chunkmap import ChunkIndex
from mtcfs.core.model import Inode, Version
from mtcfs.core.records import Counters
from mtcfs.core.store import Store
from mtcfs.core.versions import VersionStore, copy_extents

CS = 64 * 1024
PAGE = 4096


class Host:
    """The facade as VersionStore sees it (versions.Host); the verifier's drops recorded."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.db = store.db
        self.verifier = self  # drop(vid)
        self.dropped: list[int] = []
        self.vs = VersionStore(self, store, CS)
        self.budget = RamBudget(1 << 30, fd_of=self.vs.fds.get, counters=Counters())
        self.chunk_index = ChunkIndex(self.vs.versions)

    def drop(self, vid: int) -> None:
        self.dropped.append(vid)

    def close(self) -> None:
        self.vs.fds.close_all()
        self.store.close()


class Keeper:
    """A chunk keeper (the peer tier's replica store) that records what it was given."""

    def __init__(self, wants: set[str] | None = None, fail: bool = False) -> None:
        self.wanted = wants
        self.fail = fail
        self.kept: dict[str, bytes] = {}
        self.asked: list[str] = []

    def wants(self, digest: str) -> bool:
        self.asked.append(digest)
        if self.fail:
            raise RuntimeError("replica store broken")
        return self.wanted is None or digest in self.wanted

    def keep(self, digest: str, data: bytes) -> None:
        assert chunk_hash(data) == digest  # what the real keep() verifies
        self.kept[digest] = data


@pytest.fixture
def host() -> Iterator[Host]:
    d = tempfile.mkdtemp(prefix="mtcfs-t3-versions-", dir="/dev/shm")
    h = Host(Store(os.path.join(d, "store"), "job", CS))
    h.vs.load(fresh=True)
    try:
        yield h
    finally:
        h.close()
        shutil.rmtree(d)


def inode(num: int) -> Inode:
    return Inode(num, "file", 0o100644, 0, 0, 1, 0, 0, 0)


def check(h: Host) -> None:
    """The store's consistency (see the module docstring)."""
    vs = h.vs
    rows = {r[0]: r[1:] for r in h.db.execute(
        "SELECT vid, ino, size, chunk_size, sealed, chunks, blake3, missing, backed_up,"
        " origin FROM versions")}
    assert set(rows) == set(vs.versions)
    for vid, v in vs.versions.items():
        assert v.vid == vid
        assert rows[vid] == (v.ino, v.size, v.chunk_size, int(v.sealed), " ".join(v.chunks),
                             v.blake3, " ".join(str(i) for i in sorted(v.missing)),
                             int(v.backed_up), v.origin)
    assert h.store.data_vids() == set(vs.versions)
    for v in vs.versions.values():
        assert v.alloc == os.stat(h.store.data_path(v.vid)).st_blocks * 512
    assert h.budget.used == sum(v.alloc for v in vs.versions.values())
    # A store loaded again hands out no vid a row or a data file still has.
    again = VersionStore(h, h.store, CS)
    again.load(fresh=False)
    assert again.alloc_vid() > max(vs.versions | {v: v for v in h.store.data_vids()}, default=0)


def sealed(h: Host, ino: Inode, chunks: list[bytes]) -> Version:
    """A current sealed version of ``ino`` holding ``chunks`` (each CS bytes but the last)."""
    v = h.vs.new(ino)
    data = b"".join(chunks)
    os.pwrite(h.vs.fd(v), data, 0)
    v.size = len(data)
    v.sealed = True
    v.chunks = tuple(chunk_hash(c) for c in chunks)
    v.blake3 = chunk_hash(data)
    h.budget.account(v)
    h.vs.write(v)
    h.chunk_index.add_version(v)
    h.vs.set_current(ino, v)
    return v


# ---------------------------------------------------------------------- new versions


def test_new_empty_version_is_registered_with_an_empty_data_file(host):
    ino = inode(10)
    with host.db.transaction():
        v = host.vs.new(ino)
        host.vs.set_current(ino, v)
    assert host.vs.versions[v.vid] is v and ino.vid == v.vid and v.current
    assert (v.size, v.chunk_size, v.sealed, v.missing) == (0, CS, False, set())
    assert os.path.getsize(host.store.data_path(v.vid)) == 0
    assert v.fd >= 0  # adopted by the descriptor cache
    w = host.vs.new(inode(11))
    assert w.vid == v.vid + 1
    check(host)


def test_copy_from_copies_data_and_keeps_holes(host):
    ino = inode(10)
    src = host.vs.new(ino)
    fd = host.vs.fd(src)
    os.pwrite(fd, b"a" * PAGE, 0)
    os.pwrite(fd, b"b" * PAGE, 1 << 20)
    os.ftruncate(fd, 2 << 20)  # a hole between and after
    src.size = 2 << 20
    src.missing = {7}
    host.budget.account(src)
    host.vs.write(src)
    host.vs.set_current(ino, src)
    src.handles += 1  # a reader keeps it while the writer copies
    cp = host.vs.new(ino, copy_from=src)
    assert cp.vid != src.vid and cp.size == src.size and cp.missing == {7}
    assert cp.missing is not src.missing
    path = host.store.data_path(cp.vid)
    with open(path, "rb") as f:
        got = f.read()
    assert got == b"a" * PAGE + bytes((1 << 20) - PAGE) + b"b" * PAGE + bytes((1 << 20) - PAGE)
    cfd = os.open(path, os.O_RDONLY)
    try:
        assert os.lseek(cfd, PAGE, os.SEEK_DATA) == 1 << 20  # the hole stayed a hole
    finally:
        os.close(cfd)
    assert cp.alloc == 2 * PAGE
    host.vs.set_current(ino, cp)  # src stays while its handle does
    assert src.vid in host.vs.versions and not src.current
    src.handles -= 1
    host.vs.release(src)
    assert src.vid not in host.vs.versions
    check(host)


def test_copy_extents_of_a_file_that_is_all_hole(tmp_path):
    a = os.open(tmp_path / "a", os.O_RDWR | os.O_CREAT, 0o600)
    b = os.open(tmp_path / "b", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(a, 3 * PAGE)
        copy_extents(a, b, 3 * PAGE)
        assert os.fstat(b).st_size == 3 * PAGE
        assert os.pread(b, 3 * PAGE, 0) == bytes(3 * PAGE)
    finally:
        os.close(a)
        os.close(b)


def test_take_over_links_the_data_file_and_frees_the_old_version(host):
    ino = inode(10)
    old = sealed(host, ino, [b"x" * CS, b"y" * 100])
    with host.db.transaction():
        v = host.vs.new(ino, take_over=old)
        assert os.stat(host.store.data_path(v.vid)).st_ino == \
            os.stat(host.store.data_path(old.vid)).st_ino  # one file, two names
        host.vs.set_current(ino, v)
    assert (v.size, v.chunk_size, v.sealed) == (old.size, CS, False)
    assert old.vid not in host.vs.versions and host.dropped == [old.vid]
    assert not os.path.exists(host.store.data_path(old.vid))
    assert os.pread(host.vs.fd(v), CS + 100, 0) == b"x" * CS + b"y" * 100
    check(host)


def test_take_over_of_a_version_with_handles_leaves_it_with_no_data(host):
    ino = inode(10)
    old = sealed(host, ino, [b"x" * CS, b"y" * 100])
    old.handles = 1  # a reader: it reads the current version (files.py: read)
    keeper = Keeper(wants={chunk_hash(b"y" * 100)})
    host.vs.chunk_keeper = keeper
    with host.db.transaction():
        v = host.vs.new(ino, take_over=old)
        host.vs.set_current(ino, v)
        # until the commit, the old name still holds the data (a crash rolls back to it)
        assert os.stat(host.store.data_path(old.vid)).st_ino == \
            os.stat(host.store.data_path(v.vid)).st_ino
    assert v.base_chunks == old.chunks and not v.missing
    assert old.vid in host.vs.versions and old.missing == {0, 1} and old.alloc == 0
    assert os.stat(host.store.data_path(old.vid)).st_size == old.size
    assert keeper.kept == {chunk_hash(b"y" * 100): b"y" * 100}  # handed over, as at release
    assert host.chunk_index.locate(old.chunks[0]) is None and old.vid in host.dropped
    assert os.pread(host.vs.fd(v), CS + 100, 0) == b"x" * CS + b"y" * 100
    check(host)  # counted once against size=
    old.handles = 0
    with host.db.transaction():
        host.vs.release(old)
    assert old.vid not in host.vs.versions
    check(host)


def test_new_sealed_takes_inline_chunks_that_match_and_keep_open_false_closes(host):
    chunks = [b"p" * CS, b"q" * 10]
    digests = (chunk_hash(chunks[0]), chunk_hash(b"not q"))  # the second does not match
    v = host.vs.new_sealed(10, CS + 10, CS, digests, "whole", origin=3,
                           data=b"".join(chunks))
    assert v.sealed and v.origin == 3 and v.missing == {1}
    assert host.chunk_index.locate(digests[0]) == (v, 0)
    w = host.vs.new_sealed(11, 5 * CS, CS, ("a",) * 5, "h", backed_up=True, keep_open=False)
    assert w.fd == -1 and w.alloc == 0 and w.missing == set(range(5)) and w.backed_up
    assert os.path.getsize(host.store.data_path(w.vid)) == 5 * CS
    check(host)


# ---------------------------------------------------------------------- release


def test_release_of_a_non_current_version_waits_for_handles_and_pins(host):
    ino = inode(10)
    old = sealed(host, ino, [b"o" * 1000])
    old.handles, old.pins = 1, 1
    with host.db.transaction():
        host.vs.set_current(ino, host.vs.new(ino))
    assert old.vid in host.vs.versions and not old.current
    old.handles = 0
    host.vs.release(old)  # still pinned
    assert old.vid in host.vs.versions and host.dropped == []
    old.pins = 0
    with host.db.transaction():
        host.vs.release(old)
        # the data file goes only once the deletion of its row is committed
        assert os.path.exists(host.store.data_path(old.vid))
    assert old.vid not in host.vs.versions and host.dropped == [old.vid]
    assert not os.path.exists(host.store.data_path(old.vid))
    assert host.chunk_index.locate(old.chunks[0]) is None
    host.vs.release(old)  # twice: nothing more happens
    check(host)


def test_release_of_a_current_version_does_nothing(host):
    ino = inode(10)
    v = sealed(host, ino, [b"c" * 10])
    host.vs.release(v)
    assert host.vs.versions[v.vid] is v and host.dropped == []
    check(host)


def test_release_while_sealing_frees_the_pages_and_keeps_the_version(host):
    ino = inode(10)
    v = host.vs.new(ino)
    os.pwrite(host.vs.fd(v), b"s" * 3 * PAGE, 0)
    v.size = 3 * PAGE
    host.budget.account(v)
    host.vs.write(v)
    host.vs.set_current(ino, v)
    v.sealing = trio.Event()  # its seal hashes in a worker thread
    host.vs.set_current(ino, None)  # unlinked meanwhile
    assert v.dropped and v.vid in host.vs.versions
    assert os.path.getsize(host.store.data_path(v.vid)) == 0 and v.alloc == 0
    assert host.budget.used == 0
    host.vs.release(v)  # again: nothing more
    check(host)
    v.sealing = None  # the seal ends and frees the rest
    host.vs.release(v)
    assert v.vid not in host.vs.versions
    check(host)


def test_a_version_replaced_by_an_install_closes_its_descriptor_with_the_last_handle(host):
    ino = inode(10)
    v = sealed(host, ino, [b"i" * 10])
    v.handles = 1
    host.vs.forget_all()  # a namespace snapshot install
    host.budget.clear()
    host.chunk_index.clear()
    host.db.execute("DELETE FROM versions")
    assert host.vs.fds.kept() == [v] and v.fd >= 0
    v.handles = 0
    host.vs.release(v)  # not registered: only its descriptor goes
    assert v.fd == -1 and host.dropped == []
    host.store.remove_data(v.vid)  # what the install does with files no version names
    check(host)


def test_forget_all_then_register_keeps_a_version_being_written(host):
    ino = inode(10)
    v = host.vs.new(ino)
    os.pwrite(host.vs.fd(v), b"w" * PAGE, 0)
    v.size = PAGE
    host.budget.account(v)
    v.handles = v.writers = 1
    with host.db.transaction():
        host.db.execute("DELETE FROM versions")
        host.vs.forget_all()
        host.budget.clear()
        host.vs.register(v)
        host.vs.settle_kept()
    assert host.vs.versions == {v.vid: v} and host.vs.fds.kept() == []
    check(host)


def test_set_current_replaces_and_frees_the_old_version(host):
    ino = inode(10)
    first = sealed(host, ino, [b"1" * CS, b"2" * 7])
    with host.db.transaction():
        second = host.vs.new(ino)
        host.vs.set_current(ino, second)
    assert ino.vid == second.vid and not first.current
    assert first.vid not in host.vs.versions and host.dropped == [first.vid]
    host.vs.set_current(ino, second)  # the same again: nothing freed
    assert second.vid in host.vs.versions
    with host.db.transaction():
        host.vs.set_current(ino, None)
    assert ino.vid is None and host.vs.versions == {}
    check(host)


# ---------------------------------------------------------------------- the chunk keeper


def test_last_copies_are_handed_to_the_keeper_before_a_version_goes(host):
    shared, own, unwanted = b"s" * CS, b"o" * CS, b"u" * 50
    a, b = inode(10), inode(11)
    va = sealed(host, a, [shared, own, unwanted])
    sealed(host, b, [shared])  # another local copy of the first chunk
    keeper = Keeper(wants={chunk_hash(shared), chunk_hash(own)})
    host.vs.chunk_keeper = keeper
    with host.db.transaction():
        host.vs.set_current(a, None)
    # the shared chunk stays here (b holds it), the unwanted one is not given
    assert keeper.kept == {chunk_hash(own): own}
    assert chunk_hash(shared) not in keeper.asked and chunk_hash(unwanted) in keeper.asked
    assert va.vid not in host.vs.versions
    assert host.chunk_index.locate(chunk_hash(shared))[0].ino == b.ino
    check(host)


def test_missing_chunks_and_unsealed_versions_are_not_handed_over_and_a_failing_keeper_stops_nothing(host):
    a = inode(10)
    va = sealed(host, a, [b"m" * CS, b"n" * CS])
    va.missing = {0}
    host.vs.write(va)
    host.vs.chunk_keeper = keeper = Keeper(fail=True)
    with host.db.transaction():
        host.vs.set_current(a, host.vs.new(a))  # unsealed: never asked
    assert keeper.asked == [chunk_hash(b"n" * CS)] and keeper.kept == {}
    assert va.vid not in host.vs.versions
    with host.db.transaction():
        host.vs.set_current(a, None)
    assert len(keeper.asked) == 1
    check(host)


def test_drop_data_hands_over_and_keeps_the_version_all_missing(host):
    a = inode(10)
    data = [b"d" * CS, b"e" * 10]
    v = sealed(host, a, data)
    host.vs.chunk_keeper = keeper = Keeper()
    with host.db.transaction():
        host.vs.drop_data(v)
    assert keeper.kept == {chunk_hash(c): c for c in data}
    assert host.vs.versions[v.vid] is v and v.missing == {0, 1} and v.alloc == 0
    assert os.path.getsize(host.store.data_path(v.vid)) == v.size
    assert host.chunk_index.locate(chunk_hash(data[0])) is None
    check(host)


# ---------------------------------------------------------------------- load and repair


def test_load_and_repair_after_a_crash(host):
    a, b, c = inode(10), inode(11), inode(12)
    kept = sealed(host, a, [b"k" * 100])
    gone = sealed(host, b, [b"g" * 100])
    open_ = host.vs.new(c)
    os.pwrite(host.vs.fd(open_), b"w" * 300, 0)  # written, size not yet recorded
    host.vs.set_current(c, open_)
    os.close(host.store.open_data(999, create=True))  # a file whose row never committed
    host.store.remove_data(kept.vid)  # lost (a store restored without its data)
    store = host.store
    host.vs.fds.close_all()
    # the next daemon: gone was no longer current (its inode freed in the crash)
    h2 = Host.__new__(Host)
    h2.store, h2.db, h2.dropped = store, store.db, []
    h2.verifier = h2
    h2.vs = VersionStore(h2, store, CS)
    h2.budget = RamBudget(1 << 30, fd_of=h2.vs.fds.get, counters=Counters())
    h2.chunk_index = ChunkIndex(h2.vs.versions)
    h2.vs.load(fresh=False)
    assert set(h2.vs.versions) == {kept.vid, gone.vid, open_.vid}
    with h2.db.transaction():
        unsealed = h2.vs.repair({kept.vid, open_.vid})
    assert [v.vid for v in unsealed] == [open_.vid] and unsealed[0].size == 300
    assert set(h2.vs.versions) == {kept.vid, open_.vid}
    k = h2.vs.versions[kept.vid]
    assert k.missing == {0} and os.path.getsize(store.data_path(k.vid)) == 100
    h2.budget.measure_all(h2.vs.versions.values(), store.data_path)
    # past every vid a row or a data file had at load (kv next_vid is a lower bound only),
    # and past the one the unsealed version's copy was made under (a passthrough writer of
    # the dead mount may still write its old data file: VersionStore._detach_unsealed)
    assert h2.vs.alloc_vid() == 1001
    check(h2)
    host.vs = h2.vs  # the fixture closes these descriptors


# ---------------------------------------------------------------------- the store full


@pytest.fixture
def full_host() -> Iterator[tuple[Host, str]]:
    """A Host whose store is on a tmpfs of 4 MiB of its own (root only), and the path of a
    file to fill that tmpfs with."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    import subprocess
    d = tempfile.mkdtemp(prefix="mtcfs-t3-versions-full-", dir="/dev/shm")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", d], check=True)
    try:
        h = Host(Store(os.path.join(d, "store"), "job", CS))
        h.vs.load(fresh=True)
        try:
            yield h, os.path.join(d, "filler")
        finally:
            h.close()
    finally:
        subprocess.run(["umount", d], check=False)
        os.rmdir(d)


def _fill(path: str, leave: int) -> None:
    st = os.statvfs(os.path.dirname(path))
    room = st.f_bavail * st.f_frsize - leave
    with open(path, "wb", buffering=0) as f:
        while room > 0:
            room -= f.write(b"\xee" * min(room, 1 << 20))


def test_a_copy_that_runs_out_of_room_part_way_leaves_no_data_file(full_host):
    """copy_from of a 1 MiB version with 256 KiB left on the store's filesystem: ENOSPC,
    and nothing of the copy stays. Before, its partial data file stayed until the next
    load, holding RAM that size= did not count, and its descriptor stayed cached."""
    h, filler = full_host
    ino = inode(10)
    with h.db.transaction():
        src = sealed(h, ino, [os.urandom(CS) for _ in range(16)])
    used0 = h.budget.used
    _fill(filler, 256 * 1024)
    free0 = os.statvfs(filler).f_bfree
    vid = h.vs._next_vid
    with pytest.raises(OSError) as ei:
        with h.db.transaction():
            h.vs.new(ino, copy_from=src)
    assert ei.value.errno == errno.ENOSPC
    assert not os.path.exists(h.store.data_path(vid))
    assert os.statvfs(filler).f_bfree == free0  # its pages are free again
    assert h.budget.used == used0 and set(h.vs.versions) == {src.vid}
    assert ino.vid == src.vid and src.current
    assert all(getattr(v, "vid", None) != vid for v in h.vs.fds._lru)
    os.unlink(filler)
    check(h)


def test_a_commit_that_fails_for_room_runs_nothing_meant_for_after_it(full_host):
    """A COMMIT that fails with SQLITE_FULL: ENOSPC (OSError, which the FUSE adapter
    passes on as such, not EIO), nothing of the transaction is written, and what was to
    run after its commit (a data file unlinked once its row is deleted) never runs. Before,
    it ran at the next commit that succeeded: a data file went while the row that names it,
    rolled back, still did."""
    h, filler = full_host
    db = h.db
    ran: list[int] = []
    _fill(filler, 0)
    with pytest.raises(OSError) as ei:
        with db.transaction():
            db.execute("INSERT INTO kv(key, value) VALUES ('k', ?)", ("x" * 200_000,))
            db.after_commit(lambda: ran.append(1))
    assert ei.value.errno == errno.ENOSPC
    assert not db.in_transaction and not db.conn.in_transaction
    os.unlink(filler)
    with db.transaction():
        db.execute("INSERT INTO kv(key, value) VALUES ('j', '1')")
    assert ran == []
    assert db.get_kv("k") is None and db.get_kv("j") == "1"
