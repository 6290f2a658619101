"""A no-op pyfuse3 filesystem: the FUSE transport ceiling on this machine.

One regular file, ``data``, in the root directory, and whatever names a benchmark makes
beside it (an in-memory namespace: the metadata ceiling). Writes are accepted and discarded
(only a file's length is tracked); reads return zeros up to the length. It is configured like
mtcfs on the data path, so that the difference between the two is what mtcfs itself costs:

- writeback cache on (the kernel batches writes into 1 MiB requests);
- ``keep_cache`` on open (warm reads are served from the page cache);
- the mount's read-ahead raised to 4 MiB (1 MiB read requests instead of 128 KiB), after
  FUSE INIT (the kernel resets it when it processes the INIT reply);
- a 1 MiB ``st_blksize``.

By default it has no extended attributes: its GETXATTR answers ENOSYS, after which the
kernel asks no more, so it never sees the ``security.capability`` GETXATTR the kernel sends
before every write(2) to a filesystem that has them. ``--xattrs`` answers "no such
attribute" (ENODATA) instead, as any filesystem with extended attributes (mtcfs) must: the
ceiling for such a filesystem when it does not negotiate ``FUSE_HANDLE_KILLPRIV_V2``
(docs/benchmarks.md, "The GETXATTR before every write"; mtcfs does, docs/fuse-build.md).

Run ``python -m benchmarks.noop_fs MOUNTPOINT [--size BYTES] [--xattrs]``: it mounts, prints
``ready`` on stdout, and serves until unmounted (``fusermount3 -u MOUNTPOINT``) or sent
SIGTERM.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import stat
import sys
import time
from dataclasses import dataclass

import pyfuse3
import trio

from mtcfs.base.mountinfo import device_of

FILE_INO = pyfuse3.ROOT_INODE + 1
FILE_NAME = b"data"
READ_AHEAD_KB = 4096
BLKSIZE = 1 << 20


@dataclass
class _Node:
    """An inode of the no-op filesystem: its mode, length, and (directories) its entries."""

    mode: int
    size: int = 0
    entries: dict[bytes, int] | None = None
    nlink: int = 1


class NoopFS(pyfuse3.Operations):
    """See the module docstring.

    The namespace is a dict of inodes in memory, so that metadata operations (lookup,
    getattr, setattr, create, mkdir, unlink, rmdir, rename, readdir) do the least work that
    still gives a consistent tree: this is the FUSE ceiling for metadata, as ``data`` is the
    ceiling for the data path. Nothing is stored: writes only move a file's length, reads
    return zeros.
    """

    enable_writeback_cache = True

    def __init__(self, size: int, xattrs: bool = False) -> None:
        super().__init__()
        self.xattrs = xattrs
        self.mtime_ns = time.time_ns()
        self._zeros: dict[int, bytes] = {}
        self.initialized = False
        self.nodes: dict[int, _Node] = {
            pyfuse3.ROOT_INODE: _Node(stat.S_IFDIR | 0o755, entries={FILE_NAME: FILE_INO},
                                      nlink=2),
            FILE_INO: _Node(stat.S_IFREG | 0o644, size)}
        self._next_ino = FILE_INO + 1

    @property
    def size(self) -> int:
        """Length of ``data`` in bytes."""
        return self.nodes[FILE_INO].size

    def init(self) -> None:
        self.initialized = True  # the kernel has the INIT reply: its limits are now set

    def _node(self, inode: int) -> _Node:
        n = self.nodes.get(inode)
        if n is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return n

    def _dir(self, inode: int) -> dict[bytes, int]:
        entries = self._node(inode).entries
        if entries is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return entries

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        n = self._node(inode)
        e = pyfuse3.EntryAttributes()
        e.st_ino = inode
        e.entry_timeout = 60.0
        e.attr_timeout = 60.0
        e.st_uid = os.getuid()
        e.st_gid = os.getgid()
        e.st_blksize = BLKSIZE
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = self.mtime_ns
        e.st_mode = n.mode
        e.st_nlink = n.nlink
        e.st_size = n.size
        e.st_blocks = (n.size + 511) // 512
        return e

    async def getxattr(self, inode, name, ctx):
        raise pyfuse3.FUSEError(errno.ENODATA if self.xattrs else errno.ENOSYS)

    async def getattr(self, inode, ctx=None):
        return self._attr(inode)

    async def lookup(self, parent_inode, name, ctx=None):
        ino = self._dir(parent_inode).get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(ino)

    async def setattr(self, inode, attr, fields, fh, ctx):
        n = self._node(inode)
        if fields.update_size:
            n.size = attr.st_size
        if fields.update_mode:
            n.mode = stat.S_IFMT(n.mode) | stat.S_IMODE(attr.st_mode)
        if fields.update_mtime:
            self.mtime_ns = attr.st_mtime_ns or time.time_ns()
        return self._attr(inode)

    def _new(self, parent: int, name: bytes, mode: int) -> int:
        entries = self._dir(parent)
        if name in entries:
            raise pyfuse3.FUSEError(errno.EEXIST)
        ino = self._next_ino
        self._next_ino += 1
        is_dir = stat.S_ISDIR(mode)
        self.nodes[ino] = _Node(mode, entries={} if is_dir else None, nlink=2 if is_dir else 1)
        entries[name] = ino
        if is_dir:
            self.nodes[parent].nlink += 1
        return ino

    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._attr(self._new(parent_inode, name, stat.S_IFDIR | stat.S_IMODE(mode)))

    async def create(self, parent_inode, name, mode, flags, ctx):
        ino = self._new(parent_inode, name, stat.S_IFREG | stat.S_IMODE(mode))
        return pyfuse3.FileInfo(fh=ino, keep_cache=True), self._attr(ino)

    async def unlink(self, parent_inode, name, ctx):
        entries = self._dir(parent_inode)
        ino = entries.get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if self.nodes[ino].entries is not None:
            raise pyfuse3.FUSEError(errno.EISDIR)
        del entries[name]
        if ino != FILE_INO:
            del self.nodes[ino]

    async def rmdir(self, parent_inode, name, ctx):
        entries = self._dir(parent_inode)
        ino = entries.get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        children = self.nodes[ino].entries
        if children is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if children:
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        del entries[name]
        del self.nodes[ino]
        self.nodes[parent_inode].nlink -= 1

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        old, new = self._dir(parent_inode_old), self._dir(parent_inode_new)
        ino = old.get(name_old)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if name_new in new:
            raise pyfuse3.FUSEError(errno.EEXIST)  # the benchmark never replaces a name
        del old[name_old]
        new[name_new] = ino

    async def forget(self, inode_list):
        return None

    async def open(self, inode, flags, ctx):
        n = self._node(inode)
        if n.entries is not None:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & os.O_TRUNC and (flags & os.O_ACCMODE) != os.O_RDONLY:
            n.size = 0
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        n = max(0, min(size, self._node(fh).size - off))
        z = self._zeros.get(n)
        if z is None:
            z = bytes(n)
            if len(self._zeros) < 16:
                self._zeros[n] = z
        return z

    async def write(self, fh, off, buf):
        node = self._node(fh)
        end = off + len(buf)
        if end > node.size:
            node.size = end
        return len(buf)

    async def flush(self, fh):
        return None

    async def release(self, fh):
        return None

    async def fsync(self, fh, datasync):
        return None

    async def opendir(self, inode, ctx):
        self._dir(inode)
        return inode

    async def readdir(self, fh, start_id, token):
        entries = list(self._dir(fh).items())
        for i in range(start_id, len(entries)):
            name, ino = entries[i]
            if not pyfuse3.readdir_reply(token, name, self._attr(ino), i + 1):
                break

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
    p.add_argument("--xattrs", action="store_true",
                   help="answer GETXATTR with ENODATA (a filesystem with xattrs), not ENOSYS")
    a = p.parse_args(argv)
    opts = set(pyfuse3.default_options)
    opts.add("fsname=noopfs")
    opts.add("subtype=noopfs")
    fs = NoopFS(a.size, a.xattrs)
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
