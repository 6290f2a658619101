"""Extended attributes: stored user.* ones and the virtual user.mtcfs.* ones.

:class:`Xattrs` answers the facade's getxattr, setxattr, listxattr and removexattr; see
core/core.py for the concurrency protocol every method follows.
"""

from __future__ import annotations

import errno
import logging

from mtcfs.base.chunking import chunk_count
from mtcfs.base.errors import ENOATTR, FsError
from mtcfs.base import steps as stepnames
from mtcfs.core.files import OpenFiles
from mtcfs.core.inodes import InodeTable
from mtcfs.core.model import ROOT_INO, Inode
from mtcfs.core.records import StepRecord
from mtcfs.core.step_registry import StepRegistry
from mtcfs.core.store.meta import MetaDB
from mtcfs.core.versions import VersionStore

__all__ = ["XATTR_PREFIX", "Xattrs"]

log = logging.getLogger("mtcfs.core.core")

#: The namespace of the virtual, read-only attributes.
XATTR_PREFIX = b"user.mtcfs."


class Xattrs:
    """Extended attributes: stored ``user.*`` ones (rows of the ``xattrs`` table, each set
    or removal one transaction) and the virtual, read-only ``user.mtcfs.*`` ones
    (``state``, ``blake3``, ``control``: docs/usage.md).

    Args:
        db: the store's metadata database.
        tree, vstore, step_registry, open_files: the core's components.
        control_socket: the path of the mount's control socket (``user.mtcfs.control``).

    Raises (each operation): FsError ENOATTR (no such attribute), EPERM (a
    ``user.mtcfs.*`` one set), ENOTSUP (a namespace other than ``user.``).
    """

    def __init__(self, *, db: MetaDB, tree: InodeTable, vstore: VersionStore,
                 step_registry: StepRegistry, open_files: OpenFiles,
                 control_socket: str) -> None:
        self.db = db
        self.tree = tree
        self.versions = vstore.versions
        self.step_registry = step_registry
        self.open_files = open_files
        self.control_socket = control_socket

    async def getxattr(self, num: int, name: bytes) -> bytes:
        """The value of attribute ``name`` of inode ``num``."""
        ino = self.tree.get(num)
        if name.startswith(XATTR_PREFIX):
            return await self._mtcfs_xattr(ino, name[len(XATTR_PREFIX):])
        try:
            return ino.xattrs[name]
        except KeyError:
            raise FsError(ENOATTR) from None

    async def setxattr(self, num: int, name: bytes, value: bytes) -> None:
        """Set ``user.*`` attribute ``name`` of inode ``num``."""
        ino = self.tree.get(num)
        if name.startswith(XATTR_PREFIX):
            raise FsError(errno.EPERM, "user.mtcfs.* attributes are read-only")
        if not name.startswith(b"user."):
            raise FsError(errno.ENOTSUP)
        if self.tree.has_row(ino):  # else unlinked, its rows gone: in memory until FORGET
            with self.db.transaction():
                self.db.execute("INSERT OR REPLACE INTO xattrs(ino, name, value) "
                                "VALUES (?,?,?)", (ino.ino, name, value))  # not num: an alias
        ino.xattrs[name] = value

    async def listxattr(self, num: int) -> list[bytes]:
        """The stored attributes' names (the virtual ones are read by name only)."""
        # The virtual user.mtcfs.* attributes are read by name only, not listed: copy tools
        # (cp -a --preserve=xattr, tar --xattrs, rsync -X) set every listed name on the copy
        # and fail on read-only ones, and would carry stale hashes to other filesystems.
        return list(self.tree.get(num).xattrs)

    async def removexattr(self, num: int, name: bytes) -> None:
        """Remove attribute ``name`` of inode ``num``."""
        ino = self.tree.get(num)
        if name not in ino.xattrs:
            raise FsError(ENOATTR)
        with self.db.transaction():
            self.db.execute("DELETE FROM xattrs WHERE ino=? AND name=?", (ino.ino, name))
        del ino.xattrs[name]

    async def _mtcfs_xattr(self, ino: Inode, key: bytes) -> bytes:
        if key == b"state":
            return self.state_of(ino).encode()
        if key == b"blake3" and ino.is_file:
            v = await self.open_files.wait_sealed(ino)
            if v is None:
                raise FsError(ENOATTR)
            return (await self.open_files.file_hash(v)).encode()
        if key == b"control" and ino.ino == ROOT_INO:
            return self.control_socket.encode()
        raise FsError(ENOATTR)

    def state_of(self, ino: Inode) -> str:
        """The durability state shown in ``user.mtcfs.state``.

        Files: ``writing`` (open for writing or being hashed), ``local`` (sealed, RAM only),
        ``replicated k/R`` (sealed, in a checkpoint that k of its R peers confirmed holding),
        ``backed-up`` (sealed, and in the backup tier), ``restoring`` (some chunks still
        arriving), ``remote`` (evicted from RAM, in the backup tier).
        Directories: a step dir is ``incomplete`` until committed, then ``local``,
        ``replicated k/R`` or ``backed-up``; other dirs report ``local``.
        """
        if ino.is_file and ino.vid is not None:
            v = self.versions[ino.vid]
            if not v.sealed or v.sealing is not None or v.writers:
                return "writing"
            if v.missing:
                if v.origin >= 0:
                    return "remote"  # scope=job: another rank's file, on that rank
                full = len(v.missing) == chunk_count(v.size, v.chunk_size)
                return "remote" if full and v.backed_up else "restoring"
            if v.backed_up:
                return "backed-up"
            rec = self.step_registry.of(ino)
            return self._replicated(rec) if rec is not None else "local"
        if ino.is_dir and ino.parent == ROOT_INO:
            rec = self.step_registry.records.get(ino.name.decode(errors="surrogateescape"))
            if rec is None:
                return "incomplete" if stepnames.step_number(ino.name) is not None or \
                    stepnames.is_orbax_tmp(ino.name) else "local"
            if rec.backed_up_ns is not None:
                return "backed-up"
            return self._replicated(rec)
        return "local"

    @staticmethod
    def _replicated(rec: StepRecord) -> str:
        """``replicated k/R`` once k of the R peers confirmed the step, else ``local``."""
        if rec.replicas and rec.replicated:
            return f"replicated {rec.replicated}/{rec.replicas}"
        return "local"
