"""What the backup and restore tiers need of the core beyond the step registry: pins, chunk
reads, imports, verification. The steps themselves (commit detection, records, backup
state) are :class:`mtcfs.core.step_registry.StepRegistry`'s.

:class:`Checkpoints` holds no state of its own: the pins are counts on the versions (the
version store's), the chunk locations the chunk index's. It changes the other components
through their methods only. Every method runs on the trio thread, except the function
:meth:`Checkpoints.chunk_reader` returns (any thread) and the hashing of :meth:`verify`
(a worker thread); see core/core.py for the concurrency protocol.
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
from mtcfs.core.chunkmap import ChunkIndex
from mtcfs.core.inodes import InodeTable
from mtcfs.core.model import ROOT_INO, Version
from mtcfs.core.records import StepRecord, now_ns as _now_ns
from mtcfs.core.step_registry import StepRegistry
from mtcfs.core.symlinks import escapes
from mtcfs.base.manifest import SPECIAL_MODES, StepManifest
from mtcfs.core.store.fdcache import FdCache
from mtcfs.core.store.meta import MetaDB
from mtcfs.core.verifier import Verifier
from mtcfs.core.versions import VersionStore, read_data

__all__ = ["Checkpoints"]

log = logging.getLogger("mtcfs.core.core")


class Checkpoints:
    """Pins, chunk reads over pinned versions, step imports and ``mtcfs verify``.

    Args:
        db: the store's metadata database (an import is one transaction).
        tree: the core's inode table.
        vstore: the core's version store (its versions, descriptors and releases).
        step_registry: the core's step registry (an import adds its step).
        chunk_index: the core's chunk index.
        verifier: the core's verifier (``mtcfs verify`` settles its first-read hashes).
        cpu_limiter: the limiter of the hashing threads.
        chunk_size: bytes, the chunk size of an imported file whose manifest gives none.
    """

    def __init__(self, *, db: MetaDB, tree: InodeTable, vstore: VersionStore,
                 step_registry: StepRegistry, chunk_index: ChunkIndex, verifier: Verifier,
                 cpu_limiter: trio.CapacityLimiter, chunk_size: int) -> None:
        self._db = db
        self._tree = tree
        self._vstore = vstore
        self._step_registry = step_registry
        self._chunk_index = chunk_index
        self._verifier = verifier
        self._cpu_limiter = cpu_limiter
        self._chunk_size = chunk_size

    # ------------------------------------------------------------------ backup / restore support

    def unpin(self, versions: Iterable[Version]) -> None:
        """Release one pin of each of ``versions`` (taken by a snapshot, :meth:`pin_chunk`
        or :meth:`verify`); a version freed meanwhile loses its data file with its last pin."""
        for v in versions:
            v.pins -= 1
            self._vstore.release(v)

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
            data = self._vstore.read_verified(v, off, length, digest if verify else None)
            if data is None:
                raise FsError(errno.EIO, f"local chunk {digest[:16]} is corrupt")
            return data
        return read_chunk

    def pin_chunk(self, digest: str) -> tuple[Version, int, int] | None:
        """Pin a version holding chunk ``digest``: (version, offset, length), or None.

        Call on the loop; read with the core's ``read_chunk_at`` in any thread, then
        :meth:`unpin`.
        """
        loc = self._chunk_index.locate(digest)
        if loc is None:
            return None
        v, idx = loc
        v.pins += 1
        self._vstore.fd(v)
        off, length = chunk_span(idx, v.size, v.chunk_size)
        return v, off, length

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
            FsError: EEXIST if the step's directory already exists; EINVAL for a manifest
                whose entries cannot make a tree (not the step's directory first, an entry
                before its directory or twice, a bad name or kind): nothing is made then.
        """
        root = self._tree.inodes[ROOT_INO]
        if m.step.encode() in root.children:  # type: ignore[operator]
            raise FsError(errno.EEXIST, f"{m.step} already exists")
        self._check_tree(m)
        uid, gid = os.getuid(), os.getgid()
        with self._db.transaction():
            for e in m.entries:
                parent_path, _, base = e.path.rpartition("/")
                parent = self._tree.resolve(parent_path)
                name = base.encode(errors="surrogateescape")
                if e.kind == "symlink" and escapes(
                        e.target.encode(errors="surrogateescape"),
                        len([p for p in parent_path.split("/") if p not in ("", ".")])):
                    # docs/security-local.md: never made, whoever wrote the manifest
                    log.warning("restore of %s: symlink %s -> %r points outside the mount:"
                                " not created", m.step, e.path, e.target)
                    continue
                if e.kind == "dir":
                    ino = self._tree.new("dir", stat.S_IFDIR | e.mode, uid, gid)
                    parent.nlink += 1
                elif e.kind == "symlink":
                    ino = self._tree.new("symlink", stat.S_IFLNK | 0o777, uid, gid)
                    ino.target = e.target.encode(errors="surrogateescape")
                elif e.kind == "special":
                    ino = self._tree.new("special", SPECIAL_MODES[e.node] | e.mode, uid, gid)
                    ino.rdev = e.rdev
                else:
                    ino = self._tree.new("file", stat.S_IFREG | e.mode, uid, gid)
                    v = self._vstore.new_sealed(ino.ino, e.size, e.chunk_size or self._chunk_size,
                                               e.chunks, e.blake3, backed_up=backed_up,
                                               keep_open=False)  # opened again when read
                    ino.vid = v.vid
                ino.mtime_ns = e.mtime_ns
                self._tree.link(parent, name, ino)
                self._tree.write(ino)
                self._tree.write(parent)
            top = self._tree.resolve(m.step)
            rec = StepRecord(name=m.step, number=m.step_number, ino=top.ino,
                             committed_ns=_now_ns(), source="restore",
                             backed_up_ns=_now_ns() if backed_up else None)
            self._step_registry.add(rec)
        versions = self._vstore.versions
        for v in [versions[i.vid] for _p, i in self._tree.walk(top) if i.is_file]:  # type: ignore[index]
            self._chunk_index.add_version(v)
        return rec

    def _check_tree(self, m: StepManifest) -> None:
        """Refuse (EINVAL) a manifest :meth:`import_step` could apply only in part: every
        check that can fail there is made here, before anything is linked."""
        def bad(why: str) -> FsError:
            return FsError(errno.EINVAL, f"manifest of step {m.step}: {why}")
        if not m.entries or m.entries[0].path != m.step or m.entries[0].kind != "dir":
            raise bad("it does not start with the step's directory")
        try:
            self._tree.check_name(m.step.encode(errors="surrogateescape"))
        except FsError:
            raise bad(f"{m.step!r} is not a name") from None
        dirs, seen = {m.step}, {m.step}
        for e in m.entries[1:]:
            parent_path, _, base = e.path.rpartition("/")
            if parent_path not in dirs:
                raise bad(f"{e.path!r} comes before its directory, or has none")
            if e.path in seen:
                raise bad(f"{e.path!r} comes twice")
            try:
                self._tree.check_name(base.encode(errors="surrogateescape"))
            except FsError:
                raise bad(f"{e.path!r} has no valid name") from None
            if e.kind not in ("dir", "file", "symlink", "special") or \
                    (e.kind == "special" and e.node not in SPECIAL_MODES):
                raise bad(f"{e.path!r} is of no known kind ({e.kind!r})")
            seen.add(e.path)
            if e.kind == "dir":
                dirs.add(e.path)

    async def verify(self, progress: Callable[[int, int], None] | None = None) -> list[str]:
        """Re-hash every chunk of every sealed version held in RAM (``mtcfs verify``).

        The versions are pinned on the loop, hashed in a worker thread, and unpinned.

        Args:
            progress: called from the worker thread with (bytes done, bytes total).

        Returns:
            one message per chunk whose bytes do not match its digest.
        """
        versions = [v for v in self._vstore.versions.values() if v.sealed]
        for v in versions:
            v.pins += 1
        try:
            work = [(v, i) for v in versions for i in range(len(v.chunks)) if i not in v.missing]
            bad = await trio.to_thread.run_sync(self._rehash, work, progress, self._vstore.fds,
                                                limiter=self._cpu_limiter)
        finally:
            self.unpin(versions)
        out = []
        for v in versions:  # every chunk held was hashed: no first-read hash (core/verifier.py)
            self._verifier.drop(v.vid)
        for v, i in bad:
            if self._vstore.versions.get(v.vid) is v and i not in v.missing:
                await self._verifier.verify_chunk(v, i, scrub=True)  # known bad: never served again
            off, length = chunk_span(i, v.size, v.chunk_size)
            ino = self._tree.inodes.get(v.ino)
            path = self._tree.path_of(ino) if ino is not None and ino.vid == v.vid else None
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
            data = read_data(fds, v, off, length)
            if chunk_hash(data) != v.chunks[i]:
                bad.append((v, i))
            done += length
            if progress:
                progress(done, total)
        return bad
