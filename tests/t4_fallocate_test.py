"""fallocate(2) through the mount (mtcfs's pyfuse3, third_party/pyfuse3/fallocate.patch;
docs/usage.md "fallocate"), both data paths: the range gets its pages in the RAM tier at the
call and counts against ``size=`` there (ENOSPC at the call when it does not fit), mode 0
grows the file, ``FALLOC_FL_KEEP_SIZE`` does not, no byte of the file changes, other modes
are EOPNOTSUPP; the file then seals and survives a restart bit-exact.

Before, the daemon had no fallocate: the kernel answered EOPNOTSUPP, glibc's posix_fallocate
fell back to writing a byte per 4 KiB through the mount, and a writer that preallocates (fio
lays out its files so) got no pages ahead of its writes (fio's 4-job random writes at 0.73
of tmpfs, docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import errno
import os

import blake3
import pyfuse3
import pytest

from support.mount import drop_page_cache

FUSE_PATHS = ("passthrough", "daemon")
MiB = 1 << 20

pytestmark = pytest.mark.skipif(
    not hasattr(pyfuse3.Operations, "fallocate"),
    reason="the stock pyfuse3 has no fallocate (scripts/build_fuse.sh did not build mtcfs's)")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
KEEP_SIZE, PUNCH_HOLE = 0x01, 0x02


def fallocate(fd: int, mode: int, off: int, length: int) -> None:
    if _libc.fallocate(fd, mode, off, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def held(m) -> int:
    """Bytes the store's data files hold (the daemon's ``used``)."""
    return m.status()["ram"]["used"]


def test_fallocate_gives_pages_grows_the_file_and_changes_no_byte(make_mount):
    m = make_mount("n", size="256M")
    p = m.path("prealloc.bin")
    head = os.urandom(MiB + 123)
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, head)
        before = held(m)
        mtime = os.fstat(fd).st_mtime_ns
        fallocate(fd, 0, 0, 48 * MiB)  # mode 0: pages for the range, the file grows
        st = os.fstat(fd)
        assert st.st_size == 48 * MiB
        assert st.st_mtime_ns >= mtime
        assert held(m) - before >= 46 * MiB  # the pages are the RAM tier's now
        fallocate(fd, KEEP_SIZE, 40 * MiB, 20 * MiB)  # past the end: no size change
        assert os.fstat(fd).st_size == 48 * MiB
        os.posix_fallocate(fd, 10 * MiB, 4 * MiB)  # glibc's call: inside, nothing changes
        assert os.fstat(fd).st_size == 48 * MiB
        for mode in (PUNCH_HOLE | KEEP_SIZE, 0x10):  # punch hole, zero range
            with pytest.raises(OSError) as exc:
                fallocate(fd, mode, 0, MiB)
            assert exc.value.errno == errno.EOPNOTSUPP
        with pytest.raises(OSError) as exc:
            fallocate(fd, 0, 0, 0)
        assert exc.value.errno == errno.EINVAL
        os.pwrite(fd, b"tail", 48 * MiB - 4)
    finally:
        os.close(fd)
    want = head + bytes(48 * MiB - len(head) - 4) + b"tail"
    m.wait_state("prealloc.bin", "local", 30)
    drop_page_cache(p)
    assert p.read_bytes() == want
    assert os.getxattr(p, "user.mtcfs.blake3").decode() == blake3.blake3(want).hexdigest()
    m.stop()
    m.start()
    assert p.read_bytes() == want


def test_fallocate_past_size_is_enospc_at_the_call_and_loses_nothing(make_mount):
    m = make_mount("n", size="64M")
    keep = os.urandom(8 * MiB)
    m.path("kept.bin").write_bytes(keep)
    p = m.path("big.bin")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"start")
        with pytest.raises(OSError) as exc:
            fallocate(fd, 0, 0, 200 * MiB)
        assert exc.value.errno == errno.ENOSPC
        assert os.pread(fd, 5, 0) == b"start"
        fallocate(fd, 0, 0, 16 * MiB)  # what fits still does
        assert os.fstat(fd).st_size == 16 * MiB
    finally:
        os.close(fd)
    assert m.status()["counters"]["enospc"] >= 1
    drop_page_cache(m.path("kept.bin"))
    assert m.path("kept.bin").read_bytes() == keep
    m.wait_state("big.bin", "local", 30)
    assert p.read_bytes()[:5] == b"start"


def test_fallocate_on_a_read_only_descriptor_is_ebadf(make_mount):
    m = make_mount("n")
    m.path("f").write_bytes(b"x" * 100)
    fd = os.open(m.path("f"), os.O_RDONLY)
    try:
        with pytest.raises(OSError) as exc:
            fallocate(fd, 0, 0, MiB)
        assert exc.value.errno == errno.EBADF
    finally:
        os.close(fd)
    assert m.path("f").read_bytes() == b"x" * 100
