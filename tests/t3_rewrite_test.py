"""Rewrites of sealed files at chunk granularity (issue 18): reopening a sealed file for
writing and changing a few bytes costs work and RAM in proportion to the chunks changed,
not to the file's size; holes stay holes; the whole-file hash stays the true blake3.

In-process core (tests/support/corefs.py, chunks of CS = 64 KiB); the real mount's form is
in t4_posix_test.py (test_rewrite_of_one_byte_of_a_sealed_file_*)."""

import os
import threading

import blake3
import trio

from mtcfs.base import failpoints
from mtcfs.base.chunking import chunk_hash
from mtcfs.core import files as files_mod
from mtcfs.core import versions as versions_mod
from mtcfs.core.model import ROOT_INO
from support.corefs import CS, ChunksOf, run, run_to_crash, sealed, write_file

MIB = 1 << 20


def _chunks(data: bytes) -> list[str]:
    return [chunk_hash(data[i:i + CS]) for i in range(0, len(data), CS)]


async def _read_all(fs, ino: int, size: int) -> bytes:
    fh, _ = await fs.open(ino, os.O_RDONLY)
    out = bytearray()
    while len(out) < size + 1:
        b = await fs.read(fh, len(out), 4 * MIB)
        if not b:
            break
        out += b
    await fs.release(fh)
    return bytes(out)


async def _rewrite(fs, ino: int, writes, truncate: int | None = None) -> None:
    """Open ``ino`` O_RDWR (no O_TRUNC), apply ``writes`` [(off, bytes)], optionally a
    truncate through the handle, close."""
    fh, _ = await fs.open(ino, os.O_RDWR)
    for off, b in writes:
        assert await fs.write(fh, off, b) == len(b)
    if truncate is not None:
        await fs.setattr(ino, size=truncate, fh=fh)
    await fs.release(fh)


def _data_blocks(fs, vid: int) -> int:
    return os.stat(fs.store.data_path(vid)).st_blocks * 512


def _check(fs, v, expect: bytes) -> None:
    assert v.size == len(expect)
    assert list(v.chunks) == _chunks(expect)


def test_one_byte_rewrite_of_a_sealed_64mib_sparse_file_hashes_one_chunk(tmp_path):
    size = 64 * MIB
    head = os.urandom(3 * CS + 17)

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"big", head)
        await fs.setattr(ino, size=size)  # the rest: a hole
        v1 = await sealed(fs, ino)
        expect = bytearray(head + bytes(size - len(head)))
        # setattr on the sealed file was a rewrite too: its whole-file hash on first ask
        assert (await fs.getxattr(ino, b"user.mtcfs.blake3")).decode() == \
            blake3.blake3(expect).hexdigest()
        used0, hashed0 = fs.used, fs.counters.seal_bytes_hashed

        off = 40 * MIB + 5  # in the hole
        await _rewrite(fs, ino, [(off, b"\x01")])
        expect[off] = 1
        v2 = await sealed(fs, ino)
        assert v2.vid != v1.vid
        # work: the one chunk written is hashed, no other
        assert fs.counters.seal_bytes_hashed - hashed0 == CS
        # RAM: the hole stays a hole, the rest of the data is not copied
        assert fs.used - used0 <= CS
        assert _data_blocks(fs, v2.vid) <= len(head) + CS
        _check(fs, v2, bytes(expect))
        assert await _read_all(fs, ino, size) == expect
        # the whole-file hash: computed when asked, the true blake3 of the content
        fh0 = fs.counters.file_hash_bytes
        got = await fs.getxattr(ino, b"user.mtcfs.blake3")
        assert got.decode() == blake3.blake3(expect).hexdigest()
        assert fs.counters.file_hash_bytes - fh0 == size
        got = await fs.getxattr(ino, b"user.mtcfs.blake3")  # recorded: not hashed again
        assert fs.counters.file_hash_bytes - fh0 == size
        assert fs.versions[ino_vid(fs, ino)].blake3 == got.decode()
    run(body, tmp_path)


def ino_vid(fs, ino: int) -> int:
    return fs.inodes[ino].vid


def test_one_byte_rewrite_of_a_dense_file_hashes_one_chunk_and_copies_nothing(tmp_path):
    data = bytearray(os.urandom(8 * MIB))

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"dense", bytes(data))
        await sealed(fs, ino)
        used0, hashed0 = fs.used, fs.counters.seal_bytes_hashed
        await _rewrite(fs, ino, [(5 * MIB + 3, b"Z")])
        data[5 * MIB + 3] = ord("Z")
        v2 = await sealed(fs, ino)
        assert fs.counters.seal_bytes_hashed - hashed0 == CS
        assert fs.used - used0 <= CS
        _check(fs, v2, bytes(data))
        assert await _read_all(fs, ino, len(data)) == data
        assert (await fs.getxattr(ino, b"user.mtcfs.blake3")).decode() == \
            blake3.blake3(data).hexdigest()
    run(body, tmp_path)


def test_rewrites_across_chunk_boundaries_past_the_end_and_truncates(tmp_path):
    base = os.urandom(10 * CS + 100)

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"f", base)
        await sealed(fs, ino)
        cases = [
            # (writes, truncate) applied to the previous content
            ([(2 * CS - 3, b"abcdef")], None),                   # across a boundary
            ([(len(base) + 3 * CS + 7, b"tail")], None),         # past the end: a gap
            ([], 4 * CS + 9),                                    # shrink mid-chunk
            ([], 4 * CS),                                        # shrink to a boundary
            ([], 9 * CS + 1),                                    # extend: a hole
            ([(9 * CS, b"q" * (CS + 1))], None),                 # write the extension
            ([(0, b"A")], 2 * CS + 5),                           # write, then shrink
            ([(6 * CS + 1, b"B")], None),                        # past end again
        ]
        content = bytearray(base)
        for writes, trunc in cases:
            hashed0 = fs.counters.seal_bytes_hashed
            await _rewrite(fs, ino, writes, trunc)
            for off, b in writes:
                if off > len(content):
                    content += bytes(off - len(content))
                content[off:off + len(b)] = b
            if trunc is not None:
                content = content[:trunc] + bytes(max(0, trunc - len(content)))
            v = await sealed(fs, ino)
            _check(fs, v, bytes(content))
            assert await _read_all(fs, ino, len(content)) == content
            assert (await fs.getxattr(ino, b"user.mtcfs.blake3")).decode() == \
                blake3.blake3(content).hexdigest()
            # never more than the chunks written (holes are not read)
            written = sum(len(b) for _o, b in writes)
            assert fs.counters.seal_bytes_hashed - hashed0 <= (written // CS + 2) * CS
    run(body, tmp_path)


def test_rewrite_while_a_reader_holds_the_file_open(tmp_path):
    data = bytearray(os.urandom(20 * CS))

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"r", bytes(data))
        v1 = await sealed(fs, ino)
        rfh, _ = await fs.open(ino, os.O_RDONLY)
        assert await fs.read(rfh, 0, 10) == data[:10]
        used0, hashed0 = fs.used, fs.counters.seal_bytes_hashed
        await _rewrite(fs, ino, [(7 * CS + 1, b"xy")])
        data[7 * CS + 1:7 * CS + 3] = b"xy"
        v2 = await sealed(fs, ino)
        assert v2.vid != v1.vid
        assert fs.counters.seal_bytes_hashed - hashed0 == CS
        # the data file was taken over, not copied: the reader's old version holds none
        assert fs.used - used0 <= CS
        assert _data_blocks(fs, v1.vid) == 0 and v1.vid in fs.versions
        assert fs.chunk_index.locate(v1.chunks[0]) == (v2, 0)
        _check(fs, v2, bytes(data))
        assert await fs.read(rfh, 0, len(data)) == data  # one file, one content
        await fs.release(rfh)
        assert v1.vid not in fs.versions
        assert (await fs.getxattr(ino, b"user.mtcfs.blake3")).decode() == \
            blake3.blake3(data).hexdigest()
    run(body, tmp_path)


def _pinned_step(fs, data: bytes):
    """Write ``data`` as step_1/x, commit the step and pin it as a backup upload in flight
    does: (ino, v1, pinned versions, a verifying chunk reader over them)."""

    async def go():
        d = await fs.mkdir(ROOT_INO, b"step_1", 0o755, 0, 0)
        ino = await write_file(fs, d.ino, b"x", data)
        v1 = await sealed(fs, ino)
        fs.step_registry.seal("step_1")
        _m, pinned = fs.tier_api.snapshot_step("step_1")
        return ino, v1, pinned, fs.tier_api.chunk_reader(pinned)
    return go()


def _old_bytes_intact(read, v1, old: bytes) -> None:
    for i, d in enumerate(v1.chunks):
        assert read(d) == old[i * CS:(i + 1) * CS], f"chunk {i} of the pinned version"


def test_rewrite_while_a_backup_pins_the_old_version_copies_only_the_chunks_changed(
        tmp_path):
    """Issue 18: a rewrite while the old version is pinned (a backup upload, a
    replication) used to copy the whole file first. Now the new version takes the data
    file over and each chunk is copied for the pinned version just before it changes:
    RAM and work in proportion to the chunks written; the pin still reads every old byte,
    verified."""
    data = bytearray(os.urandom(20 * CS))
    old = bytes(data)

    async def body(fs):
        ino, v1, pinned, read = await _pinned_step(fs, old)
        used0, hashed0 = fs.used, fs.counters.seal_bytes_hashed
        await _rewrite(fs, ino, [(7 * CS + 1, b"p"), (12 * CS - 1, b"qr")])
        data[7 * CS + 1] = ord("p")
        data[12 * CS - 1:12 * CS + 1] = b"qr"
        v2 = await sealed(fs, ino)
        _check(fs, v2, bytes(data))
        assert fs.counters.seal_bytes_hashed - hashed0 == 3 * CS
        assert sorted(v1.preserved) == [7, 11, 12]
        assert fs.used - used0 == 3 * CS  # a whole copy was 20 chunks
        assert fs.used == _on_disk(fs) + 3 * CS  # the file once, and the copies kept
        _old_bytes_intact(read, v1, old)
        assert await _read_all(fs, ino, len(data)) == data
        assert (await fs.getxattr(ino, b"user.mtcfs.blake3")).decode() == \
            blake3.blake3(data).hexdigest()
        fs.tier_api.unpin(pinned)
        assert v1.vid not in fs.versions and v2.shared is None
        assert fs.used == _on_disk(fs) == used0
        assert await _read_all(fs, ino, len(data)) == data
        assert await fs.checkpoints.verify() == []
    run(body, tmp_path)


def test_while_pinned_a_shrink_a_second_rewrite_and_an_o_trunc_keep_every_old_byte(
        tmp_path):
    """The pinned versions read the shared file until their pins go, whatever the newer
    ones do to it: a shrink (the chunks cut off are kept first), a second rewrite while
    the first rewrite's version is pinned too (both keep their own bytes), an O_TRUNC
    open, and a delete of the file."""
    data = bytearray(os.urandom(8 * CS + 100))
    old = bytes(data)

    async def body(fs):
        ino, v1, pinned, read = await _pinned_step(fs, old)
        await _rewrite(fs, ino, [(CS, b"a")], truncate=3 * CS + 5)
        data[CS] = ord("a")
        del data[3 * CS + 5:]
        v2 = await sealed(fs, ino)
        _check(fs, v2, bytes(data))
        _old_bytes_intact(read, v1, old)
        second = bytes(data)
        # pin the rewrite's version too (a peer reading one of its chunks)
        got = fs.tier_api.pin_chunk(v2.chunks[3])
        assert got is not None and got[0] is v2
        await _rewrite(fs, ino, [(0, b"b"), (3 * CS, b"c")])
        data[0] = ord("b")
        data[3 * CS] = ord("c")
        v3 = await sealed(fs, ino)
        _check(fs, v3, bytes(data))
        assert v1.shared is v2.shared is v3.shared and v1.shared.readers == [v1, v2]
        _old_bytes_intact(read, v1, old)
        for i, d in enumerate(v2.chunks):
            n = min(CS, len(second) - i * CS)
            assert fs.tier_api.read_chunk_at(v2, i * CS, n, d) == second[i * CS:i * CS + n]
        # O_TRUNC: a new, empty version; the shared file is left to the pinned ones
        fh, _ = await fs.open(ino, os.O_RDWR | os.O_TRUNC)
        assert await fs.write(fh, 0, b"new") == 3
        await fs.release(fh)
        assert await _read_all(fs, ino, 10) == b"new"
        assert v3.vid not in fs.versions
        _old_bytes_intact(read, v1, old)
        assert fs.tier_api.read_chunk_at(v2, 3 * CS, 5, v2.chunks[3]) == second[3 * CS:]
        assert fs.used == _on_disk(fs) + sum(len(b) for r in (v1, v2)
                                             for b in r.preserved.values())
        fs.tier_api.unpin(pinned)
        fs.tier_api.unpin([v2])
        assert v1.vid not in fs.versions and v2.vid not in fs.versions
        assert fs.used == _on_disk(fs)
        assert await fs.checkpoints.verify() == []
    run(body, tmp_path)


def test_a_thread_reading_the_pinned_version_never_sees_a_byte_the_rewrite_changes(
        tmp_path):
    """The race: a backup upload reads the pinned version's chunks in a worker thread
    while the loop overwrites every chunk of the file, chunk after chunk, many times. Each
    chunk the thread reads is verified against the old digest; none may mismatch (a chunk
    is copied for the reader before its first change, and the reader looks for the copy
    after its read)."""
    data = os.urandom(16 * CS)

    async def body(fs):
        ino, v1, pinned, read = await _pinned_step(fs, data)
        done = False
        reads = [0]

        def reader() -> None:
            while not done:
                for d in v1.chunks:
                    read(d)  # raises EIO on a mismatch
                    reads[0] += 1

        async with trio.open_nursery() as n:
            n.start_soon(trio.to_thread.run_sync, reader)
            fh, _ = await fs.open(ino, os.O_RDWR)
            for _round in range(10):
                for i in range(16):
                    await fs.write(fh, i * CS, os.urandom(CS))
                    await trio.sleep(0)
            await fs.release(fh)
            done = True
        await sealed(fs, ino)
        assert reads[0] > 16
        _old_bytes_intact(read, v1, data)
        fs.tier_api.unpin(pinned)
    run(body, tmp_path)


def test_two_rewrites_in_a_row_and_an_o_trunc_rewrite(tmp_path):
    data = bytearray(os.urandom(6 * CS))

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"t", bytes(data))
        await sealed(fs, ino)
        await _rewrite(fs, ino, [(1, b"1")])
        data[1] = ord("1")
        v = await sealed(fs, ino)
        assert v.blake3 == ""  # not asked yet
        await _rewrite(fs, ino, [(5 * CS, b"2")])  # based on a version never whole-hashed
        data[5 * CS] = ord("2")
        v = await sealed(fs, ino)
        _check(fs, v, bytes(data))
        assert (await fs.getxattr(ino, b"user.mtcfs.blake3")).decode() == \
            blake3.blake3(data).hexdigest()
        new = os.urandom(3 * CS)
        await write_file(fs, ROOT_INO, b"t", new, flags=os.O_WRONLY | os.O_TRUNC)
        v = await sealed(fs, ino)
        _check(fs, v, new)
        assert v.blake3 == ""  # a full seal of more than one chunk hashes each byte once
        assert (await fs.getxattr(ino, b"user.mtcfs.blake3")).decode() == \
            blake3.blake3(new).hexdigest()
    run(body, tmp_path)


def test_crash_in_the_middle_of_a_rewrite_after_fsync_reseals_the_chunk_written(tmp_path):
    data = bytes(os.urandom(12 * CS))
    expect = bytearray(data)
    expect[3 * CS + 2:3 * CS + 7] = b"crash"

    async def during(fs, ino, fh):
        await fs.write(fh, 3 * CS + 2, b"crash")
        await fs.fsync(fh, False)
    # sealed again at start: the chunk written only
    _crash_rewrite(tmp_path, data, during, bytes(expect), max_hashed=CS, exact=True)


def test_whole_file_hash_of_a_rewritten_file_whose_data_was_dropped(tmp_path):
    data = bytearray(os.urandom(5 * CS))

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"e", bytes(data))
        await sealed(fs, ino)
        await _rewrite(fs, ino, [(2 * CS, b"e")])
        data[2 * CS] = ord("e")
        v = await sealed(fs, ino)
        # a second local copy of the content, then v's data leaves RAM (eviction)
        other = await write_file(fs, ROOT_INO, b"copy", bytes(data))
        await sealed(fs, other)
        with fs.db.transaction():
            fs.vstore.drop_data(v)
        assert v.missing
        got = await fs.getxattr(ino, b"user.mtcfs.blake3")  # faulted in from the copy
        assert got.decode() == blake3.blake3(data).hexdigest()
    run(body, tmp_path)


def _on_disk(fs) -> int:
    """Bytes the store's data files hold in RAM, each file once (a shared one has a name
    per version that reads it)."""
    data = os.path.dirname(fs.store.data_path(0))
    files = {}
    for n in os.listdir(data):
        st = os.stat(os.path.join(data, n))
        files[st.st_ino] = st.st_blocks * 512
    return sum(files.values())


def test_a_rewrite_while_pinned_fits_where_a_copy_would_not(tmp_path):
    """A pinned file of 20 chunks in a RAM tier of 30: the rewrite used to copy it (40 >
    30: ENOSPC); now it takes the file over and keeps a copy of the chunk it changes."""
    data = os.urandom(20 * CS)

    async def body(fs):
        ino, v1, pinned, read = await _pinned_step(fs, data)
        await _rewrite(fs, ino, [(0, b"X")])
        await sealed(fs, ino)
        assert fs.used <= 21 * CS
        _old_bytes_intact(read, v1, data)
        rfh, _ = await fs.open(ino, os.O_RDONLY)
        assert await fs.read(rfh, 0, 3) == b"X" + data[1:3]
        await fs.release(rfh)
        fs.tier_api.unpin(pinned)
        assert fs.used == _on_disk(fs) <= 20 * CS
    run(body, tmp_path, capacity=30 * CS)


# ---------------------------------------------------------------------------------------
# A crash during a rewrite (issue 18, crash case): the version's row holds the base chunk
# digests and the chunks dirtied, each made durable before any byte of it changes, so the
# seal at the next start hashes only those; never a stale base digest.

def _crash_rewrite(tmp_path, data: bytes, during, expect: bytes, max_hashed: int,
                   exact: bool = False, between=None) -> None:
    """Write ``data`` as a sealed file, reopen it O_RDWR, run ``during(fs, ino, fh)``,
    crash (then ``between()``, if given, on the crashed store); at the restart the file is
    sealed again with exactly the chunks of ``expect`` (read back, per-chunk digests,
    whole-file hash), hashing at most ``max_hashed`` bytes (``exact``: that many)."""
    box: list[int] = []

    async def first(fs):
        ino = await write_file(fs, ROOT_INO, b"c", data)
        await sealed(fs, ino)
        box.append(ino)
        fh, _ = await fs.open(ino, os.O_RDWR)
        await during(fs, ino, fh)
    run_to_crash(first, tmp_path)
    if between is not None:
        between()

    async def second(fs):
        v = await sealed(fs, box[0])  # sealed again at start (OpenFiles.start)
        assert fs.counters.seal_bytes_hashed <= max_hashed
        if exact:
            assert fs.counters.seal_bytes_hashed == max_hashed
        _check(fs, v, expect)
        assert await _read_all(fs, box[0], len(expect)) == expect
        assert (await fs.getxattr(box[0], b"user.mtcfs.blake3")).decode() == \
            blake3.blake3(expect).hexdigest()
        assert await fs.checkpoints.verify() == []
    run(second, tmp_path)


def test_crash_after_a_one_byte_rewrite_reseals_one_chunk(tmp_path):
    data = bytearray(os.urandom(12 * CS + 100))
    off = 5 * CS + 7

    async def during(fs, ino, fh):
        await fs.write(fh, off, b"\x00" if data[off] else b"\x01")  # no fsync, no close
    expect = bytearray(data)
    expect[off] = 0 if data[off] else 1
    _crash_rewrite(tmp_path, bytes(data), during, bytes(expect), max_hashed=CS, exact=True)


def test_crash_after_writes_that_dirtied_new_chunks_since_the_last_fsync(tmp_path):
    data = bytes(os.urandom(12 * CS))
    expect = bytearray(data)

    async def during(fs, ino, fh):
        await fs.write(fh, 2 * CS + 1, b"one")
        await fs.fsync(fh, False)
        await fs.write(fh, 2 * CS + 9, b"same chunk")  # no new chunk
        await fs.write(fh, 7 * CS - 2, b"new chunks")  # dirties 6 and 7: never stale
        await fs.write(fh, 11 * CS, b"last")
    for off, b in [(2 * CS + 1, b"one"), (2 * CS + 9, b"same chunk"),
                   (7 * CS - 2, b"new chunks"), (11 * CS, b"last")]:
        expect[off:off + len(b)] = b
    _crash_rewrite(tmp_path, data, during, bytes(expect), max_hashed=4 * CS)


def test_crash_after_a_shrink_and_an_extend_in_a_rewrite(tmp_path):
    data = bytes(os.urandom(10 * CS + 100))

    async def during(fs, ino, fh):
        await fs.write(fh, CS, b"w")
        await fs.setattr(ino, size=4 * CS + 9, fh=fh)  # shrink mid-chunk
        await fs.setattr(ino, size=8 * CS + 3, fh=fh)  # extend: a hole
        await fs.write(fh, 6 * CS + 5, b"in the hole")
    expect = bytearray(data[:4 * CS + 9] + bytes(4 * CS - 6))
    expect[CS:CS + 1] = b"w"
    expect[6 * CS + 5:6 * CS + 16] = b"in the hole"
    # chunks 1, 4 (cut), 5..8 (the extension; 5 and 7 are holes, not read)
    _crash_rewrite(tmp_path, data, during, bytes(expect), max_hashed=4 * CS)


def test_crash_after_a_shrink_to_nothing_and_a_regrow(tmp_path):
    data = bytes(os.urandom(6 * CS))
    new = os.urandom(2 * CS + 3)

    async def during(fs, ino, fh):
        await fs.setattr(ino, size=0, fh=fh)
        await fs.write(fh, 0, new)
    _crash_rewrite(tmp_path, data, during, new, max_hashed=len(new))


def test_crash_after_an_o_trunc_open_of_a_version_being_rewritten(tmp_path):
    data = bytes(os.urandom(6 * CS))
    new = os.urandom(3 * CS)

    async def during(fs, ino, fh):
        await fs.write(fh, CS, b"x")
        # a second writer with O_TRUNC: the open version is emptied, its base dropped
        fh2, _ = await fs.open(ino, os.O_WRONLY | os.O_TRUNC)
        await fs.write(fh2, 0, new)
    _crash_rewrite(tmp_path, data, during, new, max_hashed=len(new))


def test_a_dirty_chunk_is_committed_before_its_bytes_change(tmp_path, monkeypatch):
    """The invariant itself: when a rewrite's data file is written or resized, another
    connection to the database already sees every chunk that call changes as dirty."""
    import sqlite3

    data = bytes(os.urandom(8 * CS))
    seen: list[tuple[str, set[int], set[int]]] = []

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"i", data)
        await sealed(fs, ino)
        fh, _ = await fs.open(ino, os.O_RDWR)
        vid = fs.inodes[ino].vid
        v = fs.versions[vid]
        path = fs.store.db.path
        real_pwrite, real_ftruncate = os.pwrite, os.ftruncate

        def committed() -> set[int]:
            c = sqlite3.connect(path)
            try:
                return {r[0] for r in c.execute(
                    "SELECT idx FROM rewrite_dirty WHERE vid=?", (vid,))}
            finally:
                c.close()

        def pwrite(fd, buf, off):
            if fd == v.fd:
                # (chunks past the base's 8 are always hashed: none recorded)
                seen.append(("w", set(range(off // CS, min(8, (off + len(buf) - 1) // CS + 1))),
                             committed()))
            return real_pwrite(fd, buf, off)

        def ftruncate(fd, size):
            if fd == v.fd:
                lo, hi = sorted((size, v.size))
                seen.append(("t", set(range(lo // CS, min(8, (hi - 1) // CS + 1))),
                             committed()))
            return real_ftruncate(fd, size)
        monkeypatch.setattr(os, "pwrite", pwrite)
        monkeypatch.setattr(os, "ftruncate", ftruncate)
        begins = []
        real_begin = fs.db._begin
        monkeypatch.setattr(fs.db, "_begin", lambda: (begins.append(1), real_begin()))
        await fs.write(fh, 3 * CS + 1, b"a")
        assert len(begins) == 1  # one transaction for the new chunk
        await fs.write(fh, 3 * CS + 100, b"b" * 1000)
        assert len(begins) == 1  # a chunk already recorded: none
        await fs.write(fh, 5 * CS - 10, b"c" * (2 * CS))  # chunks 4, 5, 6: one transaction
        assert len(begins) == 2
        await fs.write(fh, 9 * CS, b"past the base")  # chunks 8, 9: past the base
        assert len(begins) == 2
        await fs.setattr(ino, size=2 * CS + 1, fh=fh)
        monkeypatch.undo()
        await fs.release(fh)
        await sealed(fs, ino)
    run(body, tmp_path)
    assert [k for k, _t, _c in seen] == ["w", "w", "w", "w", "t"]
    for _k, touched, committed in seen:
        assert touched <= committed, (touched, committed)


def test_crash_during_a_rewrite_of_a_store_without_the_base_columns(tmp_path):
    """A row from before the base was recorded (an older mtcfs: no column, no table; or
    NULL): sealed at the restart by hashing every chunk, as before."""
    import sqlite3

    data = bytes(os.urandom(6 * CS))
    expect = bytearray(data)
    expect[4 * CS:4 * CS + 3] = b"old"

    async def during(fs, ino, fh):
        await fs.write(fh, 4 * CS, b"old")

    def drop_columns() -> None:
        c = sqlite3.connect(tmp_path / "store" / "meta.sqlite3")
        cols = {r[1] for r in c.execute("PRAGMA table_info(versions)")}
        if "base_chunks" in cols:
            c.execute("ALTER TABLE versions DROP COLUMN base_chunks")
        c.execute("DROP TABLE IF EXISTS rewrite_dirty")
        c.commit()
        c.close()
    # every chunk
    _crash_rewrite(tmp_path, data, during, bytes(expect), max_hashed=len(data), exact=True,
                   between=drop_columns)


# ---------------------------------------------------------------------------------------
# A reopen for writing while the last close is still being hashed (fio lays a file out,
# closes it and reopens it at once): the hash stops at its next chunk and what it hashed
# becomes the base of the rewrite. The reopen used to wait for the whole hash, and the
# chunks written after it were hashed a second time at the next seal.

SEAL_PAUSE = 0.02  # failpoint seal.chunk: the seal's thread waits this long before each chunk


def test_a_reopen_while_the_close_is_hashed_stops_the_hash_and_keeps_what_it_hashed(
        tmp_path, monkeypatch):
    monkeypatch.setitem(failpoints._ACTIVE, "seal.chunk", SEAL_PAUSE)
    data = os.urandom(24 * CS)
    new = os.urandom(len(data))

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"f", data)
        v1 = fs.versions[fs.inodes[ino].vid]
        assert v1.sealing is not None
        await trio.sleep(5 * SEAL_PAUSE)  # a few chunks hashed, most not
        fh, _ = await fs.open(ino, os.O_RDWR)
        # the open did not wait for the whole file's hash (it used to: 24 chunks)
        hashed = fs.counters.seal_bytes_hashed
        assert hashed < len(data)
        v = fs.versions[fs.inodes[ino].vid]
        assert v is v1 and not v.sealed and v.sealing is None
        k = len(v.base_chunks)
        assert hashed == k * CS and list(v.base_chunks) == _chunks(data)[:k]
        assert fs.budget.used == _data_blocks(fs, v.vid) <= len(data)  # no copy
        # fio's random writes reach every chunk: each is hashed once more, not twice
        for off in range(0, len(new), 5 * CS):
            assert await fs.write(fh, off, new[off:off + 5 * CS]) == len(new[off:off + 5 * CS])
        await fs.release(fh)
        v = await sealed(fs, ino)
        _check(fs, v, new)
        assert fs.counters.seal_bytes_hashed == k * CS + len(new)
        assert await _read_all(fs, ino, len(new)) == new
        assert (await fs.getxattr(ino, b"user.mtcfs.blake3")).decode() == \
            blake3.blake3(new).hexdigest()
        assert await fs.checkpoints.verify() == []
    run(body, tmp_path)


def test_a_reopen_that_stopped_the_hash_and_is_closed_unchanged_seals_the_rest(
        tmp_path, monkeypatch):
    monkeypatch.setitem(failpoints._ACTIVE, "seal.chunk", SEAL_PAUSE)
    data = os.urandom(16 * CS + 5)

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"f", data)
        await trio.sleep(3 * SEAL_PAUSE)
        fh, _ = await fs.open(ino, os.O_RDWR)
        k = len(fs.versions[fs.inodes[ino].vid].base_chunks)
        await fs.release(fh)
        v = await sealed(fs, ino)
        _check(fs, v, data)
        assert fs.counters.seal_bytes_hashed == len(data)  # every byte hashed once
        assert k < 17
        assert (await fs.getxattr(ino, b"user.mtcfs.blake3")).decode() == \
            blake3.blake3(data).hexdigest()
    run(body, tmp_path)


def test_crash_after_a_reopen_that_stopped_the_hash(tmp_path, monkeypatch):
    # The stopped hash's chunks are the base in the version's row, committed before the
    # reopen's first write: the reseal at the next start hashes the chunks written inside
    # the base and those past it, and keeps the right digests for the rest.
    monkeypatch.setitem(failpoints._ACTIVE, "seal.chunk", SEAL_PAUSE)
    data = bytearray(os.urandom(24 * CS))
    box: list[int] = []

    async def first(fs):
        ino = await write_file(fs, ROOT_INO, b"c", bytes(data))
        await trio.sleep(5 * SEAL_PAUSE)
        fh, _ = await fs.open(ino, os.O_RDWR)
        box.extend([ino, len(fs.versions[fs.inodes[ino].vid].base_chunks)])
        await fs.write(fh, 7, b"x")  # chunk 0: inside the base unless nothing was hashed
        await fs.write(fh, 20 * CS + 3, b"y")  # past the base
    run_to_crash(first, tmp_path)
    ino, k = box
    assert k < 20
    expect = bytearray(data)
    expect[7:8] = b"x"
    expect[20 * CS + 3:20 * CS + 4] = b"y"

    async def second(fs):
        v = await sealed(fs, ino)
        assert fs.counters.seal_bytes_hashed == (CS if k else 0) + (24 - k) * CS
        _check(fs, v, bytes(expect))
        assert await _read_all(fs, ino, len(expect)) == expect
        assert await fs.checkpoints.verify() == []
    run(second, tmp_path)


# -- found by an adversarial review of the shared data files (each fails before its fix) --


def test_the_whole_file_hash_asked_during_a_rewrite_is_of_one_content(tmp_path, monkeypatch):
    """``user.mtcfs.blake3`` of a rewritten version is computed when first asked, in a
    worker thread that pins the version. A reopen for writing meanwhile takes the data file
    over (the version becomes a reader of it) and changes chunks the thread has not read
    yet: the digest must be of the old content (or the new), never of a mix of both."""
    data = bytearray(os.urandom(8 * CS))
    paused, go = threading.Event(), threading.Event()
    real_read, real_hash = versions_mod.read_data, versions_mod.hash_data
    main = threading.main_thread()

    def read_data(fds, v, off, length):
        out = real_read(fds, v, off, length)
        if threading.current_thread() is not main and off == 0:
            paused.set()
            go.wait(10)
        return out

    def hash_data(fds, v, piece=4 << 20):
        return real_hash(fds, v, piece=CS)  # chunk by chunk, so that it can pause between

    monkeypatch.setattr(versions_mod, "read_data", read_data)
    monkeypatch.setattr(files_mod, "hash_data", hash_data)

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"f", bytes(data))
        await sealed(fs, ino)
        await _rewrite(fs, ino, [(3 * CS, b"r")])
        data[3 * CS] = ord("r")
        v1 = await sealed(fs, ino)
        assert v1.blake3 == ""  # computed when asked
        before = bytes(data)
        got = []

        async def ask():
            got.append((await fs.getxattr(ino, b"user.mtcfs.blake3")).decode())
        async with trio.open_nursery() as n:
            n.start_soon(ask)
            with trio.fail_after(10):
                while not paused.is_set():
                    await trio.sleep(0.005)
            await _rewrite(fs, ino, [(0, b"A" * CS), (7 * CS, b"B" * CS)])
            data[0:CS], data[7 * CS:8 * CS] = b"A" * CS, b"B" * CS
            go.set()
        await sealed(fs, ino)
        assert got[0] in (blake3.blake3(before).hexdigest(),
                          blake3.blake3(bytes(data)).hexdigest())

    run(body, tmp_path)


def test_a_truncate_to_zero_through_a_handle_while_pinned_copies_nothing(tmp_path):
    """``truncate -s 0`` opens without O_TRUNC and calls ftruncate: with the old version
    pinned, the writer leaves the data file to it (as an O_TRUNC open does) rather than
    copy every chunk of it into the daemon's memory (ENOSPC here: 20 chunks more in a
    RAM tier of 30 holding 20). The pinned version still reads every old byte."""
    data = os.urandom(20 * CS)

    async def body(fs):
        ino, v1, pinned, read = await _pinned_step(fs, data)
        fh, _ = await fs.open(ino, os.O_WRONLY)
        try:
            await fs.setattr(ino, size=0, fh=fh)
            await fs.write(fh, 0, b"new")
        finally:
            await fs.release(fh)
        assert not v1.preserved
        _old_bytes_intact(read, v1, data)
        fs.tier_api.unpin(pinned)
        fh, _ = await fs.open(ino, os.O_RDONLY)
        assert await fs.read(fh, 0, 100) == b"new"
        await fs.release(fh)

    run(body, tmp_path, capacity=30 * CS)


def test_a_second_reader_counts_its_kept_chunks_not_the_whole_file(tmp_path):
    """A second rewrite while the first rewrite's version is pinned too: that version
    joins the readers of the shared file. size= counts the file once and each reader's
    kept chunks, also when the second rewrite changes none of its chunks (an append)."""
    data = os.urandom(20 * CS)

    async def body(fs):
        ino, v1, pinned, read = await _pinned_step(fs, data)
        await _rewrite(fs, ino, [(0, b"x")])
        v2 = await sealed(fs, ino)
        got = fs.tier_api.pin_chunk(v2.chunks[0])  # only v2 holds this chunk
        assert got is not None and got[0] is v2
        await _rewrite(fs, ino, [(20 * CS, b"appended")])  # past v2's end only
        await sealed(fs, ino)
        kept = sum(len(b) for r in (v1, v2) for b in (r.preserved or {}).values())
        assert fs.used == _on_disk(fs) + kept
        fs.tier_api.unpin(pinned)
        fs.tier_api.unpin([v2])
        assert fs.used == _on_disk(fs)

    run(body, tmp_path)


def test_a_late_duplicate_fetch_never_writes_over_a_rewrite(tmp_path, monkeypatch):
    """Two fetches of one missing chunk (a restore's delivery and a read's fault-in) both
    write it; the first to end makes the version complete. A rewrite opened then must not
    take the file over before the second write ends, or that write of the old bytes lands
    on the rewrite's (and its seal hashes them: nothing would notice)."""
    data = os.urandom(4 * CS)
    real_pwrite = os.pwrite
    main = threading.main_thread()
    first, go = threading.Event(), threading.Event()
    calls = [0]

    def pwrite(fd, buf, off):
        if threading.current_thread() is not main and len(buf) == CS and off == 0:
            calls[0] += 1
            if calls[0] == 1:  # the first fetch's write of chunk 0 is slow
                first.set()
                go.wait(10)
        return real_pwrite(fd, buf, off)

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"f", data)
        v0 = await sealed(fs, ino)
        with fs.db.transaction():
            fs.vstore.drop_data(v0)  # evicted: every chunk missing
        for i in (1, 2, 3):
            await fs.tier_api.deliver_chunk(v0.chunks[i], data[i * CS:(i + 1) * CS],
                                            [(v0, i)])
        monkeypatch.setattr(os, "pwrite", pwrite)
        async with trio.open_nursery() as n:
            n.start_soon(fs.tier_api.deliver_chunk, v0.chunks[0], data[:CS], [(v0, 0)])
            with trio.fail_after(10):
                while not first.is_set():
                    await trio.sleep(0.005)
            await fs.tier_api.deliver_chunk(v0.chunks[0], data[:CS], [(v0, 0)])
            assert not v0.missing

            wrote = []

            async def rewrite():
                fh, _ = await fs.open(ino, os.O_RDWR)
                await fs.write(fh, 0, b"N" * CS)
                wrote.append(True)
                await fs.release(fh)
            n.start_soon(rewrite)
            with trio.fail_after(10):  # the open waits for the slow write (it used to not)
                while getattr(v0, "fill_done", None) is None and not wrote:
                    await trio.sleep(0.005)
            go.set()
        monkeypatch.undo()
        await sealed(fs, ino)
        fh, _ = await fs.open(ino, os.O_RDONLY)
        got = await fs.read(fh, 0, 4 * CS)
        await fs.release(fh)
        assert got == b"N" * CS + data[CS:]

    run(body, tmp_path)


def test_a_corrupt_chunk_of_a_shared_file_is_fetched_again_for_its_readers(tmp_path):
    """A rewrite shares its data file with the old version a backup upload pins (chunks
    it changes are kept aside first: "Shared data files"). When a chunk that neither
    changed is found corrupt in that file (the scrub, or a first read), the old version's
    bytes of it are the same corrupt bytes: they become missing for it too, to be fetched
    again, and the rot is reported once. Before, they were copied aside as they were (RAM
    past size=), found corrupt again by the upload's read, and reported twice."""
    data = os.urandom(8 * CS)

    async def body(fs):
        ino, v1, pinned, read = await _pinned_step(fs, data)
        await _rewrite(fs, ino, [(6 * CS, b"new")])
        v2 = await sealed(fs, ino)
        assert v1.shared is not None and v1.shared is v2.shared
        os.pwrite(fs.vstore.fd(v2), b"\xff" * 8, 3 * CS + 100)  # rot in a chunk both hold
        fs.chunks.mark_corrupt(v2, 3, "scrub")
        assert 3 not in (v1.preserved or {}) and 3 in v1.missing
        fs.fetcher.chunk_source = src = ChunksOf(data)
        await fs.tier_api.fault_in(v1, 0, len(data))  # what the upload asks for first
        _old_bytes_intact(read, v1, data)
        assert src.fetches == 1 and fs.counters.corrupt_chunks == 1
        assert fs.used == _on_disk(fs) + sum(len(b) for b in v1.preserved.values())
        fs.tier_api.unpin(pinned)

    run(body, tmp_path)
