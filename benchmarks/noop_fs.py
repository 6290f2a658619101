"""A no-op pyfuse3 filesystem: the FUSE transport ceiling on this machine.

One regular file, ``data``, in the root directory. Writes are accepted and discarded (only
the file length is tracked); reads return zeros up to the length. It is configured like
mtcfs on the data path, so that the difference between the two is what mtcfs itself costs:

- writeback cache on (the kernel batches writes into 1 MiB requests);
- ``keep_cache`` on open (warm reads are served from the page cache);
- the mount's read-ahead raised to 4 MiB (1 MiB read requests instead of 128 KiB), after
  FUSE INIT (the kernel resets it when it processes the INIT reply);
- a 1 MiB ``st_blksize``.

Run ``python -m benchmarks.noop_fs MOUNTPOINT [--size BYTES]``: it mounts, prints ``ready``
on stdout, and serves until unmounted (``fusermount3 -u MOUNTPOINT``) or sent SIGTERM.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import stat
import sys
import time

import pyfuse3
import trio

from mtcfs.base.mountinfo import device_of

FILE_INO = pyfuse3.ROOT_INODE + 1
FILE_NAME = b"data"
READ_AHEAD_KB = 4096
BLKSIZE = 1 << 20


class NoopFS(pyfuse3.Operations):
    """See the module docstring."""

    enable_writeback_cache = True

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.mtime_ns = time.time_ns()
        self._zeros: dict[int, bytes] = {}
        self.initialized = False

    def init(self) -> None:
        self.initialized = True  # the kernel has the INIT reply: its limits are now set

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = inode
        e.entry_timeout = 60.0
        e.attr_timeout = 60.0
        e.st_uid = os.getuid()
        e.st_gid = os.getgid()
        e.st_blksize = BLKSIZE
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = self.mtime_ns
        if inode == pyfuse3.ROOT_INODE:
            e.st_mode = stat.S_IFDIR | 0o755
            e.st_nlink = 2
            e.st_size = 0
        elif inode == FILE_INO:
            e.st_mode = stat.S_IFREG | 0o644
            e.st_nlink = 1
            e.st_size = self.size
            e.st_blocks = (self.size + 511) // 512
        else:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return e

    async def getattr(self, inode, ctx=None):
        return self._attr(inode)

    async def lookup(self, parent_inode, name, ctx=None):
        if parent_inode == pyfuse3.ROOT_INODE and name == FILE_NAME:
            return self._attr(FILE_INO)
        raise pyfuse3.FUSEError(errno.ENOENT)

    async def setattr(self, inode, attr, fields, fh, ctx):
        if fields.update_size:
            self.size = attr.st_size
        if fields.update_mtime:
            self.mtime_ns = attr.st_mtime_ns or time.time_ns()
        return self._attr(inode)

    async def open(self, inode, flags, ctx):
        if inode != FILE_INO:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & os.O_TRUNC and (flags & os.O_ACCMODE) != os.O_RDONLY:
            self.size = 0
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        n = max(0, min(size, self.size - off))
        z = self._zeros.get(n)
        if z is None:
            z = bytes(n)
            if len(self._zeros) < 16:
                self._zeros[n] = z
        return z

    async def write(self, fh, off, buf):
        end = off + len(buf)
        if end > self.size:
            self.size = end
        return len(buf)

    async def flush(self, fh):
        return None

    async def release(self, fh):
        return None

    async def fsync(self, fh, datasync):
        return None

    async def opendir(self, inode, ctx):
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh, start_id, token):
        if start_id == 0:
            pyfuse3.readdir_reply(token, FILE_NAME, self._attr(FILE_INO), 1)

    async def releasedir(self, fh):
        return None

    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = s.f_bfree = s.f_bavail = 1 << 30
        s.f_files = s.f_ffree = s.f_favail = 1 << 20
        s.f_namemax = 255
        return s


def raise_read_ahead(mountpoint: str, kb: int = READ_AHEAD_KB) -> bool:
    """Set the read-ahead of the FUSE mount at ``mountpoint`` (needs root). True if set."""
    path = _read_ahead_path(mountpoint)
    if path is None:
        return False
    try:
        with open(path, "w") as f:
            f.write(str(kb))
        return True
    except OSError:
        return False


_signalled = False


def _read_ahead_path(mountpoint: str) -> str | None:
    dev = device_of(mountpoint)
    return None if dev is None else f"/sys/class/bdi/{dev}/read_ahead_kb"


async def _tune_read_ahead_then_ready(fs: NoopFS, mountpoint: str) -> None:
    """Once INIT is answered, raise the read-ahead until it sticks; then print ``ready``."""
    while not fs.initialized:
        await trio.sleep(0.01)
    path = _read_ahead_path(mountpoint)
    for _ in range(100):
        await trio.sleep(0.02)
        if not raise_read_ahead(mountpoint) or path is None:
            break  # not root: keep the kernel default
        with open(path) as f:
            if int(f.read()) == READ_AHEAD_KB:
                break
    print("ready", flush=True)


async def _serve(mountpoint: str, fs: NoopFS) -> None:
    async def on_signal() -> None:
        global _signalled
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
            async for _ in sigs:
                _signalled = True
                pyfuse3.terminate()

    async with trio.open_nursery() as n:
        n.start_soon(on_signal)
        n.start_soon(_tune_read_ahead_then_ready, fs, mountpoint)
        await pyfuse3.main()
        n.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.noop_fs")
    p.add_argument("mountpoint")
    p.add_argument("--size", type=int, default=0, help="initial length of the file in bytes")
    a = p.parse_args(argv)
    opts = set(pyfuse3.default_options)
    opts.add("fsname=noopfs")
    opts.add("subtype=noopfs")
    fs = NoopFS(a.size)
    pyfuse3.init(fs, a.mountpoint, opts)
    mounted = True
    try:
        trio.run(_serve, a.mountpoint, fs)
        mounted = _signalled  # unmounted from outside: nothing left to unmount
    finally:
        pyfuse3.close(unmount=mounted)
    sys.exit(0)


if __name__ == "__main__":
    main()
