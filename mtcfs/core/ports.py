"""What the other tiers may read from, and ask of, the filesystem core.

The tiers (mtcfs/tiers) never import the core's modules: each takes the narrow port below
that names what it uses, and the composition root (mtcfs/daemon.py) hands it the one
:class:`mtcfs.core.core.Filesystem`, which satisfies every port structurally. This module
is the only part of ``mtcfs.core`` a tier may import (tests/t1_layers_test.py), and it
re-exports the few core types that cross the boundary: :class:`StepRecord` (a committed
step), :class:`Version` (a file's content; opaque to the tiers but for the attributes they
read: ``size``, ``chunk_size``, ``writers``, ``local_bytes()``), :class:`ChunkSource` (what
the core fetches missing chunks through) and :data:`ROOT_INO`.

Ports by consumer (docs/architecture.md, "Ports" has the table):

* :class:`BackupPort`: the backup scheduler (mtcfs/tiers/backup/scheduler.py).
* :class:`PeerPort`: the peer tier (mtcfs/tiers/peer/tier*.py) and its local-chunk hook.
* :class:`RestorePort`: the prefetcher and the bulk restore from peers (mtcfs/tiers/restore).
* :class:`MtcPort`: Orbax's replicator protocol (mtcfs/tiers/mtc/replicator.py).
* :class:`NamespacePort`: scope=job's namespace log (mtcfs/tiers/namespace/etcd_log.py).
* :class:`ChunkOriginPort`: scope=job's chunk source (mtcfs/tiers/namespace/sources.py).

All calls are made on the trio loop unless a method says it is thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from mtcfs.base.manifest import StepManifest
from mtcfs.base.ns_ops import NsOp
from mtcfs.core.model import ROOT_INO, Version
from mtcfs.core.records import ChunkSource, StepRecord, oldest_first

__all__ = [
    "ROOT_INO", "BackupPort", "ChunkOriginPort", "ChunkSource", "CoreView", "FaultInPort",
    "KvStore", "MtcPort", "NamespacePort", "Observer", "OwnFilesPort", "PeerPort",
    "MountRestorePort", "RestorePort", "SnapshotPort", "StepRecord", "oldest_first", "Version",
]

#: ``observer(event, obj)``: 'sealed' (Version), 'closed' (Version: the last writer of a
#: version sealed at close(2), scope=job, left), 'committed' (StepRecord), 'step_changed'
#: (StepRecord), 'step_removed' (str, the step's name), 'invalidate_entry' ((parent ino,
#: name, child ino)).
Observer = Callable[[str, Any], None]


class KvStore(Protocol):
    """The store's small key/value table (SQLite, written through)."""

    def get_kv(self, key: str) -> str | None:
        """The value of ``key``, None when unset."""
        ...

    def set_kv(self, key: str, value: str) -> None:
        """Set ``key`` (in the current transaction, if one is open)."""
        ...

    def transaction(self) -> AbstractContextManager[Any]:
        """A context in which the writes commit together (nests: the outer one commits)."""
        ...


class CoreView(Protocol):
    """What every tier may read, and the two things every tier may ask: to hear of
    events, and to report an error to the user."""

    @property
    def steps(self) -> Mapping[str, StepRecord]:
        """Committed steps by name (the core's live records: read, never mutate, except
        the replication counts ``replicated``/``replicas`` the peer tier sets)."""
        ...

    @property
    def capacity(self) -> int:
        """Bytes of file data the RAM tier may hold (``size=``)."""
        ...

    def step_sealed(self, rec: StepRecord) -> bool:
        """True when every file below the step is sealed (no writer, no seal running)."""
        ...

    def step_in_ram(self, rec: StepRecord) -> bool:
        """True when every chunk of every file of the step is in RAM."""
        ...

    def step_versions(self, rec: StepRecord) -> list[Version]:
        """The current versions of the files below step ``rec``, in walk order."""
        ...

    def statfs(self) -> dict[str, int]:
        """Capacity figures in bytes: ``size``, ``used``, ``free`` (and inode counts)."""
        ...

    def subscribe(self, observer: Observer) -> None:
        """Register ``observer`` for the core's events (see :data:`Observer`)."""
        ...

    def report_error(self, msg: str) -> None:
        """Log ``msg`` as an error and show it in ``mtcfs status`` (the last 50 kept)."""
        ...


class SnapshotPort(CoreView, Protocol):
    """Pinned snapshots of a step, and chunk reads over them (uploads, replication)."""

    def snapshot_step(self, name: str) -> tuple[StepManifest, list[Version]]:
        """The manifest of committed step ``name`` and its pinned versions; :meth:`unpin`
        them when done. Raises FsError: ENOENT (no committed step ``name``), EAGAIN (a
        file in it is unsealed)."""
        ...

    def chunk_reader(self, versions: list[Version], *,
                     verify: bool = True) -> Callable[[str], bytes]:
        """A thread-safe ``read_chunk(digest) -> bytes`` over pinned versions."""
        ...

    def unpin(self, versions: Iterable[Version]) -> None:
        """Release pins taken by :meth:`snapshot_step` or :meth:`PeerPort.pin_chunk`."""
        ...


class BackupPort(SnapshotPort, Protocol):
    """The backup scheduler: snapshots, what is backed up, and eviction."""

    def mark_backed_up(self, name: str, versions: list[Version]) -> bool:
        """Record that step ``name`` (with these versions) is complete in the backup tier;
        False when the step changed during its upload (not backed up: upload it again)."""
        ...

    def backup_pending(self) -> str | None:
        """The step whose backup started and had not completed when the daemon stopped."""
        ...

    def set_backup_pending(self, name: str | None) -> None:
        """Record (durably) that the backup of ``name`` started; None: it completed."""
        ...

    def backup_retired(self, kept: set[str]) -> list[str]:
        """The backup tier now holds only the steps in ``kept``; returns the names of the
        local steps deleted as a result (their data had left RAM)."""
        ...

    def evict(self, need: int | None = None) -> list[str]:
        """Evict checkpoints from RAM: the keep= policy, or with ``need`` (bytes) until that
        much is free; returns the names of the evicted steps."""
        ...


class PeerPort(SnapshotPort, Protocol):
    """The peer tier: replication of this node's steps, and this node's own chunks served
    to peers (data-parallel twins)."""

    @property
    def used(self) -> int:
        """Bytes the store's data files hold now (the replicas not included)."""
        ...

    @property
    def last_write(self) -> float:
        """``time.monotonic()`` of the last application write (0.0: none yet)."""
        ...

    @property
    def db(self) -> KvStore:
        """The store's key/value table (the peer tier keeps its etcd member id there)."""
        ...

    def has_local_chunk(self, digest: str) -> bool:
        """Whether this node's own files hold chunk ``digest`` in RAM. Thread-safe."""
        ...

    def pin_chunk(self, digest: str) -> tuple[Version, int, int] | None:
        """Pin a version holding chunk ``digest``: (version, offset, length), or None.
        Read it with :meth:`read_chunk_at` (any thread), then :meth:`unpin`."""
        ...

    def read_chunk_at(self, v: Version, off: int, length: int,
                      digest: str | None) -> bytes | None:
        """``length`` bytes at ``off`` of pinned ``v``, verified against ``digest`` when
        given (None: they did not match). Thread-safe."""
        ...


class FaultInPort(Protocol):
    """Bringing missing chunks into RAM."""

    async def fault_in(self, v: Version, off: int, size: int) -> None:
        """Wait until bytes ``[off, off+size)`` of ``v`` are in RAM (fetching them through
        the core's chunk source). Raises FsError EIO when a chunk cannot be fetched in
        time from any source, or fails verification."""
        ...


class RestorePort(FaultInPort, Protocol):
    """The prefetcher and the bulk restore from peers."""

    def pending_fault_in(self) -> list[tuple[Version, int]]:
        """(version, chunk index) pairs still missing in current versions, in path order."""
        ...

    async def deliver_chunk(self, digest: str, data: bytes | memoryview,
                            where: list[tuple[Version, int]]) -> int:
        """Store chunk ``digest`` (``data`` already verified against it) wherever the
        (version, chunk index) pairs ``where`` still miss it; returns how many were filled."""
        ...

    def expect_chunks(self, digests: list[str]) -> None:
        """``digests`` are being fetched in bulk: a read of one waits for that delivery
        instead of fetching it again, until :meth:`settle_chunks`. Call on the loop."""
        ...

    def settle_chunks(self, digests: list[str]) -> None:
        """The bulk deliveries of ``digests`` ended (stored, or given up). Call on the
        loop."""
        ...


class OwnFilesPort(Protocol):
    """Files the daemon itself writes in the mount (Orbax's protocol files); ``name`` is
    one path component in directory ``parent`` (default the root)."""

    async def write_own_file(self, name: bytes, data: bytes, *, parent: int = ROOT_INO,
                             mode: int = 0o644) -> None:
        """Write ``data`` as ``parent/name`` atomically. Raises FsError: ENOSPC, ENOTDIR,
        EISDIR."""
        ...

    async def read_own_file(self, name: bytes, *, parent: int = ROOT_INO) -> bytes:
        """The whole content of ``parent/name`` (at most 1 MiB). Raises FsError: ENOENT,
        EISDIR, EFBIG, EIO (data unavailable)."""
        ...

    async def remove_own(self, name: bytes, *, parent: int = ROOT_INO) -> bool:
        """Remove ``parent/name`` (a whole tree for a directory); False: no such name."""
        ...

    async def rename_own(self, old: bytes, new: bytes, *, parent: int = ROOT_INO) -> None:
        """Rename ``parent/old`` to ``parent/new``. Raises FsError (ENOENT, EEXIST)."""
        ...


class MtcPort(CoreView, OwnFilesPort, Protocol):
    """Orbax's multi-tier checkpointing protocol: the root directory, the protocol files,
    the errors to pass on to the trainer."""

    @property
    def errors(self) -> Sequence[str]:
        """The last errors reported (timestamped lines; at most 50 kept)."""
        ...

    @property
    def errors_total(self) -> int:
        """Errors ever reported (``errors`` keeps only the newest)."""
        ...

    def root_entries(self) -> Mapping[bytes, int]:
        """The root directory's entries, name -> inode number: a read-only view that
        follows changes to the directory until a namespace install (scope=job) replaces
        the root; take it again rather than keep it."""
        ...

    def is_directory(self, ino: int) -> bool:
        """Whether inode ``ino`` exists and is a directory."""
        ...


class NamespacePort(FaultInPort, Protocol):
    """scope=job: the job's namespace log applies ops to the core and seeds it; the core
    keeps the log's position (core/jobns.py)."""

    def ns_apply(self, op: NsOp | dict[str, Any], seq: int,
                 epoch: int) -> tuple[dict[str, Any], list[Version]]:
        """Apply op ``seq`` of the log (deterministic): (result for the submitter, versions
        open here whose data to fetch before acknowledging). Raises FsError: the op is
        refused (the submitter's system call gets that errno); StoreFull: no room for its
        rows, nothing changed (apply it again later)."""
        ...

    def ns_check_room(self, op: NsOp) -> None:
        """Raise StoreFull (ENOSPC) when the store has no room for ``op``'s rows here."""
        ...

    def ns_snapshot(self) -> dict[str, Any]:
        """The whole namespace as a JSON-able dict (for a node that joins)."""
        ...

    def ns_install(self, snap: dict[str, Any]) -> None:
        """Replace this node's namespace with ``snap`` (before FUSE serves)."""
        ...

    def ns_position(self) -> tuple[int, int]:
        """(epoch, seq) of the last op applied here ((0, 0) when none)."""
        ...

    def ns_set_position(self, epoch: int, seq: int) -> None:
        """Record the log position ``(epoch, seq)`` without applying an op (an op refused
        or skipped still moves it; a seeder starts at ``(incarnation, 0)``)."""
        ...


class MountRestorePort(CoreView, RestorePort, Protocol):
    """What a mount's restorer (mtcfs/tiers/restore/restorer.py) asks: whether there is
    anything to lose, and to import a step's namespace (its chunks then missing)."""

    def namespace_empty(self) -> bool:
        """True when the root directory has no entries."""
        ...

    def import_step(self, m: StepManifest, *, backed_up: bool = True) -> StepRecord:
        """Add step ``m``'s entries with every chunk missing (fetched later); its files are
        marked backed up when ``backed_up``. Raises FsError EEXIST when the step exists."""
        ...

    def ns_install(self, snap: dict[str, Any]) -> None:
        """scope=job: replace this node's namespace with ``snap`` (before FUSE serves)."""
        ...

    def mark_all_backed_up(self) -> None:
        """Every version here came from the backup tier: none needs uploading again."""
        ...


class ChunkOriginPort(Protocol):
    """scope=job's chunk source: which rank wrote a chunk."""

    def chunk_origin(self, digest: str) -> int | None:
        """The rank that wrote chunk ``digest``, None when unknown."""
        ...
