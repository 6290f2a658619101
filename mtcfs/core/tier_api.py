"""Public methods of the core that exist for the other tiers (see mtcfs/core/ports.py).

A mixin of :class:`mtcfs.core.core.Filesystem`, kept apart so that what the ports promise
beyond the core's own operations is in one place. Each method is a small read or a
forward to the core's internals; none changes behaviour.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from mtcfs.core.model import ROOT_INO, Version
from mtcfs.core.records import StepRecord


class TierApiOps:
    """Reads and requests of the ports that the other mixins do not already provide."""

    def step_versions(self, rec: StepRecord) -> list[Version]:
        """The current versions of the files below step ``rec``, in walk order."""
        return self._step_versions(rec)  # type: ignore[attr-defined, no-any-return]

    def root_entries(self) -> Mapping[bytes, int]:
        """The root directory's entries, name -> inode number: a read-only view that
        follows changes to the directory until a namespace install (scope=job) replaces
        the root; take it again rather than keep it."""
        children = self.inodes[ROOT_INO].children  # type: ignore[attr-defined]
        assert children is not None  # the root is a directory
        return MappingProxyType(children)

    def namespace_empty(self) -> bool:
        """True when the root directory has no entries (nothing to lose by a restore)."""
        return not self.inodes[ROOT_INO].children  # type: ignore[attr-defined]

    def mark_all_backed_up(self) -> None:
        """Every version here came from the backup tier (a restore of the job's namespace
        from it): none needs uploading again."""
        for v in self.versions.values():  # type: ignore[attr-defined]
            v.backed_up = True

    def is_directory(self, ino: int) -> bool:
        """Whether inode ``ino`` exists and is a directory."""
        node = self.inodes.get(ino)  # type: ignore[attr-defined]
        return node is not None and node.is_dir

    def chunk_origin(self, digest: str) -> int | None:
        """The rank that wrote chunk ``digest`` (scope=job), None when unknown."""
        return self.chunk_origins.get(digest)  # type: ignore[attr-defined, no-any-return]
