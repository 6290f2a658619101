"""Capacity of the RAM tier: what the eviction policy does to the namespace.

:class:`Reclaim` carries out the eviction policy's decisions (core/eviction.py): drop a
step's data (the step stays, its chunks missing, faulted in again when read), or delete a
step's directory tree, or any top-level directory's (a save a crash interrupted). It holds
no state of its own: it changes the inode table, the version store and the step registry
through their methods, and removes names through :class:`~mtcfs.core.entries.Entries`.

The budget is :class:`mtcfs.core.budget.RamBudget` (``Filesystem.budget``: statfs'
figures are its), the policy :class:`mtcfs.core.eviction.Eviction`
(``Filesystem.eviction``). The RELEASEs in flight of unlinked files are the open files'
(core/files.py: ``OpenFiles.settle_releases``). Every method runs on the trio thread and
none awaits; see core/core.py for the concurrency protocol.
"""

from __future__ import annotations

from typing import Any, Protocol

from mtcfs.base.failpoints import failpoint
from mtcfs.core.entries import Entries
from mtcfs.core.inodes import InodeTable
from mtcfs.core.model import ROOT_INO, Inode
from mtcfs.core.records import StepRecord
from mtcfs.core.step_registry import StepRegistry
from mtcfs.core.store.meta import MetaDB
from mtcfs.core.versions import VersionStore

__all__ = ["MAX_FILE_SIZE", "Host", "Reclaim"]

#: The largest file, in bytes (beyond: EFBIG). Holes cost nothing against size=, but a
#: file is hashed whole when sealed, holes included (about 2 GB/s): 1 TiB is minutes.
MAX_FILE_SIZE = 1 << 40


class Host(Protocol):
    """What :class:`Reclaim` may use of the core (the ``Filesystem`` facade): the events."""

    def _emit(self, event: str, obj: Any) -> None: ...


class Reclaim:
    """Frees RAM the eviction policy chose: a step's data, or a whole directory tree.

    Args:
        host: the core (see :class:`Host`).
        db: the store's metadata database (each action is one transaction).
        tree: the core's inode table.
        vstore: the core's version store.
        step_registry: the core's step registry (the versions of a step).
        entries: the core's changes of directory entries (a name removed, an inode freed).
    """

    def __init__(self, host: Host, *, db: MetaDB, tree: InodeTable, vstore: VersionStore,
                 step_registry: StepRegistry, entries: Entries) -> None:
        self._host = host
        self._entries = entries
        self._db = db
        self._tree = tree
        self._vstore = vstore
        self._step_registry = step_registry

    def drop_step_data(self, s: StepRecord, others_only: bool = False) -> None:
        """Drop the data of step ``s``'s sealed, unpinned versions from RAM; the versions
        stay, every chunk missing. ``others_only`` (scope=job): only other ranks' files.

        A file with another name (a hard link, maybe outside the step) keeps its data: the
        backup tier keeps its chunks only while it keeps the step, and that name would
        outlive the step's retirement with its bytes nowhere (the same rule as a file
        taken out of a step, core/namespace.py). A file open in passthrough mode keeps its
        data too, until its handles are released."""
        inodes = self._tree.inodes
        with self._db.transaction():
            for v in self._step_registry.versions_of(s):
                if not v.sealed or v.pins or (others_only and v.origin < 0):
                    continue
                if inodes[v.ino].nlink > 1 or inodes[v.ino].pt_opens:
                    # (pt_opens: the kernel reads the data file itself for the file's
                    # passthrough handles, whichever version they opened: the holes the
                    # drop leaves would be read as zeros, never faulted in)
                    continue
                self._vstore.drop_data(v)  # core/versions.py; it stays, all missing
            failpoint("core.evict_in_transaction")  # tests: a crash before that commit

    def delete_step(self, s: StepRecord) -> None:
        """Delete step ``s``: its directory and everything below (:meth:`delete_dir_tree`)."""
        self.delete_dir_tree(self._tree.inodes[s.ino])

    def delete_dir_tree(self, top: Inode) -> None:
        """Delete the top-level directory ``top`` and everything below (a step is forgotten
        with its directory), in one transaction; the kernel is told to forget ``top``'s
        name (event ``invalidate_entry``), and each inode is freed once nothing holds it."""
        inodes = self._tree.inodes
        # Every entry below, as (directory, name, inode), a directory's before its own
        # children's; removed children first. Each by the name found here: a file's
        # ``parent``/``name`` is its latest link, which may be outside ``top`` (a hard
        # link) and stays.
        below: list[tuple[Inode, bytes, Inode]] = []
        dirs = [top]
        while dirs:
            d = dirs.pop()
            for child_name, num in (d.children or {}).items():
                child = inodes[num]
                below.append((d, child_name, child))
                if child.is_dir:
                    dirs.append(child)
        name = top.name
        with self._db.transaction():
            for parent, child_name, ino in reversed(below):
                if ino.is_dir:
                    self._entries.remove_dir_entry(parent, child_name, ino)
                else:
                    self._tree.unlink(parent, child_name)
                    self._entries.drop_link(ino, parent, child_name)
            # forgets the step at the top
            self._entries.remove_dir_entry(inodes[top.parent], name, top)
            self._tree.touch(inodes[ROOT_INO])
        self._host._emit("invalidate_entry", (ROOT_INO, name, top.ino))
        for ino in [top, *(c for _d, _n, c in below)]:
            self._entries.maybe_free_inode(ino)
