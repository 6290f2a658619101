"""Namespace operations: lookup, attributes, mkdir, links, unlink, rmdir, rename, directory listing.

The FUSE operations of :class:`mtcfs.core.core.Filesystem` on names and attributes (its one
base class, kept in its own file for length): each one reads the inode table, or checks
what it can before anything is logged and submits a typed op (mtcfs/base/ns_ops.py) to the
namespace log; applying the op (core/jobns.py, core/entries.py) is what changes the
namespace, in both scopes. See core/core.py for the concurrency protocol every method
follows.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import stat
from collections.abc import AsyncIterator, Iterable

import trio

from mtcfs.base.errors import FsError
from mtcfs.core.capacity import MAX_FILE_SIZE
from mtcfs.core.model import ROOT_INO, Attr, DirHandle, Inode
from mtcfs.base.ns_ops import Link, Mkdir, Mknod, Rename, Rmdir, SetAttr, Symlink, Unlink
from mtcfs.core.records import now_ns as _now_ns
from mtcfs.core.entries import SPECIAL_TYPES
from mtcfs.core.symlinks import escapes


log = logging.getLogger("mtcfs.core.core")


#: scope=job: seconds the getattr of the root or of a file open here waits for the namespace
#: before it answers from this node's copy (see ``getattr``).
ROOT_FRESH_S = 1.0


def without_suidgid(mode: int) -> int:
    """``mode`` less set-user-ID, and less set-group-ID where the group may execute: what
    a write, a truncate or a chown leaves of a regular file's mode (the kernel's rule for
    local filesystems; a set-group-ID bit without group execute marks mandatory locking
    and stays)."""
    out = mode & ~stat.S_ISUID
    if mode & stat.S_IXGRP:
        out &= ~stat.S_ISGID
    return out


class NamespaceOps:
    """Namespace operations: lookup, attributes, mkdir, links, unlink, rmdir, rename, directory listing."""

    #: Set by the FUSE adapter when the connection negotiated ``FUSE_HANDLE_KILLPRIV_V2``
    #: (``fuse_ops.Operations.init``): the kernel then leaves it to the filesystem to clear
    #: set-user-ID and set-group-ID bits, and this one does so on every write, truncate and
    #: ``O_TRUNC`` open of a regular file and on every chown of one, whoever the caller
    #: (pyfuse3 does not say whether the caller had ``CAP_FSETID``; POSIX allows clearing
    #: for any writer). Off, the kernel does it, as before (docs/fuse-build.md).
    kills_suidgid = False

    async def kill_suidgid(self, num: int, *, always: bool = False) -> None:
        """Clear regular file ``num``'s set-user-ID bit, and its set-group-ID bit where the
        group may execute, when :attr:`kills_suidgid` is on or ``always`` (a write or an
        ``O_TRUNC`` open is about to change it). Costs nothing when neither bit is set.

        ``always`` is for an ``O_TRUNC`` open: with atomic O_TRUNC (libfuse's default) the
        kernel truncates through the OPEN and drops its own clearing of the bits
        (``fuse_setattr`` returns early for ``ATTR_OPEN``), flag or no flag.

        Raises: FsError: ENOENT for an unknown inode; the errors of :meth:`setattr`.
        """
        ino = self.tree.get(num)
        if ((self.kills_suidgid or always) and ino.is_file
                and without_suidgid(ino.mode) != ino.mode):
            await self.setattr(num, mode=without_suidgid(ino.mode))

    # ------------------------------------------------------------------ namespace

    async def lookup(self, parent: int, name: bytes) -> Attr:
        if self.ns_log.replicated:  # scope=node: this copy is the namespace (ns_log.py)
            await self.ns_log.fresh()
        d = self.tree.dir(parent)
        if name == b".":
            child = d
        elif name == b"..":
            child = self.inodes.get(d.parent or ROOT_INO, d)
        else:
            child = self.tree.child(d, name)
        child.lookups += 1
        return self.tree.attr(child)

    def forget(self, items: Iterable[tuple[int, int]]) -> None:
        for num, n in items:
            ino = self.inodes.get(num) or self.inodes.get(self.aliases.get(num, 0))
            if ino is None:
                continue
            ino.lookups = max(0, ino.lookups - n)
            self.entries.maybe_free_inode(ino)

    async def getattr(self, ino: int) -> Attr:
        if not self.ns_log.replicated:  # scope=node: this copy is the namespace (ns_log.py)
            return self.tree.attr(self.tree.get(ino))
        node = self.inodes.get(ino)
        if ino != ROOT_INO and (node is None or node.opens == 0):
            await self.ns_log.fresh()
        elif not self.ns_log.unavailable:
            # The root's attributes, and those of a file open on this node, come from
            # this node's copy when the namespace cannot answer within a second (at
            # once while it is known to be unavailable, or this node waits for room in
            # its store): the kernel asks for the root's before it reads
            # user.mtcfs.control (`mtcfs status` must work on a node cut off from the
            # job's namespace, to say so), and for an open file's before every read(2)
            # and write(2) (attributes are never cached in scope=job), and the data path
            # must go on there. Close-to-open needs an open file's
            # attributes to be current only at its open. (scope=node: always current.)
            with trio.move_on_after(ROOT_FRESH_S):
                await self.ns_log.fresh()
        return self.tree.attr(self.tree.get(ino))

    async def setattr(self, num: int, *, mode: int | None = None, uid: int | None = None,
                      gid: int | None = None, size: int | None = None,
                      atime_ns: int | None = None, mtime_ns: int | None = None,
                      fh: int | None = None) -> Attr:
        ino = self.tree.get(num)
        now = _now_ns()
        if (self.kills_suidgid and mode is None and not ino.is_dir
                and (size is not None or uid is not None or gid is not None)
                and without_suidgid(ino.mode) != ino.mode):
            # FUSE_HANDLE_KILLPRIV_V2: a truncate or a chown clears them (see kills_suidgid).
            mode = without_suidgid(ino.mode)
        if size is not None:  # refused before any attribute changes
            if not ino.is_file:
                raise FsError(errno.EISDIR if ino.is_dir else errno.EINVAL)
            if size > MAX_FILE_SIZE:
                raise FsError(errno.EFBIG, f"files are at most {MAX_FILE_SIZE} bytes")
        job = self.job_scope
        cur = self.versions.get(ino.vid) if ino.vid is not None else None
        if cur is not None and cur.pt_writers:
            self.open_files.sync_from_store(cur)  # the kernel's writes so far come first
        writing = cur is not None and cur.origin < 0 and not cur.sealed and cur.writers > 0
        # The op: only what changes, of a file that still has a name (the kernel re-sends
        # unchanged times after renames and for unlinked files). atime stays on this node.
        # scope=job: ordered job-wide, except the mtime of a file being written here: other
        # nodes see its last published content until the writer's close, whose publish op
        # carries the mtime (the kernel's writeback cache flushes times with a SETATTR at
        # every close, a child's included). scope=node: the mtime stays local (applied
        # after a truncate, which sets it too), and the attributes of an unlinked file
        # are applied here.
        op = SetAttr(
            ino=ino.ino,
            mode=mode if mode is not None and (mode & 0o7777) != (ino.mode & 0o7777) else None,
            uid=uid if uid is not None and uid != ino.uid else None,
            gid=gid if gid is not None and gid != ino.gid else None,
            mtime_ns=mtime_ns if job and not writing and mtime_ns is not None
            and mtime_ns != ino.mtime_ns else None)
        named = ino.nlink > 0 or ino.ino == ROOT_INO
        if named and op.changes():
            await self.ns_log.submit(op)
        if named or job:
            mode = uid = gid = None  # applied by the op (or unchanged)
        if job and not writing:
            mtime_ns = None
        if size is not None:
            await self.open_files.truncate(ino, size, fh)
            ino.mtime_ns = now
        # Kept in memory, with no row written: the times of a file being written here (the
        # writeback cache sends them at every close: its row is written by the seal at the
        # last writer's close (files.py), as its size is; a crash before that loses them with
        # the size, docs/benchmarks.md), and anything sent for an inode with neither name
        # nor handle (the writeback cache sends an unlinked file's times as the kernel
        # evicts it, before FORGET): its rows are gone and FORGET drops it; writing them
        # again cost two transactions per unlink (docs/benchmarks.md, issue 18).
        in_memory = (writing and size is None and mode is None and uid is None
                     and gid is None) or (not named and ino.opens == 0
                                          and not self.tree.has_row(ino))
        if mode is not None:
            ino.mode = stat.S_IFMT(ino.mode) | (mode & 0o7777)
        if uid is not None:
            ino.uid = uid
        if gid is not None:
            ino.gid = gid
        if atime_ns is not None:
            ino.atime_ns = atime_ns
        if mtime_ns is not None:
            ino.mtime_ns = mtime_ns
        ino.ctime_ns = now
        if cur is not None and cur.pt_writers and self.versions.get(cur.vid) is cur:
            self.open_files.times_to_store(cur, ino)
        if not in_memory:
            with self.db.transaction():
                self.tree.write(ino)
        return self.tree.attr(ino)

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        return await self._new_entry(Mkdir(parent=self.tree.dir(parent).ino, name=name,
                                           mode=mode, uid=uid, gid=gid))

    async def _new_entry(self, op: Mkdir | Symlink | Mknod) -> Attr:
        """Submit an op that makes an entry; its attributes here (one lookup counted)."""
        res = await self.ns_log.submit(op)
        ino = self.tree.get(res["ino"])
        ino.lookups += 1
        return self.tree.attr(ino)

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Attr:
        """A symlink ``name`` -> ``target`` in ``parent``.

        Raises:
            FsError: EPERM for a target that is absolute or leaves the mount
                (:mod:`mtcfs.core.symlinks`); the errors of a new name.
        """
        d = self.tree.dir(parent)
        self.entries.check_link_target(target, d, name)  # before any op is logged
        return await self._new_entry(Symlink(parent=d.ino, name=name, target=target, uid=uid,
                                             gid=gid))

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int,
                    gid: int) -> Attr:
        """A FIFO, socket, character or block device node: metadata only (no version).

        Raises:
            FsError: EINVAL for another file type (regular files are created by create,
                directories by mkdir); the errors of a new name.
        """
        if stat.S_IFMT(mode) not in SPECIAL_TYPES:
            raise FsError(errno.EINVAL)
        if not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
            rdev = 0
        return await self._new_entry(Mknod(parent=self.tree.dir(parent).ino, name=name,
                                           mode=mode, rdev=rdev, uid=uid, gid=gid))

    async def readlink(self, num: int) -> bytes:
        """The target of symlink ``num``.

        Raises:
            FsError: EINVAL (not a symlink); EPERM for a target that leaves the mount from
                where the link is (one made before the symlink rule, in a store of an older
                version): the kernel then resolves no path through it.
        """
        ino = self.tree.get(num)
        if ino.kind != "symlink":
            raise FsError(errno.EINVAL)
        d = self.inodes.get(ino.parent) if ino.parent else None
        depth = self.entries.dir_depth(d) if d is not None else None
        if depth is not None and escapes(ino.target, depth):
            log.warning("symlink %s points outside the mount (%r): not followed",
                        self.tree.path_of(ino), ino.target)
            raise FsError(errno.EPERM)
        return ino.target

    async def link(self, num: int, new_parent: int, new_name: bytes) -> Attr:
        ino = self.tree.get(num)
        if ino.is_dir:
            raise FsError(errno.EPERM)
        dst = self.tree.dir(new_parent)
        async with self._held_here_when_leaving_its_step(ino, dst):
            await self.ns_log.submit(Link(ino=ino.ino, new_parent=dst.ino, new_name=new_name))
        ino.lookups += 1
        return self.tree.attr(ino)

    async def unlink(self, parent: int, name: bytes) -> None:
        await self.ns_log.submit(Unlink(parent=self.tree.dir(parent).ino, name=name))

    async def rmdir(self, parent: int, name: bytes) -> None:
        await self.ns_log.submit(Rmdir(parent=self.tree.dir(parent).ino, name=name))

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
                     flags: int = 0) -> None:
        """Atomic rename; ``flags`` may hold RENAME_NOREPLACE (1). RENAME_EXCHANGE (2) is
        refused with EINVAL. Taking a file out of a checkpoint whose data is not all in RAM
        first fetches it (see :meth:`_held_here_when_leaving_its_step`)."""
        src, dst = self.tree.dir(old_parent), self.tree.dir(new_parent)
        while True:
            num = (src.children or {}).get(old_name)
            async with self._held_here_when_leaving_its_step(self.inodes.get(num or 0), dst):
                if (src.children or {}).get(old_name) != num:
                    continue  # another op renamed it while the fetch ran: look again
                await self.ns_log.submit(Rename(parent=src.ino, name=old_name,
                                                new_parent=dst.ino, new_name=new_name,
                                                flags=flags))
                return

    @contextlib.asynccontextmanager
    async def _held_here_when_leaving_its_step(self, moved: Inode | None,
                                               dst: Inode) -> AsyncIterator[None]:
        """Around a rename or link of ``moved`` into directory ``dst``: when that takes
        files out of the committed step they are in (to another top-level directory, or
        the step's directory renamed), fetch first every chunk of theirs that is not in
        RAM, and keep them pinned until the op is applied.

        Why: a step's chunks that left RAM (keep=, pressure; a lazy restore) are kept by
        the backup tier only while its retention keeps that step (``backup_keep``); once
        no step names the file, the step's retirement would leave its bytes nowhere (read:
        EIO). The pins keep eviction from dropping them again before the op applies.
        A move inside the step fetches nothing. Only this rank's own files: in scope=job
        another rank's are fetched by their owner when it applies the op
        (core/jobns.py, ``_taken_out``).

        Raises:
            FsError: EIO (from the fault-in) when a chunk cannot be fetched within the
                fault-in deadline, ENOSPC when RAM cannot hold them: then nothing moved.
        """
        rec = self.step_registry.of(moved) if moved is not None else None
        if moved is None or rec is None or rec is self.step_registry.of(dst):
            yield
            return
        held = self.chunks.own_missing_below(moved)
        for v in held:
            v.pins += 1
        try:
            for v in held:
                await self.chunks.fault_in(v, 0, v.size)
            yield
        finally:
            self.tier_api.unpin(held)

    # ------------------------------------------------------------------ directories

    async def opendir(self, num: int) -> int:
        if self.ns_log.replicated:
            await self.ns_log.fresh()
        d = self.tree.dir(num)
        entries = [(b".", d.ino), (b"..", d.parent or ROOT_INO)]
        entries.extend(sorted(d.children.items()))  # type: ignore[union-attr]
        return self.open_files.add_dir(d.ino, entries)

    def readdir(self, fh: int, start: int) -> Iterable[tuple[bytes, Attr, int, bool]]:
        """Yield ``(name, attr, next_offset, counts_lookup)`` from offset ``start``."""
        h = self.handles.get(fh)
        if not isinstance(h, DirHandle):
            raise FsError(errno.EBADF)
        for i in range(start, len(h.entries)):
            name, num = h.entries[i]
            ino = self.inodes.get(num)
            if ino is None:
                continue
            yield name, self.tree.attr(ino), i + 1, name not in (b".", b"..")

    def count_lookup(self, num: int) -> None:
        ino = self.inodes.get(num) or self.inodes.get(self.aliases.get(num, 0))
        if ino is not None:
            ino.lookups += 1

    async def releasedir(self, fh: int) -> None:
        self.open_files.drop_dir(fh)
