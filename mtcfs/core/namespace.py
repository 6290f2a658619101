"""Namespace operations: lookup, attributes, mkdir, links, unlink, rmdir, rename, directory listing.

A part of :class:`mtcfs.core.core.Filesystem` (mixed in); see that module for the
concurrency protocol every method follows.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Iterable

import trio

from mtcfs.base.errors import FsError
from mtcfs.base import steps as stepnames
from mtcfs.core.capacity import MAX_FILE_SIZE
from mtcfs.core.model import ROOT_INO, Attr, DirHandle, Handle, Inode, Version
from mtcfs.base.ns_ops import Link, Mkdir, Mknod, Rename, Rmdir, SetAttr, Symlink, Unlink
from mtcfs.core.records import now_ns as _now_ns
from mtcfs.core.symlinks import check_target, escapes


def _text(name: bytes) -> str:
    return name.decode(errors="surrogateescape")

log = logging.getLogger("mtcfs.core.core")

#: File types mknod makes as special files (metadata-only inodes).
SPECIAL_TYPES = (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK)

#: scope=job: seconds the getattr of the root or of a file open here waits for the namespace
#: before it answers from this node's copy (see ``getattr``).
ROOT_FRESH_S = 1.0


class NamespaceOps:
    """Namespace operations: lookup, attributes, mkdir, links, unlink, rmdir, rename, directory listing."""

    # ------------------------------------------------------------------ namespace

    async def lookup(self, parent: int, name: bytes) -> Attr:
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
            self._maybe_free_inode(ino)

    async def getattr(self, ino: int) -> Attr:
        node = self.inodes.get(ino)
        if ino != ROOT_INO and (node is None or node.opens == 0):
            await self.ns_log.fresh()
        elif not self.ns_log.unavailable:
            # The root's attributes, and those of a file open on this node, come from
            # this node's copy when the namespace cannot answer within a second (at
            # once while it is known to be unavailable): the kernel asks for the root's
            # before it reads user.mtcfs.control (`mtcfs status` must work on a node cut
            # off from the job's namespace, to say so), and for an open file's before
            # every read(2) and write(2) (attributes are never cached in scope=job),
            # and the data path must go on there. Close-to-open needs an open file's
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
        if size is not None:  # refused before any attribute changes
            if not ino.is_file:
                raise FsError(errno.EISDIR if ino.is_dir else errno.EINVAL)
            if size > MAX_FILE_SIZE:
                raise FsError(errno.EFBIG, f"files are at most {MAX_FILE_SIZE} bytes")
        job = self.job_scope
        cur = self.versions.get(ino.vid) if ino.vid is not None else None
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
            await self._truncate(ino, size, fh)
            ino.mtime_ns = now
        if writing and size is None and mode is None and uid is None and gid is None:
            # Times of a file being written here (the writeback cache sends them at every
            # close): its row is written by the seal at the last writer's close (files.py),
            # as its size is; a crash before that loses them with the size (docs/benchmarks.md).
            if atime_ns is not None:
                ino.atime_ns = atime_ns
            if mtime_ns is not None:
                ino.mtime_ns = mtime_ns
            ino.ctime_ns = now
            return self.tree.attr(ino)
        with self.db.transaction():
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
            self.tree.write(ino)
        return self.tree.attr(ino)

    async def _truncate(self, ino: Inode, size: int, fh: int | None) -> None:
        if size > MAX_FILE_SIZE:
            raise FsError(errno.EFBIG, f"files are at most {MAX_FILE_SIZE} bytes")
        h = self.handles.get(fh) if fh is not None else None
        if isinstance(h, Handle) and h.writable and h.version.vid == ino.vid:
            v = h.version
        else:
            # truncate(2) by path: a short-lived writer of its own.
            if size:
                await self._fault_in_all(ino)
            v = await self.open_files.writable_version(ino, trunc=(size == 0))
            v.writers += 1
            try:
                await self._resize(v, size)
            finally:
                v.writers -= 1
            self.open_files.after_write_close(v)
            return
        await self._resize(v, size)

    async def _resize(self, v: Version, size: int) -> None:
        # Growing adds a hole, which costs nothing against size= (core/budget.py: account).
        if v.missing:
            await self.fault_in(v, 0, v.size)
        v.changed(v.size, size)
        os.ftruncate(self.vstore.fd(v), size)
        v.size = size
        v.gen += 1
        self.budget.account(v)

    def _dir_for_new_name(self, parent: int, name: bytes) -> Inode:
        """The directory ``parent``, once ``name`` is checked valid and free in it.

        Raises:
            FsError: ENOENT/ENOTDIR (parent), EINVAL/ENAMETOOLONG (name), EEXIST.
        """
        d = self.tree.dir(parent)
        self.tree.check_name(name)
        if name in d.children:  # type: ignore[operator]
            raise FsError(errno.EEXIST)
        return d

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        return await self._new_entry(Mkdir(parent=self.tree.dir(parent).ino, name=name,
                                           mode=mode, uid=uid, gid=gid))

    async def _new_entry(self, op: Mkdir | Symlink | Mknod) -> Attr:
        """Submit an op that makes an entry; its attributes here (one lookup counted)."""
        res = await self.ns_log.submit(op)
        ino = self.tree.get(res["ino"])
        ino.lookups += 1
        return self.tree.attr(ino)

    def _mkdir_now(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        d = self._dir_for_new_name(parent, name)
        with self.db.transaction():
            ino = self.tree.new("dir", stat.S_IFDIR | (mode & 0o7777), uid, gid)
            self.tree.link(d, name, ino)
            self.tree.write(ino)
            d.nlink += 1
            self.tree.touch(d)
        return ino

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Attr:
        """A symlink ``name`` -> ``target`` in ``parent``.

        Raises:
            FsError: EPERM for a target that is absolute or leaves the mount
                (:mod:`mtcfs.core.symlinks`); the errors of a new name.
        """
        d = self.tree.dir(parent)
        self._check_link_target(target, d, name)  # before any op is logged
        return await self._new_entry(Symlink(parent=d.ino, name=name, target=target, uid=uid,
                                             gid=gid))

    def _symlink_now(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        d = self._dir_for_new_name(parent, name)
        self._check_link_target(target, d, name)  # also for scope=job ops of other nodes
        with self.db.transaction():
            ino = self.tree.new("symlink", stat.S_IFLNK | 0o777, uid, gid)
            ino.target = target
            self.tree.link(d, name, ino)
            self.tree.write(ino)
            self.tree.touch(d)
        return ino

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

    def _mknod_now(self, parent: int, name: bytes, mode: int, rdev: int, uid: int,
                   gid: int) -> Inode:
        d = self._dir_for_new_name(parent, name)
        if stat.S_IFMT(mode) not in SPECIAL_TYPES:
            raise FsError(errno.EINVAL)
        with self.db.transaction():
            ino = self.tree.new("special", stat.S_IFMT(mode) | (mode & 0o7777), uid, gid)
            ino.rdev = rdev
            self.tree.link(d, name, ino)
            self.tree.write(ino)
            self.tree.touch(d)
        return ino

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
        depth = self._dir_depth(d) if d is not None else None
        if depth is not None and escapes(ino.target, depth):
            log.warning("symlink %s points outside the mount (%r): not followed",
                        self.tree.path_of(ino), ino.target)
            raise FsError(errno.EPERM)
        return ino.target

    def _dir_depth(self, d: Inode) -> int | None:
        """Components between the root and directory ``d`` (0 for the root); None when
        ``d`` is no longer linked into the namespace."""
        n = 0
        cur = d
        while cur.ino != ROOT_INO:
            nxt = self.inodes.get(cur.parent) if cur.parent else None
            if nxt is None or n > len(self.inodes):
                return None
            n += 1
            cur = nxt
        return n

    def _check_link_target(self, target: bytes, d: Inode, name: bytes = b"") -> None:
        """Refuse a symlink ``target`` in directory ``d`` (:func:`check_target`).

        Raises:
            FsError: EPERM, ENAMETOOLONG or EINVAL (see :func:`check_target`); ENOENT when
                ``d`` was removed.
        """
        depth = self._dir_depth(d)
        if depth is None:
            raise FsError(errno.ENOENT)
        where = "/".join(filter(None, (self.tree.path_of(d), _text(name))))
        check_target(target, depth, where)

    def _check_links_moved(self, ino: Inode, src_dir: Inode, dst_dir: Inode,
                           new_name: bytes) -> None:
        """Refuse to move ``ino`` from ``src_dir`` to ``dst_dir`` as ``new_name`` (a
        rename) when that makes a symlink leave the mount: ``ino`` itself, or one in the
        tree below it. Only a move closer to the root can; the tree is walked only then.

        Raises:
            FsError: EPERM naming the first such link.
        """
        if ino.kind != "symlink" and not ino.is_dir:
            return
        old, new = self._dir_depth(src_dir), self._dir_depth(dst_dir)
        if old is None or new is None or new >= old:
            return
        if ino.kind == "symlink":
            self._check_link_target(ino.target, dst_dir, new_name)
            return
        stack = [(ino, new + 1)]
        while stack:
            d, depth = stack.pop()
            for name, num in d.children.items():  # type: ignore[union-attr]
                child = self.inodes[num]
                if child.kind == "symlink" and escapes(child.target, depth):
                    raise FsError(errno.EPERM, f"moving {self.tree.path_of(ino)} would make "
                                  f"symlink {self.tree.path_of(d)}/{_text(name)} point outside "
                                  "the mount")
                if child.is_dir:
                    stack.append((child, depth + 1))

    async def link(self, num: int, new_parent: int, new_name: bytes) -> Attr:
        ino = self.tree.get(num)
        if ino.is_dir:
            raise FsError(errno.EPERM)
        await self.ns_log.submit(Link(ino=ino.ino, new_parent=self.tree.dir(new_parent).ino,
                                      new_name=new_name))
        ino.lookups += 1
        return self.tree.attr(ino)

    def _link_now(self, ino: Inode, new_parent: int, new_name: bytes) -> None:
        if ino.is_dir:
            raise FsError(errno.EPERM)
        d = self._dir_for_new_name(new_parent, new_name)
        if ino.kind == "symlink":  # a hard link of a symlink: its target read from there
            self._check_link_target(ino.target, d, new_name)
        with self.db.transaction():
            self.tree.link(d, new_name, ino)
            ino.nlink += 1
            ino.ctime_ns = _now_ns()
            self.tree.write(ino)
            self.tree.touch(d)

    async def unlink(self, parent: int, name: bytes) -> None:
        await self.ns_log.submit(Unlink(parent=self.tree.dir(parent).ino, name=name))

    def _unlink_now(self, parent: int, name: bytes) -> Inode:
        d = self.tree.dir(parent)
        ino = self.tree.child(d, name)
        if ino.is_dir:
            raise FsError(errno.EISDIR)
        with self.db.transaction():  # one transaction: the name, the inode, its data
            self.tree.unlink(d, name)
            self._drop_link(ino, d, name)
            self.tree.touch(d)
            self._maybe_free_inode(ino)
        return ino

    def _drop_link(self, ino: Inode, d: Inode, name: bytes) -> None:
        ino.nlink -= 1
        ino.ctime_ns = _now_ns()
        if ino.nlink == 0:
            ino.parent, ino.name = 0, b""  # no name left: nothing to look up
        elif ino.parent == d.ino and ino.name == name:
            # Re-point the file's path at another remaining link, if any.
            row = self.db.execute("SELECT parent, name FROM dentries WHERE ino=? LIMIT 1",
                                  (ino.ino,)).fetchone()
            ino.parent, ino.name = (row[0], bytes(row[1])) if row else (0, b"")
        self.tree.write(ino)

    async def rmdir(self, parent: int, name: bytes) -> None:
        await self.ns_log.submit(Rmdir(parent=self.tree.dir(parent).ino, name=name))

    def _rmdir_now(self, parent: int, name: bytes) -> None:
        d = self.tree.dir(parent)
        ino = self.tree.child(d, name)
        if not ino.is_dir:
            raise FsError(errno.ENOTDIR)
        if ino.children:
            raise FsError(errno.ENOTEMPTY)
        with self.db.transaction():  # one transaction: the name, the inode, the parent
            self._remove_dir_entry(d, name, ino)
            self.tree.touch(d)
            self._maybe_free_inode(ino)

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
                     flags: int = 0) -> None:
        """Atomic rename; ``flags`` may hold RENAME_NOREPLACE (1). RENAME_EXCHANGE (2) is
        refused with EINVAL."""
        await self.ns_log.submit(Rename(parent=self.tree.dir(old_parent).ino, name=old_name,
                                        new_parent=self.tree.dir(new_parent).ino,
                                        new_name=new_name, flags=flags))

    def _rename_now(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
                    flags: int = 0) -> Inode | None:
        """The rename itself; returns the inode it replaced (unlinked), if any."""
        if flags & ~1:
            raise FsError(errno.EINVAL)
        src_dir, dst_dir = self.tree.dir(old_parent), self.tree.dir(new_parent)
        self.tree.check_name(new_name)
        ino = self.tree.child(src_dir, old_name)
        if ino.is_dir:
            # A directory may not move below itself.
            cur: Inode | None = dst_dir
            while cur is not None and cur.ino != ROOT_INO:
                if cur.ino == ino.ino:
                    raise FsError(errno.EINVAL)
                cur = self.inodes.get(cur.parent)
        self._check_links_moved(ino, src_dir, dst_dir, new_name)
        victim_num = dst_dir.children.get(new_name)  # type: ignore[union-attr]
        victim = self.inodes[victim_num] if victim_num is not None else None
        if victim is ino:
            return None
        if victim is not None:
            if flags & 1:
                raise FsError(errno.EEXIST)
            if ino.is_dir and not victim.is_dir:
                raise FsError(errno.ENOTDIR)
            if not ino.is_dir and victim.is_dir:
                raise FsError(errno.EISDIR)
            if victim.is_dir and victim.children:
                raise FsError(errno.ENOTEMPTY)
        with self.db.transaction():
            if victim is not None:
                if victim.is_dir:
                    self._remove_dir_entry(dst_dir, new_name, victim)
                else:
                    self.tree.unlink(dst_dir, new_name)
                    self._drop_link(victim, dst_dir, new_name)
            self.tree.unlink(src_dir, old_name)
            if src_dir.ino == ROOT_INO and ino.is_dir:
                self.step_registry.forget(old_name)
            self.tree.link(dst_dir, new_name, ino)
            if ino.is_dir and src_dir is not dst_dir:
                src_dir.nlink -= 1
                dst_dir.nlink += 1
            ino.ctime_ns = _now_ns()
            self.tree.write(ino)
            self.tree.touch(src_dir)
            if dst_dir is not src_dir:
                self.tree.touch(dst_dir)
            # Commit detection (steps.py): Orbax's step rename, DCP's .metadata rename.
            if dst_dir.ino == ROOT_INO and ino.is_dir and stepnames.is_orbax_tmp(old_name):
                self.step_registry.commit(ino, "orbax-rename")
            elif dst_dir.ino == ROOT_INO and ino.is_dir and \
                    stepnames.restore_marker_step(old_name) is not None:
                self.step_registry.commit(ino, "orbax-restore")
            elif ino.is_file and new_name in stepnames.COMMIT_FILES:
                # scope=job: the marker is published (sealed job-wide) whatever this node's
                # kernel still holds open of it, so every node commits at this op
                self.step_registry.commit_by_marker(ino, published=self.job_scope)
        if victim is not None:
            self._maybe_free_inode(victim)
        return victim

    # ------------------------------------------------------------------ directories

    async def opendir(self, num: int) -> int:
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
