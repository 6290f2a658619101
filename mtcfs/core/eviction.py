"""The eviction policy: which checkpoints leave RAM, and when.

:class:`Eviction` owns the policy's settings and memory: ``keep`` (complete steps always
kept, ``keep=``), ``evict_unsaved`` (``evict_unsaved=``), the last steps deleted unsaved
(status), and what the store held when it was loaded (the crash leftovers' rules). It
decides; :class:`mtcfs.core.capacity.Reclaim` acts: it drops a step's data or deletes a
tree (:class:`Actions`).

The RAM budget (core/budget.py) calls :meth:`Eviction.make_room` when a reservation is
short. Every method runs on the trio thread and none awaits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Protocol

from mtcfs.base import steps as stepnames
from mtcfs.core.model import ROOT_INO, Inode, Version
from mtcfs.core.records import Counters, StepRecord, oldest_first

__all__ = ["Actions", "Eviction", "Host"]

log = logging.getLogger("mtcfs.core.core")


class StepVersions(Protocol):
    """The step registry's read the policy makes (core/step_registry.py)."""

    def versions_of(self, rec: StepRecord) -> list[Version]: ...


class Walks(Protocol):
    """The inode table's walk (core/inodes.py)."""

    def walk(self, top: Inode) -> Iterator[tuple[str, Inode]]: ...


class Actions(Protocol):
    """What the policy has done when it decides (core/capacity.py, ``Reclaim``)."""

    def drop_step_data(self, s: StepRecord, others_only: bool = False) -> None: ...
    def delete_step(self, s: StepRecord) -> None: ...
    def delete_dir_tree(self, top: Inode) -> None: ...


class Host(Protocol):
    """What :class:`Eviction` may read of the core (the ``Filesystem`` facade)."""

    steps: dict[str, StepRecord]
    inodes: dict[int, Inode]
    step_registry: StepVersions
    tree: Walks
    versions: dict[int, Version]
    @property
    def job_scope(self) -> bool: ...
    @property
    def used(self) -> int: ...


class Eviction:
    """The eviction policy of one core.

    Args:
        host: the core (see :class:`Host`).
        actions: what carries out its decisions (see :class:`Actions`).
        counters: the core's counters (``evicted_steps``, ``deleted_unsaved_steps``,
            ``evicted_leftovers``).
        keep: complete checkpoints always kept in RAM (``keep=``).
    """

    def __init__(self, host: Host, actions: Actions, counters: Counters, keep: int) -> None:
        self._host = host
        self._actions = actions
        self._counters = counters
        self.keep = keep
        #: Under memory pressure, delete committed steps no other tier holds (oldest first,
        #: with a warning) instead of refusing the write with ENOSPC (``evict_unsaved=``).
        self.evict_unsaved = True
        #: The last steps deleted that way (status shows them as a warning).
        self.unsaved_deleted: list[str] = []
        #: Crash leftovers (:meth:`crash_leftovers`): when the store was loaded, the inodes
        #: there were then, and the top-level directories then uncommitted.
        self._loaded_ns = 0
        self._inos_at_load: set[int] = set()
        self._leftover_dirs: set[int] = set()

    def loaded(self, now_ns: int, *, previous_crash: bool) -> None:
        """The store was just loaded (``now_ns``: wall-clock ns): remember its inodes and, if
        the daemon before crashed, its uncommitted top-level directories."""
        host = self._host
        self._loaded_ns = now_ns
        self._inos_at_load = set(host.inodes)
        self._leftover_dirs = {num for name, num in host.inodes[ROOT_INO].children.items()  # type: ignore[union-attr]
                               if name.decode(errors="surrogateescape") not in host.steps} \
            if previous_crash else set()

    def make_room(self, need: int, keep_unsaved: bool) -> None:
        """The budget's hook (core/budget.py, ``reserve``): evict at least ``need`` bytes if
        the policy allows; ``keep_unsaved`` (a read's reservation) never deletes a step no
        other tier holds."""
        self.evict(need=need, keep_unsaved=keep_unsaved)

    def evictable_steps(self, *, pressure: bool, keep_unsaved: bool = False) -> list[StepRecord]:
        """Committed steps that may leave RAM, in the order they leave it.

        Never the newest committed step, never one being backed up; without memory pressure
        also never one of the newest ``keep`` steps, and only steps already backed up.
        Under pressure, steps the backup tier holds (their data leaves RAM, nothing is
        lost) go first, oldest first; then, only when :attr:`evict_unsaved` allows it, the
        steps no other tier holds (deleted), oldest first, stopping at the first one that
        cannot go now (open, or being backed up) rather than deleting a newer one.
        """
        ordered = oldest_first(self._host.steps.values())
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
        if keep_unsaved or not self.evict_unsaved:
            return saved
        lossy = []
        for s in unsaved:
            if s.backing_up or any(v.handles for v in self._host.step_registry.versions_of(s)):
                break  # oldest first: never a newer unsaved step in its place
            lossy.append(s)
        return saved + lossy

    def _step_local_bytes(self, s: StepRecord) -> int:
        """Bytes evicting ``s`` would free: its files' but those with another name (a hard
        link keeps its data, core/capacity.py ``drop_step_data``)."""
        total = 0
        for _p, ino in self._host.tree.walk(self._host.inodes[s.ino]):
            if ino.is_file and ino.nlink == 1:
                total += self._host.versions[ino.vid].alloc  # type: ignore[index]
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
        root = self._host.inodes[ROOT_INO]
        out = []
        for name, num in root.children.items():  # type: ignore[union-attr]
            d = self._host.inodes.get(num)
            key = name.decode(errors="surrogateescape")
            if d is None or not d.is_dir or key in self._host.steps or num not in self._leftover_dirs:
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
        for _p, ino in self._host.tree.walk(top):
            if ino.ino not in self._inos_at_load or ino.mtime_ns > self._loaded_ns:
                return False  # (d) changed since load
            if ino is top:
                continue
            if ino.name in stepnames.COMMIT_FILES:
                return False  # (c) a commit marker, sealed or not (it may be sealed yet)
            if ino.is_file:
                v = self._host.versions.get(ino.vid) if ino.vid is not None else None
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
            if start_used - self._host.used >= need:
                return
            name = d.name.decode(errors="surrogateescape")
            self._actions.delete_dir_tree(d)
            self._leftover_dirs.discard(d.ino)
            self._counters.evicted_leftovers += 1
            log.warning("deleted %s from RAM under memory pressure: the incomplete leftover of"
                        " a save a crash interrupted (never committed)", name)

    def evict(self, need: int | None = None, *, keep_unsaved: bool = False) -> list[str]:
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
        start_used = self._host.used
        if pressure and not self._host.job_scope:
            self._evict_leftovers(need, start_used)  # type: ignore[arg-type]
        candidates = [s for s in self.evictable_steps(pressure=pressure,
                                                      keep_unsaved=keep_unsaved)
                      if not any(v.handles for v in self._host.step_registry.versions_of(s))]
        if pressure and not self._host.job_scope and start_used - self._host.used + sum(
                self._step_local_bytes(s) for s in candidates) < need:  # type: ignore[operator]
            # Even all of it would not make the room: the request gets ENOSPC anyway, so
            # nothing is deleted for it (only data other tiers hold leaves RAM).
            candidates = [s for s in candidates if s.backed_up_ns is not None]
        for s in candidates:
            if pressure and start_used - self._host.used >= need:  # type: ignore[operator]
                break
            if self._host.job_scope:
                # scope=job: the namespace is the job's; drop only data held elsewhere
                # (other ranks' files, and own files the backup tier holds).
                self._actions.drop_step_data(s, others_only=s.backed_up_ns is None)
            elif s.backed_up_ns is not None:
                self._actions.drop_step_data(s)
            else:
                self._actions.delete_step(s)
                self._counters.deleted_unsaved_steps += 1
                msg = (f"deleted checkpoint {s.name} from RAM under memory pressure: no other"
                       " tier held it (not backed up); it is lost (evict_unsaved=yes)")
                log.warning("%s", msg)
                self.unsaved_deleted.append(s.name)
                self.unsaved_deleted[:] = self.unsaved_deleted[-20:]
            freed_names.append(s.name)
            self._counters.evicted_steps += 1
            log.info("evicted checkpoint %s from RAM (%s)", s.name,
                     "memory pressure" if pressure else f"keep={self.keep}")
        return freed_names
