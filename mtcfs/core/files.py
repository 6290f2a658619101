"""Open files: the handle table, open, create, read, write, fsync, release, and the seal
on last close.

:class:`OpenFiles` owns

- ``handles``: fh -> :class:`~mtcfs.core.model.Handle` (or a directory's
  :class:`~mtcfs.core.model.DirHandle`, added by ``opendir`` through :meth:`OpenFiles.add_dir`)
  and the next fh number; ``Filesystem.handles`` is the same dict, read by others; only
  this class adds or removes entries;
- the writers' versions: which version a new writer writes to (copy-on-write, with holes
  kept, reserved against ``size=`` first), each version's ``writers``/``handles`` counts
  and each inode's ``opens``;
- the seal: a version is hashed (blake3 per chunk, in a worker thread under the CPU
  limiter, its chunks on up to ``hash_threads`` threads at once) when its last writer closes, and its row, the chunk index, the step registry
  (a commit marker, a changed step) and the observers (``sealed``) learn of it;
- ``last_write``: ``time.monotonic()`` of the application's last write (the background
  tiers yield to it); the RELEASEs in flight of unlinked files (:meth:`settle_releases`).

It holds the components it uses (the inode table, the version store, the RAM budget, the
verifier, the chunk index, the step registry, the counters and the CPU limiter) and reaches
the rest of the core only through :class:`Host`: the namespace log (a create, a fresh view
before open), fault-in, truncation, freeing an inode, publishing a sealed version
(scope=job), events and errors.

Units: offsets and sizes in bytes; ``fh`` numbers start at 1 and are never reused while
the core lives. Errors: :class:`~mtcfs.base.errors.FsError` (EBADF, EISDIR, EINVAL, EFBIG,
ENOSPC, EAGAIN, ESTALE, EIO), each where a method's docstring says.

Concurrency (docs/architecture.md): every method runs on the trio thread; a coroutine may
rely only on state it read after its last ``await``. The seal re-checks ``Version.gen``
after hashing.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Callable
from typing import Any, Protocol

import trio

from mtcfs.base import pools
from mtcfs.base.chunking import (DEFAULT_HASH_THREADS, HashResult, HashStopped, hash_fd,
                                 rehash_fd)
from mtcfs.base.errors import FsError
from mtcfs.base.failpoints import failpoint
from mtcfs.base.fileio import ShortWrite, pwrite_all
from mtcfs.base.ns_ops import Create
from mtcfs.base.space import FALLOC_FL_KEEP_SIZE, allocate
from mtcfs.core.budget import RamBudget
from mtcfs.core.capacity import MAX_FILE_SIZE
from mtcfs.core.chunkmap import ChunkIndex
from mtcfs.core.entries import Entries
from mtcfs.core.faultin import LocalChunks
from mtcfs.core.inodes import InodeTable
from mtcfs.core.model import Attr, DirHandle, Handle, Inode, Version
from mtcfs.core.ns_log import NamespaceLog
from mtcfs.core.passthrough import Passthrough
from mtcfs.core.records import Counters
from mtcfs.core.records import now_ns as _now_ns
from mtcfs.core.step_registry import StepRegistry
from mtcfs.core.store.fdcache import FdCache
from mtcfs.core.store.meta import MetaDB
from mtcfs.core.verifier import Verifier
from mtcfs.core.versions import VersionStore, hash_data, read_data

__all__ = ["RELEASE_WAIT_S", "Host", "OpenFiles"]

log = logging.getLogger("mtcfs.core.core")

#: A closed version up to this size is hashed on the FUSE loop itself: at ~2 GB/s that is
#: under 35 us, less than the hop to a worker thread and back (benchmarks/bench_namespace.py
#: "create", docs/benchmarks.md 6a). Larger ones are hashed in a worker thread.
INLINE_SEAL_BYTES = 64 * 1024

#: Seconds a reservation short of space, or statfs, waits for the RELEASE of unlinked files
#: whose last close(2) was seen (the kernel sends RELEASE after close returns).
RELEASE_WAIT_S = 1.0

#: Seconds a writer's open waits for fetches that still write chunks of the version it
#: would take over or copy (local writes of verified bytes: milliseconds, unless many
#: fetches queue for the CPU limiter); EAGAIN after that.
FILL_WAIT_S = 10.0

#: Seconds before a seal whose record could not be written (the store's filesystem full:
#: SQLITE_FULL) is tried again, doubled at each failure up to :data:`SEAL_RETRY_MAX_S`.
SEAL_RETRY_S = 0.5
SEAL_RETRY_MAX_S = 30.0


class Host(Protocol):
    """What :class:`OpenFiles` may use of the core (the ``Filesystem`` facade), read at
    each use (the daemon replaces ``ns_log`` in scope=job)."""

    @property
    def ns_log(self) -> NamespaceLog: ...
    @property
    def job_scope(self) -> bool: ...
    async def _ns_publish(self, ino: Inode, v: Version) -> None: ...
    def _emit(self, event: str, obj: Any) -> None: ...
    def report_error(self, msg: str) -> None: ...


class OpenFiles:
    """The open files of one core.

    Args:
        host: the core (see :class:`Host`).
        db: the store's metadata database.
        tree, vstore, budget, verifier, chunk_index, step_registry, entries: the core's
            components.
        chunks: the core's local chunks (fault-in before a read or a copy-on-write).
        counters: the core's counters (``bytes_written``, ``bytes_read``, ``seals``,
            ``enospc``).
        cpu_limiter: the limiter of the CPU pool (hashing at seal).
    """

    def __init__(self, host: Host, *, db: MetaDB, tree: InodeTable, vstore: VersionStore,
                 budget: RamBudget, verifier: Verifier, chunk_index: ChunkIndex,
                 step_registry: StepRegistry, entries: Entries, chunks: LocalChunks,
                 counters: Counters, cpu_limiter: trio.CapacityLimiter,
                 passthrough: Passthrough | None = None) -> None:
        self._host = host
        #: FUSE passthrough (core/passthrough.py): which handles the kernel serves itself.
        self.pt = passthrough or Passthrough(False)
        self.entries = entries
        self.chunks = chunks
        self.db = db
        self.tree = tree
        self.vstore = vstore
        self.budget = budget
        self.verifier = verifier
        self.chunk_index = chunk_index
        self.step_registry = step_registry
        self.counters = counters
        self.cpu_limiter = cpu_limiter
        #: Threads that hash one seal's chunks at once (mount option ``hash_threads``; the
        #: seal's own thread, under ``cpu_limiter``, and helpers of the ``hash`` pool).
        self.hash_threads = DEFAULT_HASH_THREADS
        self.versions: dict[int, Version] = vstore.versions
        self.inodes: dict[int, Inode] = tree.inodes
        self.fds: FdCache = vstore.fds
        #: fh -> open file or directory (``Filesystem.handles`` is this dict).
        self.handles: dict[int, Handle | DirHandle] = {}
        self._next_fh = 1
        #: The daemon stamps c/mtime at each WRITE it serves (set by the adapter at INIT
        #: when the kernel has no writeback cache, which would stamp them itself).
        self.stamp_writes = False
        #: Writable handles open in passthrough mode, all versions (while > 0 the budget
        #: watches the room left: RamBudget.watch).
        self._pt_writers = 0
        #: time.monotonic() of the last write() by the application (background tiers yield
        #: to it).
        self.last_write = 0.0
        self._nursery: trio.Nursery | None = None
        self._released: trio.Event | None = None
        #: vid -> (gen, size, hash, next delay) of a seal hashed but not recorded (the
        #: store full): tried again later without hashing again if the version is unchanged.
        self._unrecorded: dict[int, tuple[int, int, HashResult, float]] = {}
        #: vids of open versions made current in memory by an open whose transaction then
        #: failed (the store full): their rows (and their inode's) are written before any
        #: writer gets them (writable_version) or by their seal.
        self._rows_unwritten: set[int] = set()

    @property
    def job_scope(self) -> bool:
        """Whether other nodes change this namespace too (the host's)."""
        return self._host.job_scope

    def start(self, nursery: trio.Nursery, unsealed: list[Version]) -> None:
        """Seal in ``nursery`` from now on; start with ``unsealed`` (what a crash left)."""
        self._nursery = nursery
        for v in unsealed:
            nursery.start_soon(self._seal, v)

    # ------------------------------------------------------------------ the handle table

    def _add(self, make: Any) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = make(fh)
        return fh

    def add_dir(self, ino: int, entries: list[tuple[bytes, int]]) -> int:
        """Register an open directory (``opendir``) listing ``entries``; its fh."""
        return self._add(lambda fh: DirHandle(fh, ino, entries))

    def drop_dir(self, fh: int) -> None:
        """Forget open directory ``fh`` (``releasedir``); an unknown fh is ignored."""
        if isinstance(self.handles.get(fh), DirHandle):
            del self.handles[fh]

    def _releases_in_flight(self) -> list[Handle]:
        out = []
        for h in self.handles.values():
            if isinstance(h, Handle) and h.closed:
                ino = self.inodes.get(h.ino)
                if ino is not None and ino.nlink == 0:
                    out.append(h)
        return out

    async def settle_releases(self) -> None:
        """Wait (at most :data:`RELEASE_WAIT_S`) for the RELEASE of unlinked files already
        closed: their space comes back then. A handle is waited for once."""
        pending = self._releases_in_flight()
        if not pending:
            return
        with trio.move_on_after(RELEASE_WAIT_S):
            while any(self.handles.get(h.fh) is h for h in pending):
                if self._released is None:
                    self._released = trio.Event()
                await self._released.wait()
        for h in pending:
            h.closed = False  # still open past the wait (mapped, or held): not waited again

    def _released_one(self) -> None:
        ev, self._released = self._released, None
        if ev is not None:
            ev.set()

    # ------------------------------------------------------------------ files

    async def writable_version(self, ino: Inode, *, trunc: bool, in_place: bool = False
                               ) -> Version:
        """The version a new writer writes to: the open one, or a new copy-on-write one.

        The copy keeps holes as holes and is reserved against size= first (ENOSPC); a
        sealed version nothing but read-only handles uses is not copied: the new version
        takes its data file over (core/versions.py: ``new``). ``in_place``: a truncating
        writer takes such a version's data file over too and empties it, instead of
        starting a new file (the file's other handles pass through to that data file,
        and a passthrough open must use the same one: :meth:`_pt_fits`).
        """
        waits = 0
        while waits < 3:
            cur = self.versions[ino.vid] if ino.vid is not None else None
            while (cur is not None and cur.sealing is not None and not cur.sealed
                   and (not trunc or in_place) and not self.job_scope and not cur.writers):
                # Reopened right after its last close (fio lays a file out, closes it and
                # reopens it): the hash under way stops at its next chunk, and the chunks it
                # finished become the version's base; the version is written on (below) and
                # its next seal hashes only the other chunks and those written. A rewrite's
                # reseal (rehash_fd) does not stop: it ends, and the file is taken over.
                # (A truncating writer ``in_place`` too: it then empties this data file,
                # which the file's passthrough handles use, instead of starting another.)
                await self._stop_seal(cur)
                cur = self.versions[ino.vid] if ino.vid is not None else None
            if cur is not None and not cur.sealed and cur.sealing is None:
                if cur.vid in self._rows_unwritten:
                    # Its open failed at the commit: the rows still name the version it
                    # replaced, whose data file this one took over. Not a byte changes
                    # before they name this one (ENOSPC again if there is still no room).
                    with self.db.transaction():
                        self.vstore.write(cur)
                        self.tree.write(ino)
                    self._rows_unwritten.discard(cur.vid)
                if trunc and cur.size:
                    self._empty(cur)
                return cur
            if cur is not None and not trunc and cur.missing:
                raise FsError(errno.EAGAIN, "file is still being restored")
            if cur is not None and not trunc and cur.filling:
                # A fetch of a chunk another fetch has filled since still writes it (the
                # same bytes): once the file is taken over that write would land on the
                # writer's bytes. Let it end, then look again.
                await self._fills_done(cur)
                continue
            # Take the data file over unless the old version's seal or publish reads it:
            # read-only handles read the current version (read), so the old one keeps no
            # data (vstore._detach); a pinned one (read in a thread: an upload, a
            # replication, a peer's fetch in scope=job) reads on in the same file, and each
            # chunk is copied for it before the new version changes it (core/versions.py,
            # "Shared data files").
            # (Never a reader of a shared file: its data file holds a newer writer's bytes.)
            take = cur is not None and not trunc and self._may_take_over(cur)
            if trunc and in_place and cur is not None and self._in_place_ok(cur):
                return self._take_over_empty(ino, cur)
            need = cur.alloc if cur is not None and not trunc and not take else 0
            if need and cur is not None and not self.budget.fits(need, in_flight=False):
                cur.pins += 1  # not evicted while we wait for room
                try:
                    await self.budget.reserve(need)
                finally:
                    cur.pins -= 1
                waits += 1
                continue  # the state may have moved during the wait: look again
            try:
                with self.db.transaction():
                    v = self.vstore.new(ino, copy_from=None if trunc or take else cur,
                                          take_over=cur if take else None)
                    self.vstore.set_current(ino, v)
                    self.tree.write(ino)
            except (OSError, sqlite3.Error) as exc:
                if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                    self.counters.enospc += 1
                now = self.versions.get(ino.vid) if ino.vid is not None else None
                if now is not None and now is not cur and not now.sealed:
                    # The commit failed after the new version became current here (the
                    # rows still name the old one): it holds the old bytes; seal it as it
                    # is (its record writes the rows, tried again until there is room),
                    # and let no writer change it before they are written.
                    self._rows_unwritten.add(now.vid)
                    self.after_write_close(now)
                raise
            return v
        self.counters.enospc += 1
        raise FsError(errno.ENOSPC, "RAM tier full (no room for the copy-on-write copy)")

    @staticmethod
    def _may_take_over(cur: Version) -> bool:
        """Whether a new version may take sealed ``cur``'s data file over (a pinned ``cur``
        then shares it, its changed chunks copied aside): no writer, seal or publish of
        ``cur`` reads it, and it is not itself a reader of a shared file."""
        return (cur.sealed and cur.preserved is None
                and not (cur.writers or cur.sealing is not None or cur.publishing))

    @classmethod
    def _in_place_ok(cls, cur: Version) -> bool:
        """Whether a truncating writer may take sealed ``cur``'s data file over and empty
        it: nothing but read-only handles uses ``cur`` (no pin, seal, publish or fetch)."""
        return (cls._may_take_over(cur) and cur.shared is None and not cur.pins
                and not (cur.filling or cur.missing))

    def _take_over_empty(self, ino: Inode, cur: Version) -> Version:
        """A new version of ``ino`` that takes sealed ``cur``'s data file over, emptied
        (:meth:`writable_version` with ``in_place``)."""
        with self.db.transaction():
            v = self.vstore.new(ino, take_over=cur)
            self.vstore.set_current(ino, v)
            self.tree.write(ino)
        self._empty(v)
        return v

    def _empty(self, v: Version) -> None:
        """Truncate open version ``v`` to nothing for a truncating writer: its base dropped
        (committed before the bytes go), a data file of its own if older versions still
        read this one, the file emptied and accounted."""
        self.vstore.drop_base(v)  # committed before the bytes go
        self.vstore.unshare(v, 0)  # older versions still read its file
        os.ftruncate(self.vstore.fd(v), 0)
        v.size = 0
        v.missing.clear()
        v.gen += 1
        self.budget.account(v)
        self._own_change(v)

    async def _fills_done(self, v: Version) -> None:
        """Wait (:data:`FILL_WAIT_S` at most) until no fetch writes a chunk of ``v``.

        Raises:
            FsError: EAGAIN if one still does then.
        """
        if v.fill_done is None:
            v.fill_done = trio.Event()
        done = v.fill_done
        with trio.move_on_after(FILL_WAIT_S):
            await done.wait()
        if v.filling:
            raise FsError(errno.EAGAIN, "a chunk of the file is still being written by a fetch")

    async def _stop_seal(self, v: Version) -> None:
        """Ask the seal of closed ``v`` to stop (``Version.stop_seal``) and wait for it to
        end. If the caller does not go on to write ``v`` (cancelled meanwhile), ``v`` is
        sealed as its close asked."""
        assert v.sealing is not None
        v.stop_seal = True
        try:
            await v.sealing.wait()
        except BaseException:
            v.stop_seal = False  # a seal that stops from now on starts again (_seal)
            self.after_write_close(v)  # or it stopped already: seal v again now
            raise
        v.stop_seal = False  # the caller writes v before its next await

    async def open(self, num: int, flags: int, *, kernel: bool = False) -> tuple[int, bool]:
        """Open a file. Returns ``(fh, keep_cache)``.

        ``kernel``: the open comes from the kernel (FUSE), which may then read and write
        the data file itself (passthrough, :meth:`_pass_through`; the handle's
        ``backing_id``); the daemon's own opens never pass through.

        Raises:
            FsError: EISDIR, ENOENT, EAGAIN (writing a file still being restored); EBUSY
                when the file's other handles pass through to a data file this open
                cannot use, for longer than :data:`RELEASE_WAIT_S`.
        """
        if self._host.ns_log.replicated:
            await self._host.ns_log.fresh()
        ino = self.tree.get(num)
        if ino.is_dir:
            raise FsError(errno.EISDIR)
        if not ino.is_file:
            raise FsError(errno.EINVAL)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        trunc = bool(flags & os.O_TRUNC) and writable
        kernel = kernel and self.pt.on
        if kernel and writable:
            # The kernel will write without asking: make room now (budget.py: make_room;
            # past the room left, the data directory's own tmpfs answers ENOSPC).
            await self.budget.make_room()
            ino = self.tree.get(num)
        if kernel:
            # (O_RDONLY|O_TRUNC truncates too: it settles as a truncating writer would)
            rdonly_trunc = not writable and bool(flags & os.O_TRUNC)
            await self._pt_settle(ino, writable or rdonly_trunc, trunc or rdonly_trunc)
        if writable and not trunc:
            await self.chunks.fault_in_all(ino)
        elif kernel and ino.vid is not None:
            cur = self.versions[ino.vid]
            if not cur.missing and self.verifier.needs(cur):
                # Verified before the kernel gets the file (docs/reliability.md); a chunk
                # that cannot be verified or fetched leaves the open on the daemon's path.
                try:
                    if not await self.verifier.verify_version(cur):  # hash_threads at once
                        await self.chunks.fault_in_all(ino)  # a mismatch: fetched again
                except FsError:
                    pass
        if writable:
            v = await self.writable_version(
                ino, trunc=trunc, in_place=kernel and self.pt.live(ino.ino) is not None)
            v.writers += 1
            if trunc:
                ino.mtime_ns = ino.ctime_ns = _now_ns()
        else:
            if flags & os.O_TRUNC and self.versions[ino.vid].size:  # type: ignore[index]
                # Linux truncates on O_RDONLY|O_TRUNC too, and the kernel has already
                # dropped its own size to 0 (atomic_o_trunc): follow it. (The times first:
                # the truncation's seal records them; no writeback cache sends them later.)
                ino.mtime_ns = ino.ctime_ns = _now_ns()
                await self.truncate(ino, 0, None)
            v = self.versions[ino.vid]  # type: ignore[index]
        v.handles += 1
        ino.opens += 1
        fh = self._add(lambda fh: Handle(fh, ino.ino, v, writable, bool(flags & os.O_APPEND)))
        if kernel:
            self._pass_through(self._handle(fh), ino, v)
        # Close-to-open across nodes (scope=job): the kernel may keep its page cache only
        # if this node served the same version at its last open.
        keep = ino.last_open_vid == v.vid or not self.job_scope
        ino.last_open_vid = v.vid
        return fh, keep

    # ------------------------------------------------------------------ passthrough

    def _pt_fits(self, ino: Inode, writable: bool, trunc: bool) -> bool:
        """Whether an open of ``ino`` now would get the data file its passthrough handles
        use (the kernel allows no other, core/passthrough.py)."""
        live = self.pt.live(ino.ino)
        if live is None or ino.vid is None:
            return True
        cur = self.versions[ino.vid]
        if writable and self._writer_refusal(ino):
            return False  # it would take the daemon's path
        st = os.fstat(self.vstore.fd(cur))
        if (st.st_dev, st.st_ino) != live.dev_ino or cur.missing:
            return False
        if not writable or not cur.sealed:
            # (a truncating writer stops a seal under way and empties the file in place,
            # except in scope=job: writable_version)
            return not writable or (cur.shared is None and not (
                trunc and self.job_scope and cur.sealing is not None and not cur.writers))
        # (a take-over of an unpinned version: its data file, the one passed through)
        return self._in_place_ok(cur) or (not trunc and self._may_take_over(cur)
                                          and not cur.pins)

    def _pt_busy(self, ino: Inode) -> bool:
        """Some handle of ``ino`` that passes through is not released yet. (Not its FLUSH:
        the kernel sends one at every close(2), and its file stays open, on the backing
        file, while a dup, a forked child or a mapping still holds it; RELEASE comes after
        the last of them, as soon as the kernel dropped its hold.)"""
        live = self.pt.live(ino.ino)
        return live is not None and any(fh in self.handles for fh in live.handles)

    async def _pt_settle(self, ino: Inode, writable: bool, trunc: bool) -> None:
        """Before a kernel open of ``ino``: if its passthrough handles use a data file this
        open would not get, wait (:data:`RELEASE_WAIT_S`) for their RELEASE (the kernel
        dropped its hold at the last close(2) of each, a dup's, a child's or a mapping's
        included), so the next registration may be another file. Raises FsError EBUSY if
        they are still open then."""
        if self._pt_fits(ino, writable, trunc):
            return
        with trio.move_on_after(RELEASE_WAIT_S):
            while self._pt_busy(ino) and not self._pt_fits(ino, writable, trunc):
                if self._released is None:
                    self._released = trio.Event()
                await self._released.wait()
        if self._pt_fits(ino, writable, trunc):
            return
        if self._pt_busy(ino):
            raise FsError(errno.EBUSY, "the file is open in passthrough mode on a data file "
                                       "this open cannot share (docs/passthrough.md)")
        self.pt.forget_inode(ino.ino)

    def _pt_refusal(self, ino: Inode, v: Version, writable: bool) -> str:
        """Why handle ``v`` of ``ino``, just opened, must take the daemon's path ("" if it
        may pass through)."""
        if writable and (why := self._writer_refusal(ino)):
            return why
        if v.missing:
            return "chunks not here (still arriving, or dropped as damaged)"
        if self.verifier.needs(v):
            return "not verified (a chunk could not be verified or fetched)"
        if v.preserved is not None or (writable and v.shared is not None):
            return "its data file is shared with a version still being read"
        if not v.current or self.versions.get(v.vid) is not v:
            return "replaced while it was opened"
        if ino.opens - ino.pt_opens > 1:
            # (the kernel allows no passthrough open beside an open on its page cache)
            return "open on the daemon's path by another handle"
        return ""

    def _writer_refusal(self, ino: Inode) -> str:
        """Why a writer of ``ino`` must take the daemon's path whatever its version ("")."""
        if ino.mode & (stat.S_ISUID | stat.S_ISGID):
            # (the daemon clears them at each write it sees: FUSE_HANDLE_KILLPRIV_V2)
            return "writes to a set-user-ID or set-group-ID file"
        return ""

    def _pass_through(self, h: Handle, ino: Inode, v: Version) -> None:
        """Let the kernel serve handle ``h`` (just opened, of current ``v``) itself when
        nothing needs the daemon's path (:meth:`_pt_refusal`); sets ``h.backing_id``."""
        why = self._pt_refusal(ino, v, h.writable)
        if why:
            self.pt.count_daemon_path(why)
            return
        if h.writable and v.base_chunks is not None:
            # The writes will not be seen: the seal hashes every chunk.
            self.vstore.drop_base(v)
        h.backing_id = self.pt.attach(ino.ino, h.fh, self.vstore.fd(v), h.writable)
        if not h.backing_id:
            return
        ino.pt_opens += 1
        if h.writable:
            if not self._pt_writers and self._nursery is not None:
                self._nursery.start_soon(self.budget.watch, lambda: self._pt_writers > 0)
            self._pt_writers += 1
            v.pt_writers += 1
            v.pt_mtime = os.fstat(self.vstore.fd(v)).st_mtime_ns
            v.gen += 1  # a seal under way is overtaken (it re-checks gen and writers)
            self.last_write = time.monotonic()

    def mark_direct(self, fh: int) -> None:
        """Handle ``fh`` was opened FOPEN_DIRECT_IO (direct writes)."""
        h = self.handles.get(fh)
        if isinstance(h, Handle):
            h.direct = True

    def backing_id(self, fh: int) -> int:
        """The backing id of handle ``fh`` for the open's reply (0: the daemon serves it)."""
        h = self.handles.get(fh)
        return h.backing_id if isinstance(h, Handle) else 0

    def sync_from_store(self, v: Version) -> None:
        """Adopt what the kernel wrote into ``v``'s data file through passthrough handles:
        its length, and its times when the file changed since last looked at."""
        st = os.fstat(self.vstore.fd(v))
        if st.st_size != v.size:
            v.size = st.st_size
            v.gen += 1
        if st.st_mtime_ns != v.pt_mtime:
            v.pt_mtime = st.st_mtime_ns
            v.gen += 1
            ino = self.inodes.get(v.ino)
            if ino is not None and ino.vid == v.vid:
                ino.mtime_ns = st.st_mtime_ns
                ino.ctime_ns = max(ino.ctime_ns, st.st_ctime_ns)

    def _own_change(self, v: Version) -> None:
        """The daemon changed ``v``'s data file itself (a truncate) while the kernel may
        write it: that change's time is not the kernel's (the caller set the inode's)."""
        if v.pt_writers:
            v.pt_mtime = os.fstat(self.vstore.fd(v)).st_mtime_ns

    def times_to_store(self, v: Version, ino: Inode) -> None:
        """``ino``'s times were set (utimes, truncate) while the kernel writes ``v``'s data
        file: give the file the same times, so that only later writes move them."""
        fd = self.vstore.fd(v)
        os.utime(fd, ns=(ino.atime_ns, ino.mtime_ns))
        v.pt_mtime = os.fstat(fd).st_mtime_ns

    def live_size(self, vid: int) -> int:
        """Version ``vid``'s size as a stat(2) must show it (read from the data file while
        the kernel writes it through passthrough handles)."""
        v = self.versions[vid]
        if v.pt_writers:
            self.sync_from_store(v)
        return v.size

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
                     gid: int, *, kernel: bool = False) -> tuple[int, Attr]:
        """Create ``name`` in ``parent`` and open it (``kernel``: as :meth:`open`)."""
        if kernel and self.pt.on:
            await self.budget.make_room()  # (as open)
        res = await self._host.ns_log.submit(Create(
            parent=self.tree.dir(parent).ino, name=name, mode=mode, uid=uid, gid=gid,
            excl=bool(flags & os.O_EXCL)))
        ino = self.tree.get(res["ino"])
        if res["existed"] or self.job_scope:
            # An existing file opens as by open(2); scope=job: a new file's first writer
            # starts an empty local version (O_TRUNC) over the published empty one.
            fh, _ = await self.open(ino.ino, flags if res["existed"] else flags | os.O_TRUNC,
                                    kernel=kernel)
            ino.lookups += 1
            return fh, self.tree.attr(ino)
        v = self.versions[ino.vid]  # type: ignore[index]  # the new, open, empty version
        v.writers += 1
        v.handles += 1
        ino.opens += 1
        ino.lookups += 1
        fh = self._add(lambda fh: Handle(fh, ino.ino, v, True, bool(flags & os.O_APPEND)))
        if kernel and self.pt.on:
            self._pass_through(self._handle(fh), ino, v)
        return fh, self.tree.attr(ino)

    def _handle(self, fh: int) -> Handle:
        h = self.handles.get(fh)
        if not isinstance(h, Handle):
            raise FsError(errno.EBADF)
        return h

    async def read(self, fh: int, off: int, size: int) -> bytes:
        """Read up to ``size`` bytes at ``off``; waits for missing chunks (fault-in).

        Served with ``pread``: a read-only mapping would skip one copy but costs a page
        fault per page on first touch (slower on the measured VM, docs/benchmarks.md) and
        makes the store's pages count in the daemon's RSS, the OOM killer's measure.
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
        if v.missing or self.verifier.needs(v):  # fault-in, or verify first (core/verifier.py)
            v.pins += 1  # a version this handle does not hold must outlive the await
            try:
                await self.chunks.fault_in(v, off, size)
                data = self._pread(v, size, off)
            finally:
                v.pins -= 1
                self.vstore.release(v)  # no-op unless rewritten meanwhile
        else:
            data = self._pread(v, size, off)
        self.counters.bytes_read += len(data)
        return data

    def _pread(self, v: Version, size: int, off: int) -> bytes:
        if v.preserved is not None:  # a replaced, pinned version (a deleted file's handle)
            return read_data(self.fds, v, off, size)
        return os.pread(self.vstore.fd(v), size, off)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self._handle(fh)
        if not h.writable:
            raise FsError(errno.EBADF)
        v = h.version
        if v.sealed:
            v = await self._reopen_sealed(h)
        if h.append:
            off = v.size
        end = off + len(buf)
        if end > MAX_FILE_SIZE:
            raise FsError(errno.EFBIG, f"files are at most {MAX_FILE_SIZE} bytes")
        need = self.budget.new_bytes(v, off, end) + self.vstore.preserve_cost(v, off, end)
        if need:
            await self.budget.reserve(need)
        self.vstore.preserve(v, off, end)  # for older versions that read its data file
        self.vstore.note_dirty(v, off, end)  # committed before the bytes change
        try:
            pwrite_all(self.vstore.fd(v), buf, off)  # (a short count is never the whole)
        except OSError as exc:
            n = exc.written if isinstance(exc, ShortWrite) else 0
            if n:
                # Part of it was written: the version is as long as the bytes it holds
                # (its seal hashes v.size bytes of the data file), never the request's end.
                v.size = max(v.size, off + n)
                v.gen += 1
            self.budget.account(v)
            self._forget_kernel_copy(v)
            if exc.errno == errno.ENOSPC:
                self.counters.enospc += 1
                raise FsError(errno.ENOSPC, "store directory is full") from None
            raise
        if end > v.size:
            v.size = end
        self.budget.account(v)
        v.gen += 1
        if self.stamp_writes and not h.direct:
            # No writeback cache (beside passthrough) stamps the time: the daemon does, as
            # a local filesystem would at each write.
            ino = self.inodes.get(v.ino)
            if ino is not None:
                ino.mtime_ns = ino.ctime_ns = _now_ns()
        self.counters.bytes_written += len(buf)
        self.last_write = time.monotonic()
        return len(buf)

    def _forget_kernel_copy(self, v: Version) -> None:
        """A write into current ``v`` failed: the kernel's writeback cache holds the bytes
        (and the size) the writer asked for, which the store does not have. In scope=job
        the file gets a new kernel inode number (:meth:`InodeTable.renumber`; its entries
        are never cached there), so the next open starts from what the store holds instead
        of those pages. (scope=node: the kernel keeps them until it forgets the inode,
        docs/reliability.md.)"""
        ino = self.inodes.get(v.ino)
        if self.job_scope and ino is not None and ino.vid == v.vid:
            self.tree.renumber(ino)

    async def flush(self, fh: int, final: bool = True) -> None:
        """close(2) of one descriptor. Seal happens at release of the last writer, except in
        scope=job: there close(2) of the last writer seals and publishes the version
        job-wide before it returns (close-to-open consistency, docs/consistency.md).

        ``final``: False when the adapter knows the process that opened the file still holds
        a descriptor of it (this close came from a child that inherited one): then nothing
        is sealed.

        Raises:
            FsError: EIO when the version could not be published (the namespace service is
                unreachable past its deadline); ENOSPC when this node's store had no room
                for the seal's rows or its publish. Either way it is tried again later.
        """
        h = self._handle(fh)
        if final:
            h.closed = True  # its RELEASE follows (settle_releases)
            if h.backing_id:
                self._released_one()  # an open waiting in _pt_settle looks again
        if not self.job_scope or not h.writable or not final:
            return
        v = h.version
        if v.pt_writers and self.versions.get(v.vid) is v:
            self.sync_from_store(v)
        if v.writers == 1 and not v.sealed:
            if v.sealing is not None:
                await v.sealing.wait()
            if not v.sealed and v.writers == 1:
                await self._seal(v, allow_writers=1)
            if v.seal_error:
                raise FsError(v.seal_errno or errno.EIO, v.seal_error)

    def handle_ino(self, fh: int) -> int:
        """The inode number of handle ``fh``'s file. Raises: FsError: EBADF."""
        return self._handle(fh).ino

    def kernel_inos(self, fh: int) -> set[int]:
        """The inode numbers the kernel may know the file of handle ``fh`` by."""
        h = self._handle(fh)
        ino = self.inodes.get(h.ino)
        out = {h.ino}
        if ino is not None and ino.kid:
            out.update(k for k, n in self.tree.aliases.items() if n == h.ino)
        return out

    async def _reopen_sealed(self, h: Handle) -> Version:
        """A write through a handle whose version was sealed at an earlier close(2) of a
        duplicate descriptor (scope=job): continue in a new copy-on-write version."""
        old = h.version
        ino = self.tree.get(h.ino)
        if ino.vid != old.vid:
            raise FsError(errno.ESTALE, "the file was replaced since this descriptor was opened")
        v = await self.writable_version(ino, trunc=False)
        if h.version is not old:
            return h.version  # reopened by another write of this handle meanwhile
        old.writers -= 1
        old.handles -= 1
        v.writers += 1
        v.handles += 1
        h.version = v
        self.vstore.release(old)
        return v

    async def truncate(self, ino: Inode, size: int, fh: int | None) -> None:
        """Set the size of file ``ino`` to ``size`` bytes, through handle ``fh`` when it is
        a writer of the current version, else as a short-lived writer of its own (holes
        cost nothing). Raises FsError: EFBIG; EIO when a missing chunk cannot be fetched."""
        if size > MAX_FILE_SIZE:
            raise FsError(errno.EFBIG, f"files are at most {MAX_FILE_SIZE} bytes")
        h = self.handles.get(fh) if fh is not None else None
        if isinstance(h, Handle) and h.writable and h.version.vid == ino.vid:
            v = h.version
        else:
            # truncate(2) by path: a short-lived writer of its own.
            if size:
                await self.chunks.fault_in_all(ino)
            # (emptied in place while its handles pass through to its data file, as an
            # O_TRUNC open is: a new data file would leave every later open EBUSY or EIO)
            v = await self.writable_version(
                ino, trunc=(size == 0),
                in_place=size == 0 and self.pt.live(ino.ino) is not None)
            v.writers += 1
            try:
                await self._resize(v, size)
            finally:
                v.writers -= 1
            self.after_write_close(v)
            return
        await self._resize(v, size)

    async def _resize(self, v: Version, size: int) -> None:
        # Growing adds a hole, which costs nothing against size= (core/budget.py: account).
        if v.pt_writers:
            self.sync_from_store(v)
        if v.missing:
            await self.chunks.fault_in(v, 0, v.size)
        if size == 0:
            # Older versions still read its data file: they keep it, v gets an empty one
            # (as an O_TRUNC open: no copy of their chunks).
            self.vstore.unshare(v, 0)
        need = self.vstore.preserve_cost(v, v.size, size)
        if need:
            await self.budget.reserve(need)
        self.vstore.preserve(v, v.size, size)  # for older versions that read its data file
        self.vstore.note_dirty(v, v.size, size)  # committed before the bytes change
        os.ftruncate(self.vstore.fd(v), size)
        v.size = size
        v.gen += 1
        self.budget.account(v)
        self._own_change(v)

    async def fallocate(self, fh: int, mode: int, off: int, length: int) -> None:
        """fallocate(2) through handle ``fh``: ``mode`` 0 gives ``[off, off+length)`` its
        pages in the RAM tier now and grows the file to ``off+length`` if it is shorter (the
        new bytes read as zeros, as after ftruncate); ``FALLOC_FL_KEEP_SIZE`` gives pages to
        the part of the range inside the file and changes no size. No byte of the file
        changes either way (docs/usage.md, "fallocate"); mtime and ctime are stamped, as
        tmpfs does.

        The pages count against ``size=`` at once: a range past the room left fails here
        with ENOSPC (after eviction, as a write's would), not at a later write. Where the
        store's filesystem has no fallocate the size still changes and the pages come at
        the first write.

        Raises:
            FsError: EBADF (not open for writing); EOPNOTSUPP (any other mode: punching
                holes, zeroing, collapsing or inserting ranges); EINVAL (``off`` < 0 or
                ``length`` <= 0); EFBIG; ENOSPC.
        """
        h = self._handle(fh)
        if not h.writable:
            raise FsError(errno.EBADF)
        if mode & ~FALLOC_FL_KEEP_SIZE:
            raise FsError(errno.EOPNOTSUPP, f"fallocate mode {mode:#x} is not supported")
        if off < 0 or length <= 0:
            raise FsError(errno.EINVAL)
        end = off + length
        if end > MAX_FILE_SIZE:
            raise FsError(errno.EFBIG, f"files are at most {MAX_FILE_SIZE} bytes")
        v = h.version
        if v.sealed:
            v = await self._reopen_sealed(h)
        if v.pt_writers:
            self.sync_from_store(v)
        grow = not mode & FALLOC_FL_KEEP_SIZE and end > v.size
        hi = end if grow else min(end, v.size)  # (KEEP_SIZE: nothing past the end)
        if hi > off:
            need = self.budget.new_bytes(v, off, hi)
            if need:
                await self.budget.reserve(need)
            try:
                # First the pages (past the end too, where it grows), then the size: a
                # range that does not fit changes nothing (tmpfs undoes its own part).
                allocate(self.vstore.fd(v), off, hi - off)
            except OSError as exc:
                self.budget.account(v)
                if exc.errno == errno.ENOSPC:
                    self.counters.enospc += 1
                    raise FsError(errno.ENOSPC, "store directory is full") from None
                raise
            self.budget.account(v)
        if grow:
            await self._resize(v, end)  # (zeros past the old end: no byte changes)
        ino = self.inodes.get(v.ino)
        if ino is not None and ino.vid == v.vid:
            ino.mtime_ns = ino.ctime_ns = _now_ns()
            if v.pt_writers:
                self.times_to_store(v, ino)

    async def fsync(self, fh: int, datasync: bool) -> None:
        h = self._handle(fh)
        if h.writable and not h.version.sealed:
            if h.version.pt_writers:
                self.sync_from_store(h.version)
            # Record the length reached so far (the bytes are already in the data file), and
            # the times the kernel sent just before (its writeback cache flushes them ahead
            # of FSYNC; a file being written keeps them in memory until its seal).
            ino = self.inodes.get(h.ino)
            with self.db.transaction():
                self.vstore.write(h.version)
                if ino is not None and ino.vid == h.version.vid and self.tree.has_row(ino):
                    self.tree.write(ino)

    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if not isinstance(h, Handle):
            return
        v = h.version
        v.handles -= 1
        ino = self.inodes.get(h.ino)
        if self.pt.detach(fh):
            if ino is not None:
                ino.pt_opens -= 1
            if h.writable:
                v.pt_writers -= 1
                self._pt_writers -= 1
                if self.versions.get(v.vid) is v and not v.dropped and not v.sealed:
                    self.sync_from_store(v)  # what the kernel wrote: the seal hashes it
                    v.gen += 1
                    self.budget.account(v)
                if self.budget.data_full():
                    # The kernel refused this writer's bytes past size= (ENOSPC at its
                    # write(2)): the daemon does not see that refusal, only the full
                    # data tmpfs the writer leaves; counted as the daemon's own are.
                    self.counters.enospc += 1
                self.last_write = time.monotonic()
        if h.writable:
            v.writers -= 1
            if v.writers == 0 and v.sealed and v.sealing is None and ino is not None \
                    and ino.vid == v.vid:
                # scope=job sealed it at close(2), with this writer still holding it: a
                # step it completes is only now sealed for the tiers, which saw 'sealed'
                # and 'committed' too early to act on them
                self._host._emit("closed", v)
        if ino is not None:
            ino.opens -= 1
            self.entries.maybe_free_inode(ino)  # an unlinked file's space comes back here
        if h.writable:
            self.after_write_close(v)
        self.vstore.release(v)
        self._released_one()

    def after_write_close(self, v: Version) -> None:
        if not v.current or self.versions.get(v.vid) is not v:
            return  # freed (unlinked) or replaced: nothing to seal
        if v.writers == 0 and not v.sealed and v.sealing is None and self._nursery is not None:
            if v.size <= INLINE_SEAL_BYTES and not self.job_scope:
                self._seal_inline(v)  # nothing to await: no task of its own
                return
            v.sealing = trio.Event()
            self._nursery.start_soon(self._seal, v)

    def _seal_inline(self, v: Version) -> None:
        """:meth:`_seal` of a small closed version in scope=node, done before returning:
        hashed on the loop, no publish to wait for."""
        t0 = time.monotonic()
        try:
            res = hash_fd(self.vstore.fd(v), v.size, v.chunk_size)
        except OSError as exc:
            v.seal_error = str(exc)
            self._host.report_error(f"seal of version {v.vid} failed: {exc}")
            return
        try:
            ino = self._record_seal(v, res, t0)
        except (OSError, sqlite3.Error) as exc:
            self._seal_later(v, v.gen, v.size, res, exc)
            return
        self._announce_seal(v, ino)

    def _seal_later(self, v: Version, gen: int, size: int, res: HashResult,
                    exc: BaseException) -> None:
        """The seal of ``v`` (hashed: ``res`` for ``gen``/``size``) could not be recorded
        (``_record_seal`` undid it: the store's filesystem full, SQLITE_FULL): report it
        and try again later (:data:`SEAL_RETRY_S`, doubling), reusing ``res`` if ``v`` has
        not changed. Never fatal: the file stays open-unsealed ("writing") meanwhile, its
        bytes as written."""
        delay = self._unrecorded.get(v.vid, (0, 0, res, SEAL_RETRY_S))[3]
        self._unrecorded[v.vid] = (gen, size, res, min(delay * 2, SEAL_RETRY_MAX_S))
        v.seal_error = str(exc)
        v.seal_errno = getattr(exc, "errno", None) or 0  # (ENOSPC: SQLITE_FULL)
        self._host.report_error(f"seal of version {v.vid} could not be recorded ({exc}); "
                                f"tried again in {delay:g} s")
        if self._nursery is not None:
            self._nursery.start_soon(self._seal_again, v, delay)

    async def _seal_again(self, v: Version, delay: float) -> None:
        await trio.sleep(delay)
        if self.versions.get(v.vid) is not v or v.sealed:
            self._unrecorded.pop(v.vid, None)
            return
        self.after_write_close(v)

    # ------------------------------------------------------------------ seal

    async def _seal(self, v: Version, allow_writers: int = 0) -> None:
        """Hash a closed version into chunks off the FUSE loop and record its manifest.

        ``allow_writers``: writers that may still hold the version (1 when close(2) of the
        last writable descriptor seals it before its RELEASE, in scope=job)."""
        t0 = time.monotonic()
        if v.sealing is None:
            v.sealing = trio.Event()
        done = v.sealing
        cancelled = stopped = failed = False
        try:
            while True:
                gen, size = v.gen, v.size
                kept = self._unrecorded.get(v.vid)
                if kept is not None and kept[:2] == (gen, size):
                    if v.vid not in self.versions or v.dropped or v.writers > allow_writers:
                        return
                    res = kept[2]  # hashed before, not recorded (the store was full)
                    break
                # A rewrite hashes only the chunks written since it started from a sealed
                # version (docs/architecture.md, "Rewrites"); its whole-file hash is
                # computed when asked (file_hash).
                # Up to hash_threads chunks at once, each byte read and hashed once; the
                # whole-file hash of more than one chunk is computed when asked too.
                # Background work (base/background.py) unless a close(2) waits for it.
                pool = "hash-now" if allow_writers else "hash"
                fn: Callable[..., HashResult] = functools.partial(
                    hash_fd, threads=self.hash_threads, pool=pool)
                args: tuple[Any, ...] = (size, v.chunk_size,
                                           self._seal_stopper(v) if size > INLINE_SEAL_BYTES
                                           else None)
                if v.base_chunks is not None:
                    fn = functools.partial(rehash_fd, threads=self.hash_threads, pool=pool)
                    args = (size, v.chunk_size, v.base_chunks, set(v.dirty))
                try:
                    fd = self.fds.lease(v)  # open until hashed, whatever the loop opens
                    try:
                        if size <= INLINE_SEAL_BYTES:  # cheaper than the hop to a thread
                            res = fn(fd, *args)
                        elif allow_writers:
                            res = await trio.to_thread.run_sync(
                                fn, fd, *args, limiter=self.cpu_limiter)
                        else:
                            res = await pools.run_background(
                                fn, fd, *args, limiter=self.cpu_limiter)
                    finally:
                        self.fds.unlease(v, fd)
                except HashStopped as stop:
                    # reopened for writing (writable_version): what was hashed is its base
                    self.counters.seal_bytes_hashed += stop.hashed
                    stopped = True
                    if (v.vid in self.versions and not v.dropped and v.gen == gen
                            and v.size == size and not v.writers):
                        self.vstore.start_base(v, stop.chunks)
                    return
                except OSError as exc:
                    if v.dropped:
                        return  # freed while hashing (core/versions.py: VersionStore.release)
                    v.seal_error = str(exc)
                    self._host.report_error(f"seal of version {v.vid} failed: {exc}")
                    failed = True  # not tried again at once (it would fail the same way)
                    return
                if v.vid not in self.versions or v.dropped:
                    return
                if v.writers > allow_writers:
                    return  # reopened for writing; the next close seals again
                if v.gen != gen or v.size != size:
                    continue
                break
            try:
                ino = self._record_seal(v, res, t0)
            except (OSError, sqlite3.Error) as exc:
                # (the daemon used to die here: an error of a task ends its nursery)
                self._seal_later(v, gen, size, res, exc)
                failed = True
                return
            if self.job_scope and ino is not None and ino.nlink > 0:
                # scope=job: commit markers are detected when the publish op is applied
                await self._host._ns_publish(ino, v)
            self._announce_seal(v, ino)
        except trio.Cancelled:
            cancelled = True  # the daemon stops: the next start seals it (core: _repair)
            raise
        finally:
            v.sealing = None
            done.set()
            if v.writers == 0 and not v.sealed and v.vid in self.versions and v.current \
                    and not allow_writers and not cancelled and not failed \
                    and not (stopped and v.stop_seal):
                self.after_write_close(v)
            self.vstore.release(v)

    @staticmethod
    def _seal_stopper(v: Version) -> Callable[[], bool]:
        """``hash_fd``'s ``stop`` for the seal of ``v`` (called in the hashing thread before
        each chunk; failpoint ``seal.chunk`` pauses there)."""
        def stop() -> bool:
            failpoint("seal.chunk")
            return v.stop_seal
        return stop

    def _announce_seal(self, v: Version, ino: Inode | None) -> None:
        """Tell the observers that ``v`` is sealed and, in scope=node, commit the step whose
        marker it is (in scope=job that happens when its publish op is applied), if ``v`` is
        still ``ino``'s current version."""
        if ino is not None and ino.vid == v.vid:
            self._host._emit("sealed", v)
            if not self.job_scope:
                try:
                    with self.db.transaction():
                        self.step_registry.commit_by_marker(ino)
                except (OSError, sqlite3.Error) as exc:
                    self._host.report_error(f"commit by marker {ino.name!r} failed: {exc}")

    def _record_seal(self, v: Version, res: HashResult, t0: float) -> Inode | None:
        """Record hashed ``v`` as sealed (``res``: its chunks and whole-file digest): its row
        and its inode's (the times the writeback cache sent meanwhile), the chunk index,
        the counters, a changed step. Returns its inode, if it still has one.

        Raises:
            OSError, sqlite3.Error: the rows could not be written (ENOSPC: the store's
                filesystem is full); ``v`` is then as it was, unsealed with its base.
        """
        before = (v.seal_error, v.chunks, v.blake3, v.backed_up, v.base_chunks,
                  v.base_logged, set(v.dirty))
        v.sealed = True
        v.seal_error = ""  # an earlier seal's failure is over
        v.chunks = res.chunks
        v.blake3 = res.file_hash  # "" after a rewrite: computed when asked (file_hash)
        v.backed_up = False
        ino = self.inodes.get(v.ino)
        try:
            with self.db.transaction():
                self.vstore.drop_base(v)  # its rewrite_dirty rows too
                self.vstore.write(v)
                if ino is not None:
                    self.tree.write(ino)
        except BaseException:
            # nothing was written: undo, or v looked sealed (backed up, replicated) with
            # rows that say otherwise and chunks in no index
            v.sealed = False
            (v.seal_error, v.chunks, v.blake3, v.backed_up, v.base_chunks, v.base_logged,
             dirty) = before
            v.dirty.clear()
            v.dirty.update(dirty)
            raise
        self._unrecorded.pop(v.vid, None)
        self._rows_unwritten.discard(v.vid)
        self.counters.seal_bytes_hashed += res.hashed
        self.chunk_index.add_version(v)
        self.counters.seals += 1
        self.counters.seal_seconds.observe(time.monotonic() - t0)
        v.sealing = None
        if ino is not None:
            self.step_registry.changed(ino)
        self.budget.after_seal()  # the headroom, once passthrough writers made room
        return ino

    async def file_hash(self, v: Version) -> str:
        """The hex blake3 of sealed ``v``'s whole content (``user.mtcfs.blake3``).

        A rewrite's seal hashes only the chunks it changed and leaves ``v.blake3`` empty;
        the first ask computes it here (missing chunks faulted in first, as a read would),
        records it in the version's row and counts the bytes (``file_hash_bytes``).

        Raises:
            FsError: EIO from the fault-in of a chunk this node does not hold.
        """
        if v.blake3:
            return v.blake3
        v.pins += 1  # stays while hashed, even if replaced meanwhile
        try:
            await self.chunks.fault_in(v, 0, v.size)
            chunks = v.chunks
            # Through read_data: a reopen during the hash may take the file over (v is
            # pinned, so it becomes a reader and its changed chunks are kept aside).
            digest = await trio.to_thread.run_sync(hash_data, self.fds, v,
                                                   limiter=self.cpu_limiter)
            self.counters.file_hash_bytes += v.size
        finally:
            v.pins -= 1
            self.vstore.release(v)
        if v.chunks == chunks and not v.dropped:
            v.blake3 = digest
            if self.versions.get(v.vid) is v:
                try:
                    with self.db.transaction():
                        self.vstore.write(v)
                except (OSError, sqlite3.Error) as exc:  # (the store full) a cache only
                    log.warning("blake3 of version %d not recorded: %s", v.vid, exc)
        return digest

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
