"""Files the daemon itself writes, reads, renames and removes in its namespace.

:class:`OwnFiles` is a client of the core's facade (:class:`mtcfs.core.core.Filesystem`),
calling the operations the FUSE adapter calls, as an application's open/write/close would;
the tiers reach it through ``TierApi`` (the own-file methods of the mtc port). A replicator
protocol spoken through files (Orbax's multi-tier checkpointing: ``jax-init-info.txt``, ``replicator.yaml``,
``*.restore`` markers) needs the daemon to change names the kernel may have cached: every
method here tells the adapter which names to drop (the ``invalidate_entry`` event), and
counts no kernel lookup (the kernel never looked these inodes up).
"""

from __future__ import annotations

import errno
import os

from typing import TYPE_CHECKING

from mtcfs.base.errors import FsError
from mtcfs.core.model import ROOT_INO

if TYPE_CHECKING:
    from mtcfs.core.core import Filesystem

__all__ = ["MAX_OWN_FILE", "OwnFiles"]

#: Largest file :meth:`OwnFiles.read` reads, bytes.
MAX_OWN_FILE = 1 << 20


class OwnFiles:
    """The daemon's own small files and tree removals (no kernel involved).

    Args:
        fs: the core's facade, whose operations these call.
    """

    def __init__(self, fs: Filesystem) -> None:
        self.fs = fs

    def invalidate_name(self, parent: int, name: bytes, child: int = 0) -> None:
        """Tell the adapter to drop the kernel's cached entry ``parent/name`` (``child``:
        the inode it named, 0 for a name that now exists or never did)."""
        self.fs._emit("invalidate_entry", (parent, name, child))

    async def write(self, name: bytes, data: bytes, *, parent: int = ROOT_INO,
                             mode: int = 0o644) -> None:
        """Write ``data`` as ``parent/name`` atomically: a hidden temporary name, sealed,
        then renamed over ``name``.

        Raises:
            FsError: ENOSPC (RAM tier full), ENOTDIR, EISDIR (``name`` is a directory).
        """
        tmp = b"." + name + b".mtcfs-tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fh, attr = await self.fs.create(parent, tmp, mode, flags,
                                     os.getuid(), os.getgid())
        ino = self.fs.inodes[attr.ino]
        ino.lookups -= 1  # create() counts the kernel's lookup; there is none here
        try:
            if data:
                await self.fs.write(fh, 0, data)
            await self.fs.flush(fh)
        finally:
            await self.fs.release(fh)
        v = await self.fs.open_files.wait_sealed(ino)
        if v is not None and v.seal_error:
            raise FsError(v.seal_errno or errno.EIO, v.seal_error)
        old = self.fs.tree.dir(parent).children.get(name)
        await self.fs.rename(parent, tmp, parent, name)
        self.invalidate_name(parent, name, old or 0)

    async def read(self, name: bytes, *, parent: int = ROOT_INO) -> bytes:
        """The whole content of ``parent/name`` (at most 1 MiB).

        Raises:
            FsError: ENOENT, EISDIR, EFBIG (larger than 1 MiB), EIO (data unavailable).
        """
        num = self.fs.tree.dir(parent).children.get(name)
        if num is None:
            raise FsError(errno.ENOENT, f"no {name.decode(errors='replace')}")
        ino = self.fs.inodes[num]
        v = await self.fs.open_files.wait_sealed(ino)
        if v is None:  # still open for writing: read what it holds now
            v = self.fs.versions[ino.vid] if ino.vid is not None else None
        size = v.size if v is not None else 0
        if size > MAX_OWN_FILE:
            raise FsError(errno.EFBIG, f"{name.decode(errors='replace')} is {size} bytes")
        fh, _keep = await self.fs.open(num, os.O_RDONLY)
        try:
            return await self.fs.read(fh, 0, size)
        finally:
            await self.fs.release(fh)

    async def remove(self, name: bytes, *, parent: int = ROOT_INO) -> bool:
        """Remove ``parent/name`` — a file, a symlink or a whole directory tree.

        Returns False when there was no such name.
        """
        d = self.fs.tree.dir(parent)
        num = d.children.get(name)
        if num is None:
            return False
        ino = self.fs.inodes[num]
        if ino.is_dir:
            for child in list(ino.children):
                await self.remove(child, parent=ino.ino)
            await self.fs.rmdir(parent, name)
        else:
            await self.fs.unlink(parent, name)
        self.invalidate_name(parent, name, num)
        return True

    async def rename(self, old: bytes, new: bytes, *, parent: int = ROOT_INO) -> None:
        """Rename ``parent/old`` to ``parent/new`` (which must not exist).

        Raises:
            FsError: ENOENT, EEXIST.
        """
        await self.fs.rename(parent, old, parent, new, 1)
        # A rename is not a deletion: naming the inode would make the kernel mark it dead
        # (a directory someone holds open would then list empty under its new name).
        self.invalidate_name(parent, old)
        self.invalidate_name(parent, new)
