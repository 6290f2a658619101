"""Changes of directory entries: make, link, unlink, remove and rename one name.

:class:`Entries` is what applying a namespace op does to the namespace (the apply path,
:class:`mtcfs.core.jobns.JobNamespace`, is its only caller for these), and what eviction
(:class:`mtcfs.core.capacity.Reclaim`) and the open files (:class:`mtcfs.core.files.OpenFiles`)
use to remove a name and free an inode. Each change is one SQLite transaction (the caller's,
when it holds one), checked by the errno rules of POSIX, the symlink rule of
:mod:`mtcfs.core.symlinks` (no link may lead out of the mount) and, in a rename, the commit
rules of :mod:`mtcfs.base.steps` (Orbax's step rename, a commit marker renamed into place).

It owns no state: it changes the inode table, the version store and the step registry
through their methods. Every method runs on the trio thread and none awaits (see
core/core.py for the concurrency protocol).
"""

from __future__ import annotations

import errno
import stat
from collections.abc import Callable

from mtcfs.base import steps as stepnames
from mtcfs.base.errors import FsError
from mtcfs.core.inodes import InodeTable
from mtcfs.core.model import ROOT_INO, Inode
from mtcfs.core.records import now_ns as _now_ns
from mtcfs.core.step_registry import StepRegistry
from mtcfs.core.store.meta import MetaDB
from mtcfs.core.symlinks import check_target, escapes
from mtcfs.core.versions import VersionStore

__all__ = ["SPECIAL_TYPES", "Entries"]

#: File types mknod makes as special files (metadata-only inodes).
SPECIAL_TYPES = (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK)


def _text(name: bytes) -> str:
    return name.decode(errors="surrogateescape")


class Entries:
    """The changes of one directory entry, each one transaction.

    Args:
        db: the store's metadata database.
        tree: the core's inode table (inodes, entries and their rows).
        vstore: the core's version store (a freed inode's data).
        step_registry: the core's step registry (a step directory removed or renamed, a
            commit detected).
        job_scope: whether other nodes change this namespace too (read at each rename: a
            marker renamed into place is then already published job-wide).

    Raises (every change): FsError with the errno a POSIX filesystem gives: ENOENT,
    ENOTDIR, EISDIR, EEXIST, ENOTEMPTY, EINVAL, ENAMETOOLONG, EPERM (a link, or a move,
    that would lead out of the mount).
    """

    def __init__(self, *, db: MetaDB, tree: InodeTable, vstore: VersionStore,
                 step_registry: StepRegistry, job_scope: Callable[[], bool]) -> None:
        self.db = db
        self.tree = tree
        self.inodes: dict[int, Inode] = tree.inodes
        self.vstore = vstore
        self.step_registry = step_registry
        self._job_scope = job_scope

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

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        """Make directory ``name`` in ``parent`` (mode bits of ``mode``); the new inode."""
        d = self._dir_for_new_name(parent, name)
        with self.db.transaction():
            ino = self.tree.new("dir", stat.S_IFDIR | (mode & 0o7777), uid, gid)
            self.tree.link(d, name, ino)
            self.tree.write(ino)
            d.nlink += 1
            self.tree.touch(d)
        return ino

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        """Make symlink ``name`` -> ``target`` in ``parent``; EPERM for a target that leaves
        the mount (also for scope=job ops of other nodes)."""
        d = self._dir_for_new_name(parent, name)
        self.check_link_target(target, d, name)  # also for scope=job ops of other nodes
        with self.db.transaction():
            ino = self.tree.new("symlink", stat.S_IFLNK | 0o777, uid, gid)
            ino.target = target
            self.tree.link(d, name, ino)
            self.tree.write(ino)
            self.tree.touch(d)
        return ino

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int,
              gid: int) -> Inode:
        """Make special file ``name`` (FIFO, socket, device: no data) in ``parent``;
        EINVAL for another file type."""
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

    def link(self, ino: Inode, new_parent: int, new_name: bytes) -> None:
        """Add hard link ``new_name`` in ``new_parent`` to ``ino`` (EPERM for a directory)."""
        if ino.is_dir:
            raise FsError(errno.EPERM)
        d = self._dir_for_new_name(new_parent, new_name)
        if ino.kind == "symlink":  # a hard link of a symlink: its target read from there
            self.check_link_target(ino.target, d, new_name)
        with self.db.transaction():
            self.tree.link(d, new_name, ino)
            ino.nlink += 1
            ino.ctime_ns = _now_ns()
            self.tree.write(ino)
            self.tree.touch(d)

    def unlink(self, parent: int, name: bytes) -> Inode:
        """Remove name ``name`` (not a directory) from ``parent``, and the inode's data
        and rows with its last name when no handle holds it; the inode."""
        d = self.tree.dir(parent)
        ino = self.tree.child(d, name)
        if ino.is_dir:
            raise FsError(errno.EISDIR)
        with self.db.transaction():  # one transaction: the name, the inode, its data
            self.tree.unlink(d, name)
            self.drop_link(ino, d, name)
            self.tree.touch(d)
            self.maybe_free_inode(ino)
        return ino

    def drop_link(self, ino: Inode, d: Inode, name: bytes) -> None:
        """Count one name less of ``ino`` (``name`` in ``d``, already unlinked by the
        caller, in its transaction); its path follows another link, if any."""
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

    def rmdir(self, parent: int, name: bytes) -> None:
        """Remove empty directory ``name`` from ``parent``."""
        d = self.tree.dir(parent)
        ino = self.tree.child(d, name)
        if not ino.is_dir:
            raise FsError(errno.ENOTDIR)
        if ino.children:
            raise FsError(errno.ENOTEMPTY)
        with self.db.transaction():  # one transaction: the name, the inode, the parent
            self.remove_dir_entry(d, name, ino)
            self.tree.touch(d)
            self.maybe_free_inode(ino)

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int = 0) -> Inode | None:
        """Rename atomically (``flags``: RENAME_NOREPLACE (1); others EINVAL), detecting
        a commit (Orbax's step rename, a marker renamed into place); returns the inode it
        replaced (unlinked), if any."""
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
                    self.remove_dir_entry(dst_dir, new_name, victim)
                else:
                    self.tree.unlink(dst_dir, new_name)
                    self.drop_link(victim, dst_dir, new_name)
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
                self.step_registry.commit_by_marker(ino, published=self._job_scope())
        if victim is not None:
            self.maybe_free_inode(victim)
        return victim

    def dir_depth(self, d: Inode) -> int | None:
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

    def check_link_target(self, target: bytes, d: Inode, name: bytes = b"") -> None:
        """Refuse a symlink ``target`` in directory ``d`` (:func:`check_target`).

        Raises:
            FsError: EPERM, ENAMETOOLONG or EINVAL (see :func:`check_target`); ENOENT when
                ``d`` was removed.
        """
        depth = self.dir_depth(d)
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
        old, new = self.dir_depth(src_dir), self.dir_depth(dst_dir)
        if old is None or new is None or new >= old:
            return
        if ino.kind == "symlink":
            self.check_link_target(ino.target, dst_dir, new_name)
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

    def remove_dir_entry(self, parent: Inode, name: bytes, d: Inode) -> None:
        """Remove the (empty) directory ``d`` from ``parent`` (rmdir, rename over it,
        eviction); a step directory at the root stops being a checkpoint. The caller
        writes ``parent``."""
        self.tree.unlink(parent, name)
        d.nlink = 0
        d.parent, d.name = 0, b""
        self.tree.write(d)
        parent.nlink -= 1
        if parent.ino == ROOT_INO:
            self.step_registry.forget(name)

    def maybe_free_inode(self, ino: Inode) -> None:
        """Free what an inode without a name no longer needs: with no open handle, its
        data and its rows (in the caller's transaction, or one of its own), even while the
        kernel still holds a lookup reference (it cannot read without opening; a crash
        frees such an inode at load anyway: ``free_orphans``); its number once the kernel
        forgot it too."""
        if ino.nlink > 0 or ino.ino == ROOT_INO:
            return
        if ino.opens == 0 and (ino.vid is not None or self.tree.has_row(ino)):
            with self.db.transaction():
                self.vstore.set_current(ino, None)
                self.tree.delete_rows(ino)
        if ino.lookups > 0 or ino.opens > 0:
            return
        rows = self.tree.has_row(ino) or bool(ino.xattrs)  # written again since (a setattr)
        if not self.tree.forget(ino):  # its number and kernel aliases
            return
        if rows:
            with self.db.transaction():
                self.tree.delete_rows(ino)
