"""Capacity of the RAM tier: reservations, eviction of old checkpoints, statfs.

A part of :class:`mtcfs.core.core.Filesystem` (mixed in); see that module for the
concurrency protocol every method follows.
"""

from __future__ import annotations

import logging
import os

import trio

from mtcfs.base.chunking import chunk_count
from mtcfs.base import steps as stepnames
from mtcfs.core.model import ROOT_INO, Handle, Inode, Version
from mtcfs.core.records import StepRecord

log = logging.getLogger("mtcfs.core.core")

#: The largest file, in bytes (beyond: EFBIG). Holes cost nothing against size=, but a
#: file is hashed whole when sealed, holes included (about 2 GB/s): 1 TiB is minutes.
MAX_FILE_SIZE = 1 << 40
#: Seconds a reservation short of space, or statfs, waits for the RELEASE of unlinked files
#: whose last close(2) was seen (the kernel sends RELEASE after close returns).
RELEASE_WAIT_S = 1.0


class CapacityOps:
    """Capacity of the RAM tier: reservations, eviction of old checkpoints, statfs."""

    # ------------------------------------------------------------------ capacity

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

    def _make_room(self, need: int, keep_unsaved: bool) -> None:
        """The budget's eviction hook (core/budget.py, ``reserve``): evict at least ``need``
        bytes if the policy allows; ``keep_unsaved`` (a read's reservation) never deletes a
        step no other tier holds."""
        unsaved = self.evict_unsaved
        if keep_unsaved:
            self.evict_unsaved = False
        try:
            self.evict(need=need)
        finally:
            self.evict_unsaved = unsaved

    def evictable_steps(self, *, pressure: bool) -> list[StepRecord]:
        """Committed steps that may leave RAM, in the order they leave it.

        Never the newest committed step, never one being backed up; without memory pressure
        also never one of the newest ``keep`` steps, and only steps already backed up.
        Under pressure, steps the backup tier holds (their data leaves RAM, nothing is
        lost) go first, oldest first; then, only when :attr:`evict_unsaved` allows it, the
        steps no other tier holds (deleted), oldest first, stopping at the first one that
        cannot go now (open, or being backed up) rather than deleting a newer one.
        """
        ordered = sorted(self.steps.values(), key=lambda s: (s.number, s.committed_ns))
        if not ordered:
            return []
        protected = {ordered[-1].name}
        if not pressure:
            protected.update(s.name for s in ordered[-self.keep:] if self.keep > 0)
        saved, unsaved = [], []
        for s in ordered:
            if s.name in protected:
                continue
            if s.backed_up_ns is None:
                if pressure:
                    unsaved.append(s)
                continue
            if s.backing_up or self._step_local_bytes(s) == 0:
                continue
            saved.append(s)
        if not self.evict_unsaved:
            return saved
        lossy = []
        for s in unsaved:
            if s.backing_up or any(v.handles for v in self._step_versions(s)):
                break  # oldest first: never a newer unsaved step in its place
            lossy.append(s)
        return saved + lossy

    def _step_local_bytes(self, s: StepRecord) -> int:
        total = 0
        for _p, ino in self.walk(self.inodes[s.ino]):
            if ino.is_file:
                total += self.versions[ino.vid].alloc  # type: ignore[index]
        return total

    def crash_leftovers(self) -> list[Inode]:
        """Top-level directories a save killed by a crash left behind, oldest step first.

        A directory is a leftover only if all hold (docs/usage.md, "Capacity and eviction"):
        (a) the daemon before this one did not stop cleanly (``previous_crash``; a store
        created fresh had no run before); (b) it is, by its library's own definition, an
        unfinished save (base/steps.py): a DCP step directory of ``*.distcp`` shards without
        ``.metadata``, or an Orbax temporary directory; a directory of plain files
        (torch.save, HF ``checkpoint-N``, committed by ``mtcfs seal``) never is; (c) it
        holds no commit marker file, and no file that is unsealed, being sealed, open or
        pinned; (d) nothing in it changed since the store was loaded (a job writing into it
        again makes it a save in progress). It was uncommitted at load and still is.
        """
        if not self._leftover_dirs:
            return []
        root = self.inodes[ROOT_INO]
        out = []
        for name, num in root.children.items():  # type: ignore[union-attr]
            d = self.inodes.get(num)
            key = name.decode(errors="surrogateescape")
            if d is None or not d.is_dir or key in self.steps or num not in self._leftover_dirs:
                continue
            if stepnames.is_orbax_tmp(name):
                dcp = False
            elif stepnames.step_number(name) is not None:
                dcp = True
            else:
                continue
            if self._unfinished_save(d, dcp=dcp):
                out.append(d)
        out.sort(key=lambda d: (stepnames.step_number(d.name) or
                                stepnames.orbax_tmp_step(d.name) or 0, d.ino))
        return out

    def _unfinished_save(self, top: Inode, *, dcp: bool) -> bool:
        """Rules (b) to (d) of :meth:`crash_leftovers` for the directory ``top``."""
        shards = False
        for _p, ino in self.walk(top):
            if ino.ino not in self._inos_at_load or ino.mtime_ns > self._loaded_ns:
                return False  # (d) changed since load
            if ino is top:
                continue
            if ino.name in stepnames.COMMIT_FILES:
                return False  # (c) a commit marker, sealed or not (it may be sealed yet)
            if ino.is_file:
                v = self.versions.get(ino.vid) if ino.vid is not None else None
                if v is None or not v.sealed or v.sealing is not None or v.handles \
                        or v.writers or v.pins:
                    return False  # (c)
            if dcp:  # (b) DCP writes its files flat in the step directory
                if not ino.is_file or ino.parent != top.ino or not stepnames.is_dcp_file(ino.name):
                    return False
                shards = shards or ino.name != stepnames.DCP_METADATA_TMP
        return shards or not dcp

    def _evict_leftovers(self, need: int, start_used: int) -> None:
        for d in self.crash_leftovers():
            if start_used - self.budget.used >= need:
                return
            name = d.name.decode(errors="surrogateescape")
            self._delete_dir_tree(d)
            self._leftover_dirs.discard(d.ino)
            self.counters.evicted_leftovers += 1
            log.warning("deleted %s from RAM under memory pressure: the incomplete leftover of"
                        " a save a crash interrupted (never committed)", name)

    def evict(self, need: int | None = None) -> list[str]:
        """Evict checkpoints from RAM (``mtcfs gc``, the keep= policy, memory pressure).

        A step that is in the backup keeps its namespace and drops its data (read again, it
        is faulted back in); a step that is not is deleted (only under pressure, and only
        with ``evict_unsaved``: counted, logged and shown in status as a warning). With
        ``need`` (bytes), first deletes the incomplete leftovers of saves a crash
        interrupted, and stops once enough is free; without, applies the keep= policy.

        Returns:
            names of the evicted steps.
        """
        pressure = need is not None
        freed_names = []
        start_used = self.budget.used
        if pressure and self.ns_log is None:
            self._evict_leftovers(need, start_used)  # type: ignore[arg-type]
        for s in self.evictable_steps(pressure=pressure):
            if pressure and start_used - self.budget.used >= need:  # type: ignore[operator]
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
                self.counters.deleted_unsaved_steps += 1
                msg = (f"deleted checkpoint {s.name} from RAM under memory pressure: no other"
                       " tier held it (not backed up); it is lost (evict_unsaved=yes)")
                log.warning("%s", msg)
                self.unsaved_deleted.append(s.name)
                self.unsaved_deleted[:] = self.unsaved_deleted[-20:]
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
                # first, so that other local copies take over at once
                self.chunk_index.forget_version(v)
                fd = self._fd(v)
                os.ftruncate(fd, 0)
                os.ftruncate(fd, v.size)
                v.missing = set(range(chunk_count(v.size, v.chunk_size)))
                self.budget.account(v)
                self._write_version(v)

    def _delete_tree(self, s: StepRecord) -> None:
        self._delete_dir_tree(self.inodes[s.ino])

    def _delete_dir_tree(self, top: Inode) -> None:
        """Delete the top-level directory ``top`` and everything below (a step is forgotten
        with its directory)."""
        name = top.name
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
        self._emit("invalidate_entry", (ROOT_INO, name, top.ino))
        for _path, ino in items:
            self._maybe_free_inode(ino)

    def statfs(self) -> dict[str, int]:
        """Capacity figures in bytes (the RAM tier's ``size=``, not the tmpfs's): ``capacity``,
        ``used`` (what the store's data files really hold, holes cost nothing, plus the
        replicas), ``replicas``, ``free``, ``files`` (inodes). See core/budget.py."""
        return self.budget.figures(len(self.inodes))
