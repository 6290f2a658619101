"""Capacity of the RAM tier, the facade's part: statfs, and what the
eviction policy does to the namespace (drop a step's data, delete a tree).

The budget is :class:`mtcfs.core.budget.RamBudget` (``Filesystem.budget``); the policy
that chooses what leaves RAM is :class:`mtcfs.core.eviction.Eviction`
(``Filesystem.eviction``). A part of :class:`mtcfs.core.core.Filesystem` (mixed in); see
that module for the concurrency protocol every method follows. The RELEASEs in flight of
unlinked files are the open files' (core/files.py: ``OpenFiles.settle_releases``).
"""

from __future__ import annotations

from mtcfs.core.model import ROOT_INO, Inode
from mtcfs.core.records import StepRecord

#: The largest file, in bytes (beyond: EFBIG). Holes cost nothing against size=, but a
#: file is hashed whole when sealed, holes included (about 2 GB/s): 1 TiB is minutes.
MAX_FILE_SIZE = 1 << 40


class CapacityOps:
    """Capacity of the RAM tier, the facade's part (see the module docstring)."""

    # ------------------------------------------------------------------ eviction (core/eviction.py)

    @property
    def evict_unsaved(self) -> bool:
        """Under memory pressure, delete committed steps no other tier holds (oldest first,
        with a warning) instead of refusing the write with ENOSPC (``evict_unsaved=``)."""
        return self.eviction.evict_unsaved

    @evict_unsaved.setter
    def evict_unsaved(self, allowed: bool) -> None:
        self.eviction.evict_unsaved = allowed

    @property
    def unsaved_deleted(self) -> list[str]:
        """The last steps deleted that way (status shows them as a warning)."""
        return self.eviction.unsaved_deleted

    def evict(self, need: int | None = None) -> list[str]:
        """Evict checkpoints from RAM (``mtcfs gc``, the keep= policy, memory pressure); see
        :meth:`mtcfs.core.eviction.Eviction.evict`. Returns the names of the evicted steps."""
        return self.eviction.evict(need)

    def crash_leftovers(self) -> list[Inode]:
        """Top-level directories a save killed by a crash left behind, oldest step first
        (:meth:`mtcfs.core.eviction.Eviction.crash_leftovers`)."""
        return self.eviction.crash_leftovers()

    def _drop_step_data(self, s: StepRecord, others_only: bool = False) -> None:
        with self.db.transaction():
            for v in self.step_registry.versions_of(s):
                if not v.sealed or v.pins or (others_only and v.origin < 0):
                    continue
                self.vstore.drop_data(v)  # core/versions.py; it stays, all missing

    def _delete_tree(self, s: StepRecord) -> None:
        self._delete_dir_tree(self.inodes[s.ino])

    def _delete_dir_tree(self, top: Inode) -> None:
        """Delete the top-level directory ``top`` and everything below (a step is forgotten
        with its directory)."""
        name = top.name
        items = list(self.tree.walk(top))
        with self.db.transaction():
            for _path, ino in reversed(items):
                parent, name = self.inodes[ino.parent], ino.name
                if ino.is_dir:
                    self._remove_dir_entry(parent, name, ino)  # forgets the step at the top
                else:
                    self.tree.unlink(parent, name)
                    self._drop_link(ino, parent, name)
            self.tree.touch(self.inodes[ROOT_INO])
        self._emit("invalidate_entry", (ROOT_INO, name, top.ino))
        for _path, ino in items:
            self._maybe_free_inode(ino)

    def statfs(self) -> dict[str, int]:
        """Capacity figures in bytes (the RAM tier's ``size=``, not the tmpfs's): ``capacity``,
        ``used`` (what the store's data files really hold, holes cost nothing, plus the
        replicas), ``replicas``, ``free``, ``files`` (inodes). See core/budget.py."""
        return self.budget.figures(len(self.inodes))
