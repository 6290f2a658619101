"""The step registry: the committed checkpoints (steps) of one core and their rows.

:class:`StepRegistry` owns

- ``records``: step name -> :class:`~mtcfs.core.records.StepRecord`, every committed step
  whose top-level directory exists. ``Filesystem.steps`` is the same dict, read by many
  (the tiers through their ports, the daemon, the eviction policy); only this class adds
  or removes entries. The peer tier sets the replication counts (``replicated``,
  ``replicas``) of a record, and the backup tier its ``backing_up`` flag: runtime fields,
  never written to a row;
- the ``steps`` table of the store's SQLite database (one row per record: name, number,
  inode, commit time, backup time, source) and the kv key ``backup_pending``;
- the commit rules applied to the namespace (mtcfs/base/steps.py names them): a marker
  file sealed and closed (:meth:`commit_by_marker`), a top-level directory renamed from
  Orbax's temporary or restore name, and ``mtcfs seal`` (:meth:`seal`); a commit is
  recorded once per directory, again after a change while not backed up;
- what a step's backup state is: :meth:`mark_backed_up` (the backup tier holds it),
  :meth:`changed` (a file in it changed: its copies elsewhere no longer match),
  :meth:`retired` (the backup tier dropped it).

It holds the :class:`~mtcfs.core.inodes.InodeTable` (a step is a top-level directory; its
files are found by a walk) and the :class:`~mtcfs.core.versions.VersionStore` (its files'
versions, whose ``backed_up`` flag and row it sets with the step's), and reaches the rest
of the core only through :class:`Host` (the events to observers, whether the namespace is
job-wide) and the ``delete_step`` it is given (core/capacity.py's ``Reclaim``).

Shapes and units: step names are ``str`` (a top-level directory's name decoded with
``surrogateescape``); times are nanoseconds since the epoch.

Errors: :meth:`seal` raises :class:`~mtcfs.base.errors.FsError` (ENOENT, ENOTDIR, EINVAL),
:meth:`snapshot` raises ENOENT and EAGAIN. Rows are written inline: the caller holds the
transaction of the namespace change that commits or forgets a step; the methods that act
on their own (:meth:`seal`, :meth:`changed`, :meth:`mark_backed_up`,
:meth:`set_backup_pending`, :meth:`retired`, :meth:`commit_sealed_markers`) open one.

Concurrency (docs/architecture.md): every method runs on the trio thread and never awaits.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from mtcfs.base import steps as stepnames
from mtcfs.base.errors import FsError
from mtcfs.base.manifest import Entry, StepManifest, special_node
from mtcfs.core.inodes import InodeTable
from mtcfs.core.model import ROOT_INO, Inode, Version
from mtcfs.core.records import StepRecord
from mtcfs.core.records import now_ns as _now_ns
from mtcfs.core.store.meta import MetaDB
from mtcfs.core.versions import VersionStore

__all__ = ["Host", "StepRegistry"]

log = logging.getLogger("mtcfs.core.core")

#: kv key of the store: the step whose backup started and had not completed ("" none).
BACKUP_PENDING_KEY = "backup_pending"


class Host(Protocol):
    """What :class:`StepRegistry` may use of the core (the ``Filesystem`` facade)."""

    @property
    def job_scope(self) -> bool: ...
    def _emit(self, event: str, obj: Any) -> None: ...


def backup_lag(steps: Iterable[StepRecord], now_ns: int) -> tuple[int, float]:
    """How far the backup tier is behind the newest committed step on this node.

    Returns ``(steps, seconds)``: the committed steps newer than the newest one backed up
    (all of them if none is), and the seconds since the oldest of those was committed
    (``now_ns`` and ``committed_ns`` are Unix times in ns); ``(0, 0.0)`` when the newest
    committed step is backed up. The seconds are the training a loss of every RAM tier
    would cost now, at most. Shown in ``mtcfs status`` and as the metrics
    ``mtcfs_backup_lag_steps``/``_seconds``.
    """
    rows = list(steps)
    backed = [r.number for r in rows if r.backed_up_ns is not None]
    newest = max(backed) if backed else None
    behind = [r for r in rows if newest is None or r.number > newest]
    if not behind:
        return 0, 0.0
    return len(behind), max(0.0, (now_ns - min(r.committed_ns for r in behind)) / 1e9)


class StepRegistry:
    """The committed steps of one core.

    Args:
        db: the store's metadata database.
        tree: the core's inode table.
        vstore: the core's version store.
        host: the core (see :class:`Host`).
        job: the job name, recorded in manifests (:meth:`snapshot`).
        rank: this node's rank, recorded in manifests.
        delete_step: deletes a step's directory tree (``Reclaim.delete_step``,
            core/capacity.py; :meth:`retired`), called at use (bound late: the
            facade builds it after the registry).
    """

    def __init__(self, db: MetaDB, tree: InodeTable, vstore: VersionStore, host: Host, *,
                 job: str, rank: int, delete_step: Callable[[StepRecord], None]) -> None:
        self._db = db
        self._delete_step = delete_step
        self._tree = tree
        self._vstore = vstore
        self._host = host
        self._job = job
        self._rank = rank
        #: step name -> record (``Filesystem.steps`` is this dict).
        self.records: dict[str, StepRecord] = {}

    # ------------------------------------------------------------------ rows

    def load(self) -> None:
        """Read the records from the ``steps`` table (at start, before :meth:`drop_stale`)."""
        for row in self._db.execute(
                "SELECT name, number, ino, committed_ns, backed_up_ns, source FROM steps"):
            self.records[row[0]] = StepRecord(name=row[0], number=row[1], ino=row[2],
                                              committed_ns=row[3], backed_up_ns=row[4],
                                              source=row[5])

    def drop_stale(self) -> list[str]:
        """Forget (without events) the records whose directory is no longer the root's
        entry of that name (a crash between a directory's removal and the row's). The
        caller holds the transaction. Returns their names."""
        root = self._tree.inodes[ROOT_INO].children or {}
        stale = [n for n, s in self.records.items()
                 if s.ino not in self._tree.inodes or root.get(n.encode()) != s.ino]
        for name in stale:
            del self.records[name]
            self._db.execute("DELETE FROM steps WHERE name=?", (name,))
        return stale

    def write(self, rec: StepRecord) -> None:
        """Write ``rec``'s row (inside the caller's transaction)."""
        self._db.execute(
            "INSERT OR REPLACE INTO steps(name, number, ino, committed_ns, backed_up_ns, source)"
            " VALUES (?,?,?,?,?,?)",
            (rec.name, rec.number, rec.ino, rec.committed_ns, rec.backed_up_ns, rec.source))

    def add(self, rec: StepRecord) -> None:
        """Register ``rec`` as it is (an imported step, a namespace snapshot's) and write
        its row; no event. The caller holds the transaction."""
        self.records[rec.name] = rec
        self.write(rec)

    def clear(self) -> None:
        """Forget every record (a namespace snapshot install, whose transaction deleted
        the rows)."""
        self.records.clear()

    def forget(self, name: bytes) -> None:
        """The top-level directory ``name`` is gone or renamed: it is no longer a step
        (event ``step_removed``). The caller holds the transaction."""
        key = name.decode(errors="surrogateescape")
        if self.records.pop(key, None) is not None:
            self._db.execute("DELETE FROM steps WHERE name=?", (key,))
            self._host._emit("step_removed", key)

    # ------------------------------------------------------------------ commits

    def commit(self, d: Inode, source: str) -> StepRecord | None:
        """Record that top-level directory ``d`` is a complete step (event ``committed``).

        ``source`` names the rule (``.metadata``, ``orbax-rename``, ``mtcfs seal``...). A
        directory that is not top-level, or whose name is no step name (except for ``mtcfs
        seal``), is none: None. Committed again while not backed up, the commit time moves
        (the backup policy sees a new commit). The caller holds the transaction.
        """
        if d.parent != ROOT_INO:
            return None
        name = d.name.decode(errors="surrogateescape")
        number = stepnames.step_number(name)
        if number is None and source != "mtcfs seal":
            return None
        rec = self.records.get(name)
        if rec is not None and rec.ino == d.ino:
            if rec.backed_up_ns is None and source != "mtcfs seal":
                # Committed again after a change (DCP re-saving into the same directory):
                # the backup policy must see it as a new commit.
                rec.committed_ns = _now_ns()
                rec.source = source
                self.write(rec)
                self._host._emit("committed", rec)
            return rec
        rec = StepRecord(name=name, number=number if number is not None else 0, ino=d.ino,
                         committed_ns=_now_ns(), source=source)
        self.records[name] = rec
        if source == "orbax-restore":
            # A step the replicator restored under its marker name, back under its own:
            # its bytes are those of the backup tier if every file's are.
            versions = self.versions_of(rec)
            if versions and all(v.backed_up for v in versions):
                rec.backed_up_ns = rec.committed_ns
        self.write(rec)
        log.info("checkpoint %s committed (%s)", name, source)
        self._host._emit("committed", rec)
        return rec

    def commit_by_marker(self, f: Inode, published: bool = False) -> None:
        """Commit the step whose marker file ``f`` is, once sealed and closed
        (``published``: sealed at close(2) in scope=job, whose RELEASE may not have come
        yet). Anything else: nothing. The caller holds the transaction."""
        if f.name not in stepnames.COMMIT_FILES:
            return
        v = self._vstore.versions.get(f.vid) if f.vid is not None else None
        if v is None or not v.sealed or (v.writers and not published):
            return
        d = self._tree.inodes.get(f.parent)
        if d is not None and d.parent == ROOT_INO:
            self.commit(d, stepnames.COMMIT_FILES[f.name])

    def commit_sealed_markers(self) -> None:
        """Commit the steps whose marker file is sealed but whose commit was never
        recorded: a crash between the seal's transaction and the commit's."""
        inodes = self._tree.inodes
        for name, num in list((inodes[ROOT_INO].children or {}).items()):
            d = inodes.get(num)
            if d is None or not d.is_dir or stepnames.step_number(name) is None or \
                    name.decode(errors="surrogateescape") in self.records:
                continue
            for marker in stepnames.COMMIT_FILES:
                f = inodes.get((d.children or {}).get(marker, 0))
                if f is not None and f.is_file:
                    with self._db.transaction():
                        self.commit_by_marker(f)

    def seal(self, path: str) -> StepRecord:
        """Mark the top-level directory ``path`` as a complete checkpoint (``mtcfs seal``).

        Raises:
            FsError: ENOENT, ENOTDIR, or EINVAL when ``path`` is not a top-level directory
            or its name is not UTF-8.
        """
        ino = self._tree.resolve(path)
        if not ino.is_dir:
            raise FsError(errno.ENOTDIR, f"{path} is not a directory")
        if ino.parent != ROOT_INO:
            raise FsError(errno.EINVAL, f"{path} is not a top-level directory of the job")
        try:
            ino.name.decode()
        except UnicodeDecodeError:
            # a step's name travels as text (manifests, etcd keys, SQLite): refused before
            # anything is recorded
            raise FsError(errno.EINVAL, f"{path!r}: a checkpoint's name must be UTF-8") from None
        with self._db.transaction():
            rec = self.commit(ino, "mtcfs seal")
        assert rec is not None
        return rec

    def changed(self, ino: Inode) -> None:
        """A file in a committed step changed (a seal): its copies elsewhere no longer
        match. The step's ``generation`` moves, its replication count drops to 0 (event
        ``step_changed``) and it is no longer backed up."""
        rec = self.of(ino)
        if rec is None:
            return
        rec.replicated = 0
        rec.generation += 1
        self._host._emit("step_changed", rec)
        if rec.backed_up_ns is not None:
            rec.backed_up_ns = None
            with self._db.transaction():
                self.write(rec)

    # ------------------------------------------------------------------ reads

    def of(self, ino: Inode) -> StepRecord | None:
        """The step ``ino`` is in (or is, for its directory); None outside any step."""
        top = self._tree.top_dir(ino)
        if top is None:
            return None
        return self.records.get(top.name.decode(errors="surrogateescape"))

    def versions_of(self, rec: StepRecord) -> list[Version]:
        """The current versions of the files below step ``rec``, in walk order."""
        versions = self._vstore.versions
        return [versions[i.vid] for _p, i in self._tree.walk(self._tree.inodes[rec.ino])
                if i.is_file and i.vid is not None]

    def sealed(self, rec: StepRecord) -> bool:
        """True when every file below the step is sealed (no writer, no seal running)."""
        return all(v.sealed and not v.writers and v.sealing is None
                   for v in self.versions_of(rec))

    def in_ram(self, rec: StepRecord) -> bool:
        """True when every chunk of every file of the step is in RAM (nothing to fault in);
        another rank's files (scope=job) do not count."""
        return all(not v.missing for v in self.versions_of(rec) if v.origin < 0)

    def snapshot(self, name: str) -> tuple[StepManifest, list[Version]]:
        """The manifest of committed step ``name`` and its pinned versions (another rank's
        files left out: that rank backs them up).

        The caller unpins the versions when done (``Filesystem.unpin``): their data files
        stay while pinned, even if the files are rewritten or deleted meanwhile.

        Raises:
            FsError: ENOENT if the step is not committed; EAGAIN if a file in it is unsealed.
        """
        rec = self.records.get(name)
        if rec is None:
            raise FsError(errno.ENOENT, f"no committed checkpoint {name}")
        if not self.sealed(rec):
            raise FsError(errno.EAGAIN, f"checkpoint {name} has files still being written")
        entries, pinned = [], []
        for path, ino in self._tree.walk(self._tree.inodes[rec.ino]):
            perm = ino.mode & 0o7777
            if ino.is_dir:
                entries.append(Entry(path, "dir", perm, ino.mtime_ns))
            elif ino.kind == "symlink":
                entries.append(Entry(path, "symlink", perm, ino.mtime_ns, size=len(ino.target),
                                     target=ino.target.decode(errors="surrogateescape")))
            elif ino.kind == "special":  # metadata only: carried as such, no data
                entries.append(Entry(path, "special", perm, ino.mtime_ns,
                                     node=special_node(ino.mode), rdev=ino.rdev))
            else:
                v = self._vstore.versions[ino.vid]  # type: ignore[index]
                if v.origin >= 0:
                    continue  # scope=job: another rank's file; that rank backs it up
                v.pins += 1
                pinned.append(v)
                entries.append(Entry(path, "file", perm, ino.mtime_ns, size=v.size,
                                     chunk_size=v.chunk_size, chunks=v.chunks, blake3=v.blake3))
        m = StepManifest(job=self._job, step=name, step_number=rec.number,
                         created_ns=_now_ns(), entries=entries, rank=self._rank)
        return m, pinned

    # ------------------------------------------------------------------ the backup tier

    def mark_backed_up(self, name: str, versions: Iterable[Version]) -> bool:
        """Record that step ``name`` as it was with ``versions`` (its snapshot) is complete
        in the backup tier: those versions still registered, and the step's record if its
        files are still exactly those versions, in one transaction.

        Returns False when the step changed while it was uploaded (a file rewritten, added
        or deleted): the backup tier holds an older image of it, so the step is not backed
        up and must be uploaded again; its versions that did not change are marked all
        the same."""
        versions = list(versions)
        with self._db.transaction():
            for v in versions:
                if self._vstore.versions.get(v.vid) is v and not v.backed_up:
                    v.backed_up = True
                    self._vstore.write(v)
            rec = self.records.get(name)
            if rec is None:
                return True  # deleted meanwhile: nothing left to back up
            # (another rank's files, scope=job, are in no snapshot: that rank backs them up)
            now = {v.vid for v in self.versions_of(rec) if v.origin < 0}
            if now != {v.vid for v in versions}:
                return False
            rec.backed_up_ns = _now_ns()
            self.write(rec)
        return True

    def backup_pending(self) -> str | None:
        """The step whose backup started and had not completed when the daemon stopped."""
        return self._db.get_kv(BACKUP_PENDING_KEY) or None

    def set_backup_pending(self, name: str | None) -> None:
        """Record (durably) that the backup of ``name`` started; None: it completed."""
        with self._db.transaction():
            self._db.set_kv(BACKUP_PENDING_KEY, name or "")

    def retired(self, kept: set[str]) -> list[str]:
        """The backup tier now holds only the steps in ``kept`` (after ``backup_keep``).

        Local steps that were counted as backed up but were retired lose that status; those
        of them whose data has left RAM are deleted (scope=node), since their bytes are now
        nowhere. A step being backed up is left alone. Returns the names of the deleted
        steps.
        """
        deleted = []
        for rec in list(self.records.values()):
            if rec.backed_up_ns is None or rec.name in kept or rec.backing_up:
                continue
            versions = self.versions_of(rec)
            if any(v.missing for v in versions) and not self._host.job_scope:
                self._delete_step(rec)
                deleted.append(rec.name)
                log.info("deleted checkpoint %s: backup_keep retired its backup copy and its"
                         " data was no longer in RAM", rec.name)
                continue
            rec.backed_up_ns = None
            with self._db.transaction():
                self.write(rec)
                for v in versions:
                    if v.backed_up:
                        v.backed_up = False
                        self._vstore.write(v)
        return deleted
