"""Capacity of the RAM tier: reservations, eviction of old checkpoints, statfs.

A part of :class:`mtcfs.fs.core.Filesystem` (mixed in); see that module for the
concurrency protocol every method follows.
"""

from __future__ import annotations

import errno
import logging
import os

from mtcfs.chunking import chunk_count
from mtcfs.errors import FsError
import trio

from mtcfs.fs.model import ROOT_INO, Handle, Version
from mtcfs.fs.records import StepRecord

log = logging.getLogger("mtcfs.fs.core")

#: The largest file, in bytes (beyond: EFBIG). Holes cost nothing against size=, but a
#: file is hashed whole when sealed, holes included (about 2 GB/s): 1 TiB is minutes.
MAX_FILE_SIZE = 1 << 40
#: Seconds a reservation short of space, or statfs, waits for the RELEASE of unlinked files
#: whose last close(2) was seen (the kernel sends RELEASE after close returns).
RELEASE_WAIT_S = 1.0
#: Allocation unit assumed for a reservation (tmpfs allocates pages).
PAGE = 4096


class CapacityOps:
    """Capacity of the RAM tier: reservations, eviction of old checkpoints, statfs."""

    # ------------------------------------------------------------------ capacity

    def _account(self, v: Version) -> None:
        """Measure what the data file of ``v`` really holds (st_blocks) and count the change
        against size=: the accounting rule (docs/architecture.md, "Capacity")."""
        try:
            alloc = os.fstat(self._fd(v)).st_blocks * 512
        except OSError:
            return
        self.used += alloc - v.alloc
        v.alloc = alloc

    def _new_bytes(self, v: Version, off: int, end: int) -> int:
        """At most how many bytes writing ``[off, end)`` of ``v`` adds to the store: the pages
        of the range from its first hole on (none when the range is all data)."""
        start = off
        if off < v.size:
            try:
                start = os.lseek(self._fd(v), off, os.SEEK_HOLE)
            except OSError:
                start = off
            if start >= end:
                return 0
        return (-(-end // PAGE) - start // PAGE) * PAGE

    def _releases_in_flight(self) -> list[Handle]:
        out = []
        for h in self.handles.values():
            if isinstance(h, Handle) and h.closed:
                ino = self.inodes.get(h.ino)
                if ino is not None and ino.nlink == 0:
                    out.append(h)
        return out

    async def settle_releases(self) -> None:
        """Wait (at most RELEASE_WAIT_S) for the RELEASE of unlinked files already closed:
        their space comes back then. A handle is waited for once."""
        pending = self._releases_in_flight()
        if not pending:
            return
        with trio.move_on_after(RELEASE_WAIT_S):
            while any(self.handles.get(h.fh) is h for h in pending):
                ev = self.__dict__.setdefault("_released", trio.Event())
                await ev.wait()
        for h in pending:
            h.closed = False  # still open past the wait (mapped, or held): not waited again

    def _released_one(self) -> None:
        ev = self.__dict__.pop("_released", None)
        if ev is not None:
            ev.set()

    async def _reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` more bytes of data, evicting checkpoints if needed.

        Raises:
            FsError: ENOSPC when eviction cannot free enough.
        """
        shared = self.shared_used()
        if self.used + shared + nbytes <= self.capacity:
            return
        await self.settle_releases()
        shared = self.shared_used()
        if self.used + shared + nbytes <= self.capacity:
            return
        self.evict(need=self.used + shared + nbytes - self.capacity)
        if self.used + shared + nbytes > self.capacity:
            self.counters.enospc += 1
            raise FsError(errno.ENOSPC, f"RAM tier full ({self.used} bytes of files and {shared}"
                          f" of peer replicas, of {self.capacity} bytes)")

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
                total += self.versions[ino.vid].alloc  # type: ignore[index]
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
            if self.ns_log is not None:
                # scope=job: the namespace is the job's; drop only data held elsewhere
                # (other ranks' files, and own files the backup tier holds).
                self._drop_step_data(s, others_only=s.backed_up_ns is None)
            elif s.backed_up_ns is not None:
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

    def _drop_step_data(self, s: StepRecord, others_only: bool = False) -> None:
        with self.db.transaction():
            for v in self._step_versions(s):
                if not v.sealed or v.pins or (others_only and v.origin < 0):
                    continue
                self._hand_over_last_copies(v)
                for d in v.chunks:  # first, so that other local copies take over at once
                    self._forget_chunk(d, v.vid)
                fd = self._fd(v)
                os.ftruncate(fd, 0)
                os.ftruncate(fd, v.size)
                v.missing = set(range(chunk_count(v.size, v.chunk_size)))
                self._account(v)
                self._write_version(v)

    def _delete_tree(self, s: StepRecord) -> None:
        top = self.inodes[s.ino]
        items = list(self.walk(top))
        with self.db.transaction():
            for _path, ino in reversed(items):
                parent, name = self.inodes[ino.parent], ino.name
                if ino.is_dir:
                    self._remove_dir_entry(parent, name, ino)  # forgets the step at the top
                else:
                    self._unlink_entry(parent, name)
                    self._drop_link(ino, parent, name)
            self._touch_dir(self.inodes[ROOT_INO])
        self._emit("invalidate_entry", (ROOT_INO, s.name.encode(errors="surrogateescape"), top.ino))
        for _path, ino in items:
            self._maybe_free_inode(ino)

    def statfs(self) -> dict[str, int]:
        """Capacity figures in bytes (the RAM tier's ``size=``, not the tmpfs's). ``used`` is
        what the store's data files really hold (holes cost nothing), plus the replicas."""
        shared = self.shared_used()
        return {"capacity": self.capacity, "used": self.used + shared, "replicas": shared,
                "free": max(0, self.capacity - self.used - shared), "files": len(self.inodes)}
