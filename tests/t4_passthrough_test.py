"""FUSE passthrough in the product (issue 40): the kernel reads and writes the store's data
files itself; the daemon keeps the books.

What a user checks: the bytes (bit-exact, through every way of writing: write(2), a shared
mapping, O_APPEND, a reopen), the size and times stat(2) shows while a file is being
written, the seal after the last close (``user.mtcfs.state``, ``user.mtcfs.blake3``), and
``mtcfs status`` saying whether passthrough is on and, when it is off, why. With
passthrough on the daemon sees no READ or WRITE: its byte counters stay where they were.
"""

from __future__ import annotations

import mmap
import os
import threading
import time

import blake3
import pytest

from support.passthrough import data as _data
from support.passthrough import fuse_status as _fuse
from support.passthrough import assert_sealed_as, held_checkpoint, passthrough_mount

MiB = 1 << 20


@pytest.fixture
def pt_mount(make_mount):
    return passthrough_mount(make_mount)


def test_the_kernel_moves_the_bytes_and_the_seal_hashes_them(pt_mount):
    m = pt_mount
    before = m.status()["counters"]
    data = _data(24 * MiB + 5, 1)
    p = m.path("model.bin")
    with open(p, "wb") as f:
        for i in range(0, len(data), 3 * MiB):
            f.write(data[i:i + 3 * MiB])
    m.wait_state("model.bin", "local", 30)
    assert os.getxattr(p, "user.mtcfs.blake3").decode() == blake3.blake3(data).hexdigest()
    with open(p, "rb") as f:
        assert f.read() == data
    st = m.status()
    after, fuse = st["counters"], st["fuse"]
    # neither a WRITE nor a READ reached the daemon
    assert after["bytes_written"] == before["bytes_written"]
    assert after["bytes_read"] == before["bytes_read"]
    assert fuse["passthrough_opens_write"] >= 1 and fuse["passthrough_opens_read"] >= 1
    assert fuse["passthrough_off"] == ""


def test_passthrough_no_keeps_every_byte_on_the_daemons_path(make_mount):
    m = make_mount("d", passthrough="no")
    fuse = _fuse(m)
    assert fuse["passthrough"] is False
    assert "passthrough=no" in fuse["passthrough_off"]
    data = _data(3 * MiB, 2)
    m.path("f").write_bytes(data)
    assert m.path("f").read_bytes() == data
    assert m.status()["counters"]["bytes_written"] == len(data)
    out = m.cli("status", str(m.mnt)).stdout
    assert "passthrough off" in out and "passthrough=no" in out


def test_stat_shows_what_the_kernel_wrote_while_the_file_is_open(pt_mount):
    m = pt_mount
    p = m.path("growing")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        t0 = os.stat(p).st_mtime_ns
        time.sleep(0.02)
        os.write(fd, b"x" * 100_000)
        st = os.stat(p)
        assert st.st_size == 100_000
        assert st.st_mtime_ns > t0
        os.write(fd, b"y" * 50_000)
        assert os.stat(p).st_size == 150_000
        assert os.getxattr(p, "user.mtcfs.state") == b"writing"
    finally:
        os.close(fd)
    m.wait_state("growing", "local", 30)
    mtime = os.stat(p).st_mtime_ns
    assert p.read_bytes() == b"x" * 100_000 + b"y" * 50_000
    m.stop()
    m.start()
    assert os.stat(p).st_mtime_ns == mtime  # the times a node shows are the ones it keeps
    assert os.stat(p).st_size == 150_000


def test_a_shared_mapping_and_appends_reach_the_store(pt_mount):
    m = pt_mount
    p = m.path("mapped")
    with open(p, "wb") as f:
        f.truncate(4 * MiB)
    with open(p, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 4 * MiB)
        mm[MiB:MiB + 5] = b"hello"
        mm[3 * MiB] = 7
        mm.flush()
        mm.close()
    with open(p, "ab") as f:
        f.write(b"tail")
    want = bytearray(4 * MiB)
    want[MiB:MiB + 5] = b"hello"
    want[3 * MiB] = 7
    want += b"tail"
    assert_sealed_as(m, "mapped", bytes(want))
    m.stop()
    m.start()
    assert p.read_bytes() == want  # what the store holds, after a restart


def test_a_truncating_rewrite_under_a_reader_gives_one_content(pt_mount):
    """A reader holds the file open (passthrough) while a writer replaces it with O_TRUNC:
    no open fails (the kernel allows one backing file per inode), and the reader, like
    every later one, sees the new bytes (one file, one content)."""
    m = pt_mount
    p, new, r = held_checkpoint(m)
    try:
        with open(p, "wb") as f:
            f.write(new)
        assert os.pread(r, len(new) + 10, 0) == new
    finally:
        os.close(r)
    assert_sealed_as(m, "ckpt", new)


def test_reopens_racing_their_release_never_fail(pt_mount):
    """close(2) returns before the daemon hears RELEASE: a writer that reopens at once, and
    readers beside it, must never get EIO or another writer's stale bytes."""
    m = pt_mount
    p = m.path("hot")
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                with open(p, "rb") as f:
                    got = f.read()
                assert got == b"" or len(set(got[:4096])) <= 1, "a mix of two writes"
            except FileNotFoundError:
                pass
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)
                return

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(150):
            with open(p, "wb") as f:
                f.write(bytes([i % 251]) * 8192)
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors[:3]
    m.wait_state("hot", "local", 30)
    assert p.read_bytes() == bytes([149 % 251]) * 8192


def test_a_chunk_damaged_while_down_is_never_handed_to_the_kernel(make_mount):
    """The first open after a restart verifies the file before the kernel gets it; a
    mismatching chunk leaves the file on the daemon's path, which refuses that chunk
    (EIO, nothing else can fetch it here) and serves the others."""
    import sqlite3

    m = passthrough_mount(make_mount, "v", chunk_size="128K")
    data = _data(16 * 128 * 1024, 5)
    p = m.path("w.bin")
    p.write_bytes(data)
    m.wait_state("w.bin", "local", 30)
    m.stop()
    db = sqlite3.connect(f"file:{m.store / 'meta.sqlite3'}?mode=ro", uri=True)
    (vid,) = db.execute("SELECT vid FROM inodes WHERE parent=1 AND name=?",
                        (b"w.bin",)).fetchone()
    db.close()
    fd = os.open(m.store / "data" / str(vid), os.O_RDWR)
    os.pwrite(fd, b"\xff", 9 * 128 * 1024 + 3)
    os.close(fd)
    m.start()
    with open(p, "rb", buffering=0) as f:
        assert f.read(128 * 1024) == data[:128 * 1024]
        f.seek(9 * 128 * 1024)
        with pytest.raises(OSError):
            f.read(128 * 1024)
    fuse = _fuse(m)
    assert fuse["passthrough_opens_read"] == 0
    assert fuse["daemon_path_opens"], fuse


def test_a_writer_that_outlives_a_killed_daemon_never_changes_the_sealed_file(pt_mount):
    """kill -9 of the daemon while a process writes a file through passthrough: the kernel
    goes on writing the data file for that descriptor. After the restart the file is sealed
    from what the store held, and nothing the old descriptor writes afterwards changes it
    (the restart gave the version a data file of its own)."""
    m = pt_mount
    p = m.path("live.bin")
    first = _data(3 * MiB, 8)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert os.write(fd, first) == len(first)
        os.fsync(fd)
        m.kill9()
        m.start()
        m.wait_state("live.bin", "local", 30)
        sealed = p.read_bytes()
        assert sealed == first
        for off in (0, MiB, 5 * MiB):  # the old descriptor: whatever the kernel does with it
            try:
                os.pwrite(fd, b"Z" * 4096, off)
            except OSError:
                pass
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    assert p.read_bytes() == first
    r = m.cli("verify", str(m.mnt), check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_writer_that_needs_the_daemons_path_waits_for_passthrough_readers(pt_mount):
    """A set-user-ID file (its writes go through the daemon, which clears the bit) held
    open by a reader in passthrough mode: the kernel allows no other kind of open beside
    it, so a writer waits for the reader's close, and gets EBUSY if it does not come
    (docs/passthrough.md); once the reader closes, the writer opens and the bit goes."""
    import errno
    import stat

    m = pt_mount
    p = m.path("tool")
    p.write_bytes(b"#!/bin/sh\n")
    os.chmod(p, 0o4755)
    r = os.open(p, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as exc:
            os.open(p, os.O_WRONLY | os.O_APPEND)
        assert exc.value.errno == errno.EBUSY
    finally:
        os.close(r)
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"exit 0\n")
    finally:
        os.close(fd)
    assert p.read_bytes() == b"#!/bin/sh\nexit 0\n"
    assert not os.stat(p).st_mode & stat.S_ISUID
