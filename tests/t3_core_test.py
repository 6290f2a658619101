"""The filesystem core driven in-process (no FUSE): versions, seal, pins, crash recovery."""

import errno
import os

import blake3
import pytest
import trio

from mtcfs.base.chunking import chunk_hash
from mtcfs.base.errors import FsError
from mtcfs.core.model import ROOT_INO
from mtcfs.core.store import Store, StoreError
from support.corefs import CS, open_fs, run, run_to_crash, sealed, write_file


def test_seal_chunks_and_file_hash(tmp_path):
    data = os.urandom(5 * CS + 123)

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"a", data)
        v = await sealed(fs, ino)
        assert v.blake3 == ""  # more than one chunk: the seal hashes each byte once
        assert await fs.open_files.file_hash(v) == blake3.blake3(data).hexdigest()
        assert v.blake3 == blake3.blake3(data).hexdigest()  # computed when asked, kept
        assert list(v.chunks) == [chunk_hash(data[i:i + CS]) for i in range(0, len(data), CS)]
    run(body, tmp_path)


def test_rewrite_makes_new_version_and_pinned_old_stays(tmp_path):
    old, new = os.urandom(3 * CS), os.urandom(2 * CS)

    async def body(fs):
        d = await fs.mkdir(ROOT_INO, b"step_1", 0o755, 0, 0)
        f = await write_file(fs, d.ino, b"x", old)
        v1 = await sealed(fs, f)
        fs.step_registry.seal("step_1")
        _m, pinned = fs.tier_api.snapshot_step("step_1")
        read = fs.tier_api.chunk_reader(pinned)
        await write_file(fs, d.ino, b"x", new)          # O_TRUNC rewrite: new version
        v2 = await sealed(fs, f)
        assert v2.vid != v1.vid
        assert await fs.open_files.file_hash(v2) == blake3.blake3(new).hexdigest()
        # The pinned old version is still readable for a backup upload in flight...
        assert read(v1.chunks[2]) == old[2 * CS:]
        fs.tier_api.unpin(pinned)
        # ...and freed once unpinned.
        assert v1.vid not in fs.versions
        assert not os.path.exists(fs.store.data_path(v1.vid))
    run(body, tmp_path)


def test_unlinked_open_file_stays_readable(tmp_path):
    data = os.urandom(CS + 5)

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"f", data)
        await sealed(fs, ino)
        fh, _ = await fs.open(ino, os.O_RDONLY)
        await fs.unlink(ROOT_INO, b"f")
        assert await fs.read(fh, 0, len(data) + 10) == data
        await fs.release(fh)
        assert ino not in fs.inodes or fs.inodes[ino].vid is None
    run(body, tmp_path)


def test_crash_recovery_keeps_sealed_and_prefix_of_unsealed(tmp_path):
    sealed_data, partial = os.urandom(3 * CS), os.urandom(2 * CS)

    async def first(fs):
        ino = await write_file(fs, ROOT_INO, b"sealed", sealed_data)
        await sealed(fs, ino)
        fh, _ = await fs.create(ROOT_INO, b"partial", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
        await fs.write(fh, 0, partial)
    run_to_crash(first, tmp_path)  # no release, no close of the database

    async def second(fs):
        root = fs.inodes[ROOT_INO]
        s = fs.inodes[root.children[b"sealed"]]
        p = fs.inodes[root.children[b"partial"]]
        fh, _ = await fs.open(s.ino, os.O_RDONLY)
        assert await fs.read(fh, 0, 10 * CS) == sealed_data
        v = await sealed(fs, p.ino)          # re-sealed after recovery
        assert v is not None and v.size == len(partial)
        fh2, _ = await fs.open(p.ino, os.O_RDONLY)
        assert await fs.read(fh2, 0, 10 * CS) == partial
        assert await fs.checkpoints.verify() == []
    run(second, tmp_path)


def test_store_refuses_second_daemon_and_other_job(tmp_path):
    s = Store(str(tmp_path / "s"), "job", CS)
    with pytest.raises(StoreError, match="in use"):
        Store(str(tmp_path / "s"), "job", CS, lock_wait=0.2)
    s.close()
    with pytest.raises(StoreError, match="belongs to job"):
        Store(str(tmp_path / "s"), "other", CS)


def test_missing_chunk_without_source_is_eio(tmp_path):
    data = os.urandom(2 * CS)

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"f", data)
        v = await sealed(fs, ino)
        v.missing.add(1)
        fs.chunk_index.clear()
        fh, _ = await fs.open(ino, os.O_RDONLY)
        assert await fs.read(fh, 0, CS) == data[:CS]
        with pytest.raises(FsError) as ei:
            await fs.read(fh, CS, CS)
        assert ei.value.errno == errno.EIO
    run(body, tmp_path)


def test_verify_reports_corruption(tmp_path):
    data = os.urandom(3 * CS)

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"f", data)
        v = await sealed(fs, ino)
        os.pwrite(fs.vstore.fd(v), b"\xff" * 10, CS + 7)   # bit rot in the RAM tier
        bad = await fs.checkpoints.verify()
        assert len(bad) == 1 and "chunk 1" in bad[0] and bad[0].startswith("f:")
    run(body, tmp_path)


def test_a_chunk_in_two_files_stays_local_when_one_goes(tmp_path):
    """Identical data in two steps (an array unchanged between saves, data-parallel
    replicas): deleting the older file leaves the chunk known as local, so the replicas this
    node holds for its peers, which count on it, stay complete."""
    data = os.urandom(3 * CS)

    async def body(fs):
        a = await write_file(fs, ROOT_INO, b"a", data)
        b = await write_file(fs, ROOT_INO, b"b", data + b"tail")
        await sealed(fs, a)
        await sealed(fs, b)
        digests = [chunk_hash(data[i:i + CS]) for i in range(0, len(data), CS)]
        assert all(fs.tier_api.has_local_chunk(d) for d in digests)
        await fs.unlink(ROOT_INO, b"a")
        fs.forget([(a, 1)])
        assert a not in fs.inodes
        assert all(fs.tier_api.has_local_chunk(d) for d in digests)
        reader = fs.tier_api.chunk_reader([fs.versions[fs.inodes[b].vid]])
        assert b"".join(reader(d) for d in digests) == data
        await fs.unlink(ROOT_INO, b"b")
        fs.forget([(b, 1)])
        assert not any(fs.tier_api.has_local_chunk(d) for d in digests)
    run(body, tmp_path)


def test_a_sealed_marker_whose_commit_was_lost_commits_at_start(tmp_path):
    """A crash between the seal of DCP's .metadata and the step's commit record (two
    transactions): at the next start the step is committed, not left incomplete."""
    async def write(fs):
        d = await fs.mkdir(ROOT_INO, b"step_10", 0o755, 0, 0)
        shard = await write_file(fs, d.ino, b"__0_0.distcp", b"x" * 1000)
        meta = await write_file(fs, d.ino, b".metadata", b"m" * 100)
        await sealed(fs, meta)
        await sealed(fs, shard)  # no seal may still run when run() closes the store
        assert "step_10" in fs.steps
        fs.db.execute("DELETE FROM steps WHERE name='step_10'")  # the lost commit

    async def check(fs):
        assert "step_10" in fs.steps and fs.steps["step_10"].source == ".metadata"
    run(write, tmp_path)
    run(check, tmp_path)


def test_a_schema_1_store_opens_and_takes_special_files(tmp_path):
    """A store written before special files existed (no inodes.rdev, schema_version 1)
    loads with everything in it, and then holds FIFOs and device nodes across a restart."""
    import sqlite3
    import stat

    data = os.urandom(2 * CS + 5)

    async def first(fs):
        await sealed(fs, await write_file(fs, ROOT_INO, b"a", data))
        await fs.symlink(ROOT_INO, b"l", b"a", 0, 0)
    run(first, tmp_path)
    db = sqlite3.connect(tmp_path / "store" / "meta.sqlite3")
    db.execute("ALTER TABLE inodes DROP COLUMN rdev")
    db.execute("UPDATE kv SET value='1' WHERE key='schema_version'")
    db.commit()
    db.close()

    async def second(fs):
        root = fs.inodes[ROOT_INO]
        fh, _ = await fs.open(root.children[b"a"], os.O_RDONLY)
        assert await fs.read(fh, 0, 10 * CS) == data
        await fs.release(fh)
        assert await fs.readlink(root.children[b"l"]) == b"a"
        assert fs.db.get_kv("schema_version") == "2"
        await fs.mknod(ROOT_INO, b"p", stat.S_IFIFO | 0o644, 0, 0, 0)
        await fs.mknod(ROOT_INO, b"c", stat.S_IFCHR | 0o600, os.makedev(4, 5), 0, 0)
        with pytest.raises(FsError) as exc:
            await fs.mknod(ROOT_INO, b"d", stat.S_IFDIR | 0o755, 0, 0, 0)
        assert exc.value.errno == errno.EINVAL
    run(second, tmp_path)

    async def third(fs):
        root = fs.inodes[ROOT_INO]
        p = fs.tree.attr(fs.inodes[root.children[b"p"]])
        c = fs.tree.attr(fs.inodes[root.children[b"c"]])
        assert stat.S_ISFIFO(p.mode) and p.rdev == 0 and p.size == 0
        assert stat.S_ISCHR(c.mode) and c.rdev == os.makedev(4, 5)
        assert stat.S_IMODE(c.mode) == 0o600
    run(third, tmp_path)


def test_stopping_while_a_seal_hashes_ends_and_the_next_start_seals(tmp_path):
    """The daemon stops (its nursery is cancelled) while a seal hashes in a thread: the
    nursery ends (before: the seal's clean-up started a new seal in the cancelled nursery,
    for ever), and the next start seals the file."""
    data = os.urandom(64 * CS)

    async def main() -> None:
        with trio.fail_after(20):
            async with trio.open_nursery() as n:
                fs = open_fs(tmp_path / "store")
                fs.start(n)
                ino = await write_file(fs, ROOT_INO, b"a", data)
                v = fs.versions[fs.inodes[ino].vid]
                assert v.sealing is not None  # the seal was started at release
                n.cancel_scope.cancel()
        fs.close()
        fs.store.close()
    trio.run(main)

    async def again(fs):
        (num,) = [n for name, n in fs.inodes[ROOT_INO].children.items() if name == b"a"]
        v = await sealed(fs, num)
        assert v is not None
        assert await fs.open_files.file_hash(v) == blake3.blake3(data).hexdigest()
    run(again, tmp_path)


def test_a_corrupt_chunk_of_a_replaced_version_still_open_is_never_served(tmp_path):
    """scope=job: a snapshot install replaces every version object, and a handle open
    across it reads on through the old object's kept descriptor. A chunk of it that fails
    its first-read hash is missing on that object (fault-in then fetches it, here from no
    source: EIO), never served (before: no verdict was given, and the read served it)."""
    data = os.urandom(3 * CS)

    async def write(fs):
        ino = await write_file(fs, ROOT_INO, b"a", data)
        await sealed(fs, ino)
    run(write, tmp_path)
    (vid,) = [int(n) for n in os.listdir(tmp_path / "store" / "data")]
    path = tmp_path / "store" / "data" / str(vid)
    raw = bytearray(path.read_bytes())
    raw[CS + 3] ^= 0x40  # chunk 1, while no daemon runs
    path.write_bytes(bytes(raw))

    async def read(fs):
        v = fs.versions[vid]
        assert fs.verifier.needs(v)
        fs.fds.keep(v)  # what an install does for a version a handle still reads
        v.handles += 1
        del fs.versions[vid]  # ... and the install replaced it
        fs.fetcher.fetch_deadline_s = 1
        await fs.tier_api.fault_in(v, 0, CS)  # chunk 0 is good
        with pytest.raises(FsError) as exc:
            await fs.tier_api.fault_in(v, CS, CS)
        assert exc.value.errno == errno.EIO
        assert 1 in v.missing and fs.counters.corrupt_chunks == 1
    run(read, tmp_path)


def test_the_times_the_kernel_sends_for_an_unlinked_file_write_no_row(tmp_path):
    """With the writeback cache the kernel sends an unlinked file's times (a SETATTR) as it
    evicts the inode, before FORGET. The inode's rows went with its last name; writing them
    again (and deleting them once more at FORGET) cost two transactions per unlink. The
    times still apply in memory; nothing of the file is left in the store after FORGET."""
    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"f", b"x" * 5000)
        vid = (await sealed(fs, ino)).vid
        await fs.unlink(ROOT_INO, b"f")
        node = fs.inodes[ino]
        assert not fs.tree.has_row(node)
        a = await fs.setattr(ino, mtime_ns=1_000_000_000, atime_ns=2_000_000_000)
        assert (a.mtime_ns, a.atime_ns) == (1_000_000_000, 2_000_000_000)
        assert not fs.tree.has_row(node)  # no row written again
        fs.forget([(ino, 1)])
        assert ino not in fs.inodes
        for table, col, key in (("inodes", "ino", ino), ("dentries", "ino", ino),
                                ("versions", "vid", vid)):
            assert fs.db.execute(f"SELECT count(*) FROM {table} WHERE {col}=?",
                                 (key,)).fetchone()[0] == 0, table
        assert not os.path.exists(fs.store.data_path(vid))  # its data file went too
    run(body, tmp_path)


def test_the_adapter_answers_names_outside_user_without_the_core(tmp_path):
    """GETXATTR of a name outside user.* (the kernel's security.capability before every
    write(2)) is answered ENODATA by the FUSE adapter; only user.* names reach the core."""
    import pyfuse3

    from mtcfs.fuse_ops import Operations

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"f", b"x" * 10)
        await fs.setxattr(ino, b"user.a", b"1")
        ops = Operations(fs)
        asked = []
        real = fs.getxattr

        async def counted(num, name):
            asked.append(name)
            return await real(num, name)
        fs.getxattr = counted
        for name in (b"security.capability", b"trusted.a", b"system.posix_acl_access"):
            with pytest.raises(pyfuse3.FUSEError) as e:
                await ops.getxattr(ino, name, None)
            assert e.value.errno == errno.ENODATA
        assert asked == []
        assert await ops.getxattr(ino, b"user.a", None) == b"1"
        assert asked == [b"user.a"]
    run(body, tmp_path)
