"""Checkpoints (steps): commit detection, and what the backup and restore tiers need — snapshots, pins, imports, verification.

A part of :class:`mtcfs.core.core.Filesystem` (mixed in); see that module for the
concurrency protocol every method follows.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Iterable

import trio

from mtcfs.base.chunking import chunk_hash, chunk_span
from mtcfs.base.errors import FsError
from mtcfs.base import steps as stepnames
from mtcfs.core.model import ROOT_INO, Inode, Version
from mtcfs.core.records import StepRecord, now_ns as _now_ns
from mtcfs.core.symlinks import escapes
from mtcfs.base.manifest import SPECIAL_MODES, Entry, StepManifest, special_node
from mtcfs.core.store.fdcache import FdCache

log = logging.getLogger("mtcfs.core.core")


class CheckpointOps:
    """Checkpoints (steps): commit detection, and what the backup and restore tiers need — snapshots, pins, imports, verification."""

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
        if source == "orbax-restore":
            # A step the replicator restored under its marker name, back under its own:
            # its bytes are those of the backup tier if every file's are.
            versions = self._step_versions(rec)
            if versions and all(v.backed_up for v in versions):
                rec.backed_up_ns = rec.committed_ns
        self._write_step(rec)
        log.info("checkpoint %s committed (%s)", name, source)
        self._emit("committed", rec)
        return rec

    def _maybe_commit_by_file(self, f: Inode, published: bool = False) -> None:
        """Commit the step whose marker file ``f`` is (once sealed and closed; ``published``:
        sealed at close(2) in scope=job, whose RELEASE may not have come yet)."""
        if f.name not in stepnames.COMMIT_FILES:
            return
        v = self.versions.get(f.vid) if f.vid is not None else None
        if v is None or not v.sealed or (v.writers and not published):
            return
        d = self.inodes.get(f.parent)
        if d is not None and d.parent == ROOT_INO:
            self._commit_step(d, stepnames.COMMIT_FILES[f.name])

    def _commit_sealed_markers(self) -> None:
        """Commit the steps whose marker file is sealed but whose commit was never recorded:
        a crash between the seal's transaction and the commit's."""
        root = self.inodes[ROOT_INO]
        for name, num in list(root.children.items()):  # type: ignore[union-attr]
            d = self.inodes.get(num)
            if d is None or not d.is_dir or stepnames.step_number(name) is None or \
                    name.decode(errors="surrogateescape") in self.steps:
                continue
            for marker in stepnames.COMMIT_FILES:
                f = self.inodes.get(d.children.get(marker, 0))  # type: ignore[union-attr]
                if f is not None and f.is_file:
                    with self.db.transaction():
                        self._maybe_commit_by_file(f)

    def _step_changed(self, ino: Inode) -> None:
        """A file in a committed step changed: its backup copy no longer matches."""
        rec = self.step_of(ino)
        if rec is not None:
            rec.replicated = 0
            rec.generation += 1
            self._emit("step_changed", rec)
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
            if any(v.missing for v in versions) and not self.job_scope:
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
                        self.vstore.write(v)
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
        ino = self.tree.resolve(path)
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
        base = self.tree.path_of(top) or ""
        stack = [(base, top)]
        while stack:
            path, ino = stack.pop()
            yield path, ino
            if ino.is_dir:
                for name, child in sorted(ino.children.items(), reverse=True):  # type: ignore[union-attr]
                    stack.append((f"{path}/{name.decode(errors='surrogateescape')}" if path
                                  else name.decode(errors="surrogateescape"), self.inodes[child]))

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
            elif ino.kind == "special":  # metadata only: carried as such, no data
                entries.append(Entry(path, "special", perm, ino.mtime_ns,
                                     node=special_node(ino.mode), rdev=ino.rdev))
            else:
                v = self.versions[ino.vid]  # type: ignore[index]
                if v.origin >= 0:
                    continue  # scope=job: another rank's file; that rank backs it up
                v.pins += 1
                pinned.append(v)
                entries.append(Entry(path, "file", perm, ino.mtime_ns, size=v.size,
                                     chunk_size=v.chunk_size, chunks=v.chunks, blake3=v.blake3))
        m = StepManifest(job=self.job, step=name, step_number=rec.number,
                         created_ns=_now_ns(), entries=entries, rank=self.rank)
        return m, pinned

    def step_in_ram(self, rec: StepRecord) -> bool:
        """True when every chunk of every file of the step is in RAM (nothing to fault in)."""
        return all(not v.missing for v in self._step_versions(rec) if v.origin < 0)

    def unpin(self, versions: Iterable[Version]) -> None:
        for v in versions:
            v.pins -= 1
            self.vstore.release(v)

    def chunk_reader(self, versions: list[Version], *,
                     verify: bool = True) -> Callable[[str], bytes]:
        """A thread-safe ``read_chunk(digest) -> bytes`` over pinned versions (for uploads).

        Args:
            versions: pinned versions whose chunks may be asked for.
            verify: re-hash each chunk read. Uploads to the backup tier need it (the bucket
                checks nothing); a peer verifies every chunk it receives and refuses a
                mismatch (DATA_LOSS), so replication passes False and saves a blake3 pass.

        The returned function raises FsError(EIO) for a chunk whose bytes no longer match
        (when verifying), or that is not in RAM.
        """
        where: dict[str, tuple[Version, int]] = {}
        for v in versions:  # each read leases a descriptor (read_chunk_at)
            for i, d in enumerate(v.chunks):
                if i not in v.missing:
                    where.setdefault(d, (v, i))

        def read_chunk(digest: str) -> bytes:
            loc = where.get(digest)
            if loc is None:
                raise FsError(errno.EIO, f"chunk {digest[:16]} is not in RAM (still being"
                              " restored, or evicted)")
            v, i = loc
            off, length = chunk_span(i, v.size, v.chunk_size)
            data = self.read_chunk_at(v, off, length, digest if verify else None)
            if data is None:
                raise FsError(errno.EIO, f"local chunk {digest[:16]} is corrupt")
            return data
        return read_chunk

    def has_local_chunk(self, digest: str) -> bool:
        """Whether this node's own files hold chunk ``digest`` in RAM now.

        Safe to call from other threads (a dict lookup and a set membership test, each
        atomic under the GIL); the answer may be stale by the time it is used.
        """
        return self.chunk_index.holds(digest)

    def pin_chunk(self, digest: str) -> tuple[Version, int, int] | None:
        """Pin a version holding chunk ``digest``: (version, offset, length), or None.

        Call on the loop; read with :meth:`read_chunk_at` in any thread, then :meth:`unpin`.
        """
        loc = self.chunk_index.locate(digest)
        if loc is None:
            return None
        v, idx = loc
        v.pins += 1
        self.vstore.fd(v)
        off, length = chunk_span(idx, v.size, v.chunk_size)
        return v, off, length

    def mark_backed_up(self, name: str, versions: list[Version]) -> None:
        """Record that step ``name`` (with these versions) is complete in the backup tier."""
        with self.db.transaction():
            for v in versions:
                if v.vid in self.versions and not v.backed_up:
                    v.backed_up = True
                    self.vstore.write(v)
            rec = self.steps.get(name)
            if rec is not None:
                rec.backed_up_ns = _now_ns()
                self._write_step(rec)

    def backup_pending(self) -> str | None:
        """The step whose backup started and had not completed when the daemon stopped."""
        return self.db.get_kv("backup_pending") or None

    def set_backup_pending(self, name: str | None) -> None:
        """Record (durably) that the backup of ``name`` started; None: it completed."""
        with self.db.transaction():
            self.db.set_kv("backup_pending", name or "")

    def import_step(self, m: StepManifest, *, backed_up: bool = True) -> StepRecord:
        """Create the namespace of a step with no data yet (restore).

        Files appear at once with their sizes; their chunks are missing and are faulted in
        on read or by the background prefetcher.
        A symlink entry whose target is absolute or leaves the mount is not created (logged;
        docs/security-local.md), whoever wrote the manifest.

        Args:
            m: the step's manifest (from the backup tier or a peer).
            backed_up: the backup tier holds the step complete (then its data may leave RAM
                again under the keep= policy); False for a step restored from peers only.

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
                parent = self.tree.resolve(parent_path)
                name = base.encode(errors="surrogateescape")
                if e.kind == "symlink" and escapes(
                        e.target.encode(errors="surrogateescape"),
                        len([p for p in parent_path.split("/") if p not in ("", ".")])):
                    # docs/security-local.md: never made, whoever wrote the manifest
                    log.warning("restore of %s: symlink %s -> %r points outside the mount:"
                                " not created", m.step, e.path, e.target)
                    continue
                if e.kind == "dir":
                    ino = self.tree.new("dir", stat.S_IFDIR | e.mode, uid, gid)
                    parent.nlink += 1
                elif e.kind == "symlink":
                    ino = self.tree.new("symlink", stat.S_IFLNK | 0o777, uid, gid)
                    ino.target = e.target.encode(errors="surrogateescape")
                elif e.kind == "special":
                    ino = self.tree.new("special", SPECIAL_MODES[e.node] | e.mode, uid, gid)
                    ino.rdev = e.rdev
                else:
                    ino = self.tree.new("file", stat.S_IFREG | e.mode, uid, gid)
                    v = self.vstore.new_sealed(ino.ino, e.size, e.chunk_size or self.chunk_size,
                                               e.chunks, e.blake3, backed_up=backed_up,
                                               keep_open=False)  # opened again when read
                    ino.vid = v.vid
                ino.mtime_ns = e.mtime_ns
                self.tree.link(parent, name, ino)
                self.tree.write(ino)
                self.tree.write(parent)
            top = self.tree.resolve(m.step)
            rec = StepRecord(name=m.step, number=m.step_number, ino=top.ino,
                             committed_ns=_now_ns(), source="restore",
                             backed_up_ns=_now_ns() if backed_up else None)
            self.steps[m.step] = rec
            self._write_step(rec)
        for v in [self.versions[i.vid] for _p, i in self.walk(top) if i.is_file]:
            self.chunk_index.add_version(v)
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
        try:
            work = [(v, i) for v in versions for i in range(len(v.chunks)) if i not in v.missing]
            bad = await trio.to_thread.run_sync(self._rehash, work, progress, self.fds,
                                                limiter=self.cpu_limiter)
        finally:
            self.unpin(versions)
        out = []
        for v in versions:  # every chunk held was hashed: no first-read hash (core/verifier.py)
            self.verifier.drop(v.vid)
        for v, i in bad:
            if self.versions.get(v.vid) is v and i not in v.missing:
                await self.verifier.verify_chunk(v, i, scrub=True)  # known bad: never served again
            off, length = chunk_span(i, v.size, v.chunk_size)
            ino = self.inodes.get(v.ino)
            path = self.tree.path_of(ino) if ino is not None and ino.vid == v.vid else None
            out.append(f"{path or f'version {v.vid}'}: chunk {i} (bytes {off}..{off + length})"
                       f" does not match {v.chunks[i][:16]}")
        return out

    @staticmethod
    def _rehash(work: list[tuple[Version, int]], progress: Callable[[int, int], None] | None,
                fds: FdCache) -> list[tuple[Version, int]]:
        """Worker-thread half of :meth:`verify`: the (version, chunk) pairs that mismatch."""
        total = sum(chunk_span(i, v.size, v.chunk_size)[1] for v, i in work)
        done, bad = 0, []
        for v, i in work:
            off, length = chunk_span(i, v.size, v.chunk_size)
            fd = fds.lease(v)
            try:
                data = os.pread(fd, length, off)
            finally:
                fds.unlease(v, fd)
            if chunk_hash(data) != v.chunks[i]:
                bad.append((v, i))
            done += length
            if progress:
                progress(done, total)
        return bad
