"""Public methods of the core that exist for the other tiers (see mtcfs/core/ports.py).

A mixin of :class:`mtcfs.core.core.Filesystem`, kept apart so that what the ports promise
beyond the core's own operations is in one place. Each method is a small read or a
forward to the core's components (the step registry's backup state and reads among them);
none changes behaviour. The core's own code calls the components, never these.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from mtcfs.base.manifest import StepManifest
from mtcfs.core.model import ROOT_INO, Version
from mtcfs.core.records import StepRecord
from mtcfs.core.step_registry import StepRegistry


class TierApiOps:
    """Reads and requests of the ports that the other mixins do not already provide."""

    # The step registry's answers the ports promise (core/step_registry.py); the core's own
    # code calls ``step_registry`` directly.

    step_registry: StepRegistry

    def step_versions(self, rec: StepRecord) -> list[Version]:
        """The current versions of the files below step ``rec``, in walk order."""
        return self.step_registry.versions_of(rec)

    def step_sealed(self, rec: StepRecord) -> bool:
        """True when every file below the step is sealed (no writer, no seal running)."""
        return self.step_registry.sealed(rec)

    def step_in_ram(self, rec: StepRecord) -> bool:
        """True when every chunk of every file of the step is in RAM (nothing to fault in)."""
        return self.step_registry.in_ram(rec)

    def snapshot_step(self, name: str) -> tuple[StepManifest, list[Version]]:
        """The manifest of committed step ``name`` and its pinned versions; unpin them when
        done. Raises FsError ENOENT (no such step) or EAGAIN (a file in it is unsealed)."""
        return self.step_registry.snapshot(name)

    def mark_backed_up(self, name: str, versions: list[Version]) -> None:
        """Record that step ``name`` (with these versions) is complete in the backup tier."""
        self.step_registry.mark_backed_up(name, versions)

    def backup_pending(self) -> str | None:
        """The step whose backup started and had not completed when the daemon stopped."""
        return self.step_registry.backup_pending()

    def set_backup_pending(self, name: str | None) -> None:
        """Record (durably) that the backup of ``name`` started; None: it completed."""
        self.step_registry.set_backup_pending(name)

    def backup_retired(self, kept: set[str]) -> list[str]:
        """The backup tier now holds only ``kept``; the names of the local steps deleted."""
        return self.step_registry.retired(kept)

    # ------------------------------------------------------------------ namespace reads

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
