"""The versions of files: their table, their data files and their descriptors.

:class:`VersionStore` owns

- ``versions``: vid -> :class:`~mtcfs.core.model.Version`, every version registered in the
  store (the current version of each file, and old ones still read through handles or
  pins). Others read this dict (``Filesystem.versions`` is the same object, for the
  component's lifetime); only this class adds or removes entries;
- the ``versions`` table of the store's SQLite database (one row per registered version,
  written by :meth:`write`), the ``rewrite_dirty`` table (the chunks a rewrite changed,
  committed before their bytes change: :meth:`note_dirty`, :meth:`drop_base`) and the kv
  key ``next_vid`` (a lower bound; :meth:`alloc_vid`, :meth:`load`);
- the data files ``<store>/data/<vid>`` (created by :meth:`new`/:meth:`new_sealed`,
  removed by :meth:`release` once the deletion of the row commits);
- ``fds``: the :class:`~mtcfs.core.store.fdcache.FdCache` of data file descriptors
  (``Version.fd`` is its entry); :meth:`fd` for a use on the loop, ``fds.lease`` across an
  ``await`` or in a thread;
- ``chunk_keeper``: told before this node drops its last local copy of a chunk (a
  version freed or its data dropped): ``wants(digest) -> bool``, ``keep(digest, data)``
  (the peer tier's replica store, wired by the daemon; None: nobody).

It reaches the rest of the core only through :class:`Host`: the store's database, the RAM
budget (every data file it creates, grows or frees is accounted there, ``Version.alloc``
in bytes), the chunk index (a freed version's chunks are forgotten) and the verifier (a
freed version has nothing left to verify).

Errors: ``OSError`` of the data files propagates (the caller is in a transaction, which
then rolls back; the data file of a version whose row was never committed is removed at
the next load, :meth:`repair`). Nothing here raises ``FsError``; the room a version needs
is reserved by the caller first (``RamBudget.reserve``).

Shared data files (issue 18: a rewrite at chunk granularity while the old version is
still read). A version opened for writing takes the sealed version's data file over (a
second name for it, :meth:`VersionStore.new`); when that old version is pinned (a backup
upload, a replication, a verification reads it in a thread) it stays, as a *reader* of
the same file, and the new version is the file's *writer* (one
:class:`~mtcfs.core.model.SharedData` per file, readers oldest first). Before the writer
changes any byte of a chunk (a write, a resize, a corrupt chunk's hole), :meth:`preserve`
copies that chunk into each reader's ``preserved`` dict (copy-before-write, as LVM's
snapshots do per extent); readers read through :func:`read_data`, which takes the chunks
found there after its ``pread``, so a thread never returns a byte the writer changed.
Work and RAM: the chunks changed, not the file. The writer leaves the file to the readers
when it is truncated to 0 or its data dropped (:meth:`unshare`: a new file of its own) or
freed; a reader leaves when its last pin goes (:meth:`release`). The file counts against
size= once (with its writer, else with the first reader) and each reader's copies on top.
A crash needs nothing: readers are replaced versions, forgotten at the next load with
their names (:meth:`repair`), and the writer's row is the take-over's. A scope=job
snapshot install keeps local copies by taking data files over: never a reader's, and a
copy of a writer's whose readers still read it (core/jobns.py: ``install``).

Concurrency: every method runs on the trio thread and none awaits; a version being sealed
(``Version.sealing``, hashing in a worker thread) is never freed under it: :meth:`release`
gives its pages back and the seal frees the rest.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
from typing import Any, Protocol

import blake3

from mtcfs.base.chunking import chunk_count, chunk_hash, chunk_span, zero_chunk_hash
from mtcfs.base.failpoints import failpoint
from mtcfs.base.fileio import pwrite_all
from mtcfs.core.budget import RamBudget
from mtcfs.core.chunkmap import ChunkIndex
from mtcfs.core.model import Inode, SharedData, Version
from mtcfs.core.store import Store
from mtcfs.core.store.fdcache import FdCache
from mtcfs.core.store.meta import MetaDB

__all__ = ["Host", "Releaser", "VersionStore", "copy_extents", "hash_data", "read_data"]

log = logging.getLogger("mtcfs.core.core")


class Forgets(Protocol):
    """What :class:`VersionStore` asks of the verifier: ``drop(vid)``, nothing left to
    verify of that version."""

    def drop(self, vid: int) -> None: ...


class Releaser(Protocol):
    """What other components ask of the version store: free ``v`` once nothing uses it
    (:meth:`VersionStore.release`)."""

    def release(self, v: Version) -> None: ...


class Host(Protocol):
    """What :class:`VersionStore` may use of the core (the ``Filesystem`` facade), read
    at each use (the facade builds some of them after the store)."""

    @property
    def db(self) -> MetaDB: ...
    @property
    def budget(self) -> RamBudget: ...
    @property
    def chunk_index(self) -> ChunkIndex: ...
    @property
    def verifier(self) -> Forgets: ...


def copy_extents(src: int, dst: int, size: int) -> None:
    """Copy the first ``size`` bytes of descriptor ``src`` to ``dst``, data extents only
    (holes stay holes), and make ``dst`` ``size`` bytes long.

    Raises:
        OSError: of ``lseek``/``copy_file_range``; EIO if a copy ends early.
    """
    off = 0
    while off < size:
        try:
            data = os.lseek(src, off, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole is left
                break
            raise
        if data >= size:
            break
        end = min(os.lseek(src, data, os.SEEK_HOLE), size)
        pos = data
        while pos < end:
            n = os.copy_file_range(src, dst, end - pos, pos, pos)
            if n <= 0:
                raise OSError(errno.EIO, "copy of a version's data ended early")
            pos += n
        off = end
    os.ftruncate(dst, size)


def _is_hole(fd: int, off: int, length: int) -> bool:
    """Whether ``[off, off+length)`` of ``fd`` holds no data extent (reads as zeros; past
    the end of the file included).

    Raises:
        OSError: of ``lseek`` but ENXIO (no data past ``off``).
    """
    try:
        return os.lseek(fd, off, os.SEEK_DATA) >= off + length
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return True
        raise


def read_data(fds: FdCache, v: Version, off: int, length: int) -> bytes:
    """``length`` bytes at ``off`` of ``v``'s content (fewer at its end), from any thread
    (the caller pins ``v``) or the loop.

    A version that shares its data file with a newer one that writes on it (a reader,
    ``v.preserved`` set: "Shared data files" in this module) gets its preserved copy of
    each chunk the writer changed. ``preserved`` is read after the ``pread``: the writer
    copies a chunk there before it changes a byte of it, so a chunk not there after the
    read was not being changed during it (the order of a seqlock's check).
    """
    fd = fds.lease(v)
    try:
        data = os.pread(fd, length, off)
    finally:
        fds.unlease(v, fd)
    kept = v.preserved
    if kept is None or not length:
        return data
    cs = v.chunk_size
    want = max(0, min(length, v.size - off))
    first, last = off // cs, (off + want - 1) // cs
    if not any(i in kept for i in range(first, last + 1)):
        return data if len(data) <= want else data[:want]  # (the writer may have grown it)
    out = bytearray(data.ljust(want, b"\0")[:want])
    for i in range(first, last + 1):
        piece = kept.get(i)
        if piece is not None:
            lo, hi = max(off, i * cs), min(off + want, i * cs + len(piece))
            out[lo - off:hi - off] = piece[lo - i * cs:hi - i * cs]
    return bytes(out)


#: Bytes :func:`hash_range` reads at a time: small enough to be still in the CPU's cache
#: when blake3 reads them back, large enough that each ``preadv`` costs little per byte.
HASH_PIECE = 1 << 20
_piece_buffers = threading.local()


def hash_range(fds: FdCache, v: Version, off: int, length: int) -> str:
    """The blake3 (hex) of ``read_data(fds, v, off, length)``, from any thread (the caller
    pins ``v``), without a new buffer per call: the bytes are read :data:`HASH_PIECE` at a
    time with ``preadv`` into a buffer the calling thread keeps, and hashed as they come.
    1.1-1.5x as fast here as hashing what ``read_data`` returns (a fresh ``length``-byte
    object each time; 4 MiB chunks, 1 and 2 threads: docs/benchmarks.md, "First read after
    a restart").

    A chunk that a writer of the same data file copied aside (``v.preserved``, "Shared data
    files" above) is hashed from :func:`read_data` instead; ``preserved`` is looked at
    after the reads, as :func:`read_data` does.

    Raises:
        OSError: the data file cannot be read.
    """
    if v.preserved is None:
        view: memoryview | None = getattr(_piece_buffers, "view", None)
        if view is None:
            view = _piece_buffers.view = memoryview(bytearray(HASH_PIECE))
        h = blake3.blake3()
        fd = fds.lease(v)
        try:
            pos, end = off, off + length
            while pos < end:
                n = os.preadv(fd, [view[:min(HASH_PIECE, end - pos)]], pos)
                if n == 0:
                    break  # the file ends first: fewer bytes, as read_data returns
                h.update(view[:n])
                pos += n
        finally:
            fds.unlease(v, fd)
        kept = v.preserved
        cs = v.chunk_size
        if kept is None or not any(i in kept for i in range(off // cs,
                                                            (off + max(length, 1) - 1) // cs + 1)):
            return str(h.hexdigest())
    return chunk_hash(read_data(fds, v, off, length))


def hash_data(fds: FdCache, v: Version, piece: int = 4 << 20) -> str:
    """The whole-file blake3 (hex) of ``v``'s content, read with :func:`read_data` in
    pieces of ``piece`` bytes (a reader of a shared data file; worker thread)."""
    h = blake3.blake3()
    for off in range(0, v.size, piece):
        h.update(read_data(fds, v, off, min(piece, v.size - off)))
    return str(h.hexdigest())


class VersionStore:
    """The versions of one core.

    Args:
        host: the core (see :class:`Host`).
        store: the opened store (data files: ``open_data``, ``data_path``,
            ``remove_data``, ``data_vids``).
        chunk_size: chunk size in bytes of new versions.

    Settable by the daemon: :attr:`chunk_keeper`.
    """

    def __init__(self, host: Host, store: Store, chunk_size: int) -> None:
        self._host = host
        self._store = store
        self.chunk_size = chunk_size
        #: vid -> registered version (read by everyone, changed only here).
        self.versions: dict[int, Version] = {}
        #: Data file descriptors, a bounded LRU: ``Version.fd`` is its entry (fdcache.py).
        self.fds = FdCache(store.open_data)
        #: Told before this node drops its last local copy of a chunk (see the module).
        self.chunk_keeper: Any = None
        self._next_vid = 1

    # ------------------------------------------------------------------ rows

    def load(self, fresh: bool) -> None:
        """Read the versions and ``next_vid`` from the database (``fresh``: a new store,
        whose ``next_vid`` is set to 1)."""
        db = self._host.db
        if fresh:
            db.set_kv("next_vid", "1")
        # kv next_vid is a lower bound (not written per version, versions are this node's
        # own): past every vid a row or a data file still has.
        self._next_vid = max(int(db.get_kv("next_vid") or 1),
                             1 + db.execute("SELECT coalesce(max(vid), 0) FROM versions"
                                            ).fetchone()[0],
                             1 + max((int(n) for n in os.listdir(self._store.data_dir)
                                      if n.isascii() and n.isdigit()), default=0))
        for row in db.execute("SELECT vid, ino, size, chunk_size, sealed, chunks, blake3, missing,"
                              " backed_up, origin, base_chunks FROM versions"):
            v = Version(vid=row[0], ino=row[1], size=row[2], chunk_size=row[3],
                        sealed=bool(row[4]), chunks=tuple(row[5].split()) if row[5] else (),
                        blake3=row[6], missing={int(i) for i in row[7].split()},
                        backed_up=bool(row[8]), origin=row[9])
            if not v.sealed and row[10] is not None:
                # a rewrite at the crash: its base and (below) the chunks it changed
                v.base_chunks = tuple(row[10].split())
                v.base_logged = True
            self.versions[v.vid] = v
        for vid, idx in db.execute("SELECT vid, idx FROM rewrite_dirty"):
            v = self.versions.get(vid)
            if v is not None and v.base_logged:
                v.dirty.add(idx)

    def repair(self, current: set[int]) -> list[Version]:
        """Crash recovery, in the caller's transaction: forget the versions no inode has as
        current (``current``: their vids), remove data files no version has, recreate the
        missing data files of the others (a sealed one's chunks become missing), and adopt
        the data file length of unsealed ones. Returns the unsealed versions (being written
        at the crash: sealed again after mount; their data may be short, never garbage)."""
        db = self._host.db
        store = self._store
        for vid in [v for v in self.versions if v not in current]:
            self.versions.pop(vid)
            db.execute("DELETE FROM versions WHERE vid=?", (vid,))
        on_disk = store.data_vids()
        for vid in on_disk - set(self.versions):
            store.remove_data(vid)
        # rewrite_dirty rows of versions that are gone, sealed or have no base: leftovers
        db.execute("DELETE FROM rewrite_dirty WHERE vid NOT IN (SELECT vid FROM versions"
                   " WHERE sealed=0 AND base_chunks IS NOT NULL)")
        unsealed: list[Version] = []
        for v in self.versions.values():
            if v.vid not in on_disk:
                fd = store.open_data(v.vid, create=True)
                os.ftruncate(fd, v.size)
                os.close(fd)
                if v.sealed:
                    v.missing = set(range(chunk_count(v.size, v.chunk_size)))
                    self.write(v)
                else:
                    self.drop_base(v)  # its data is zeros now, not the base's bytes
            if not v.sealed:
                if v.missing:
                    self.drop_base(v)  # (never with a base: new() records none then)
                if v.vid in on_disk:
                    self._detach_unsealed(v)
                v.size = os.stat(store.data_path(v.vid)).st_size
                self.write(v)
                unsealed.append(v)
        return unsealed

    def _detach_unsealed(self, v: Version) -> None:
        """``v`` was being written when the daemon before this one died. A process that
        had it open for writing through FUSE passthrough may still be writing its data file
        (the kernel writes it for that descriptor, which outlives the daemon, until the
        process closes it). Give ``v`` a copy of the file under its own name, so that the
        seal after this start hashes bytes no one else changes: the old file, still written
        by that process, has no name any more. The copy is made under an unused version
        number first and renamed over the name (a crash in between leaves a file that the
        next start removes as having no version). If the copy cannot be made (no room), the
        file is kept as it is and the log says so."""
        store = self._store
        tmp_vid = self.alloc_vid()
        try:
            src = store.open_data(v.vid)
            try:
                dst = store.open_data(tmp_vid, create=True)
                try:
                    copy_extents(src, dst, os.fstat(src).st_size)
                finally:
                    os.close(dst)
            finally:
                os.close(src)
            os.rename(store.data_path(tmp_vid), store.data_path(v.vid))
        except OSError as exc:
            store.remove_data(tmp_vid, 0)
            log.warning("version %d, being written at the crash, keeps its data file (a copy "
                        "could not be made: %s); a writer of the old mount that is still "
                        "running could change it after its seal", v.vid, exc)
            return
        self.fds.drop(v)

    def check_present(self) -> list[tuple[Version, list[int]]]:
        """The store check at load, in the caller's transaction, after the budget measured
        every data file (``Version.alloc``): the chunks a sealed version's row lists as
        present whose bytes its data file does not hold become missing (their rows
        written; fetched again when read, like an evicted chunk), and are returned as
        ``(version, chunk indices)``.

        A chunk counts as gone when its whole range is a hole (``SEEK_DATA``) and its
        digest is not that of zeros (a sparse file's chunk of zeros is a hole, and right).
        Only versions whose file holds fewer bytes than their present chunks span are
        looked at (one ``lseek`` per chunk): nothing costs more than the measure in the
        usual case. Such a store came from a crash of an mtcfs that freed an evicted
        step's bytes before the rows said "missing" (issue 39), or a damaged disk; the
        first-read verification would catch it too, but only at the first read, and
        ``mtcfs verify`` would report mismatches. An unreadable data file is left to
        that verification."""
        out: list[tuple[Version, list[int]]] = []
        for v in self.versions.values():
            if not v.sealed or not v.chunks:
                continue
            if v.alloc >= (v.size if not v.missing else sum(
                    chunk_span(i, v.size, v.chunk_size)[1]
                    for i in range(len(v.chunks)) if i not in v.missing)):
                continue
            present = [i for i in range(len(v.chunks)) if i not in v.missing]
            try:
                fd = self._store.open_data(v.vid)
            except OSError:
                continue
            try:
                gone = [i for i in present if _is_hole(fd, *chunk_span(i, v.size, v.chunk_size))
                        and v.chunks[i] != zero_chunk_hash(chunk_span(i, v.size, v.chunk_size)[1])]
            except OSError:
                continue
            finally:
                os.close(fd)
            if gone:
                v.missing.update(gone)
                self.write(v)
                out.append((v, gone))
        return out

    def write(self, v: Version) -> None:
        """Write ``v``'s row (its persistent fields) in the caller's transaction."""
        base = (" ".join(v.base_chunks) if v.base_logged and v.base_chunks is not None
                and not v.sealed else None)
        self._host.db.execute(
            "INSERT OR REPLACE INTO versions(vid, ino, size, chunk_size, sealed, chunks, blake3,"
            " missing, backed_up, origin, base_chunks) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (v.vid, v.ino, v.size, v.chunk_size, int(v.sealed), " ".join(v.chunks), v.blake3,
             " ".join(str(i) for i in sorted(v.missing)), int(v.backed_up), v.origin, base))

    # ------------------------------------------------------------------ rewrites

    def note_dirty(self, v: Version, off: int, end: int) -> None:
        """Bytes ``[off, end)`` of open ``v`` are about to change (a write, or a resize
        from ``off`` to ``end`` or back; ``v.size`` not yet updated): add the chunks this
        touches to ``v.dirty`` (``Version.touched``).

        When ``v``'s row holds its base (``base_logged``), the chunks among them that the
        base has and ``rewrite_dirty`` does not yet list are committed there first, in one
        transaction of their own, before this returns and so before the caller changes a
        byte: a crash then never leaves a changed chunk whose stale base digest the reseal
        would keep. A change of chunks already listed, or only past the base, costs no
        transaction. Must not be called inside a transaction (its commit would come after
        the change).

        Raises:
            RuntimeError: called inside a transaction.
            sqlite3.Error: the rows could not be written (nothing is recorded; the caller
                must not change the bytes).
        """
        t = v.touched(off, end)
        if not t:
            return
        if v.base_logged and v.base_chunks is not None:
            new = [i for i in range(t.start, min(t.stop, len(v.base_chunks)))
                   if i not in v.dirty]
            if new:
                db = self._host.db
                if db.in_transaction:
                    raise RuntimeError("note_dirty inside a transaction: the dirty chunks "
                                       "would commit after the bytes change")
                with db.transaction():
                    for i in new:
                        db.execute("INSERT OR IGNORE INTO rewrite_dirty(vid, idx) VALUES (?,?)",
                                   (v.vid, i))
        v.dirty.update(t)

    def start_base(self, v: Version, chunks: tuple[str, ...]) -> None:
        """Open, unsealed ``v`` holds exactly the bytes whose first chunks' digests are
        ``chunks`` (a seal stopped part way: core/files.py): make them its base, so that
        its next seal hashes only the chunks past them and those written since. The base
        is recorded in its row (as :meth:`note_dirty` needs), committed before this
        returns, so before any byte changes. Must not be called inside a transaction (its
        commit would come later).

        Raises:
            RuntimeError: called inside a transaction (nothing changed).
            sqlite3.Error: the row could not be written.
        """
        db = self._host.db
        if db.in_transaction:
            raise RuntimeError("start_base inside a transaction")
        v.base_chunks = chunks
        v.base_logged = True
        v.dirty.clear()
        with db.transaction():
            db.execute("DELETE FROM rewrite_dirty WHERE vid=?", (v.vid,))
            self.write(v)

    def drop_base(self, v: Version) -> None:
        """Forget ``v``'s base (its seal then hashes every chunk, or it is sealed now):
        ``base_chunks``, ``dirty``, and if its row holds them, the row's base and its
        ``rewrite_dirty`` rows, in the caller's transaction or, outside one, in one of its
        own committed before this returns (so before the caller changes its bytes)."""
        if v.base_logged:
            db = self._host.db
            with db.transaction():
                db.execute("UPDATE versions SET base_chunks=NULL WHERE vid=?", (v.vid,))
                db.execute("DELETE FROM rewrite_dirty WHERE vid=?", (v.vid,))
        v.base_chunks = None
        v.base_logged = False
        v.dirty.clear()

    def alloc_vid(self) -> int:
        """A new version id: past every vid a row or a data file has (kv ``next_vid`` is
        only a lower bound, recovered at :meth:`load`)."""
        n = self._next_vid
        self._next_vid += 1
        return n

    # ------------------------------------------------------------------ new versions

    def new(self, ino: Inode, copy_from: Version | None = None,
            take_over: Version | None = None) -> Version:
        """A new version of ``ino``, registered and accounted: empty, a copy of
        ``copy_from`` (its data extents only: holes stay holes), or ``take_over``'s data
        file itself (a second name for it; the caller makes sure that nothing but read-only
        handles uses that version, which goes at :meth:`set_current` or, with handles, is
        left with no data: :meth:`_detach`). Not current yet: the caller makes it
        so with :meth:`set_current`.

        A version that starts from a sealed one's chunks (``base_chunks``) records them in
        its row, and :meth:`note_dirty` the chunks it changes, so that a crash's reseal
        hashes only those."""
        store, fds = self._store, self.fds
        v = Version(vid=self.alloc_vid(), ino=ino.ino, size=0, chunk_size=self.chunk_size)
        src = take_over or copy_from
        if take_over is not None:
            os.link(store.data_path(take_over.vid), store.data_path(v.vid))
            fds.adopt(v, store.open_data(v.vid))
        else:
            fd = store.open_data(v.vid, create=True)
            fds.adopt(v, fd)
            try:
                os.ftruncate(fd, 0)
                if copy_from is not None and copy_from.size:
                    sfd = fds.lease(copy_from)  # two descriptors in use: neither is evicted
                    dfd = fds.lease(v)
                    try:
                        copy_extents(sfd, dfd, copy_from.size)
                        for i, piece in (copy_from.preserved or {}).items():
                            # a reader of a shared file: its own bytes of the chunks changed
                            pwrite_all(dfd, piece, i * copy_from.chunk_size)
                    finally:
                        fds.unlease(v, dfd)
                        fds.unlease(copy_from, sfd)
            except BaseException:
                # The copy stopped part way (ENOSPC of the store's filesystem): v is not
                # registered, accounted or in a row; its partial data file goes now, not
                # at the next load (until then it held RAM that size= did not count).
                fds.drop(v)
                store.remove_data(v.vid, 0)
                raise
        if src is not None and src.size:
            v.size = src.size
            v.missing = set(src.missing)
            v.chunk_size = src.chunk_size
            if src.sealed and not src.missing:
                # its data file holds exactly those chunks: the seal hashes only the
                # chunks written since (Version.dirty)
                v.base_chunks = src.chunks
                v.base_logged = True
        self._host.budget.account(v)
        self.versions[v.vid] = v
        try:
            self.write(v)
        except BaseException:
            # (the store full: ENOSPC) not registered after all, its name gone
            del self.versions[v.vid]
            self._host.budget.remove(v)
            self.fds.drop(v)
            store.remove_data(v.vid, 0)
            raise
        if take_over is not None:
            self._share(take_over, v)
            if take_over.handles and take_over.preserved is None:
                self._detach(take_over)
        return v

    # ------------------------------------------------------------------ shared data files

    def _share(self, old: Version, v: Version) -> None:
        """``v`` took ``old``'s data file over (:meth:`new`). If ``old`` is pinned (read in
        a thread: an upload, a replication, a verification), it stays a reader of that file
        and ``v`` its writer, which preserves ``old``'s bytes of each chunk before changing
        it (:meth:`preserve`); a group of such versions is one :class:`SharedData`."""
        group = old.shared
        if old.pins:
            if group is None:
                group = old.shared = SharedData(writer=None)
            if old.preserved is None:
                old.preserved = {}
            if old not in group.readers:
                group.readers.append(old)
        elif group is not None:
            old.shared = None  # the writer leaves; freed or detached next
        if group is None:
            return
        group.writer = v if group.readers else None
        v.shared = group if group.readers else None
        self._account_file_holder(group)  # the file counts once, with its writer
        if old.pins and old is not group.readers[0]:
            self._host.budget.account(old)  # a writer that joins the readers: its copies

    def _account_file_holder(self, group: SharedData) -> None:
        """Account ``group``'s first reader again after its writer came or went: the
        reader that counts the shared file itself while the group has no writer
        (``RamBudget.account``)."""
        for r in group.readers[:1]:
            self._host.budget.account(r)

    def preserve_cost(self, v: Version, off: int, end: int) -> int:
        """Bytes :meth:`preserve` would copy for the same arguments (to reserve first)."""
        group = v.shared
        if group is None or group.writer is not v:
            return 0
        return sum(chunk_span(i, r.size, r.chunk_size)[1] for r, i in self._to_preserve(v, off, end))

    def _to_preserve(self, v: Version, off: int, end: int) -> list[tuple[Version, int]]:
        group = v.shared
        assert group is not None
        lo, hi = min(off, end), max(off, end)
        if lo == hi:
            return []
        cs = v.chunk_size
        out = []
        for r in group.readers:
            kept = r.preserved
            assert kept is not None
            for i in range(lo // cs, min((hi - 1) // cs + 1, chunk_count(r.size, cs))):
                if i not in kept and i not in r.missing:
                    out.append((r, i))
        return out

    def preserve(self, v: Version, off: int, end: int) -> None:
        """Bytes ``[off, end)`` of ``v``'s data file are about to change (a write, or a
        resize from ``off`` to ``end`` or back): if older versions still read that file
        (``v`` is the writer of a :class:`SharedData`), copy each chunk of theirs that the
        range touches and that they do not hold yet into their ``preserved`` copies first.
        On the loop, before the change; a no-op for any other version. Work and RAM: the
        chunks touched, not the file."""
        group = v.shared
        if group is None or group.writer is not v:
            return
        fd = self.fd(v)
        for r, i in self._to_preserve(v, off, end):
            c_off, length = chunk_span(i, r.size, r.chunk_size)
            assert r.preserved is not None
            r.preserved[i] = os.pread(fd, length, c_off)
            self._host.budget.account(r)

    def lose_shared(self, v: Version, off: int, end: int) -> list[tuple[Version, int]]:
        """Bytes ``[off, end)`` of ``v``'s data file are lost (a corrupt chunk, about to be
        punched out): the chunks of the older versions reading that file (``v`` the writer
        of a :class:`SharedData`) that the range touches and that they do not keep aside
        are the same bytes, so they become missing too (fetched again like any missing
        chunk, into their kept copies). Returns those ``(version, chunk index)``; empty for
        any other version. The caller forgets them in the chunk index and writes rows."""
        group = v.shared
        if group is None or group.writer is not v:
            return []
        lost = self._to_preserve(v, off, end)
        for r, i in lost:
            r.missing.add(i)
        return lost

    def unshare(self, v: Version, size: int) -> None:
        """Give writer ``v`` a data file of its own, ``size`` bytes of holes, in place of
        the one older versions still read (which keep it, unchanged): its truncation to 0,
        or the drop of its data (eviction), without a copy. A no-op for any other version.
        Its bytes are gone: the caller makes them missing or truncates them."""
        group = v.shared
        if group is None or group.writer is not v:
            return
        v.shared = None
        group.writer = None
        self._new_data_file(v, size, 0)  # its name only: the readers' names keep the file
        self._account_file_holder(group)  # now a reader counts the file

    def _leave_shared(self, v: Version) -> None:
        """``v`` is freed: it no longer reads or writes its group's file."""
        group = v.shared
        if group is None:
            return
        v.shared = None
        if v in group.readers:
            group.readers.remove(v)
            v.preserved = None
        if group.writer is v:
            group.writer = None
        if not group.readers and group.writer is not None:
            group.writer.shared = None
        self._account_file_holder(group)

    def _detach(self, old: Version) -> None:
        """``old``'s data file became a new version's (:meth:`new`, ``take_over``) while
        handles still hold ``old`` (none writable, no pin: nothing reads it in a thread).
        Their reads go to the file's current version (core/files.py: ``read``), so ``old``
        keeps no data: every chunk missing, out of the chunk index and the verifier, its
        descriptor closed and, once the caller's transaction commits, a new empty data file
        under its name (not counted twice against size=; nothing that reads it by vid sees
        the new version's bytes). A crash before that commit leaves ``old`` current with its
        data file intact."""
        host = self._host
        self._hand_over_last_copies(old)  # as its release would (the new version is unindexed)
        host.chunk_index.forget_version(old)
        host.verifier.drop(old.vid)
        self.fds.drop(old)
        old.missing = set(range(chunk_count(old.size, old.chunk_size)))
        self.write(old)
        host.db.after_commit(functools.partial(self._fresh_data, old))
        failpoint("core.detach_in_transaction")  # tests: a crash before that commit

    def _fresh_data(self, old: Version) -> None:
        """The second half of :meth:`_detach`, after the commit: ``old``'s name gets a new
        sparse data file of its size (nothing if ``old`` was freed meanwhile)."""
        if self.versions.get(old.vid) is not old:
            return
        # Mostly a second link to the new version's file (nothing freed); the only one if
        # that version went meanwhile, and then a large one is freed off the loop.
        self._new_data_file(old, old.size, old.alloc)

    def _new_data_file(self, v: Version, size: int, allocated: int) -> None:
        """``v``'s name gets a new data file of ``size`` bytes of holes, adopted and
        accounted; the file the name had loses that name (``allocated``: its bytes in RAM
        when this name was its last, for ``Store.remove_data``)."""
        self.fds.drop(v)
        self._store.remove_data(v.vid, allocated)
        fd = self._store.open_data(v.vid, create=True)
        self.fds.adopt(v, fd)
        os.ftruncate(fd, size)
        self._host.budget.account(v)

    def new_sealed(self, ino: int, size: int, chunk_size: int, chunks: tuple[str, ...],
                   file_hash: str, *, origin: int = -1, backed_up: bool = False,
                   data: bytes | None = None, keep_open: bool = True) -> Version:
        """A new sealed version of inode number ``ino`` whose chunks are all missing (a
        sparse data file of ``size`` bytes), registered; reads fault them in. ``data``: the
        whole content, inline (its chunks whose hash matches are written and not missing).
        ``keep_open``: its descriptor stays in ``fds``, and it is accounted and indexed;
        otherwise (an imported step) the descriptor is closed (a hole costs nothing)."""
        v = Version(vid=self.alloc_vid(), ino=ino, size=size, chunk_size=chunk_size,
                    sealed=True, chunks=chunks, blake3=file_hash,
                    missing=set(range(len(chunks))), backed_up=backed_up, origin=origin)
        fd = self._store.open_data(v.vid, create=True)
        if not keep_open:
            os.ftruncate(fd, v.size)
            os.close(fd)  # opened again when read (fdcache.py)
            self.versions[v.vid] = v
            self.write(v)
            return v
        self.fds.adopt(v, fd)
        os.ftruncate(fd, v.size)
        if data is not None and len(data) == v.size:
            for i, d in enumerate(chunks):
                off, length = chunk_span(i, v.size, v.chunk_size)
                piece = data[off:off + length]
                if blake3.blake3(piece).hexdigest() == d:
                    pwrite_all(fd, piece, off)
                    v.missing.discard(i)
        self._host.budget.account(v)
        self.versions[v.vid] = v
        self.write(v)
        self._host.chunk_index.add_version(v)
        return v

    def register(self, v: Version) -> None:
        """Register ``v`` again after :meth:`forget_all` (a namespace snapshot install
        keeps a version being written here): counted, its row written, its chunks indexed
        if sealed."""
        self.versions[v.vid] = v
        self._host.budget.add(v)
        self.write(v)
        if v.sealed:
            self._host.chunk_index.add_version(v)

    def forget_all(self) -> None:
        """Unregister every version (a namespace snapshot install, which also clears the
        budget and the chunk index). Descriptors of versions with handles or pins are kept
        open (they read on through them; :meth:`settle_kept` later), the others closed.
        Rows and data files are the caller's."""
        for v in self.versions.values():
            if v.handles or v.pins:
                # open handles and reads under way read on through their descriptor,
                # never evicted: its path may name other data after the install
                self.fds.keep(v)
            else:
                self.fds.drop(v)
        self.versions.clear()

    def settle_kept(self) -> None:
        """After an install: descriptors kept by :meth:`forget_all` of versions registered
        again become evictable. A version not registered again that still reads a shared
        data file (pinned: a reader of a rewrite that stays) keeps counting against size=
        (its preserved chunks), until its :meth:`release` takes it out of the group."""
        for v in self.fds.kept():
            if self.versions.get(v.vid) is v:
                self.fds.unkeep(v)
            elif v.shared is not None and v.preserved is not None:  # a reader
                group = v.shared
                w = group.writer
                if w is not None and self.versions.get(w.vid) is not w:
                    # its writer was forgotten too (sealed, not written here any more): the
                    # readers hold the file now, the first one counting it
                    w.shared = None
                    group.writer = None
                self._host.budget.add(v)
                self._host.budget.account(v)

    # ------------------------------------------------------------------ data

    def read_verified(self, v: Version, off: int, length: int,
                      digest: str | None) -> bytes | None:
        """Read ``length`` bytes at ``off`` of ``v`` and verify them against ``digest``
        (None: unverified).

        Thread-safe: the caller pins ``v`` on the loop so that its data file stays; the
        descriptor is leased for the read (fdcache.py). Returns None on a mismatch: a chunk
        whose hash does not match is never served.
        """
        data = read_data(self.fds, v, off, length)
        if digest is not None and chunk_hash(data) != digest:
            log.error("local chunk %s of version %d does not match its hash", digest[:16], v.vid)
            return None
        return data

    def fd(self, v: Version) -> int:
        """``v``'s data file descriptor, for use on the loop before the next ``await``
        (across one, or in a thread: ``fds.lease``)."""
        return self.fds.get(v)

    def drop_data(self, v: Version) -> None:
        """Drop a sealed ``v``'s data from RAM (eviction; in the caller's transaction): its
        last copies handed to :attr:`chunk_keeper`, its chunks forgotten by the index and
        all missing, its pages freed; it stays registered (faulted in again on read).

        Its row, every chunk missing, is written in the caller's transaction; its bytes go
        only once that transaction has committed (:meth:`MetaDB.after_commit`). A kill -9
        before the commit leaves the row and the bytes as they were; after it, chunks
        marked missing whose bytes may still be there (fetched again when read). Never a
        row that lists a chunk as present over bytes that are gone (issue 39: the data file
        was truncated before the commit, and a kill rolled the row back over zeros)."""
        self._hand_over_last_copies(v)
        # first, so that other local copies take over at once
        self._host.chunk_index.forget_version(v)
        v.missing = set(range(chunk_count(v.size, v.chunk_size)))
        self.write(v)
        self._host.db.after_commit(functools.partial(self._free_dropped, v))

    def _free_dropped(self, v: Version) -> None:
        """The second half of :meth:`drop_data`, after the commit: ``v``'s pages freed (its
        file handed to the older versions that still read it, if any). Nothing if ``v`` was
        freed meanwhile (its file goes with it), got a chunk back, or is read in a thread
        (its bytes stay, their chunks missing: fetched again when read). An error of the
        data file is logged: the committed rows are right, only RAM is not given back."""
        if self.versions.get(v.vid) is not v or v.pins or \
                len(v.missing) != chunk_count(v.size, v.chunk_size):
            return
        try:
            self.unshare(v, v.size)  # older versions still read its file: keep it for them
            fd = self.fd(v)
            os.ftruncate(fd, 0)
            os.ftruncate(fd, v.size)
        except OSError as exc:
            log.warning("evicted version %d: its data could not be freed (%s); its chunks "
                        "are missing and fetched again when read", v.vid, exc)
        self._host.budget.account(v)
        failpoint("core.evict_after_commit")  # tests: a crash with some files dropped

    # ------------------------------------------------------------------ freeing

    def set_current(self, ino: Inode, v: Version | None) -> None:
        """Make ``v`` the current version of ``ino`` (None: none); the one it replaces is
        no longer current and freed once nothing uses it. The caller writes ``ino``."""
        old = self.versions.get(ino.vid) if ino.vid is not None else None
        ino.vid = v.vid if v is not None else None
        if old is not None and old is not v:
            old.current = False
            self.release(old)

    def release(self, v: Version) -> None:
        """Free a version that is no longer current, once nothing uses it (no handles, no
        pins); a no-op otherwise. While it is being sealed its pages go at once and the
        seal frees the rest. The data file goes when the deletion of its row commits."""
        if self.versions.get(v.vid) is not v:
            # Replaced by a namespace snapshot install (core/jobns.py): the handles and reads
            # that held it read on through its descriptor; the last one closes it, and a
            # reader of a shared file leaves its group (settle_kept counted it).
            if not (v.handles or v.pins):
                if v.shared is not None:
                    counted = v.preserved is not None  # a reader: settle_kept counted it
                    self._leave_shared(v)
                    if counted:
                        self._host.budget.remove(v)
                self.fds.drop(v)
            return
        if v.current or v.handles or v.pins:
            return
        host = self._host
        if v.sealing is not None:
            # Only its seal (hashing in a worker thread) holds it: give its pages back now
            # (an unlinked file's space is free when unlink returns); the seal drops its
            # result and frees the rest.
            if not v.dropped:
                v.dropped = True
                if v.shared is None:  # (older versions still read a shared one)
                    os.ftruncate(self.fd(v), 0)
                host.budget.account(v)
            return
        del self.versions[v.vid]
        host.verifier.drop(v.vid)  # core/verifier.py: nothing left to verify
        self._hand_over_last_copies(v)
        self._leave_shared(v)
        self.fds.drop(v)
        allocated = v.alloc
        host.budget.remove(v)
        host.db.execute("DELETE FROM versions WHERE vid=?", (v.vid,))
        if v.base_logged:
            host.db.execute("DELETE FROM rewrite_dirty WHERE vid=?", (v.vid,))
        # The data file goes once the deletion of its row is committed (store/meta.py); a
        # large one is freed by the store's reaper thread (core/store/reaper.py).
        host.db.after_commit(functools.partial(self._store.remove_data, v.vid, allocated))
        failpoint("core.release_in_transaction")  # tests: a crash before that commit
        host.chunk_index.forget_version(v)

    def _hand_over_last_copies(self, v: Version) -> None:
        """Give :attr:`chunk_keeper` the chunks of ``v`` that no other local file holds and
        that it wants, before ``v``'s data goes."""
        keeper = self.chunk_keeper
        if keeper is None or not v.sealed:
            return
        for i, d in enumerate(v.chunks):
            if i in v.missing or not self._host.chunk_index.last_copy(d, v.vid):
                continue  # not here, or another local file holds it too
            try:
                if not keeper.wants(d):
                    continue
                off, length = chunk_span(i, v.size, v.chunk_size)
                keeper.keep(d, read_data(self.fds, v, off, length))  # keep() verifies it
            except Exception as exc:  # the keeper's problem must not stop a delete
                log.warning("could not hand chunk %s over before dropping it: %s", d[:16], exc)
