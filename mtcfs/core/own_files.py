"""Files the daemon itself writes, reads, renames and removes in its namespace.

A part of :class:`mtcfs.core.core.Filesystem` (mixed in). A replicator protocol spoken through
files (Orbax's multi-tier checkpointing: ``jax-init-info.txt``, ``replicator.yaml``,
``*.restore`` markers) needs the daemon to change names the kernel may have cached: every
method here tells the adapter which names to drop (the ``invalidate_entry`` event), and
counts no kernel lookup (the kernel never looked these inodes up).
"""

from __future__ import annotations

import errno
import os

from mtcfs.base.errors import FsError
from mtcfs.core.model import ROOT_INO

#: Largest file :meth:`OwnFileOps.read_own_file` reads, bytes.
MAX_OWN_FILE = 1 << 20


class OwnFileOps:
    """The daemon's own small files and tree removals (no kernel involved)."""

    def invalidate_name(self, parent: int, name: bytes, child: int = 0) -> None:
        """Tell the adapter to drop the kernel's cached entry ``parent/name`` (``child``:
        the inode it named, 0 for a name that now exists or never did)."""
        self._emit("invalidate_entry", (parent, name, child))  # type: ignore[attr-defined]

    async def write_own_file(self, name: bytes, data: bytes, *, parent: int = ROOT_INO,
                             mode: int = 0o644) -> None:
        """Write ``data`` as ``parent/name`` atomically: a hidden temporary name, sealed,
        then renamed over ``name``.

        Raises:
            FsError: ENOSPC (RAM tier full), ENOTDIR, EISDIR (``name`` is a directory).
        """
        tmp = b"." + name + b".mtcfs-tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fh, attr = await self.create(parent, tmp, mode, flags,  # type: ignore[attr-defined]
                                     os.getuid(), os.getgid())
        ino = self.inodes[attr.ino]  # type: ignore[attr-defined]
        ino.lookups -= 1  # create() counts the kernel's lookup; there is none here
        try:
            if data:
                await self.write(fh, 0, data)  # type: ignore[attr-defined]
            await self.flush(fh)  # type: ignore[attr-defined]
        finally:
            await self.release(fh)  # type: ignore[attr-defined]
        v = await self.open_files.wait_sealed(ino)  # type: ignore[attr-defined]
        if v is not None and v.seal_error:
            raise FsError(errno.EIO, v.seal_error)
        old = self.tree.dir(parent).children.get(name)  # type: ignore[attr-defined]
        await self.rename(parent, tmp, parent, name)  # type: ignore[attr-defined]
        self.invalidate_name(parent, name, old or 0)

    async def read_own_file(self, name: bytes, *, parent: int = ROOT_INO) -> bytes:
        """The whole content of ``parent/name`` (at most 1 MiB).

        Raises:
            FsError: ENOENT, EISDIR, EFBIG (larger than 1 MiB), EIO (data unavailable).
        """
        num = self.tree.dir(parent).children.get(name)  # type: ignore[attr-defined]
        if num is None:
            raise FsError(errno.ENOENT, f"no {name.decode(errors='replace')}")
        ino = self.inodes[num]  # type: ignore[attr-defined]
        v = await self.open_files.wait_sealed(ino)  # type: ignore[attr-defined]
        if v is None:  # still open for writing: read what it holds now
            v = self.versions[ino.vid] if ino.vid is not None else None  # type: ignore[attr-defined]
        size = v.size if v is not None else 0
        if size > MAX_OWN_FILE:
            raise FsError(errno.EFBIG, f"{name.decode(errors='replace')} is {size} bytes")
        fh, _keep = await self.open(num, os.O_RDONLY)  # type: ignore[attr-defined]
        try:
            return await self.read(fh, 0, size)  # type: ignore[attr-defined]
        finally:
            await self.release(fh)  # type: ignore[attr-defined]

    async def remove_own(self, name: bytes, *, parent: int = ROOT_INO) -> bool:
        """Remove ``parent/name`` — a file, a symlink or a whole directory tree.

        Returns False when there was no such name.
        """
        d = self.tree.dir(parent)  # type: ignore[attr-defined]
        num = d.children.get(name)
        if num is None:
            return False
        ino = self.inodes[num]  # type: ignore[attr-defined]
        if ino.is_dir:
            for child in list(ino.children):
                await self.remove_own(child, parent=ino.ino)
            await self.rmdir(parent, name)  # type: ignore[attr-defined]
        else:
            await self.unlink(parent, name)  # type: ignore[attr-defined]
        self.invalidate_name(parent, name, num)
        return True

    async def rename_own(self, old: bytes, new: bytes, *, parent: int = ROOT_INO) -> None:
        """Rename ``parent/old`` to ``parent/new`` (which must not exist).

        Raises:
            FsError: ENOENT, EEXIST.
        """
        await self.rename(parent, old, parent, new, 1)  # type: ignore[attr-defined]
        # A rename is not a deletion: naming the inode would make the kernel mark it dead
        # (a directory someone holds open would then list empty under its new name).
        self.invalidate_name(parent, old)
        self.invalidate_name(parent, new)
