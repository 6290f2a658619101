"""The filesystem core: namespace, handles, versions, seal, steps, capacity.

It knows nothing of FUSE: :mod:`mtcfs.fuse_ops` adapts pyfuse3 calls onto the coroutine
methods here. Every method runs on the trio thread (the FUSE loop); nothing here blocks it
for long:

- small file I/O (FUSE requests are at most 1 MiB) is done inline with ``os.pwrite`` /
  ``os.pread`` on tmpfs: measured faster than a thread hop (library-fs-ops.md);
- hashing (seal), copies of large versions, and fault-in of chunks run in worker threads
  under :attr:`Filesystem.cpu_limiter`;
- metadata goes to SQLite on tmpfs inline, one transaction per namespace change.

Concurrency protocol: a coroutine may only rely on in-memory state it read after its last
``await``. Sealing re-checks ``Version.gen`` after hashing; fault-in re-checks
``Version.missing`` after each fetch. See docs/architecture.md.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from mtcfs.chunking import chunk_count, chunk_hash, chunk_span, hash_fd
from mtcfs.errors import ENOATTR, FsError
from mtcfs.fs import steps as stepnames
from mtcfs.fs.model import ROOT_INO, Attr, DirHandle, Handle, Inode, Version
from mtcfs.manifest import Entry, StepManifest
from mtcfs.store import Store

log = logging.getLogger(__name__)

XATTR_PREFIX = b"user.mtcfs."
NAME_MAX = 255


class ChunkSource(Protocol):
    """Where missing chunks come from (backup tier, later peers). Wired by the daemon."""

    async def fetch(self, digest: str) -> bytes:
        """Return the chunk's bytes, already verified against ``digest``.

        Raises:
            FsError: EIO when no source has a valid copy.
        """
        ...


@dataclass
class StepRecord:
    """A committed checkpoint on this node."""

    name: str
    number: int
    ino: int
    committed_ns: int
    source: str
    backed_up_ns: int | None = None
    backing_up: bool = False


@dataclass
class Counters:
    """Monotonic counters for status and metrics."""

    bytes_written: int = 0
    bytes_read: int = 0
    seals: int = 0
    chunks_faulted: int = 0
    bytes_faulted: int = 0
    fault_errors: int = 0
    enospc: int = 0
    evicted_steps: int = 0


def _now_ns() -> int:
    return time.time_ns()


class Filesystem:
    """The core of one mount.

    Args:
        store: the opened store (RAM tier on disk).
        capacity: bytes of file data the RAM tier may hold (``size=`` option).
        keep: complete checkpoints always kept in RAM (``keep=`` option).
        chunk_size: chunk size in bytes for new versions.
        job: the job name, recorded in manifests.
    """

    def __init__(self, store: Store, *, capacity: int, keep: int = 2,
                 chunk_size: int | None = None, job: str = "job") -> None:
        self.store = store
        self.db = store.db
        self.capacity = capacity
        self.keep = keep
        self.chunk_size = chunk_size or store.chunk_size
        self.job = job
        self.inodes: dict[int, Inode] = {}
        self.versions: dict[int, Version] = {}
        self.handles: dict[int, Handle | DirHandle] = {}
        self.steps: dict[str, StepRecord] = {}
        self.used = 0
        self.counters = Counters()
        self.errors: list[str] = []
        self.chunk_source: ChunkSource | None = None
        self.cpu_limiter = trio.CapacityLimiter(2)
        self._fetch_limiter = trio.CapacityLimiter(8)
        self._observers: list[Callable[[str, Any], None]] = []
        self._next_fh = 1
        self._nursery: trio.Nursery | None = None
        self._inflight: dict[tuple[int, int], trio.Event] = {}
        self._chunk_locations: dict[str, tuple[int, int]] = {}
        self._unsealed_at_load: list[Version] = []
        self._load()

    # ------------------------------------------------------------------ lifecycle

    def _load(self) -> None:
        """Load the namespace from SQLite and repair what a crash may have left."""
        db = self.db
        now = _now_ns()
        if db.execute("SELECT 1 FROM inodes WHERE ino=?", (ROOT_INO,)).fetchone() is None:
            with db.transaction():
                root = Inode(ROOT_INO, "dir", stat.S_IFDIR | 0o755, os.getuid(), os.getgid(),
                             2, now, now, now, children={})
                self._write_inode(root)
                db.set_kv("next_ino", "2")
                db.set_kv("next_vid", "1")
        self._next_ino = int(db.get_kv("next_ino") or 2)
        self._next_vid = int(db.get_kv("next_vid") or 1)
        for row in db.execute("SELECT ino, kind, mode, uid, gid, nlink, atime_ns, mtime_ns,"
                              " ctime_ns, target, vid, parent, name FROM inodes"):
            ino = Inode(*row[:9], target=row[9] or b"", vid=row[10], parent=row[11] or 0,
                        name=row[12] or b"")
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
        for row in db.execute("SELECT vid, ino, size, chunk_size, sealed, chunks, blake3, missing,"
                              " backed_up FROM versions"):
            v = Version(vid=row[0], ino=row[1], size=row[2], chunk_size=row[3],
                        sealed=bool(row[4]), chunks=tuple(row[5].split()) if row[5] else (),
                        blake3=row[6], missing={int(i) for i in row[7].split()},
                        backed_up=bool(row[8]))
            self.versions[v.vid] = v
        for row in db.execute("SELECT name, number, ino, committed_ns, backed_up_ns, source FROM steps"):
            self.steps[row[0]] = StepRecord(name=row[0], number=row[1], ino=row[2],
                                            committed_ns=row[3], backed_up_ns=row[4], source=row[5])
        self._repair()

    def _repair(self) -> None:
        """Crash recovery: free orphans, adopt data file lengths of unsealed versions."""
        db = self.db
        with db.transaction():
            # Inodes no directory refers to (unlinked while open at the crash) are garbage.
            linked = {ROOT_INO}
            for ino in self.inodes.values():
                if ino.children:
                    linked.update(ino.children.values())
            for num in [n for n in self.inodes if n not in linked]:
                self._delete_inode_rows(self.inodes.pop(num))
            current = {i.vid for i in self.inodes.values() if i.vid is not None}
            for vid in [v for v in self.versions if v not in current]:
                self.versions.pop(vid)
                db.execute("DELETE FROM versions WHERE vid=?", (vid,))
            on_disk = self.store.data_vids()
            for vid in on_disk - set(self.versions):
                self.store.remove_data(vid)
            for v in self.versions.values():
                if v.vid not in on_disk:
                    fd = self.store.open_data(v.vid, create=True)
                    os.ftruncate(fd, v.size)
                    os.close(fd)
                    if v.sealed:
                        v.missing = set(range(chunk_count(v.size, v.chunk_size)))
                        self._write_version(v)
                if not v.sealed:
                    # Being written at the crash: keep what reached the data file; it is
                    # sealed again after mount (may be short, never garbage).
                    v.size = os.stat(self.store.data_path(v.vid)).st_size
                    self._write_version(v)
                    self._unsealed_at_load.append(v)
            for name in [n for n, s in self.steps.items()
                         if s.ino not in self.inodes or self.inodes[ROOT_INO].children.get(n.encode()) != s.ino]:
                self.steps.pop(name)
                db.execute("DELETE FROM steps WHERE name=?", (name,))
        self.used = sum(v.local_bytes() for v in self.versions.values())
        for v in self.versions.values():
            self._index_chunks(v)

    def start(self, nursery: trio.Nursery) -> None:
        """Attach the core to a nursery for its background work; seals what a crash left open."""
        self._nursery = nursery
        for v in self._unsealed_at_load:
            nursery.start_soon(self._seal, v)
        self._unsealed_at_load.clear()

    def close(self) -> None:
        """Close data file descriptors (the store itself is closed by its owner)."""
        for v in self.versions.values():
            self._unmap(v)
            if v.fd >= 0:
                os.close(v.fd)
                v.fd = -1

    def subscribe(self, observer: Callable[[str, Any], None]) -> None:
        """Register ``observer(event, obj)``; events: 'sealed' (Version), 'committed'
        (StepRecord), 'step_removed' (str), 'invalidate_entry' ((parent ino, name, child
        ino): a name the core removed on its own, which the kernel may still cache).
        Observers must not block."""
        self._observers.append(observer)

    def _emit(self, event: str, obj: Any) -> None:
        for fn in self._observers:
            try:
                fn(event, obj)
            except Exception:  # an observer bug must not break the filesystem
                log.exception("observer failed on %s", event)

    # ------------------------------------------------------------------ persistence

    def _write_inode(self, ino: Inode) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO inodes(ino, kind, mode, uid, gid, nlink, atime_ns, mtime_ns,"
            " ctime_ns, target, vid, parent, name) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (ino.ino, ino.kind, ino.mode, ino.uid, ino.gid, ino.nlink, ino.atime_ns, ino.mtime_ns,
             ino.ctime_ns, ino.target or None, ino.vid, ino.parent, ino.name))

    def _write_version(self, v: Version) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO versions(vid, ino, size, chunk_size, sealed, chunks, blake3,"
            " missing, backed_up) VALUES (?,?,?,?,?,?,?,?,?)",
            (v.vid, v.ino, v.size, v.chunk_size, int(v.sealed), " ".join(v.chunks), v.blake3,
             " ".join(str(i) for i in sorted(v.missing)), int(v.backed_up)))

    def _write_step(self, s: StepRecord) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO steps(name, number, ino, committed_ns, backed_up_ns, source)"
            " VALUES (?,?,?,?,?,?)", (s.name, s.number, s.ino, s.committed_ns, s.backed_up_ns, s.source))

    def _delete_inode_rows(self, ino: Inode) -> None:
        self.db.execute("DELETE FROM inodes WHERE ino=?", (ino.ino,))
        self.db.execute("DELETE FROM xattrs WHERE ino=?", (ino.ino,))

    def _alloc_ino(self) -> int:
        n = self._next_ino
        self._next_ino += 1
        self.db.set_kv("next_ino", str(self._next_ino))
        return n

    def _alloc_vid(self) -> int:
        n = self._next_vid
        self._next_vid += 1
        self.db.set_kv("next_vid", str(self._next_vid))
        return n

    # ------------------------------------------------------------------ helpers

    def _inode(self, ino: int) -> Inode:
        try:
            return self.inodes[ino]
        except KeyError:
            raise FsError(errno.ENOENT) from None

    def _dir(self, ino: int) -> Inode:
        d = self._inode(ino)
        if not d.is_dir:
            raise FsError(errno.ENOTDIR)
        return d

    @staticmethod
    def _check_name(name: bytes) -> None:
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        if not name or b"/" in name or name in (b".", b".."):
            raise FsError(errno.EINVAL)

    def attr(self, ino: Inode) -> Attr:
        size = 0
        if ino.is_file and ino.vid is not None:
            size = self.versions[ino.vid].size
        elif ino.kind == "symlink":
            size = len(ino.target)
        elif ino.is_dir:
            size = 4096
        return Attr(ino.ino, ino.mode, ino.nlink, ino.uid, ino.gid, size,
                    ino.atime_ns, ino.mtime_ns, ino.ctime_ns)

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

    def resolve(self, path: str) -> Inode:
        """Look up a job-relative path without touching lookup counts."""
        cur = self.inodes[ROOT_INO]
        for part in [p for p in path.split("/") if p and p != "."]:
            if not cur.is_dir:
                raise FsError(errno.ENOTDIR)
            child = cur.children.get(part.encode(errors="surrogateescape"))  # type: ignore[union-attr]
            if child is None:
                raise FsError(errno.ENOENT, f"no such file: {path}")
            cur = self.inodes[child]
        return cur

    def _top_dir(self, ino: Inode) -> Inode | None:
        """The top-level directory containing ``ino`` (itself if top-level)."""
        cur = ino
        while cur.parent and cur.parent != ROOT_INO:
            cur = self.inodes.get(cur.parent)
            if cur is None:
                return None
        return cur if cur.parent == ROOT_INO else None

    def step_of(self, ino: Inode) -> StepRecord | None:
        top = self._top_dir(ino)
        if top is None:
            return None
        return self.steps.get(top.name.decode(errors="surrogateescape"))

    def _touch_dir(self, d: Inode) -> None:
        d.mtime_ns = d.ctime_ns = _now_ns()
        self._write_inode(d)

    def _link(self, parent: Inode, name: bytes, child: Inode) -> None:
        parent.children[name] = child.ino  # type: ignore[index]
        self.db.execute("INSERT OR REPLACE INTO dentries(parent, name, ino) VALUES (?,?,?)",
                        (parent.ino, name, child.ino))
        child.parent, child.name = parent.ino, name

    def _unlink_entry(self, parent: Inode, name: bytes) -> None:
        del parent.children[name]  # type: ignore[union-attr]
        self.db.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent.ino, name))

    def _new_inode(self, kind: str, mode: int, uid: int, gid: int) -> Inode:
        now = _now_ns()
        ino = Inode(self._alloc_ino(), kind, mode, uid, gid, 2 if kind == "dir" else 1,
                    now, now, now, children={} if kind == "dir" else None)
        self.inodes[ino.ino] = ino
        return ino

    def _new_version(self, ino: Inode, copy_from: Version | None = None) -> Version:
        v = Version(vid=self._alloc_vid(), ino=ino.ino, size=0, chunk_size=self.chunk_size)
        fd = self.store.open_data(v.vid, create=True)
        os.ftruncate(fd, 0)
        v.fd = fd
        if copy_from is not None and copy_from.size:
            src = self._fd(copy_from)
            left, off = copy_from.size, 0
            while left:
                n = os.copy_file_range(src, fd, left, off, off)
                if n <= 0:
                    break
                left -= n
                off += n
            v.size = copy_from.size
            v.missing = set(copy_from.missing)
            v.chunk_size = copy_from.chunk_size
            self.used += v.local_bytes()
        self.versions[v.vid] = v
        self._write_version(v)
        return v

    def _fd(self, v: Version) -> int:
        if v.fd < 0:
            v.fd = self.store.open_data(v.vid)
        return v.fd

    def _release_version(self, v: Version) -> None:
        """Free a version that is no longer current, once nothing uses it."""
        if v.current or v.handles or v.pins or v.sealing is not None:
            return
        if self.versions.pop(v.vid, None) is None:
            return
        self._unmap(v)
        if v.fd >= 0:
            os.close(v.fd)
            v.fd = -1
        self.used -= v.local_bytes()
        self.db.execute("DELETE FROM versions WHERE vid=?", (v.vid,))
        self.store.remove_data(v.vid)
        for d in v.chunks:
            loc = self._chunk_locations.get(d)
            if loc is not None and loc[0] == v.vid:
                del self._chunk_locations[d]

    def _set_current(self, ino: Inode, v: Version | None) -> None:
        old = self.versions.get(ino.vid) if ino.vid is not None else None
        ino.vid = v.vid if v is not None else None
        if old is not None and old is not v:
            old.current = False
            self._release_version(old)

    def _maybe_free_inode(self, ino: Inode) -> None:
        if ino.nlink > 0 or ino.ino == ROOT_INO:
            return
        if ino.opens == 0 and ino.vid is not None:
            # No name and no open handle: the data can go now, even while the kernel still
            # holds a lookup reference (it cannot read without opening).
            with self.db.transaction():
                self._set_current(ino, None)
                self._write_inode(ino)
        if ino.lookups > 0 or ino.opens > 0:
            return
        if self.inodes.pop(ino.ino, None) is None:
            return
        with self.db.transaction():
            self._delete_inode_rows(ino)
            self._set_current(ino, None)

    # ------------------------------------------------------------------ namespace

    async def lookup(self, parent: int, name: bytes) -> Attr:
        d = self._dir(parent)
        if name == b".":
            child = d
        elif name == b"..":
            child = self.inodes.get(d.parent or ROOT_INO, d)
        else:
            num = d.children.get(name)  # type: ignore[union-attr]
            if num is None:
                raise FsError(errno.ENOENT)
            child = self.inodes[num]
        child.lookups += 1
        return self.attr(child)

    def forget(self, items: Iterable[tuple[int, int]]) -> None:
        for num, n in items:
            ino = self.inodes.get(num)
            if ino is None:
                continue
            ino.lookups = max(0, ino.lookups - n)
            self._maybe_free_inode(ino)

    async def getattr(self, ino: int) -> Attr:
        return self.attr(self._inode(ino))

    async def setattr(self, num: int, *, mode: int | None = None, uid: int | None = None,
                      gid: int | None = None, size: int | None = None,
                      atime_ns: int | None = None, mtime_ns: int | None = None,
                      fh: int | None = None) -> Attr:
        ino = self._inode(num)
        now = _now_ns()
        if size is not None:
            if not ino.is_file:
                raise FsError(errno.EISDIR if ino.is_dir else errno.EINVAL)
            await self._truncate(ino, size, fh)
            ino.mtime_ns = now
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
            self._write_inode(ino)
        return self.attr(ino)

    async def _truncate(self, ino: Inode, size: int, fh: int | None) -> None:
        h = self.handles.get(fh) if fh is not None else None
        if isinstance(h, Handle) and h.writable and h.version.vid == ino.vid:
            v = h.version
        else:
            # truncate(2) by path: a short-lived writer of its own.
            if size:
                await self._fault_in_all(ino)
            v = self._writable_version(ino, trunc=(size == 0))
            v.writers += 1
            try:
                await self._resize(v, size)
            finally:
                v.writers -= 1
            self._after_write_close(v)
            return
        await self._resize(v, size)

    async def _resize(self, v: Version, size: int) -> None:
        if size > v.size:
            await self._reserve(size - v.size)
        if v.missing:
            await self.fault_in(v, 0, v.size)
        old_local = v.local_bytes()
        os.ftruncate(self._fd(v), size)
        v.size = size
        v.gen += 1
        self.used += v.local_bytes() - old_local

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        d = self._dir(parent)
        self._check_name(name)
        if name in d.children:  # type: ignore[operator]
            raise FsError(errno.EEXIST)
        with self.db.transaction():
            ino = self._new_inode("dir", stat.S_IFDIR | (mode & 0o7777), uid, gid)
            self._write_inode(ino)
            self._link(d, name, ino)
            self._write_inode(ino)
            d.nlink += 1
            self._touch_dir(d)
        ino.lookups += 1
        return self.attr(ino)

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Attr:
        d = self._dir(parent)
        self._check_name(name)
        if name in d.children:  # type: ignore[operator]
            raise FsError(errno.EEXIST)
        with self.db.transaction():
            ino = self._new_inode("symlink", stat.S_IFLNK | 0o777, uid, gid)
            ino.target = target
            self._link(d, name, ino)
            self._write_inode(ino)
            self._touch_dir(d)
        ino.lookups += 1
        return self.attr(ino)

    async def readlink(self, num: int) -> bytes:
        ino = self._inode(num)
        if ino.kind != "symlink":
            raise FsError(errno.EINVAL)
        return ino.target

    async def link(self, num: int, new_parent: int, new_name: bytes) -> Attr:
        ino = self._inode(num)
        if ino.is_dir:
            raise FsError(errno.EPERM)
        d = self._dir(new_parent)
        self._check_name(new_name)
        if new_name in d.children:  # type: ignore[operator]
            raise FsError(errno.EEXIST)
        with self.db.transaction():
            self._link(d, new_name, ino)
            ino.nlink += 1
            ino.ctime_ns = _now_ns()
            self._write_inode(ino)
            self._touch_dir(d)
        ino.lookups += 1
        return self.attr(ino)

    async def unlink(self, parent: int, name: bytes) -> None:
        d = self._dir(parent)
        num = d.children.get(name)  # type: ignore[union-attr]
        if num is None:
            raise FsError(errno.ENOENT)
        ino = self.inodes[num]
        if ino.is_dir:
            raise FsError(errno.EISDIR)
        with self.db.transaction():
            self._unlink_entry(d, name)
            self._drop_link(ino, d, name)
            self._touch_dir(d)
        self._maybe_free_inode(ino)

    def _drop_link(self, ino: Inode, d: Inode, name: bytes) -> None:
        ino.nlink -= 1
        ino.ctime_ns = _now_ns()
        if ino.parent == d.ino and ino.name == name:
            # Re-point the file's path at another remaining link, if any.
            row = self.db.execute("SELECT parent, name FROM dentries WHERE ino=? LIMIT 1",
                                  (ino.ino,)).fetchone()
            ino.parent, ino.name = (row[0], bytes(row[1])) if row else (0, b"")
        self._write_inode(ino)

    async def rmdir(self, parent: int, name: bytes) -> None:
        d = self._dir(parent)
        num = d.children.get(name)  # type: ignore[union-attr]
        if num is None:
            raise FsError(errno.ENOENT)
        ino = self.inodes[num]
        if not ino.is_dir:
            raise FsError(errno.ENOTDIR)
        if ino.children:
            raise FsError(errno.ENOTEMPTY)
        with self.db.transaction():
            self._unlink_entry(d, name)
            ino.nlink = 0
            ino.parent, ino.name = 0, b""
            self._write_inode(ino)
            d.nlink -= 1
            self._touch_dir(d)
            if d.ino == ROOT_INO:
                self._forget_step(name)
        self._maybe_free_inode(ino)

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
                     flags: int = 0) -> None:
        """Atomic rename; ``flags`` may hold RENAME_NOREPLACE (1). RENAME_EXCHANGE (2) is
        refused with EINVAL."""
        if flags & ~1:
            raise FsError(errno.EINVAL)
        src_dir, dst_dir = self._dir(old_parent), self._dir(new_parent)
        self._check_name(new_name)
        num = src_dir.children.get(old_name)  # type: ignore[union-attr]
        if num is None:
            raise FsError(errno.ENOENT)
        ino = self.inodes[num]
        if ino.is_dir:
            # A directory may not move below itself.
            cur: Inode | None = dst_dir
            while cur is not None and cur.ino != ROOT_INO:
                if cur.ino == ino.ino:
                    raise FsError(errno.EINVAL)
                cur = self.inodes.get(cur.parent)
        victim_num = dst_dir.children.get(new_name)  # type: ignore[union-attr]
        victim = self.inodes[victim_num] if victim_num is not None else None
        if victim is ino:
            return
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
                self._unlink_entry(dst_dir, new_name)
                if victim.is_dir:
                    victim.nlink = 0
                    victim.parent, victim.name = 0, b""
                    self._write_inode(victim)
                    dst_dir.nlink -= 1
                    if dst_dir.ino == ROOT_INO:
                        self._forget_step(new_name)
                else:
                    self._drop_link(victim, dst_dir, new_name)
            self._unlink_entry(src_dir, old_name)
            if src_dir.ino == ROOT_INO and ino.is_dir:
                self._forget_step(old_name)
            self._link(dst_dir, new_name, ino)
            if ino.is_dir and src_dir is not dst_dir:
                src_dir.nlink -= 1
                dst_dir.nlink += 1
            ino.ctime_ns = _now_ns()
            self._write_inode(ino)
            self._touch_dir(src_dir)
            if dst_dir is not src_dir:
                self._touch_dir(dst_dir)
            # Commit detection (steps.py): Orbax's step rename, DCP's .metadata rename.
            if dst_dir.ino == ROOT_INO and ino.is_dir and stepnames.is_orbax_tmp(old_name):
                self._commit_step(ino, "orbax-rename")
            elif ino.is_file and new_name in stepnames.COMMIT_FILES:
                self._maybe_commit_by_file(ino)
        if victim is not None:
            self._maybe_free_inode(victim)

    # ------------------------------------------------------------------ steps

    def _commit_step(self, d: Inode, source: str) -> StepRecord | None:
        if d.parent != ROOT_INO:
            return None
        name = d.name.decode(errors="surrogateescape")
        number = stepnames.step_number(name)
        if number is None and source != "mtcfs seal":
            return None
        rec = self.steps.get(name)
        if rec is not None and rec.ino == d.ino:
            if rec.backed_up_ns is None and source != "mtcfs seal":
                # Committed again after a change (DCP re-saving into the same directory):
                # the backup policy must see it as a new commit.
                rec.committed_ns = _now_ns()
                rec.source = source
                self._write_step(rec)
                self._emit("committed", rec)
            return rec
        rec = StepRecord(name=name, number=number if number is not None else 0, ino=d.ino,
                         committed_ns=_now_ns(), source=source)
        self.steps[name] = rec
        self._write_step(rec)
        log.info("checkpoint %s committed (%s)", name, source)
        self._emit("committed", rec)
        return rec

    def _maybe_commit_by_file(self, f: Inode) -> None:
        if f.name not in stepnames.COMMIT_FILES:
            return
        v = self.versions.get(f.vid) if f.vid is not None else None
        if v is None or not v.sealed or v.writers:
            return
        d = self.inodes.get(f.parent)
        if d is not None and d.parent == ROOT_INO:
            self._commit_step(d, stepnames.COMMIT_FILES[f.name])

    def _step_changed(self, ino: Inode) -> None:
        """A file in a committed step changed: its backup copy no longer matches."""
        rec = self.step_of(ino)
        if rec is not None and rec.backed_up_ns is not None:
            rec.backed_up_ns = None
            with self.db.transaction():
                self._write_step(rec)

    def backup_retired(self, kept: set[str]) -> list[str]:
        """The backup tier now holds only the steps in ``kept`` (after ``backup_keep``).

        Local steps that were counted as backed up but were retired lose that status; those
        of them whose data has left RAM are deleted, since their bytes are now nowhere.
        Returns the names of the deleted steps.
        """
        deleted = []
        for rec in list(self.steps.values()):
            if rec.backed_up_ns is None or rec.name in kept or rec.backing_up:
                continue
            versions = self._step_versions(rec)
            if any(v.missing for v in versions):
                self._delete_tree(rec)
                deleted.append(rec.name)
                log.info("deleted checkpoint %s: backup_keep retired its backup copy and its"
                         " data was no longer in RAM", rec.name)
                continue
            rec.backed_up_ns = None
            with self.db.transaction():
                self._write_step(rec)
                for v in versions:
                    if v.backed_up:
                        v.backed_up = False
                        self._write_version(v)
        return deleted

    def _forget_step(self, name: bytes) -> None:
        key = name.decode(errors="surrogateescape")
        if self.steps.pop(key, None) is not None:
            self.db.execute("DELETE FROM steps WHERE name=?", (key,))
            self._emit("step_removed", key)

    def seal_path(self, path: str) -> StepRecord:
        """Mark the top-level directory ``path`` as a complete checkpoint (``mtcfs seal``).

        Raises:
            FsError: ENOENT, ENOTDIR, or EINVAL when ``path`` is not a top-level directory.
        """
        ino = self.resolve(path)
        if not ino.is_dir:
            raise FsError(errno.ENOTDIR, f"{path} is not a directory")
        if ino.parent != ROOT_INO:
            raise FsError(errno.EINVAL, f"{path} is not a top-level directory of the job")
        with self.db.transaction():
            rec = self._commit_step(ino, "mtcfs seal")
        assert rec is not None
        return rec

    def step_sealed(self, rec: StepRecord) -> bool:
        """True when every file below the step is sealed (no writer, no seal running)."""
        for _path, ino in self.walk(self.inodes[rec.ino]):
            if ino.is_file:
                v = self.versions[ino.vid]  # type: ignore[index]
                if not v.sealed or v.writers or v.sealing is not None:
                    return False
        return True

    def walk(self, top: Inode) -> Iterable[tuple[str, Inode]]:
        """Yield (job-relative path, inode) of ``top`` and everything below, parents first."""
        base = self.path_of(top) or ""
        stack = [(base, top)]
        while stack:
            path, ino = stack.pop()
            yield path, ino
            if ino.is_dir:
                for name, child in sorted(ino.children.items(), reverse=True):  # type: ignore[union-attr]
                    stack.append((f"{path}/{name.decode(errors='surrogateescape')}" if path
                                  else name.decode(errors="surrogateescape"), self.inodes[child]))

    # ------------------------------------------------------------------ files

    def _writable_version(self, ino: Inode, *, trunc: bool) -> Version:
        """The version a new writer writes to: the open one, or a new copy-on-write one."""
        cur = self.versions[ino.vid] if ino.vid is not None else None
        if cur is not None and not cur.sealed and cur.sealing is None:
            if trunc and cur.size:
                os.ftruncate(self._fd(cur), 0)
                self.used -= cur.local_bytes()
                cur.size = 0
                cur.missing.clear()
                cur.gen += 1
            return cur
        if cur is not None and not trunc and cur.missing:
            raise FsError(errno.EAGAIN, "file is still being restored")
        with self.db.transaction():
            v = self._new_version(ino, copy_from=None if trunc else cur)
            self._set_current(ino, v)
            self._write_inode(ino)
        return v

    async def open(self, num: int, flags: int) -> tuple[int, bool]:
        """Open a file. Returns ``(fh, keep_cache)``.

        Raises:
            FsError: EISDIR, ENOENT, EAGAIN (writing a file still being restored).
        """
        ino = self._inode(num)
        if ino.is_dir:
            raise FsError(errno.EISDIR)
        if not ino.is_file:
            raise FsError(errno.EINVAL)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        trunc = bool(flags & os.O_TRUNC) and writable
        if writable and not trunc:
            await self._fault_in_all(ino)
        if writable:
            v = self._writable_version(ino, trunc=trunc)
            v.writers += 1
            if trunc:
                ino.mtime_ns = ino.ctime_ns = _now_ns()
        else:
            if flags & os.O_TRUNC and self.versions[ino.vid].size:  # type: ignore[index]
                # Linux truncates on O_RDONLY|O_TRUNC too, and the kernel has already
                # dropped its own size to 0 (atomic_o_trunc): follow it.
                await self._truncate(ino, 0, None)
                ino.mtime_ns = ino.ctime_ns = _now_ns()
            v = self.versions[ino.vid]  # type: ignore[index]
        v.handles += 1
        ino.opens += 1
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = Handle(fh, ino.ino, v, writable, bool(flags & os.O_APPEND))
        return fh, True

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
                     gid: int) -> tuple[int, Attr]:
        d = self._dir(parent)
        self._check_name(name)
        existing = d.children.get(name)  # type: ignore[union-attr]
        if existing is not None:
            if flags & os.O_EXCL:
                raise FsError(errno.EEXIST)
            fh, _ = await self.open(existing, flags)
            ino = self.inodes[existing]
            ino.lookups += 1
            return fh, self.attr(ino)
        with self.db.transaction():
            ino = self._new_inode("file", stat.S_IFREG | (mode & 0o7777), uid, gid)
            v = self._new_version(ino)
            ino.vid = v.vid
            self._link(d, name, ino)
            self._write_inode(ino)
            self._touch_dir(d)
        v.writers += 1
        v.handles += 1
        ino.opens += 1
        ino.lookups += 1
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = Handle(fh, ino.ino, v, True, bool(flags & os.O_APPEND))
        return fh, self.attr(ino)

    def _handle(self, fh: int) -> Handle:
        h = self.handles.get(fh)
        if not isinstance(h, Handle):
            raise FsError(errno.EBADF)
        return h

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        """Read up to ``size`` bytes at ``off``; waits for missing chunks (fault-in).

        A sealed, complete version is served as a view of its read-only mapping: the only
        copy is the kernel's into the FUSE reply (pyfuse3 takes any buffer, and consumes
        it before the next request runs). Other versions are read with ``pread``.
        """
        h = self._handle(fh)
        v = h.version
        ino = self.inodes.get(h.ino)
        if not v.current and ino is not None and ino.vid is not None:
            # Rewritten (copy-on-write) since this handle was opened: one file has one
            # content, so read the current version, as the kernel's page cache does.
            v = self.versions[ino.vid]
        if off >= v.size:
            return b""
        size = min(size, v.size - off)
        if v.missing:
            v.pins += 1  # a version this handle does not hold must outlive the await
            try:
                await self.fault_in(v, off, size)
                data = os.pread(self._fd(v), size, off)
            finally:
                v.pins -= 1
                self._release_version(v)  # no-op unless rewritten meanwhile
        elif v.sealed:
            self.counters.bytes_read += size
            return memoryview(self._map(v))[off:off + size]
        else:
            data = os.pread(self._fd(v), size, off)
        self.counters.bytes_read += len(data)
        return data

    def _map(self, v: Version) -> mmap.mmap:
        if v.mm is None:
            v.mm = mmap.mmap(self._fd(v), v.size, prot=mmap.PROT_READ)
        return v.mm

    @staticmethod
    def _unmap(v: Version) -> None:
        """Drop ``v``'s mapping; must precede any truncation of its data file."""
        if v.mm is not None:
            try:
                v.mm.close()
            except BufferError:  # a view is still exported: the GC unmaps it later
                pass
            v.mm = None

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self._handle(fh)
        if not h.writable:
            raise FsError(errno.EBADF)
        v = h.version
        if h.append:
            off = v.size
        end = off + len(buf)
        if end > v.size:
            await self._reserve(end - v.size)
        try:
            n = os.pwrite(self._fd(v), buf, off)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                self.counters.enospc += 1
                raise FsError(errno.ENOSPC, "store directory is full") from None
            raise
        if end > v.size:
            self.used += end - v.size
            v.size = end
        v.gen += 1
        self.counters.bytes_written += n
        return n

    async def flush(self, fh: int) -> None:
        """close(2) of one descriptor. Seal happens at release of the last writer."""
        self._handle(fh)

    async def fsync(self, fh: int, datasync: bool) -> None:
        h = self._handle(fh)
        if h.writable and not h.version.sealed:
            # Record the length reached so far; the bytes are already in the data file.
            with self.db.transaction():
                self._write_version(h.version)

    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if not isinstance(h, Handle):
            return
        v = h.version
        v.handles -= 1
        ino = self.inodes.get(h.ino)
        if h.writable:
            v.writers -= 1
            self._after_write_close(v)
        if ino is not None:
            ino.opens -= 1
            self._maybe_free_inode(ino)
        self._release_version(v)

    def _after_write_close(self, v: Version) -> None:
        if v.writers == 0 and not v.sealed and v.sealing is None and self._nursery is not None:
            v.sealing = trio.Event()
            self._nursery.start_soon(self._seal, v)

    # ------------------------------------------------------------------ seal

    async def _seal(self, v: Version) -> None:
        """Hash a closed version into chunks off the FUSE loop and record its manifest."""
        if v.sealing is None:
            v.sealing = trio.Event()
        done = v.sealing
        try:
            while True:
                gen, size = v.gen, v.size
                fd = self._fd(v)
                try:
                    res = await trio.to_thread.run_sync(hash_fd, fd, size, v.chunk_size,
                                                        limiter=self.cpu_limiter)
                except OSError as exc:
                    v.seal_error = str(exc)
                    self._error(f"seal of version {v.vid} failed: {exc}")
                    return
                if v.vid not in self.versions:
                    return
                if v.writers:
                    return  # reopened for writing; the next close seals again
                if v.gen != gen or v.size != size:
                    continue
                break
            v.sealed = True
            v.chunks = res.chunks
            v.blake3 = res.file_hash
            v.backed_up = False
            ino = self.inodes.get(v.ino)
            with self.db.transaction():
                self._write_version(v)
                if ino is not None:
                    self._write_inode(ino)
            self._index_chunks(v)
            self.counters.seals += 1
            v.sealing = None
            if ino is not None:
                self._step_changed(ino)
            if ino is not None and ino.vid == v.vid:
                self._emit("sealed", v)
                with self.db.transaction():
                    self._maybe_commit_by_file(ino)
        finally:
            v.sealing = None
            done.set()
            if v.writers == 0 and not v.sealed and v.vid in self.versions and v.current:
                self._after_write_close(v)
            self._release_version(v)

    async def wait_sealed(self, ino: Inode, grace: float = 2.0) -> Version | None:
        """Wait until the current version of file ``ino`` is sealed.

        The kernel sends RELEASE shortly after close(2) returns, so a version that still has
        writers gets ``grace`` seconds to lose them. Returns None if it is still open then.
        """
        deadline = trio.current_time() + grace
        while True:
            if ino.vid is None:
                return None
            v = self.versions[ino.vid]
            if v.sealed:
                return v
            if v.sealing is not None:
                await v.sealing.wait()
                continue
            if trio.current_time() >= deadline:
                return None
            await trio.sleep(0.01)

    def _index_chunks(self, v: Version) -> None:
        if not v.sealed:
            return
        for i, d in enumerate(v.chunks):
            if i not in v.missing:
                self._chunk_locations.setdefault(d, (v.vid, i))

    # ------------------------------------------------------------------ capacity

    async def _reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` more bytes of data, evicting checkpoints if needed.

        Raises:
            FsError: ENOSPC when eviction cannot free enough.
        """
        if self.used + nbytes <= self.capacity:
            return
        self.evict(need=self.used + nbytes - self.capacity)
        if self.used + nbytes > self.capacity:
            self.counters.enospc += 1
            raise FsError(errno.ENOSPC, f"RAM tier full ({self.used} of {self.capacity} bytes)")

    def evictable_steps(self, *, pressure: bool) -> list[StepRecord]:
        """Committed steps that may leave RAM, oldest first.

        Never the newest committed step, never one being backed up; without memory pressure
        also never one of the newest ``keep`` steps, and only steps already backed up.
        """
        ordered = sorted(self.steps.values(), key=lambda s: (s.number, s.committed_ns))
        if not ordered:
            return []
        protected = {ordered[-1].name}
        if not pressure:
            protected.update(s.name for s in ordered[-self.keep:] if self.keep > 0)
        out = []
        for s in ordered:
            if s.name in protected or s.backing_up:
                continue
            if not pressure and s.backed_up_ns is None:
                continue
            if self._step_local_bytes(s) == 0 and s.backed_up_ns is not None:
                continue
            out.append(s)
        return out

    def _step_local_bytes(self, s: StepRecord) -> int:
        total = 0
        for _p, ino in self.walk(self.inodes[s.ino]):
            if ino.is_file:
                total += self.versions[ino.vid].local_bytes()  # type: ignore[index]
        return total

    def evict(self, need: int | None = None) -> list[str]:
        """Evict checkpoints from RAM (``mtcfs gc``, the keep= policy, memory pressure).

        A step that is in the backup keeps its namespace and drops its data (read again, it
        is faulted back in); a step that is not is deleted. With ``need`` (bytes) stops once
        enough is free; without, applies the keep= policy.

        Returns:
            names of the evicted steps.
        """
        pressure = need is not None
        freed_names = []
        start_used = self.used
        for s in self.evictable_steps(pressure=pressure):
            if pressure and start_used - self.used >= need:  # type: ignore[operator]
                break
            if any(v.handles for v in self._step_versions(s)):
                continue
            if s.backed_up_ns is not None:
                self._drop_step_data(s)
            else:
                self._delete_tree(s)
            freed_names.append(s.name)
            self.counters.evicted_steps += 1
            log.info("evicted checkpoint %s from RAM (%s)", s.name,
                     "memory pressure" if pressure else f"keep={self.keep}")
        return freed_names

    def _step_versions(self, s: StepRecord) -> list[Version]:
        return [self.versions[i.vid] for _p, i in self.walk(self.inodes[s.ino])
                if i.is_file and i.vid is not None]

    def _drop_step_data(self, s: StepRecord) -> None:
        with self.db.transaction():
            for v in self._step_versions(s):
                if not v.sealed or v.pins:
                    continue
                before = v.local_bytes()
                self._unmap(v)
                fd = self._fd(v)
                os.ftruncate(fd, 0)
                os.ftruncate(fd, v.size)
                v.missing = set(range(chunk_count(v.size, v.chunk_size)))
                self.used -= before
                self._write_version(v)
                for d in v.chunks:
                    if self._chunk_locations.get(d, (None,))[0] == v.vid:
                        del self._chunk_locations[d]

    def _delete_tree(self, s: StepRecord) -> None:
        top = self.inodes[s.ino]
        items = list(self.walk(top))
        with self.db.transaction():
            for _path, ino in reversed(items):
                parent = self.inodes[ino.parent]
                if ino.is_dir:
                    self._unlink_entry(parent, ino.name)
                    ino.nlink = 0
                    ino.parent, ino.name = 0, b""
                    parent.nlink -= 1
                    self._write_inode(ino)
                else:
                    name = ino.name
                    self._unlink_entry(parent, name)
                    self._drop_link(ino, parent, name)
            self._forget_step(top.name or s.name.encode())
        self._emit("invalidate_entry", (ROOT_INO, s.name.encode(errors="surrogateescape"), top.ino))
        for _path, ino in items:
            self._maybe_free_inode(ino)

    def statfs(self) -> dict[str, int]:
        """Capacity figures in bytes (the RAM tier's ``size=``, not the tmpfs's)."""
        return {"capacity": self.capacity, "used": self.used,
                "free": max(0, self.capacity - self.used), "files": len(self.inodes)}

    # ------------------------------------------------------------------ fault-in

    async def _fault_in_all(self, ino: Inode) -> None:
        """Bring every chunk of the current version here (before a copy-on-write)."""
        v = self.versions.get(ino.vid) if ino.vid is not None else None
        if v is not None and v.missing:
            await self.fault_in(v, 0, v.size)

    async def fault_in(self, v: Version, off: int, size: int) -> None:
        """Wait until bytes ``[off, off+size)`` of ``v`` are in the data file.

        Raises:
            FsError: EIO when a chunk cannot be fetched or fails verification.
        """
        cs = v.chunk_size
        first, last = off // cs, (off + max(size, 1) - 1) // cs
        wanted = [i for i in range(first, last + 1) if i in v.missing]
        if not wanted:
            return
        if len(wanted) == 1:
            await self._fetch_chunk(v, wanted[0])
            return
        errors: list[BaseException] = []

        async def one(i: int) -> None:
            try:
                await self._fetch_chunk(v, i)
            except FsError as exc:
                errors.append(exc)

        async with trio.open_nursery() as n:
            for i in wanted:
                n.start_soon(one, i)
        if errors:
            raise errors[0]

    async def _fetch_chunk(self, v: Version, idx: int) -> None:
        key = (v.vid, idx)
        while idx in v.missing:
            ev = self._inflight.get(key)
            if ev is not None:
                await ev.wait()
                if idx in v.missing and key not in self._inflight:
                    raise FsError(errno.EIO, f"chunk {idx} of version {v.vid} unavailable")
                continue
            ev = self._inflight[key] = trio.Event()
            try:
                await self._fetch_chunk_once(v, idx)
            finally:
                del self._inflight[key]
                ev.set()

    async def _fetch_chunk_once(self, v: Version, idx: int) -> None:
        digest = v.chunks[idx]
        off, length = chunk_span(idx, v.size, v.chunk_size)
        v.pins += 1
        try:
            async with self._fetch_limiter:
                data = await self._chunk_bytes(digest, length)
            if idx not in v.missing or v.vid not in self.versions:
                return
            await trio.to_thread.run_sync(os.pwrite, self._fd(v), data, off,
                                          limiter=self.cpu_limiter)
            if idx in v.missing:
                v.missing.discard(idx)
                self.used += length
                self.counters.chunks_faulted += 1
                self.counters.bytes_faulted += length
                self._chunk_locations.setdefault(digest, (v.vid, idx))
                with self.db.transaction():
                    self._write_version(v)
        finally:
            v.pins -= 1
            self._release_version(v)

    async def _chunk_bytes(self, digest: str, length: int) -> bytes:
        """Bytes of chunk ``digest``: a local copy if one exists, else the chunk source."""
        loc = self._chunk_locations.get(digest)
        if loc is not None:
            src = self.versions.get(loc[0])
            if src is not None and loc[1] not in src.missing:
                off, _ = chunk_span(loc[1], src.size, src.chunk_size)
                self._fd(src)
                src.pins += 1  # its descriptor must stay open while the thread reads
                try:
                    data = await trio.to_thread.run_sync(self.read_chunk_at, src, off, length,
                                                         digest, limiter=self.cpu_limiter)
                finally:
                    self.unpin([src])
                if data is not None:
                    return data
        if self.chunk_source is None:
            self.counters.fault_errors += 1
            raise FsError(errno.EIO, f"chunk {digest[:16]} is in no tier this node can reach")
        try:
            data = await self.chunk_source.fetch(digest)
        except FsError as exc:
            self.counters.fault_errors += 1
            self._error(f"fault-in of chunk {digest[:16]} failed: {exc.strerror}")
            raise
        if len(data) != length:
            self.counters.fault_errors += 1
            self._error(f"chunk {digest[:16]} has {len(data)} bytes, expected {length}")
            raise FsError(errno.EIO, "chunk length mismatch")
        return data

    def read_chunk_at(self, v: Version, off: int, length: int, digest: str | None) -> bytes | None:
        """Read ``length`` bytes at ``off`` of ``v`` and verify them against ``digest``.

        Thread-safe: the caller opens ``v``'s descriptor on the loop and pins ``v`` so that it
        stays open. Returns None on a mismatch: a chunk whose hash does not match is never
        served.
        """
        data = os.pread(v.fd, length, off)
        if digest is not None and chunk_hash(data) != digest:
            log.error("local chunk %s of version %d does not match its hash", digest[:16], v.vid)
            return None
        return data

    def pending_fault_in(self) -> list[tuple[Version, int]]:
        """(version, chunk index) pairs still missing in current versions, in path order."""
        out = []
        for _path, ino in self.walk(self.inodes[ROOT_INO]):
            if ino.is_file and ino.vid is not None:
                v = self.versions[ino.vid]
                out.extend((v, i) for i in sorted(v.missing))
        return out

    def _error(self, msg: str) -> None:
        log.error("%s", msg)
        self.errors.append(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {msg}")
        del self.errors[:-50]

    # ------------------------------------------------------------------ directories

    async def opendir(self, num: int) -> int:
        d = self._dir(num)
        fh = self._next_fh
        self._next_fh += 1
        entries = [(b".", d.ino), (b"..", d.parent or ROOT_INO)]
        entries.extend(sorted(d.children.items()))  # type: ignore[union-attr]
        self.handles[fh] = DirHandle(fh, d.ino, entries)
        return fh

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
            yield name, self.attr(ino), i + 1, name not in (b".", b"..")

    def count_lookup(self, num: int) -> None:
        ino = self.inodes.get(num)
        if ino is not None:
            ino.lookups += 1

    async def releasedir(self, fh: int) -> None:
        self.handles.pop(fh, None)

    # ------------------------------------------------------------------ xattrs

    async def getxattr(self, num: int, name: bytes) -> bytes:
        ino = self._inode(num)
        if name.startswith(XATTR_PREFIX):
            return await self._mtcfs_xattr(ino, name[len(XATTR_PREFIX):])
        try:
            return ino.xattrs[name]
        except KeyError:
            raise FsError(ENOATTR) from None

    async def setxattr(self, num: int, name: bytes, value: bytes) -> None:
        ino = self._inode(num)
        if name.startswith(XATTR_PREFIX):
            raise FsError(errno.EPERM, "user.mtcfs.* attributes are read-only")
        if not name.startswith(b"user."):
            raise FsError(errno.ENOTSUP)
        with self.db.transaction():
            ino.xattrs[name] = value
            self.db.execute("INSERT OR REPLACE INTO xattrs(ino, name, value) VALUES (?,?,?)",
                            (num, name, value))

    async def listxattr(self, num: int) -> list[bytes]:
        # The virtual user.mtcfs.* attributes are read by name only, not listed: copy tools
        # (cp -a --preserve=xattr, tar --xattrs, rsync -X) set every listed name on the copy
        # and fail on read-only ones, and would carry stale hashes to other filesystems.
        return list(self._inode(num).xattrs)

    async def removexattr(self, num: int, name: bytes) -> None:
        ino = self._inode(num)
        if name not in ino.xattrs:
            raise FsError(ENOATTR)
        with self.db.transaction():
            del ino.xattrs[name]
            self.db.execute("DELETE FROM xattrs WHERE ino=? AND name=?", (num, name))

    async def _mtcfs_xattr(self, ino: Inode, key: bytes) -> bytes:
        if key == b"state":
            return self.state_of(ino).encode()
        if key == b"blake3" and ino.is_file:
            v = await self.wait_sealed(ino)
            if v is None:
                raise FsError(ENOATTR)
            return v.blake3.encode()
        if key == b"control" and ino.ino == ROOT_INO:
            return self.store.control_socket.encode()
        raise FsError(ENOATTR)

    def state_of(self, ino: Inode) -> str:
        """The durability state shown in ``user.mtcfs.state``.

        Files: ``writing`` (open for writing or being hashed), ``local`` (sealed, RAM only),
        ``backed-up`` (sealed, and in the backup tier), ``restoring`` (some chunks still
        arriving), ``remote`` (evicted from RAM, in the backup tier).
        Directories: a step dir is ``incomplete`` until committed, then ``local`` or
        ``backed-up``; other dirs report ``local``.
        """
        if ino.is_file and ino.vid is not None:
            v = self.versions[ino.vid]
            if not v.sealed or v.sealing is not None or v.writers:
                return "writing"
            if v.missing:
                full = len(v.missing) == chunk_count(v.size, v.chunk_size)
                return "remote" if full and v.backed_up else "restoring"
            return "backed-up" if v.backed_up else "local"
        if ino.is_dir and ino.parent == ROOT_INO:
            rec = self.steps.get(ino.name.decode(errors="surrogateescape"))
            if rec is None:
                return "incomplete" if stepnames.step_number(ino.name) is not None or \
                    stepnames.is_orbax_tmp(ino.name) else "local"
            if rec.backed_up_ns is not None:
                return "backed-up"
            return "local"
        return "local"

    # ------------------------------------------------------------------ backup / restore support

    def snapshot_step(self, name: str) -> tuple[StepManifest, list[Version]]:
        """The manifest of committed step ``name`` and its pinned versions.

        The caller must :meth:`unpin` the versions when done (the data files stay while
        pinned, even if the files are rewritten or deleted meanwhile).

        Raises:
            FsError: ENOENT if the step is not committed; EAGAIN if a file in it is unsealed.
        """
        rec = self.steps.get(name)
        if rec is None:
            raise FsError(errno.ENOENT, f"no committed checkpoint {name}")
        if not self.step_sealed(rec):
            raise FsError(errno.EAGAIN, f"checkpoint {name} has files still being written")
        entries, pinned = [], []
        for path, ino in self.walk(self.inodes[rec.ino]):
            perm = ino.mode & 0o7777
            if ino.is_dir:
                entries.append(Entry(path, "dir", perm, ino.mtime_ns))
            elif ino.kind == "symlink":
                entries.append(Entry(path, "symlink", perm, ino.mtime_ns, size=len(ino.target),
                                     target=ino.target.decode(errors="surrogateescape")))
            else:
                v = self.versions[ino.vid]  # type: ignore[index]
                v.pins += 1
                pinned.append(v)
                entries.append(Entry(path, "file", perm, ino.mtime_ns, size=v.size,
                                     chunk_size=v.chunk_size, chunks=v.chunks, blake3=v.blake3))
        m = StepManifest(job=self.job, step=name, step_number=rec.number,
                         created_ns=_now_ns(), entries=entries)
        return m, pinned

    def unpin(self, versions: Iterable[Version]) -> None:
        for v in versions:
            v.pins -= 1
            self._release_version(v)

    def chunk_reader(self, versions: list[Version]) -> Callable[[str], bytes]:
        """A thread-safe ``read_chunk(digest) -> bytes`` over pinned versions (for uploads).

        The returned function raises FsError(EIO) for a chunk whose bytes no longer match.
        """
        where: dict[str, tuple[Version, int]] = {}
        for v in versions:
            self._fd(v)  # opened here, on the loop: the reader runs in worker threads
            for i, d in enumerate(v.chunks):
                if i not in v.missing:
                    where.setdefault(d, (v, i))

        def read_chunk(digest: str) -> bytes:
            v, i = where[digest]
            off, length = chunk_span(i, v.size, v.chunk_size)
            data = self.read_chunk_at(v, off, length, digest)
            if data is None:
                raise FsError(errno.EIO, f"local chunk {digest[:16]} is corrupt")
            return data
        return read_chunk

    def mark_backed_up(self, name: str, versions: list[Version]) -> None:
        """Record that step ``name`` (with these versions) is complete in the backup tier."""
        with self.db.transaction():
            for v in versions:
                if v.vid in self.versions and not v.backed_up:
                    v.backed_up = True
                    self._write_version(v)
            rec = self.steps.get(name)
            if rec is not None:
                rec.backed_up_ns = _now_ns()
                self._write_step(rec)

    def import_step(self, m: StepManifest) -> StepRecord:
        """Create the namespace of a backed-up step with no data yet (restore).

        Files appear at once with their sizes; their chunks are missing and are faulted in
        on read or by the background prefetcher.

        Raises:
            FsError: EEXIST if the step's directory already exists.
        """
        root = self.inodes[ROOT_INO]
        if m.step.encode() in root.children:  # type: ignore[operator]
            raise FsError(errno.EEXIST, f"{m.step} already exists")
        uid, gid = os.getuid(), os.getgid()
        with self.db.transaction():
            for e in m.entries:
                parent_path, _, base = e.path.rpartition("/")
                parent = self.resolve(parent_path)
                name = base.encode(errors="surrogateescape")
                if e.kind == "dir":
                    ino = self._new_inode("dir", stat.S_IFDIR | e.mode, uid, gid)
                    parent.nlink += 1
                elif e.kind == "symlink":
                    ino = self._new_inode("symlink", stat.S_IFLNK | 0o777, uid, gid)
                    ino.target = e.target.encode(errors="surrogateescape")
                else:
                    ino = self._new_inode("file", stat.S_IFREG | e.mode, uid, gid)
                    v = Version(vid=self._alloc_vid(), ino=ino.ino, size=e.size,
                                chunk_size=e.chunk_size or self.chunk_size, sealed=True,
                                chunks=e.chunks, blake3=e.blake3,
                                missing=set(range(len(e.chunks))), backed_up=True)
                    fd = self.store.open_data(v.vid, create=True)
                    os.ftruncate(fd, v.size)
                    v.fd = fd
                    self.versions[v.vid] = v
                    self._write_version(v)
                    ino.vid = v.vid
                ino.mtime_ns = e.mtime_ns
                self._link(parent, name, ino)
                self._write_inode(ino)
                self._write_inode(parent)
            top = self.resolve(m.step)
            rec = StepRecord(name=m.step, number=m.step_number, ino=top.ino,
                             committed_ns=_now_ns(), source="restore", backed_up_ns=_now_ns())
            self.steps[m.step] = rec
            self._write_step(rec)
        for v in [self.versions[i.vid] for _p, i in self.walk(top) if i.is_file]:
            self._index_chunks(v)
        return rec

    async def verify(self, progress: Callable[[int, int], None] | None = None) -> list[str]:
        """Re-hash every chunk of every sealed version held in RAM (``mtcfs verify``).

        The versions are pinned on the loop, hashed in a worker thread, and unpinned.

        Args:
            progress: called from the worker thread with (bytes done, bytes total).

        Returns:
            one message per chunk whose bytes do not match its digest.
        """
        versions = [v for v in self.versions.values() if v.sealed]
        for v in versions:
            v.pins += 1
            self._fd(v)
        try:
            work = [(v, i) for v in versions for i in range(len(v.chunks)) if i not in v.missing]
            bad = await trio.to_thread.run_sync(self._rehash, work, progress,
                                                limiter=self.cpu_limiter)
        finally:
            self.unpin(versions)
        out = []
        for v, i in bad:
            off, length = chunk_span(i, v.size, v.chunk_size)
            ino = self.inodes.get(v.ino)
            path = self.path_of(ino) if ino is not None and ino.vid == v.vid else None
            out.append(f"{path or f'version {v.vid}'}: chunk {i} (bytes {off}..{off + length})"
                       f" does not match {v.chunks[i][:16]}")
        return out

    @staticmethod
    def _rehash(work: list[tuple[Version, int]],
                progress: Callable[[int, int], None] | None) -> list[tuple[Version, int]]:
        """Worker-thread half of :meth:`verify`: the (version, chunk) pairs that mismatch."""
        total = sum(chunk_span(i, v.size, v.chunk_size)[1] for v, i in work)
        done, bad = 0, []
        for v, i in work:
            off, length = chunk_span(i, v.size, v.chunk_size)
            if chunk_hash(os.pread(v.fd, length, off)) != v.chunks[i]:
                bad.append((v, i))
            done += length
            if progress:
                progress(done, total)
        return bad
