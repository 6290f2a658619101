"""The inode table: inodes, directory entries, kernel aliases and their rows in SQLite.

:class:`InodeTable` owns the namespace's shape: the ``inodes`` dict (core inode number ->
:class:`~mtcfs.core.model.Inode`), each directory's ``children`` (name -> inode number),
``aliases`` (scope=job: kernel inode number -> core inode number, for files renumbered for
the kernel, ``Inode.kid``), the next inode number (kv ``next_ino``) and the next kernel
number. It writes and deletes the rows of the ``inodes`` and ``dentries`` tables (and the
``xattrs`` rows of a deleted inode) and loads them, xattrs included, at start. Only this
component adds or removes entries of ``inodes`` and ``aliases``; the facade
(``Filesystem.inodes`` / ``.aliases``) holds references to the same dicts for its many
readers, and changes fields of the inodes themselves (mode, times, ``vid``, ``nlink``...),
writing them back with :meth:`InodeTable.write`.

It knows nothing of versions, steps or the namespace log: the facade decides what a
namespace op does (core/namespace.py, core/jobns.py) and calls this table for the pieces.
The one thing it asks of the facade is a file's size, for :meth:`InodeTable.attr`
(``size_of(vid) -> bytes``).

Shapes and units: inode numbers are ints (:data:`~mtcfs.core.model.ROOT_INO` is the job
root, never freed); names are ``bytes`` of at most :data:`NAME_MAX` bytes, never empty, never
``.``/``..``, no ``/``; paths (:meth:`InodeTable.path_of`, :meth:`InodeTable.resolve`) are
``str``, relative to the job root (``''`` for the root), names decoded with
``surrogateescape``; times are nanoseconds since the epoch.

Errors: lookups raise :class:`~mtcfs.base.errors.FsError` with ENOENT (no such inode or
name), ENOTDIR (not a directory), ENAMETOOLONG (a name over NAME_MAX) and EINVAL (a name no
entry may have). Writes go to SQLite inline: the caller holds the transaction
(``db.transaction()``) a namespace change is made in; none of these methods opens one.

Concurrency (docs/architecture.md): every method runs on the trio thread and never awaits.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from mtcfs.base.errors import FsError
from mtcfs.core.model import ROOT_INO, Attr, Inode
from mtcfs.core.records import now_ns as _now_ns

__all__ = ["NAME_MAX", "InodeTable"]

#: The longest name a directory entry may have, in bytes (as the kernel's own filesystems).
NAME_MAX = 255

#: Kernel aliases (``Inode.kid``) are numbered from here up; inode numbers stay below.
FIRST_KID = 1 << 48


class InodeTable:
    """The inodes and directory entries of one core.

    Args:
        db: the store's metadata database (``execute``, ``get_kv``, ``set_kv``, ``defer``,
            ``cancel``); rows are written through it inside the caller's transaction.
        size_of: the size in bytes of version ``vid`` (a regular file's size in
            :meth:`attr`); the facade's versions answer it.
        exact_next_ino: whether kv ``next_ino`` must be written with every new inode (the
            numbers are the job's: scope=job); when False it is recovered at :meth:`load`
            as past every number a row names (a statement fewer per new inode).
    """

    def __init__(self, db: Any, size_of: Callable[[int], int],
                 exact_next_ino: Callable[[], bool] = lambda: True) -> None:
        self._db = db
        self._size_of = size_of
        self._exact_next_ino = exact_next_ino
        #: inode number -> inode (every inode the core knows, linked or still open).
        self.inodes: dict[int, Inode] = {}
        #: scope=job: kernel inode number -> core inode number (Inode.kid).
        self.aliases: dict[int, int] = {}
        #: numbers of registered inodes whose rows were deleted (unlinked, still known to
        #: the kernel): their final forget writes nothing.
        self._rowless: set[int] = set()
        self._next_ino = 2
        self._next_kid = FIRST_KID

    # ------------------------------------------------------------------ loading

    def create_root(self) -> Inode:
        """Write the row of a new, empty root directory and ``next_ino`` (a fresh store);
        :meth:`load` then loads it."""
        root = self._root_inode()
        self.write(root)
        self._db.set_kv("next_ino", "2")
        return root

    def load(self) -> None:
        """Load every inode, directory entry and xattr from SQLite (the table is empty)."""
        db = self._db
        # kv next_ino is written with each new inode only where the numbers must be the
        # same on every node (scope=job: each node applies the same ops); elsewhere it is
        # a lower bound, and no number any row still names is handed out again.
        # A number of the kernel aliases' range names no inode (a stray row of one): it
        # must never move the counter there (scope=job: every node's must agree).
        self._next_ino = max(int(db.get_kv("next_ino") or 2), 1 + max(
            db.execute(f"SELECT coalesce(max({col}), 1) FROM {table} WHERE {col} < ?",
                       (FIRST_KID,)).fetchone()[0]
            for table, col in (("inodes", "ino"), ("dentries", "ino"), ("versions", "ino"),
                               ("xattrs", "ino"), ("steps", "ino"))))
        for row in db.execute("SELECT ino, kind, mode, uid, gid, nlink, atime_ns, mtime_ns,"
                              " ctime_ns, target, vid, parent, name, rdev FROM inodes"):
            ino = Inode(*row[:9], target=row[9] or b"", vid=row[10], parent=row[11] or 0,
                        name=row[12] or b"", rdev=row[13])
            if ino.is_dir:
                ino.children = {}
            self.inodes[ino.ino] = ino
        for parent, name, child in db.execute("SELECT parent, name, ino FROM dentries"):
            p = self.inodes.get(parent)
            if p is not None and p.children is not None and child in self.inodes:
                p.children[bytes(name)] = child
        for num, name, value in db.execute("SELECT ino, name, value FROM xattrs"):
            if num in self.inodes:
                self.inodes[num].xattrs[bytes(name)] = bytes(value)

    def free_orphans(self) -> None:
        """Crash recovery: delete the inodes no directory refers to (unlinked while open
        at the crash), rows included. In the caller's transaction."""
        linked = {ROOT_INO}
        for ino in self.inodes.values():
            if ino.children:
                linked.update(ino.children.values())
        for num in [n for n in self.inodes if n not in linked]:
            self.delete_rows(self.inodes.pop(num))
        # attributes of no inode (stored under a kernel alias before that was fixed)
        self._db.execute("DELETE FROM xattrs WHERE ino NOT IN (SELECT ino FROM inodes)")

    def clear(self) -> Inode:
        """Forget every inode and alias and start over with a new, empty root (written
        and returned); a namespace snapshot install (core/jobns.py) fills the rest."""
        for num in self.inodes:  # a row write still deferred names an inode that goes
            self._db.cancel(("inode", num))
        self.inodes.clear()
        self.aliases.clear()
        self._rowless.clear()
        root = self._root_inode()
        self.write(root)
        self.inodes[ROOT_INO] = root
        return root

    def add(self, ino: Inode) -> None:
        """Register ``ino`` under its own number (a snapshot install's inodes); the caller
        links and writes it."""
        self.inodes[ino.ino] = ino

    def keep_aliases(self, old: Mapping[int, int]) -> None:
        """Take back the aliases of ``old`` whose inode is still here (a snapshot install)."""
        self.aliases.update((k, n) for k, n in old.items() if n in self.inodes)

    @property
    def next_ino(self) -> int:
        """The number the next new inode gets."""
        return self._next_ino

    def set_next_ino(self, n: int) -> None:
        """Allocate from ``n`` on (a snapshot install: the job's counter); written to kv."""
        self._next_ino = n
        self._db.set_kv("next_ino", str(n))

    # ------------------------------------------------------------------ rows

    def write(self, ino: Inode) -> None:
        """Write the row of ``ino`` (INSERT OR REPLACE): at the commit of the transaction in
        progress, once however often it is asked in that transaction (the fields as they
        are then), at once outside one."""
        self._rowless.discard(ino.ino)
        self._db.defer(("inode", ino.ino), lambda: self._write_row(ino))

    def _write_row(self, ino: Inode) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO inodes(ino, kind, mode, uid, gid, nlink, atime_ns, mtime_ns,"
            " ctime_ns, target, vid, parent, name, rdev) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (ino.ino, ino.kind, ino.mode, ino.uid, ino.gid, ino.nlink, ino.atime_ns, ino.mtime_ns,
             ino.ctime_ns, ino.target or None, ino.vid, ino.parent, ino.name, ino.rdev))

    def delete_rows(self, ino: Inode) -> None:
        """Delete the inode and xattr rows of ``ino`` (its entries are the caller's); a
        write of its row still deferred in this transaction is dropped."""
        self._db.cancel(("inode", ino.ino))
        self._db.execute("DELETE FROM inodes WHERE ino=?", (ino.ino,))
        if ino.xattrs:  # no row without an entry (loaded at start, kept by core/xattrs.py)
            self._db.execute("DELETE FROM xattrs WHERE ino=?", (ino.ino,))
        if ino.ino in self.inodes:
            self._rowless.add(ino.ino)  # until written again or forgotten

    def has_row(self, ino: Inode) -> bool:
        """Whether ``ino`` (a registered inode) may have a row: False after
        :meth:`delete_rows` until it is written again."""
        return ino.ino not in self._rowless

    def forget(self, ino: Inode) -> bool:
        """Drop ``ino``'s number (and its kernel aliases) from the table; False if it was
        not there. Its rows stay until :meth:`delete_rows`."""
        if self.inodes.pop(ino.ino, None) is None:
            return False
        self._rowless.discard(ino.ino)
        if ino.kid:
            for k in [k for k, n in self.aliases.items() if n == ino.ino]:
                del self.aliases[k]
        return True

    def _alloc_ino(self) -> int:
        n = self._next_ino
        self._next_ino += 1
        if self._exact_next_ino():
            self._db.set_kv("next_ino", str(self._next_ino))
        return n

    # ------------------------------------------------------------------ inodes

    @staticmethod
    def _root_inode() -> Inode:
        now = _now_ns()
        return Inode(ROOT_INO, "dir", stat.S_IFDIR | 0o755, os.getuid(), os.getgid(), 2, now,
                     now, now, children={})

    def new(self, kind: str, mode: int, uid: int, gid: int) -> Inode:
        """A new inode of ``kind`` ('file', 'dir', 'symlink', 'special') with the next
        number, registered, not linked and not written yet (the caller links and writes it).
        ``mode`` includes the file type bits."""
        now = _now_ns()
        ino = Inode(self._alloc_ino(), kind, mode, uid, gid, 2 if kind == "dir" else 1,
                    now, now, now, children={} if kind == "dir" else None)
        self.inodes[ino.ino] = ino
        return ino

    def get(self, num: int) -> Inode:
        """The inode numbered ``num``, or the one a kernel alias ``num`` names.

        Raises:
            FsError: ENOENT.
        """
        try:
            return self.inodes[num]
        except KeyError:
            alias = self.aliases.get(num)
            if alias is not None and alias in self.inodes:
                return self.inodes[alias]
            raise FsError(errno.ENOENT) from None

    def dir(self, num: int) -> Inode:
        """The directory numbered ``num`` (or aliased).

        Raises:
            FsError: ENOENT; ENOTDIR.
        """
        d = self.get(num)
        if not d.is_dir:
            raise FsError(errno.ENOTDIR)
        return d

    def renumber(self, ino: Inode) -> None:
        """The content of ``ino`` changed under the kernel's feet: give it a new kernel
        inode number, so that the next lookup of its name makes the kernel start a new inode
        with the new size (with writeback cache on, it never refreshes a cached one). Only
        an inode the kernel knows (looked up) or knew under a kernel number gets one."""
        if ino.lookups or ino.kid:
            self._next_kid += 1
            ino.kid = self._next_kid
            self.aliases[ino.kid] = ino.ino

    def attr(self, ino: Inode) -> Attr:
        """The attributes the kernel sees: its kernel number, and the size (a file's
        current version, a symlink's target, 4096 for a directory, 0 else)."""
        size = 0
        if ino.is_file and ino.vid is not None:
            size = self._size_of(ino.vid)
        elif ino.kind == "symlink":
            size = len(ino.target)
        elif ino.is_dir:
            size = 4096
        return Attr(ino.kid or ino.ino, ino.mode, ino.nlink, ino.uid, ino.gid, size,
                    ino.atime_ns, ino.mtime_ns, ino.ctime_ns, rdev=ino.rdev)

    # ------------------------------------------------------------------ entries

    @staticmethod
    def check_name(name: bytes) -> None:
        """Raises FsError ENAMETOOLONG (over NAME_MAX bytes) or EINVAL (empty, ``.``,
        ``..``, or with a ``/``) for a name no new entry may have."""
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        if not name or b"/" in name or name in (b".", b".."):
            raise FsError(errno.EINVAL)

    def child(self, d: Inode, name: bytes) -> Inode:
        """The inode ``name`` names in directory ``d``.

        Raises:
            FsError: ENOENT; ENAMETOOLONG for a name no entry can have (over NAME_MAX
                bytes), as the kernel's own filesystems answer a lookup of one.
        """
        num = d.children.get(name)  # type: ignore[union-attr]
        if num is None:
            raise FsError(errno.ENAMETOOLONG if len(name) > NAME_MAX else errno.ENOENT)
        return self.inodes[num]

    def link(self, parent: Inode, name: bytes, child: Inode) -> None:
        """Enter ``child`` as ``name`` in directory ``parent`` (replacing an entry of that
        name) and make it ``child``'s parent and name. Counts (``nlink``) and the inode rows
        are the caller's."""
        parent.children[name] = child.ino  # type: ignore[index]
        self._db.execute("INSERT OR REPLACE INTO dentries(parent, name, ino) VALUES (?,?,?)",
                         (parent.ino, name, child.ino))
        child.parent, child.name = parent.ino, name

    def unlink(self, parent: Inode, name: bytes) -> None:
        """Remove the entry ``name`` from directory ``parent`` (KeyError if none). Counts,
        the child's parent/name and the inode rows are the caller's."""
        del parent.children[name]  # type: ignore[union-attr]
        self._db.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent.ino, name))

    def touch(self, d: Inode) -> None:
        """Directory ``d`` changed: its mtime and ctime are now; written."""
        d.mtime_ns = d.ctime_ns = _now_ns()
        self.write(d)

    # ------------------------------------------------------------------ paths

    def path_of(self, ino: Inode) -> str | None:
        """Path relative to the job root ('' for the root), None if unlinked."""
        parts: list[bytes] = []
        cur = ino
        while cur.ino != ROOT_INO:
            if not cur.parent or cur.parent not in self.inodes:
                return None
            parts.append(cur.name)
            cur = self.inodes[cur.parent]
        return "/".join(p.decode(errors="surrogateescape") for p in reversed(parts))

    def walk(self, top: Inode) -> Iterator[tuple[str, Inode]]:
        """Yield (job-relative path, inode) of ``top`` and everything below it, parents
        first, names in byte order. The tree must not change while the walk runs (take a
        ``list`` of it first when acting on it)."""
        base = self.path_of(top) or ""
        stack = [(base, top)]
        while stack:
            path, ino = stack.pop()
            yield path, ino
            if ino.is_dir:
                for name, child in sorted((ino.children or {}).items(), reverse=True):
                    sub = name.decode(errors="surrogateescape")
                    stack.append((f"{path}/{sub}" if path else sub, self.inodes[child]))

    def resolve(self, path: str) -> Inode:
        """Look up a job-relative path without touching lookup counts.

        Raises:
            FsError: ENOENT; ENOTDIR (a component before the last is no directory).
        """
        cur = self.inodes[ROOT_INO]
        for part in [p for p in path.split("/") if p and p != "."]:
            if not cur.is_dir:
                raise FsError(errno.ENOTDIR)
            child = cur.children.get(part.encode(errors="surrogateescape"))  # type: ignore[union-attr]
            if child is None:
                raise FsError(errno.ENOENT, f"no such file: {path}")
            cur = self.inodes[child]
        return cur

    def top_dir(self, ino: Inode) -> Inode | None:
        """The top-level directory containing ``ino`` (itself if top-level: any entry of
        the root); None for the root itself and for an inode not linked to the root."""
        cur: Inode | None = ino
        while cur is not None and cur.parent and cur.parent != ROOT_INO:
            cur = self.inodes.get(cur.parent)
        if cur is None:
            return None
        return cur if cur.parent == ROOT_INO else None
