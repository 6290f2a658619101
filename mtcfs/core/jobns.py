"""The apply path of namespace ops (both scopes), and the core's side of scope=job's
job-wide namespace (docs/consistency.md, docs/architecture.md, "Namespace operations").

:class:`JobNamespace` is a component of :class:`mtcfs.core.core.Filesystem` (``fs.jobns``):
it owns the log position and where other ranks' chunks come from. The facade forwards to
it ``apply_op``, ``ns_apply``, ``ns_position``, ``ns_set_position``, ``ns_snapshot`` and
``ns_install`` (the names the ports and the logs use) and the seal's publish; what it needs
of the core is its :class:`Host` protocol. Every namespace change is an *op*
(:mod:`mtcfs.base.ns_ops`). In scope=job the mount's ``ns_log``
(:mod:`mtcfs.tiers.namespace.etcd_log`) has etcd order each op into the job's log, and every
node applies it, in log order, with :meth:`JobNamespace.apply_at`. Applying is
deterministic and synchronous (one trio step, one SQLite transaction): every node that
applied the same ops holds the same namespace, with the same inode numbers, because only
applying an op (:meth:`JobNamespace.apply_op`) allocates them. The errno with which
applying refuses an op (the same on every node) is the answer to the system call that made
it.

The FUSE-facing methods (mkdir, create, rename, ...) submit an op and return once this node
applied it. File data never travels in ops, except the bytes of small files (every DCP rank
reads ``.metadata`` at load): a sealed version is *published* as its chunk list and the rank
that wrote it, and other nodes fault its chunks in on read.

The op kinds and their fields are in :mod:`mtcfs.base.ns_ops` (typed ops and their wire
form, the JSON stored in etcd). The apply functions here (``_apply_<kind>``) are also
scope=node's: its :class:`~mtcfs.core.ns_log.LocalLog` applies every op at once through
:meth:`JobNamespace.apply_op`. What differs by scope inside them is said where it does (a
new file's first version; what nodes reading a removed file keep).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import stat
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Protocol

import blake3
import trio

from mtcfs.base.errors import FsError
from mtcfs.base.ns_ops import (
    Create, Link, Mkdir, Mknod, Noop, NsOp, Publish, Rename, Rmdir, SetAttr, Symlink, Unlink,
    from_wire,
)
from mtcfs.core.budget import RamBudget
from mtcfs.core.checkpoints import Checkpoints
from mtcfs.core.chunkmap import ChunkIndex
from mtcfs.core.entries import Entries
from mtcfs.core.inodes import InodeTable
from mtcfs.core.model import ROOT_INO, Inode, Version
from mtcfs.core.ns_log import NamespaceLog
from mtcfs.core.records import StepRecord
from mtcfs.core.step_registry import StepRegistry
from mtcfs.core.store import Store
from mtcfs.core.store.meta import META_FLOOR_BYTES, MetaDB
from mtcfs.core.symlinks import escapes
from mtcfs.core.verifier import Verifier
from mtcfs.core.versions import VersionStore, copy_extents

__all__ = ["EMPTY_BLAKE3", "INLINE_BYTES", "LINGER_S", "Host", "JobNamespace",
           "publication_id"]

log = logging.getLogger("mtcfs.core.core")

#: Seconds this node keeps the data of its own file after another node removed or replaced
#: it, so that nodes still reading the file can copy what they lack (docs/consistency.md).
LINGER_S = 30.0

#: blake3 of no bytes: the content of a file created and not yet published.
EMPTY_BLAKE3 = blake3.blake3(b"").hexdigest()

#: Files up to this size travel inside their publish op, so that N ranks reading the same
#: small file (DCP's ``.metadata``, Orbax's JSON metadata) cause no fetch from its writer.
INLINE_BYTES = 256 * 1024

#: A publish refused with one of these is tried again (:meth:`JobNamespace._republish`):
#: EIO, etcd did not answer (the outcome unknown); ENOSPC, this node's store had no room
#: for the op's rows (refused before etcd had it).
REPUBLISH_ERRNOS = (errno.EIO, errno.ENOSPC)


#: What starts every :func:`publication_id`: no whole-file hash (64 hex characters) does,
#: so the two kinds of ``Publish.expect`` are never taken for each other.
PUBLICATION_ID_PREFIX = "manifest:"


def publication_id(published: dict[str, Any] | None) -> str:
    """The name of a file's published version (``Inode.published``, None: never published)
    that a publication tried again expects to replace (``Publish.expect``):
    :data:`PUBLICATION_ID_PREFIX` and the blake3 (hex) of its manifest (size, chunk size,
    chunk digests). Not the whole-file hash: a rewrite's seal leaves that empty (computed
    when asked), and two rewrites would share the name "". An empty file and one never
    published (both empty job-wide) have the same name."""
    if not published or not published.get("size"):
        return PUBLICATION_ID_PREFIX + EMPTY_BLAKE3
    h = blake3.blake3(b"%d:%d:" % (published["size"], published["chunk_size"]))
    for d in published["chunks"]:
        h.update(d.encode())
    return PUBLICATION_ID_PREFIX + h.hexdigest()


def _expected(published: dict[str, Any] | None, expect: str) -> bool:
    """Whether ``expect`` names ``published``: its :func:`publication_id`, or, without the
    prefix, its whole-file hash (an mtcfs before 2026-11-25 named it so in the ops it wrote
    to the log)."""
    if expect.startswith(PUBLICATION_ID_PREFIX):
        return expect == publication_id(published)
    whole = (published or {}).get("blake3", EMPTY_BLAKE3)
    return bool(whole) and expect == whole


def _name(s: str) -> bytes:
    return s.encode(errors="surrogateescape")


def _text(b: bytes) -> str:
    return b.decode(errors="surrogateescape")


class Host(Protocol):
    """What :class:`JobNamespace` may use of the core (the ``Filesystem`` facade), read at
    each use (the daemon replaces ``ns_log`` in scope=job): the log and the errors."""

    @property
    def ns_log(self) -> NamespaceLog: ...
    @property
    def job_scope(self) -> bool: ...
    def report_error(self, msg: str) -> None: ...


#: An apply function: (the component, the op, the versions to keep) -> result or None.
ApplyFn = Callable[["JobNamespace", Any, list[Version]], "dict[str, Any] | None"]


class JobNamespace:
    """The apply path of every namespace op (both scopes); scope=job: publishing, the log
    position, where other ranks' chunks come from, and the snapshot and install of the
    job-wide namespace.

    Owns: the log position (kv keys ``ns_epoch``/``ns_seq``: only :meth:`apply_at`,
    :meth:`set_position` and :meth:`install` write them), :attr:`chunk_origins`, and the
    publications in flight (:meth:`publish`, its retries) and lingering pins of this node's
    replaced files (their tasks in the core's nursery, from :meth:`start`).

    Args:
        host: the core (see :class:`Host`).
        db: the store's metadata database (one transaction per op).
        store: the store (data file paths, at install).
        rank: this node's rank (ops of this rank are this node's own).
        tree, vstore, step_registry, chunk_index, budget, verifier: the core's components.
        entries: the changes of one name each op makes (core/entries.py).
        checkpoints: the pins (a replaced file's version lingers pinned a while).
        own_missing_below, fetch_later: the local chunks' (core/faultin.py): this rank's
            files another node took out of their step are fetched back (``_taken_out``).
    """

    #: op type -> its apply function (set below the class)
    _apply_fns: ClassVar[dict[type[NsOp], ApplyFn]]

    def __init__(self, host: Host, *, db: MetaDB, store: Store, rank: int, tree: InodeTable,
                 vstore: VersionStore, step_registry: StepRegistry, chunk_index: ChunkIndex,
                 budget: RamBudget, verifier: Verifier, entries: Entries,
                 checkpoints: Checkpoints, own_missing_below: Callable[[Inode], list[Version]],
                 fetch_later: Callable[[list[Version], str], None]) -> None:
        self._host = host
        self._own_missing_below = own_missing_below
        self._fetch_later = fetch_later
        self.entries = entries
        self._checkpoints = checkpoints
        self.db = db
        self.store = store
        self.rank = rank
        self.tree = tree
        self.vstore = vstore
        self.step_registry = step_registry
        self.chunk_index = chunk_index
        self.budget = budget
        self.verifier = verifier
        #: chunk digest -> rank that wrote it (scope=job: where fault-in looks first); read
        #: by the chunk source through ``Filesystem.chunk_origin``; only this changes it.
        self.chunk_origins: dict[str, int] = {}
        self._nursery: trio.Nursery | None = None

    def start(self, nursery: trio.Nursery) -> None:
        """Run background work (publications tried again, lingering pins) in ``nursery``;
        before this, none is started (a snapshot install at mount needs none)."""
        self._nursery = nursery

    def loaded(self, versions: Iterable[Version]) -> None:
        """At load: note where other ranks' chunks of ``versions`` come from."""
        for v in versions:
            if v.origin >= 0:  # scope=job: where another rank's chunks are fetched from
                self.chunk_origins.update(dict.fromkeys(v.chunks, v.origin))

    def chunk_origin(self, digest: str) -> int | None:
        """The rank that wrote chunk ``digest``, None when unknown."""
        return self.chunk_origins.get(digest)

    # ------------------------------------------------------------------ submitting

    async def publish(self, ino: Inode, v: Version) -> None:
        """Publish sealed version ``v`` of ``ino`` job-wide (called by the seal).

        Records the failure as ``v.seal_error`` (close(2) then returns EIO) when the
        namespace service cannot be reached before its deadline, or ``v.seal_errno``
        ENOSPC when this node's store has no room for the op's rows; both are published
        again later (:meth:`_republish`).
        """
        op = Publish(ino=ino.ino, vid=v.vid, size=v.size, chunk_size=v.chunk_size,
                     chunks=tuple(v.chunks), blake3=v.blake3, mtime_ns=ino.mtime_ns,
                     data=os.pread(self.vstore.fd(v), v.size, 0) if v.size <= INLINE_BYTES
                     else None)
        # the job's version this one replaces: a later try publishes only over it
        expect = publication_id(ino.published)
        v.pins += 1  # must be here when this node applies its own publish
        v.publishing = True  # and a snapshot installed meanwhile keeps it (install)
        try:
            await self._host.ns_log.submit(op)
        except FsError as exc:
            v.seal_error = f"cannot publish {self.tree.path_of(ino)} job-wide: {exc.strerror}"
            v.seal_errno = exc.errno
            self._host.report_error(v.seal_error)
            if exc.errno in REPUBLISH_ERRNOS and self._nursery is not None:
                self._nursery.start_soon(self._republish, ino, v,
                                        dataclasses.replace(op, expect=expect))
        finally:
            v.publishing = False
            v.pins -= 1
            self.vstore.release(v)

    async def _republish(self, ino: Inode, v: Version, op: Publish) -> None:
        """Publish again a version whose publication failed because etcd did not answer
        (its close(2) got EIO: the outcome unknown, as for any network filesystem's
        timeout) or this node's store had no room for it (ENOSPC, refused before etcd had
        it), until etcd takes or refuses it. The op carries ``expect``, the job's
        version it replaces: applied only if the job still has that one, so a newer
        publication by any node wins; taken, every node serves what this node's writer
        closed, as if the first try had taken effect late. Never does this node keep
        serving bytes no other node has (docs/consistency.md)."""
        v.pins += 1
        delay = 1.0
        try:
            while True:
                await trio.sleep(delay)
                delay = min(delay * 2, 30.0)
                if not (ino.vid == v.vid and ino.nlink > 0 and v.seal_error):
                    # Written again (a newer version of this node's is current: its close
                    # publishes), replaced by the job's newer version, removed, or published
                    # meanwhile: nothing to try again.
                    if v.seal_error and ino.nlink > 0:
                        log.info("%s: not published again: %s", self.tree.path_of(ino),
                                 self._replaced_by(ino))
                    return
                v.publishing = True  # a reopen meanwhile copies (files: writable_version)
                try:
                    await self._host.ns_log.submit(op)
                except FsError as exc:
                    if exc.errno in REPUBLISH_ERRNOS:
                        continue  # etcd still away, or still no room here
                    log.info("%s: not published again (%s): the job's newer version stays",
                             self.tree.path_of(ino), exc.strerror)
                    return
                finally:
                    v.publishing = False
                log.info("%s: published job-wide after etcd came back", self.tree.path_of(ino))
                v.seal_error = ""
                return
        finally:
            v.pins -= 1
            self.vstore.release(v)

    def _replaced_by(self, ino: Inode) -> str:
        """Why a version waiting to publish again is no longer current (for the log)."""
        cur = self.vstore.versions.get(ino.vid) if ino.vid is not None else None
        if cur is not None and cur.origin >= 0:
            return f"rank {cur.origin} published a newer version meanwhile, which stays"
        return "written again here meanwhile; that close publishes"

    # ------------------------------------------------------------------ applying

    def apply_op(self, op: NsOp) -> tuple[dict[str, Any], list[Version]]:
        """Apply one namespace op (deterministic; no await; one SQLite transaction): the
        only way the namespace changes, in both scopes.

        Returns:
            (result for the submitter: ``{"ino"}``, ``{"ino", "existed"}`` or ``{}``;
            versions this node has open whose data it should fetch before acknowledging:
            in scope=job a file another node unlinked or replaced while this node reads it
            keeps its content here; always empty in scope=node).

        Raises:
            FsError: the op is refused (the submitter's system call gets that errno).
        """
        keep: list[Version] = []
        with self.db.transaction():
            res = self._apply_fns[type(op)](self, op, keep)
        return res or {}, keep

    #: ops that add nothing to the namespace: they may use the metadata's reserve (so that
    #: room can be freed on a full store) down to its floor, see :meth:`check_room`
    NO_RESERVE_OPS: ClassVar[tuple[type[NsOp], ...]] = (Unlink, Rmdir, SetAttr, Noop)

    def check_room(self, op: NsOp) -> None:
        """Refuse ``op`` before it changes anything when the store's filesystem is too full
        for its rows (:meth:`MetaDB.ensure_room`); a commit that failed part way would
        leave the namespace in memory changed and its rows not (a file created, then lost
        at the next start). Ops of :attr:`NO_RESERVE_OPS` are refused only under
        :data:`META_FLOOR_BYTES` (their commit would fail the same way).

        Raises:
            StoreFull: (an OSError, ENOSPC).
        """
        if isinstance(op, self.NO_RESERVE_OPS):
            self.db.ensure_room(op.KIND, META_FLOOR_BYTES)
        else:
            self.db.ensure_room(op.KIND)

    def apply_at(self, op: NsOp | dict[str, Any], seq: int, epoch: int
                 ) -> tuple[dict[str, Any], list[Version]]:
        """scope=job: apply the op at position ``(epoch, seq)`` of the job's log and record
        that position, in the same transaction. ``op``: typed, or its wire dict.

        Returns:
            as :meth:`apply_op`.

        Raises:
            FsError: the op is refused (MalformedOp, EINVAL, for a wire dict that is no op).
            StoreFull: the store's filesystem has no room for the op's rows
                (:meth:`check_room`); nothing changed, not even the position: apply it
                again once there is room.
        """
        if not isinstance(op, NsOp):
            op = from_wire(op)
        self.check_room(op)
        with self.db.transaction():
            res, keep = self.apply_op(op)
            self.db.set_kv("ns_seq", str(seq))
            self.db.set_kv("ns_epoch", str(epoch))
        return res, keep

    def position(self) -> tuple[int, int]:
        """(epoch, seq) of the last op applied here (0, 0 when none)."""
        return int(self.db.get_kv("ns_epoch") or 0), int(self.db.get_kv("ns_seq") or 0)

    def set_position(self, epoch: int, seq: int) -> None:
        """Record the log position ``(epoch, seq)`` without applying an op: an op refused
        or skipped by the log still moves it; a node that seeds the log starts at
        ``(incarnation, 0)``. In the current transaction, if one is open."""
        with self.db.transaction():
            self.db.set_kv("ns_seq", str(seq))
            self.db.set_kv("ns_epoch", str(epoch))

    def _ns_dir(self, num: int) -> Inode:
        d = self.tree.dir(num)
        if d.ino != ROOT_INO and not d.parent:
            raise FsError(errno.ENOENT)  # removed; may linger for the kernel here only
        return d

    def _origin(self, op: NsOp) -> int:
        return -1 if op.rank == self.rank else op.rank  # type: ignore[return-value]

    def _apply_noop(self, op: Noop, keep: list[Version]) -> None:
        return None

    def _apply_mkdir(self, op: Mkdir, keep: list[Version]) -> dict[str, Any]:
        self._ns_dir(op.parent)
        ino = self.entries.mkdir(op.parent, op.name, op.mode, op.uid, op.gid)
        return {"ino": ino.ino}

    def _apply_symlink(self, op: Symlink, keep: list[Version]) -> dict[str, Any]:
        self._ns_dir(op.parent)
        ino = self.entries.symlink(op.parent, op.name, op.target, op.uid, op.gid)
        return {"ino": ino.ino}

    def _apply_mknod(self, op: Mknod, keep: list[Version]) -> dict[str, Any]:
        self._ns_dir(op.parent)
        ino = self.entries.mknod(op.parent, op.name, op.mode, op.rdev, op.uid, op.gid)
        return {"ino": ino.ino}

    def _apply_link(self, op: Link, keep: list[Version]) -> None:
        ino = self.tree.inodes.get(op.ino)
        if ino is None or ino.nlink <= 0:
            raise FsError(errno.ENOENT)
        self._ns_dir(op.new_parent)
        before = self.step_registry.of(ino)
        self.entries.link(ino, op.new_parent, op.new_name)
        self._taken_out(ino, before)

    def _apply_create(self, op: Create, keep: list[Version]) -> dict[str, Any]:
        d = self._ns_dir(op.parent)
        self.tree.check_name(op.name)
        existing = d.children.get(op.name)  # type: ignore[union-attr]
        if existing is not None:
            if op.excl:
                raise FsError(errno.EEXIST)
            if not self.tree.inodes[existing].is_file:
                # (the kernel looks the name up first: only a race with another node's
                # op, or this node's, gets here)
                raise FsError(errno.EISDIR if self.tree.inodes[existing].is_dir
                              or self._host.job_scope else errno.EINVAL)
            return {"ino": existing, "existed": True}
        ino = self.tree.new("file", stat.S_IFREG | (op.mode & 0o7777), op.uid, op.gid)
        v = self.vstore.new(ino)
        if self._host.job_scope:
            # Job-wide, a new file is empty and published as such (every node serves it);
            # the submitter's writer starts its own version over it (files.py: create).
            v.sealed, v.blake3, v.origin = True, EMPTY_BLAKE3, self._origin(op)
            self.vstore.write(v)
            ino.published = self._published(v, op.rank)  # type: ignore[arg-type]
        # scope=node: the new version is the submitter's open, empty one
        ino.vid = v.vid
        self.tree.link(d, op.name, ino)
        self.tree.write(ino)
        self.tree.touch(d)
        return {"ino": ino.ino, "existed": False}

    def _apply_unlink(self, op: Unlink, keep: list[Version]) -> None:
        self._ns_dir(op.parent)
        victim = self.tree.child(self.tree.dir(op.parent), op.name)
        if victim.nlink <= 1:  # another hard link keeps the content reachable
            self._keep_if_open(victim, keep)
        self.entries.unlink(op.parent, op.name)

    def _apply_rmdir(self, op: Rmdir, keep: list[Version]) -> None:
        self._ns_dir(op.parent)
        self.entries.rmdir(op.parent, op.name)

    def _apply_rename(self, op: Rename, keep: list[Version]) -> None:
        self._ns_dir(op.parent)
        dst = self._ns_dir(op.new_parent)
        victim = dst.children.get(op.new_name)  # type: ignore[union-attr]
        inodes = self.tree.inodes
        if victim is not None and victim in inodes and inodes[victim].nlink <= 1:
            self._keep_if_open(inodes[victim], keep)
        moved = inodes.get(self.tree.dir(op.parent).children.get(op.name, 0))  # type: ignore[union-attr]
        before = self.step_registry.of(moved) if moved is not None else None
        self.entries.rename(op.parent, op.name, op.new_parent, op.new_name, op.flags)
        self._taken_out(moved, before)

    def _taken_out(self, moved: Inode | None, before: StepRecord | None) -> None:
        """An applied rename or link took ``moved`` out of step ``before``: this rank's files
        there whose data left RAM are fetched back in the background. The node that ran
        the op fetched its own before submitting (core/namespace.py); another rank's files
        are their owner's, which learns of the op only here, where nothing may wait. The
        backup keeps their chunks only while it keeps ``before`` (docs/reliability.md)."""
        if moved is None or before is None or self.step_registry.of(moved) is before:
            return
        self._fetch_later(self._own_missing_below(moved),
                          f"taken out of checkpoint {before.name}")

    def _apply_setattr(self, op: SetAttr, keep: list[Version]) -> None:
        ino = self.tree.inodes.get(op.ino)
        if ino is None or (ino.nlink <= 0 and ino.ino != ROOT_INO):
            raise FsError(errno.ENOENT)
        if op.mode is not None:
            ino.mode = stat.S_IFMT(ino.mode) | (op.mode & 0o7777)
        if op.uid is not None:
            ino.uid = op.uid
        if op.gid is not None:
            ino.gid = op.gid
        if op.atime_ns is not None:
            ino.atime_ns = op.atime_ns
        if op.mtime_ns is not None:
            ino.mtime_ns = op.mtime_ns
        self.tree.write(ino)

    def _keep_if_open(self, ino: Inode, keep: list[Version]) -> None:
        """``ino`` loses its name or content job-wide: keep what nodes reading it need."""
        if not self._host.job_scope:
            return  # scope=node: open descriptors keep the data file itself
        v = self.vstore.versions.get(ino.vid) if ino.is_file and ino.vid is not None else None
        if v is None:
            return
        if ino.opens and v.missing:
            keep.append(v)  # this node reads it: copy the rest before acknowledging
        if v.origin < 0 and v.sealed and self._nursery is not None:
            v.pins += 1  # this node wrote it: other readers copy from here for a while
            self._nursery.start_soon(self._unpin_later, v)

    async def _unpin_later(self, v: Version) -> None:
        await trio.sleep(LINGER_S)
        self._checkpoints.unpin([v])

    def _apply_publish(self, op: Publish, keep: list[Version]) -> None:
        ino = self.tree.inodes.get(op.ino)
        if ino is None or not ino.is_file or ino.nlink <= 0:
            return  # unlinked meanwhile: nobody can open it by name
        if op.expect is not None and not _expected(ino.published, op.expect):
            # a publication tried again (_republish): another version was published since
            raise FsError(errno.ESTALE, "the file was published again meanwhile")
        chunks = op.chunks
        ino.published = {"size": op.size, "chunk_size": op.chunk_size, "chunks": list(chunks),
                         "blake3": op.blake3, "rank": op.rank}
        if op.rank == self.rank:
            v = self.vstore.versions.get(op.vid)
            # (Not a reader of a shared data file, which holds a newer writer's bytes: it
            # never becomes current again; the job's content comes as another rank's would.)
            if v is not None and v.ino == ino.ino and v.sealed and v.chunks == chunks \
                    and v.preserved is None:
                if ino.vid != v.vid:
                    # replaced here by another node's earlier publish, or by a writer opened
                    # since (a copy: its close publishes over this one, or, if that close
                    # fails, the job keeps this one on every node)
                    v.current = True
                    self.vstore.set_current(ino, v)
                    self.tree.renumber(ino)
                v.origin = -1
                self.vstore.write(v)
                ino.mtime_ns = op.mtime_ns
                self.tree.write(ino)
                self.step_registry.commit_by_marker(ino, published=True)
                return
        cur = self.vstore.versions.get(ino.vid) if ino.vid is not None else None
        if cur is not None and cur.sealed and cur.chunks == chunks and cur.size == op.size:
            # this content already (a snapshot carried it, the file was rewritten with the
            # same bytes or touched, or an empty file, which the create op made, was sealed):
            # the time changes, and a commit marker still commits its step (an empty
            # ``commit_success.txt`` written by another rank)
            ino.mtime_ns = ino.ctime_ns = op.mtime_ns
            self.tree.write(ino)
            self.step_registry.commit_by_marker(ino)
            return
        if cur is not None:
            self._keep_if_open(ino, keep)
        v = self._remote_version(ino, op.size, op.chunk_size, chunks, op.blake3,
                                 op.rank, op.data)  # type: ignore[arg-type]
        self.vstore.set_current(ino, v)
        ino.mtime_ns = ino.ctime_ns = op.mtime_ns
        self.tree.renumber(ino)
        self.tree.write(ino)
        self.step_registry.commit_by_marker(ino)

    @staticmethod
    def _published(v: Version, rank: int) -> dict[str, Any]:
        return {"size": v.size, "chunk_size": v.chunk_size, "chunks": list(v.chunks),
                "blake3": v.blake3, "rank": rank}

    def _remote_version(self, ino: Inode, size: int, chunk_size: int,
                        chunks: tuple[str, ...], file_hash: str, rank: int,
                        data: bytes | None = None) -> Version:
        """A sealed version of rank ``rank``'s file: its chunks are missing unless they
        came inline in ``data`` (verified here) — reads fault them in from that rank and its
        replicas."""
        v = self.vstore.new_sealed(ino.ino, size, chunk_size, chunks, file_hash,
                                   origin=-1 if rank == self.rank else rank, data=data)
        for d in chunks:
            self.chunk_origins[d] = rank
        return v

    # ------------------------------------------------------------------ snapshots

    def snapshot(self) -> dict[str, Any]:
        """The whole namespace as a JSON-able dict (for a node that joins)."""
        epoch, seq = self.position()
        out: list[dict[str, Any]] = []
        for parent, name, ino in self._dentries():
            # one entry per name: a hard-linked inode comes once per link, each with the
            # same ino (install links the later ones to the first)
            e: dict[str, Any] = {"ino": ino.ino, "parent": parent, "name": _text(name),
                                 "kind": ino.kind, "mode": ino.mode, "uid": ino.uid,
                                 "gid": ino.gid, "mtime_ns": ino.mtime_ns,
                                 "target": _text(ino.target)}
            if ino.rdev:
                e["rdev"] = ino.rdev
            if ino.is_file and ino.vid is not None:
                v = self.vstore.versions[ino.vid]
                if v.sealed and v.sealing is None and not v.writers and not v.publishing \
                        and not v.seal_error:
                    e["version"] = self._published(v, self.rank if v.origin < 0 else v.origin)
                else:  # being written or published here, or its publication failed: the
                    # job knows the last published version
                    e["version"] = ino.published or {
                        "size": 0, "chunk_size": v.chunk_size, "chunks": [],
                        "blake3": EMPTY_BLAKE3, "rank": self.rank}
            out.append(e)
        steps = [{"name": s.name, "number": s.number, "ino": s.ino, "source": s.source,
                  "committed_ns": s.committed_ns} for s in self.step_registry.records.values()]
        return {"epoch": epoch, "seq": seq, "next_ino": self.tree.next_ino, "entries": out,
                "steps": steps}

    def _dentries(self) -> list[tuple[int, bytes, Inode]]:
        """Every (parent ino, name, inode) of the namespace, parents before children."""
        out: list[tuple[int, bytes, Inode]] = []
        stack = [self.tree.inodes[ROOT_INO]]
        while stack:
            d = stack.pop()
            for name, num in sorted(d.children.items()):  # type: ignore[union-attr]
                child = self.tree.inodes[num]
                out.append((d.ino, name, child))
                if child.is_dir:
                    stack.append(child)
        return out

    @staticmethod
    def _can_take_over(old: Version) -> bool:
        """Whether an install may hand ``old``'s data file itself to a new version (else
        it copies): nothing reads it in a thread (no pin), and it shares it with nobody."""
        return old.shared is None and not old.pins

    def _keep_local(self, old: Version, v: Version) -> bool:
        """Give the installed version ``v`` the complete local copy ``old`` of its content:
        ``old``'s data file, or a copy of it when ``old`` is pinned (read in a thread) or
        shares its file (a rewrite of ``v`` changes its file in place, and nothing would
        preserve their bytes). False when the copy fails (the store full: ENOSPC): ``v``'s
        data file is left empty and its chunks are faulted in like another rank's."""
        if self._can_take_over(old):
            self.vstore.fds.drop(v)
            os.replace(self.store.data_path(old.vid), self.store.data_path(v.vid))
            return True
        src = self.store.open_data(old.vid)
        try:
            copy_extents(src, self.vstore.fd(v), v.size)
            return True
        except OSError as exc:
            fd = self.vstore.fd(v)
            os.ftruncate(fd, 0)  # give back what the copy wrote; v's file stays all holes
            os.ftruncate(fd, v.size)
            log.warning("namespace snapshot: inode %d: could not copy its local data (%s); "
                        "its chunks are fetched again", v.ino, exc.strerror)
            return False
        finally:
            os.close(src)

    def install(self, snap: dict[str, Any]) -> None:
        """Replace this node's namespace with ``snap`` (at mount, before FUSE serves).

        This node's own files come back as versions with every chunk missing, faulted in
        from its replicas (or the backup tier) like any other rank's. A file this node is
        writing (open for writing, or closed and not yet published) stays this node's
        current version when the snapshot still has the file under the same name: its
        writer's close publishes it as if nothing happened. A symlink whose target is
        absolute or leaves the mount is not created (logged; docs/security-local.md).

        Raises:
            StoreFull: less than the metadata's reserve is free on the store's filesystem
                (:meth:`MetaDB.ensure_room`); nothing changed. (A snapshot whose rows need
                more than the reserve can still fail at its commit.)
        """
        self.db.ensure_room("installing the job's namespace")
        writing: dict[int, tuple[Version, int, bytes, dict[str, Any] | None]] = {}
        for v in self.vstore.versions.values():
            ino = self.tree.inodes.get(v.ino)
            if v.origin < 0 and v.current and ino is not None and ino.vid == v.vid and (
                    v.writers or not v.sealed or v.sealing is not None or v.publishing):
                writing[v.ino] = (v, ino.parent, ino.name, ino.published)
        aside: list[Version] = []  # published here, then replaced by another node's
        busy = {w[0].vid for w in writing.values()}
        # Complete local copies of content the snapshot names are kept (a node that rejoins
        # with its store keeps its own files, replicated or not). Not a pinned old version
        # that reads a rewrite's data file (core/versions.py, "Shared data files"): that
        # file holds the rewrite's bytes, its own are partly kept aside.
        # Each content's copies, those whose file can be taken over (no copy) last.
        have: dict[tuple[tuple[str, ...], int], list[Version]] = {}
        for v in self.vstore.versions.values():
            if v.sealed and not v.missing and v.chunks and v.vid not in busy and \
                    v.preserved is None:
                have.setdefault((v.chunks, v.size), []).append(v)
        for copies in have.values():
            copies.sort(key=self._can_take_over)
        with self.db.transaction():
            for table in ("inodes", "dentries", "xattrs", "versions", "steps"):
                self.db.execute(f"DELETE FROM {table}")
            # what the kernel and open descriptors know of inodes that stay
            runtime = {n: (i.kind, i.lookups, i.opens, i.last_open_vid, i.kid)
                       for n, i in self.tree.inodes.items()}
            content = {v.ino: (v.chunks, v.size) for v in self.vstore.versions.values()
                       if v.current and v.sealed}
            old_aliases = dict(self.tree.aliases)
            # handles and reads under way read on through their descriptors (core/versions.py)
            self.vstore.forget_all()
            self.step_registry.clear()
            self.chunk_index.clear()
            self.chunk_origins.clear()
            self.budget.clear()
            root = self.tree.clear()  # no inode and no alias left, a new root
            names: dict[int, set[tuple[int, bytes]]] = {}
            for e in snap["entries"]:
                names.setdefault(e["ino"], set()).add((e["parent"], _name(e["name"])))
            for e in snap["entries"]:
                parent = self.tree.inodes[e["parent"]]
                kind = e["kind"]
                if kind == "symlink" and escapes(_name(e["target"]),
                                                 self.entries.dir_depth(parent) or 0):
                    # docs/security-local.md: never made, whoever sent the snapshot
                    log.warning("namespace snapshot: symlink %s/%s -> %r points outside "
                                "the mount: not created", self.tree.path_of(parent), e["name"],
                                e["target"])
                    continue
                linked = self.tree.inodes.get(e["ino"])
                if linked is not None and kind != "dir":  # another name of an inode here
                    self.tree.link(parent, _name(e["name"]), linked)
                    linked.nlink += 1
                    self.tree.write(linked)
                    continue
                ino = Inode(e["ino"], kind, e["mode"], e["uid"], e["gid"],
                            2 if kind == "dir" else 1, e["mtime_ns"], e["mtime_ns"],
                            e["mtime_ns"], target=_name(e["target"]), rdev=e.get("rdev", 0),
                            children={} if kind == "dir" else None)
                rt = runtime.get(ino.ino)
                if rt is not None and rt[0] == kind:
                    _k, ino.lookups, ino.opens, ino.last_open_vid, ino.kid = rt
                elif rt is not None:  # the number named another kind here (a diverged log)
                    ino.lookups, ino.opens = rt[1], rt[2]
                    self.tree.renumber(ino)
                self.tree.add(ino)
                if kind == "dir":
                    parent.nlink += 1
                ver = e.get("version")
                mine = writing.get(ino.ino)
                if mine is not None and (kind != "file" or mine[1:3] not in names[ino.ino]):
                    mine = None
                if mine is not None and mine[0].publishing and not mine[0].writers and \
                        ver != mine[3] and not (ver is not None and ver["rank"] == self.rank
                                                and tuple(ver["chunks"]) == mine[0].chunks):
                    # Our publish was ordered before the snapshot and another node's after
                    # it: theirs is the file now; ours stays known (not current) for our op.
                    aside.append(mine[0])
                    mine = None
                if mine is not None:
                    v = mine[0]  # being written here: it stays, and its close publishes it
                    self.vstore.register(v)
                    ino.vid = v.vid
                    ino.published = dict(ver) if ver is not None else None
                elif ver is not None:
                    v = self._remote_version(ino, ver["size"], ver["chunk_size"],
                                             tuple(ver["chunks"]), ver["blake3"], ver["rank"])
                    v.origin = -1 if ver["rank"] == self.rank else ver["rank"]
                    copies = have.get((v.chunks, v.size))
                    old = copies.pop() if copies else None
                    if old is not None and self._keep_local(old, v):
                        v.missing.clear()
                        self.budget.account(v)
                        # Chunks not hashed since this daemon started stay so under the new
                        # version: a rejoin after a restart takes this path (core/verifier.py).
                        self.verifier.carry(old, v)
                    self.vstore.write(v)
                    self.chunk_index.add_version(v)
                    ino.vid = v.vid
                    ino.published = dict(ver)
                    if content.get(ino.ino) != (v.chunks, v.size):
                        self.tree.renumber(ino)  # the kernel may cache the old size
                self.tree.link(parent, _name(e["name"]), ino)
                self.tree.write(ino)
            self.tree.write(root)
            root_rt = runtime.get(ROOT_INO)
            if root_rt is not None:
                root.lookups, root.opens = root_rt[1], root_rt[2]
            self.tree.keep_aliases(old_aliases)
            # A publish in flight whose file another node replaced, renamed or removed: its
            # data stays (not current) until our op is applied, which may make it current.
            set_aside = {v.vid for v in aside}
            aside.extend(w[0] for w in writing.values()
                         if w[0].publishing and w[0].vid not in self.vstore.versions and
                         w[0].vid not in set_aside)
            for v in aside:
                v.current = False
                self.vstore.register(v)
            for s in snap["steps"]:
                rec = StepRecord(name=s["name"], number=s["number"], ino=s["ino"],
                                 committed_ns=s["committed_ns"], source=s["source"])
                self.step_registry.add(rec)
            new = {v.vid for v in self.vstore.versions.values()}
            self.vstore.settle_kept()  # still registered (being written here): evictable
            for vid in self.store.data_vids() - new:
                self.store.remove_data(vid)  # open descriptors still read what they opened
            self.tree.set_next_ino(snap["next_ino"])
            self.db.set_kv("ns_seq", str(snap["seq"]))
            self.db.set_kv("ns_epoch", str(snap["epoch"]))
        log.info("installed the job namespace at seq %d: %d entries, %d steps", snap["seq"],
                 len(snap["entries"]), len(snap["steps"]))


#: The apply function of each op type (JobNamespace.apply_op).
JobNamespace._apply_fns = {
    Noop: JobNamespace._apply_noop, Mkdir: JobNamespace._apply_mkdir,
    Create: JobNamespace._apply_create, Symlink: JobNamespace._apply_symlink,
    Mknod: JobNamespace._apply_mknod, Link: JobNamespace._apply_link,
    Unlink: JobNamespace._apply_unlink, Rmdir: JobNamespace._apply_rmdir,
    Rename: JobNamespace._apply_rename, SetAttr: JobNamespace._apply_setattr,
    Publish: JobNamespace._apply_publish,
}
