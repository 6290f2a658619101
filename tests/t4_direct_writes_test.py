"""Direct writes (mount option ``direct_writes``, issue 18; docs/usage.md, "Direct writes").

A handle that creates a file or opens it with ``O_TRUNC`` for writing is opened with
FOPEN_DIRECT_IO: each write(2) reaches the daemon at once instead of waiting in the
kernel's page cache. What a user can check: the bytes, a shared mmap of such a file
(which Linux refuses on a direct-I/O file unless the mount negotiated
FUSE_DIRECT_IO_ALLOW_MMAP), ENOSPC at the write(2) that does not fit, the file's times
(the same before and after a restart), and the option that turns it off. The libraries'
own saves through the mount (torch.save, safetensors, DCP, Orbax) are in t5_*; the speed
in docs/benchmarks.md.
"""

from __future__ import annotations

import errno
import mmap
import os
import time
import types

import pyfuse3
import pytest

from mtcfs.fuse_ops import Operations

MiB = 1024 * 1024

#: mtcfs's pyfuse3 (third_party/pyfuse3/direct-io-allow-mmap.patch) is installed.
PATCHED = hasattr(pyfuse3, "direct_io_allow_mmap")
needs_patched = pytest.mark.skipif(
    not PATCHED, reason="the stock pyfuse3 cannot negotiate FUSE_DIRECT_IO_ALLOW_MMAP, so "
                        "direct writes stay off (scripts/build_fuse.sh; docs/fuse-build.md)")


def _ops(direct_writes: bool) -> Operations:
    fs = types.SimpleNamespace(job_scope=False, subscribe=lambda cb: None)
    ops = Operations(fs, "", direct_writes=direct_writes)  # type: ignore[arg-type]
    ops.direct_writes = direct_writes  # as INIT decides when the kernel grants the flag
    return ops


def test_which_handles_are_opened_direct():
    ops = _ops(True)
    wr, rw, ro = os.O_WRONLY, os.O_RDWR, os.O_RDONLY
    assert ops._direct(wr | os.O_CREAT | os.O_TRUNC, created=True)
    assert ops._direct(rw | os.O_CREAT | os.O_EXCL, created=True)
    assert ops._direct(wr | os.O_TRUNC, created=False)            # an overwrite in place
    assert not ops._direct(wr | os.O_CREAT | os.O_APPEND, created=True)  # a log's appends
    assert not ops._direct(rw, created=False)                     # a rewrite of a few bytes
    assert not ops._direct(ro | os.O_TRUNC, created=False)        # nothing written through it
    assert not ops._direct(ro, created=False)
    off = _ops(False)
    assert not off._direct(wr | os.O_CREAT | os.O_TRUNC, created=True)
    assert not off._direct(wr | os.O_TRUNC, created=False)


@needs_patched
def test_status_says_so_and_the_option_turns_them_off(make_mount):
    assert make_mount("on").status()["fuse"]["direct_writes"] is True
    off = make_mount("off", direct_writes="no")
    assert off.status()["fuse"]["direct_writes"] is False
    data = os.urandom(3 * MiB + 5)
    off.path("f").write_bytes(data)
    assert off.path("f").read_bytes() == data


@needs_patched
def test_a_file_being_created_can_be_mapped_shared(mount):
    """numpy.memmap(mode="w+") and the like: create, size, map MAP_SHARED, write through
    the mapping and the descriptor alike; every byte arrives, in the file and after close."""
    path = mount.path("mapped.bin")
    size = 3 * MiB + 4096
    data = bytearray(os.urandom(size))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as mm:  # ENODEV on a direct-I/O file without the flag
            mm[:2 * MiB] = data[:2 * MiB]
            mm.flush()
            # the descriptor (direct) sees what the mapping wrote ...
            assert os.pread(fd, 4096, MiB) == bytes(data[MiB:MiB + 4096])
            os.pwrite(fd, bytes(data[2 * MiB:]), 2 * MiB)
            # ... and the mapping what the descriptor wrote
            assert mm[2 * MiB:2 * MiB + 4096] == bytes(data[2 * MiB:2 * MiB + 4096])
            data[100:200] = b"\x07" * 100
            mm[100:200] = b"\x07" * 100
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(data)
    mount.wait_state("mapped.bin", "local")
    assert path.read_bytes() == bytes(data)


@needs_patched
def test_enospc_comes_at_the_write_that_does_not_fit(make_mount):
    """With the page cache in between, a write past size= was accepted and the error came
    at close; now the write(2) that does not fit gets ENOSPC, and the file holds exactly
    the bytes the writes before it were told were written."""
    m = make_mount(size="32M")
    piece = 4 * MiB
    data = os.urandom(12 * piece)
    fd = os.open(m.path("big.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    done = 0
    try:
        with pytest.raises(OSError) as ei:
            while done < len(data):
                done += os.write(fd, data[done:done + piece])
        assert ei.value.errno == errno.ENOSPC
    finally:
        os.close(fd)  # nothing left in the page cache to fail here
    assert 0 < done < 32 * MiB
    assert m.path("big.bin").read_bytes() == data[:done]


@needs_patched
def test_the_times_a_node_shows_are_the_times_a_restart_shows(make_mount):
    """The kernel stamps no c/mtime for a direct write (and, under the writeback cache,
    shows its own times of a regular file, never the daemon's, until it forgets the
    inode). So the daemon stamps none either: a first try that recorded each write's time
    made a restart show other times than before it (t4_posix_test's restart test caught
    it, 4 ms apart). The times stay those of the create, across writes spread in time and
    across a restart."""
    m = make_mount(size="1G")
    fd = os.open(m.path("f.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        created = os.fstat(fd)
        os.write(fd, os.urandom(MiB))
        time.sleep(0.2)  # the clock, not a race: the writes are 0.2 s apart
        os.write(fd, os.urandom(MiB))
    finally:
        os.close(fd)
    shown = os.stat(m.path("f.bin"))
    assert (shown.st_mtime_ns, shown.st_ctime_ns) == (created.st_mtime_ns, created.st_ctime_ns)
    m.wait_state("f.bin", "local")
    m.stop()
    m.start()
    after = os.stat(m.path("f.bin"))
    assert (after.st_mtime_ns, after.st_ctime_ns, after.st_size) == (
        shown.st_mtime_ns, shown.st_ctime_ns, 2 * MiB)


@needs_patched
def test_an_overwrite_in_place_moves_the_mtime_this_node_shows(mount):
    """The truncating open stamps the time (the kernel does), so tools comparing mtimes
    across a rewrite see it even before the inode is forgotten."""
    path = mount.path("g.bin")
    path.write_bytes(b"x" * 100)
    t0 = os.stat(path).st_mtime_ns
    time.sleep(0.1)  # past the coarse clock's tick
    with open(path, "wb") as f:
        f.write(b"y" * 100)
    assert os.stat(path).st_mtime_ns > t0
    assert path.read_bytes() == b"y" * 100
