"""The filesystem core: namespace, handles, versions, seal, steps, capacity.

:class:`Filesystem` is the facade the FUSE adapter and the daemon call: one method per FUSE
operation (the namespace ones in :mod:`~mtcfs.core.namespace`, its one base class), the
lifecycle, events, errors. The other tiers never get it: they get ``tier_api``
(:class:`~mtcfs.core.tier_api.TierApi`, the one object every port of
:mod:`mtcfs.core.ports` is). Behind both, components that own their state, built and
joined here (the core's own composition): :class:`~mtcfs.core.inodes.InodeTable`
(``tree``: the inodes, directory entries and kernel aliases, and their rows; ``inodes``
and ``aliases`` here are its dicts: only it adds or removes entries),
:class:`~mtcfs.core.versions.VersionStore` (``vstore``: the versions, their rows, data
files and descriptors; ``versions`` and ``fds`` here are its),
:class:`~mtcfs.core.step_registry.StepRegistry` (``step_registry``: the committed steps
and their rows; ``steps`` here is its dict), :class:`~mtcfs.core.entries.Entries`
(``entries``: the change of one directory entry each op makes),
:class:`~mtcfs.core.files.OpenFiles` (``open_files``: the handle table, writers' versions
and the seal; ``handles`` here is its dict), :class:`~mtcfs.core.budget.RamBudget`
(``budget``), :class:`~mtcfs.core.faultin.LocalChunks` (``chunks``: fault-in, with its
``fetcher`` and ``verifier``, and corrupt chunks' repair),
:class:`~mtcfs.core.chunkmap.ChunkIndex` (``chunk_index``),
:class:`~mtcfs.core.eviction.Eviction` (``eviction``: the policy),
:class:`~mtcfs.core.capacity.Reclaim` (``reclaim``: what eviction does to the namespace),
:class:`~mtcfs.core.checkpoints.Checkpoints` (``checkpoints``: pins, chunk readers,
imports, ``mtcfs verify``), :class:`~mtcfs.core.jobns.JobNamespace` (``jobns``: the one
apply path of namespace ops, the log position, publishing in scope=job, the namespace's
snapshot and install, and where other ranks' chunks come from),
:class:`~mtcfs.core.xattrs.Xattrs` (``xattrs``) and
:class:`~mtcfs.core.own_files.OwnFiles` (``own_files``); see docs/architecture.md,
"The core".

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

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import trio

from mtcfs.base import pools
from mtcfs.core.budget import RamBudget
from mtcfs.core.capacity import Reclaim
from mtcfs.core.checkpoints import Checkpoints
from mtcfs.core.chunkmap import ChunkIndex
from mtcfs.core.entries import Entries
from mtcfs.core.eviction import Eviction
from mtcfs.core.faultin import LocalChunks
from mtcfs.core.fetcher import FaultIn
from mtcfs.core.files import OpenFiles
from mtcfs.core.inodes import InodeTable
from mtcfs.core.jobns import JobNamespace
from mtcfs.core.model import ROOT_INO, Attr, DirHandle, Handle, Inode, Version
from mtcfs.core.namespace import NamespaceOps
from mtcfs.core.ns_log import LocalLog, NamespaceLog
from mtcfs.core.own_files import OwnFiles
from mtcfs.core.passthrough import Passthrough
from mtcfs.core.records import ChunkSource, Counters, StepRecord
from mtcfs.core.records import now_ns as _now_ns
from mtcfs.core.step_registry import StepRegistry
from mtcfs.core.tier_api import TierApi
from mtcfs.core.verifier import Verifier
from mtcfs.core.xattrs import Xattrs
from mtcfs.core.store import Store
from mtcfs.core.store.fdcache import FdCache
from mtcfs.core.versions import VersionStore

__all__ = ["ChunkSource", "Counters", "Filesystem", "StepRecord"]

log = logging.getLogger(__name__)

#: kv key of the store: "1" once a daemon stopped cleanly, "0" while one serves (a crash
#: leaves it so). See Filesystem.close and crash_leftovers (core/eviction.py).
CLEAN_SHUTDOWN_KEY = "clean_shutdown"


class Filesystem(NamespaceOps):
    """The core of one mount.

    Args:
        store: the opened store (RAM tier on disk).
        capacity: bytes of file data the RAM tier may hold (``size=`` option).
        keep: complete checkpoints always kept in RAM (``keep=`` option).
        chunk_size: chunk size in bytes for new versions.
        job: the job name, recorded in manifests.
        rank: this node's rank in the job, recorded in manifests (0 on a single node).
        passthrough: which opens the kernel serves itself (core/passthrough.py); none
            when not given.
    """

    def __init__(self, store: Store, *, capacity: int, keep: int = 2,
                 chunk_size: int | None = None, job: str = "job", rank: int = 0,
                 passthrough: Passthrough | None = None) -> None:
        self.store = store
        self.db = store.db
        self.chunk_size = chunk_size or store.chunk_size
        self.job = job
        self.rank = rank
        #: The inode table (core/inodes.py): inodes, directory entries, kernel aliases and
        #: their rows. ``inodes`` and ``aliases`` here are its dicts (read them; only it adds
        #: or removes entries).
        self.tree = InodeTable(self.db, size_of=lambda vid: self.open_files.live_size(vid),
                               exact_next_ino=lambda: self.job_scope)
        self.inodes: dict[int, Inode] = self.tree.inodes
        #: The versions of files, their rows, data files and descriptors (core/versions.py).
        #: ``versions`` and ``fds`` here are its (the same objects), read by many; only it
        #: changes them.
        self.vstore = VersionStore(self, store, self.chunk_size)
        self.versions: dict[int, Version] = self.vstore.versions
        self.fds: FdCache = self.vstore.fds
        #: The committed steps, their rows and commit rules (core/step_registry.py).
        #: ``steps`` here is its dict of records (read it; only it adds or removes).
        self.step_registry = StepRegistry(self.db, self.tree, self.vstore, self,
                                          job=job, rank=rank,
                                          delete_step=lambda rec: self.reclaim.delete_step(rec))
        self.steps: dict[str, StepRecord] = self.step_registry.records
        #: The changes of one directory entry each (core/entries.py): what applying a
        #: namespace op does, and how eviction and the open files free a name.
        self.entries = Entries(db=self.db, tree=self.tree, vstore=self.vstore,
                               step_registry=self.step_registry,
                               job_scope=lambda: self.job_scope)
        #: What eviction does to the namespace (core/capacity.py): drop a step's data,
        #: delete a directory tree.
        self.reclaim = Reclaim(self, db=self.db, tree=self.tree, vstore=self.vstore,
                               step_registry=self.step_registry, entries=self.entries)
        self.counters = Counters()
        #: The eviction policy (core/eviction.py): what leaves RAM when room is short.
        self.eviction = Eviction(self, self.reclaim, self.counters, keep)
        #: The RAM budget against size= (core/budget.py): the only owner of ``used``,
        #: ``in_flight`` and ``Version.alloc``; the eviction policy makes room for it.
        self.budget = RamBudget(capacity, fd_of=self.fds.get, counters=self.counters,
                                settle=lambda: self.open_files.settle_releases(),
                                make_room=self.eviction.make_room)
        usage = getattr(store, "data_usage", None)  # (a store double in tests may lack it)
        if usage is not None:  # (each a no-op without a data tmpfs)
            self.budget.data_usage = usage
            self.budget.grow_data, self.budget.shrink_data = store.grow_data, store.shrink_data
        self.errors: list[str] = []
        self.errors_total: int = 0  # errors ever logged (``errors`` keeps the last 50)
        self.cpu_limiter = pools.limiter("cpu")
        self._observers: list[Callable[[str, Any], None]] = []
        #: The local chunk index (core/chunkmap.py): where each chunk held here is read.
        self.chunk_index = ChunkIndex(self.versions)
        #: Local chunks as reads see them (core/faultin.py): fault-in, first-read
        #: verification, corrupt chunks dropped and repaired. Its ``fetcher``
        #: (core/fetcher.py: the fetches, the chunk source, the deadline) and ``verifier``
        #: (core/verifier.py: the first-read hashes and the scrub) are also here.
        self.chunks = LocalChunks(db=self.db, tree=self.tree, vstore=self.vstore,
                                  budget=self.budget, chunk_index=self.chunk_index,
                                  fds=self.fds, counters=self.counters,
                                  cpu_limiter=self.cpu_limiter, report_error=self.report_error,
                                  pin_chunk=lambda d: self.checkpoints.pin_chunk(d),
                                  unpin=lambda vs: self.checkpoints.unpin(vs))
        self.fetcher: FaultIn = self.chunks.fetcher
        self.verifier: Verifier = self.chunks.verifier
        #: Open files (core/files.py): the handle table, writers' versions, the seal on
        #: last close, ``last_write``. ``handles`` here is its dict (read it).
        self.open_files = OpenFiles(self, db=self.db, tree=self.tree, vstore=self.vstore,
                                    budget=self.budget, verifier=self.verifier,
                                    chunk_index=self.chunk_index,
                                    step_registry=self.step_registry, entries=self.entries,
                                    chunks=self.chunks, counters=self.counters,
                                    cpu_limiter=self.cpu_limiter, passthrough=passthrough)
        self.handles: dict[int, Handle | DirHandle] = self.open_files.handles
        #: Pins, chunk readers, step imports and ``mtcfs verify`` (core/checkpoints.py).
        self.checkpoints = Checkpoints(db=self.db, tree=self.tree, vstore=self.vstore,
                                       step_registry=self.step_registry,
                                       chunk_index=self.chunk_index, verifier=self.verifier,
                                       cpu_limiter=self.cpu_limiter,
                                       chunk_size=self.chunk_size)
        self._unsealed_at_load: list[Version] = []
        #: scope=job: kernel inode number -> core inode number, for files renumbered for
        #: the kernel (Inode.kid); the inode table's.
        self.aliases: dict[int, int] = self.tree.aliases
        #: The apply path of namespace ops, the log position, publishing, and the
        #: namespace's snapshot and install (core/jobns.py).
        self.jobns = JobNamespace(self, db=self.db, store=store, rank=rank, tree=self.tree,
                                  vstore=self.vstore, step_registry=self.step_registry,
                                  chunk_index=self.chunk_index, budget=self.budget,
                                  verifier=self.verifier, entries=self.entries,
                                  checkpoints=self.checkpoints,
                                  own_missing_below=self.chunks.own_missing_below,
                                  fetch_later=self.chunks.fetch_later)
        #: The namespace log every namespace op goes through (core/ns_log.py): a LocalLog
        #: in scope=node; the daemon replaces it with the job's log in etcd in scope=job.
        self.ns_log: NamespaceLog = LocalLog(self.jobns)
        #: Extended attributes, stored and virtual (core/xattrs.py).
        self.xattrs = Xattrs(db=self.db, tree=self.tree, vstore=self.vstore,
                             step_registry=self.step_registry, open_files=self.open_files,
                             control_socket=store.control_socket)
        #: The daemon's own files, written through this facade (core/own_files.py).
        self.own_files = OwnFiles(self)
        #: What the other tiers see of the core: the one object every port is
        #: (core/tier_api.py, core/ports.py); the daemon hands them this, not the facade.
        self.tier_api = TierApi(self, step_registry=self.step_registry,
                                checkpoints=self.checkpoints, chunks=self.chunks,
                                jobns=self.jobns, tree=self.tree, vstore=self.vstore,
                                budget=self.budget, eviction=self.eviction,
                                chunk_index=self.chunk_index, open_files=self.open_files,
                                own_files=self.own_files, db=self.db)
        #: The daemon before this one did not stop cleanly (set by _load).
        self.previous_crash = False
        self._load()
        self.verifier.start()  # core/verifier.py: what is in RAM now is verified on first read

    # ------------------------------------------------------------------ the budget's figures, eviction

    @property
    def capacity(self) -> int:
        """Bytes of file data the RAM tier may hold (``size=``); :attr:`budget`'s."""
        return self.budget.capacity

    @property
    def used(self) -> int:
        """Bytes the store's data files hold (read-only; :class:`RamBudget` changes it)."""
        return self.budget.used

    def statfs(self) -> dict[str, int]:
        """Capacity figures in bytes (the RAM tier's ``size=``, not the tmpfs's): ``capacity``,
        ``used`` (what the store's data files really hold, holes cost nothing, plus the
        replicas), ``replicas``, ``free``, ``files`` (inodes). See core/budget.py."""
        return self.budget.figures(len(self.inodes))

    def evict(self, need: int | None = None) -> list[str]:
        """Evict checkpoints from RAM (``mtcfs gc``, the keep= policy, memory pressure):
        the names of the evicted steps (:meth:`Eviction.evict`)."""
        return self.eviction.evict(need)


    # ------------------------------------------------------------------ FUSE operations on
    # open files: the adapter's entry points (core/files.py does the work)

    async def open(self, num: int, flags: int, *, kernel: bool = False) -> tuple[int, bool]:
        """Open file ``num``: ``(fh, keep_cache)`` (:meth:`OpenFiles.open`; ``kernel``: a
        FUSE open, which may pass through, :meth:`backing_id`); a writable ``O_TRUNC``
        open clears set-user-ID and set-group-ID first (:meth:`kill_suidgid`)."""
        if flags & os.O_TRUNC and flags & os.O_ACCMODE != os.O_RDONLY:
            await self.kill_suidgid(num, always=True)
        return await self.open_files.open(num, flags, kernel=kernel)

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
                     gid: int, *, kernel: bool = False) -> tuple[int, Attr]:
        """Create and open ``name`` in ``parent``: ``(fh, attr)`` (:meth:`OpenFiles.create`)."""
        return await self.open_files.create(parent, name, mode, flags, uid, gid,
                                            kernel=kernel)

    def adapter_ready(self, *, stamp_writes: bool) -> None:
        """The FUSE connection is negotiated: ``stamp_writes`` when the kernel keeps no
        writeback cache (beside passthrough), so the daemon stamps c/mtime at each WRITE."""
        self.open_files.stamp_writes = stamp_writes

    def mark_direct(self, fh: int) -> None:
        """Handle ``fh`` was opened FOPEN_DIRECT_IO (its writes are not time-stamped)."""
        self.open_files.mark_direct(fh)

    def backing_id(self, fh: int) -> int:
        """The backing id the kernel serves handle ``fh`` by (FUSE passthrough), 0 when the
        daemon serves it (:meth:`OpenFiles.backing_id`)."""
        return self.open_files.backing_id(fh)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``off`` (:meth:`OpenFiles.read`)."""
        return await self.open_files.read(fh, off, size)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        """Write ``buf`` at ``off``; bytes written (:meth:`OpenFiles.write`). Clears
        set-user-ID and set-group-ID first (:meth:`kill_suidgid`)."""
        if self.kills_suidgid:
            await self.kill_suidgid(self.open_files.handle_ino(fh))
        return await self.open_files.write(fh, off, buf)

    async def flush(self, fh: int, final: bool = True) -> None:
        """close(2) of one descriptor (:meth:`OpenFiles.flush`)."""
        await self.open_files.flush(fh, final)

    async def fallocate(self, fh: int, mode: int, off: int, length: int) -> None:
        """fallocate(2) through handle ``fh`` (:meth:`OpenFiles.fallocate`)."""
        await self.open_files.fallocate(fh, mode, off, length)

    async def fsync(self, fh: int, datasync: bool) -> None:
        """Record the length written so far (:meth:`OpenFiles.fsync`)."""
        await self.open_files.fsync(fh, datasync)

    async def release(self, fh: int) -> None:
        """The last close of handle ``fh`` (:meth:`OpenFiles.release`)."""
        await self.open_files.release(fh)

    def kernel_inos(self, fh: int) -> set[int]:
        """The inode numbers the kernel may know handle ``fh``'s file by."""
        return self.open_files.kernel_inos(fh)

    # ------------------------------------------------------------------ extended attributes
    # (core/xattrs.py does the work)

    async def getxattr(self, num: int, name: bytes) -> bytes:
        """The value of attribute ``name`` of inode ``num`` (:meth:`Xattrs.getxattr`)."""
        return await self.xattrs.getxattr(num, name)

    async def setxattr(self, num: int, name: bytes, value: bytes) -> None:
        """Set ``user.*`` attribute ``name`` (:meth:`Xattrs.setxattr`)."""
        await self.xattrs.setxattr(num, name, value)

    async def listxattr(self, num: int) -> list[bytes]:
        """The stored attributes' names (:meth:`Xattrs.listxattr`)."""
        return await self.xattrs.listxattr(num)

    async def removexattr(self, num: int, name: bytes) -> None:
        """Remove attribute ``name`` (:meth:`Xattrs.removexattr`)."""
        await self.xattrs.removexattr(num, name)


    async def _ns_publish(self, ino: Inode, v: Version) -> None:
        """Publish sealed ``v`` of ``ino`` job-wide (the seal's; :meth:`JobNamespace.publish`)."""
        await self.jobns.publish(ino, v)

    # ------------------------------------------------------------------ lifecycle

    def _load(self) -> None:
        """Load the namespace from SQLite and repair what a crash may have left."""
        db = self.db
        fresh = db.execute("SELECT 1 FROM inodes WHERE ino=?", (ROOT_INO,)).fetchone() is None
        # (a) of crash_leftovers (core/eviction.py): did the daemon before stop cleanly? "1":
        # it did (close(clean=True)); "0": it was serving and never got there (a crash). A
        # store created fresh had no run before; one from before this flag counts as clean
        # (nothing in it is deleted as a crash leftover).
        self.previous_crash = not fresh and db.get_kv(CLEAN_SHUTDOWN_KEY) == "0"
        if fresh:
            with db.transaction():
                self.tree.create_root()
                db.set_kv("next_vid", "1")
        self.tree.load()  # inodes, directory entries, xattrs (core/inodes.py)
        self.vstore.load(fresh)  # core/versions.py: its rows and next_vid
        self.step_registry.load()  # core/step_registry.py: the committed steps
        self._repair()

    def _repair(self) -> None:
        """Crash recovery: free orphans, adopt data file lengths of unsealed versions."""
        db = self.db
        with db.transaction():
            # Inodes no directory refers to (unlinked while open at the crash) are garbage.
            self.tree.free_orphans()
            # Versions no inode has, data files no version has (core/versions.py); those
            # being written at the crash are sealed again after mount (start).
            current = {i.vid for i in self.inodes.values() if i.vid is not None}
            self._unsealed_at_load.extend(self.vstore.repair(current))
            # Steps whose directory a crash removed before their row.
            self.step_registry.drop_stale()
        # what counts against size=: core/budget.py
        self.budget.measure_all(self.versions.values(), self.store.data_path)
        with db.transaction():  # chunks the rows list whose bytes are gone: missing
            for v, gone in self.vstore.check_present():  # core/versions.py
                log.warning("store check: version %d (inode %d): chunks %s are listed as "
                            "held but their bytes are not in its data file (a crash during "
                            "an eviction, or a damaged store): marked missing, fetched again"
                            " when read", v.vid, v.ino, gone)
        self.eviction.loaded(_now_ns(), previous_crash=self.previous_crash)
        for v in self.versions.values():
            self.chunk_index.add_version(v)
        self.jobns.loaded(self.versions.values())  # where other ranks' chunks come from

    @property
    def job_scope(self) -> bool:
        """Whether other nodes change this namespace too (scope=job: the log is replicated)."""
        return self.ns_log.replicated

    def start(self, nursery: trio.Nursery) -> None:
        """Attach the core to a nursery for its background work; seals what a crash left open."""
        self.jobns.start(nursery)
        self.chunks.start(nursery)
        # Serving from now on: until close(clean=True), a stop is a crash.
        self.db.set_kv(CLEAN_SHUTDOWN_KEY, "0")
        self.open_files.start(nursery, self._unsealed_at_load)
        self._unsealed_at_load = []
        if not self.job_scope:
            self.step_registry.commit_sealed_markers()

    def close(self, clean: bool = False) -> None:
        """Close data file descriptors (the store itself is closed by its owner).

        ``clean``: the daemon stops cleanly (unmounted, or a stop signal); recorded in the
        store, so that the next start knows no crash interrupted a save (crash_leftovers).
        """
        if clean:
            self.db.set_kv(CLEAN_SHUTDOWN_KEY, "1")
        self.fds.close_all()

    def subscribe(self, observer: Callable[[str, Any], None]) -> None:
        """Register ``observer(event, obj)``; events: 'sealed' (Version), 'closed'
        (Version: the last writer of a version sealed at close(2) left, scope=job),
        'committed' (StepRecord), 'step_changed' (StepRecord), 'step_removed' (str),
        'invalidate_entry' ((parent ino, name, child ino): a name the core removed on its
        own, which the kernel may still cache).
        Observers must not block."""
        self._observers.append(observer)

    def _emit(self, event: str, obj: Any) -> None:
        for fn in self._observers:
            try:
                fn(event, obj)
            except Exception:  # an observer bug must not break the filesystem
                log.exception("observer failed on %s", event)

    # ------------------------------------------------------------------ helpers

    def report_error(self, msg: str) -> None:
        """Log ``msg`` as an error and show it in ``mtcfs status`` (the last 50 kept)."""
        log.error("%s", msg)
        self.errors.append(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {msg}")
        self.errors_total += 1
        del self.errors[:-50]
