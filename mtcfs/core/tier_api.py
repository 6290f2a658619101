"""What the other tiers see of the core: the one object that satisfies every port.

:class:`TierApi` is the core's side of the boundary drawn by :mod:`mtcfs.core.ports`: the
composition root (mtcfs/daemon.py) hands ``Filesystem.tier_api`` to the backup, peer,
namespace, mtc and restore tiers, and nothing else of the core. It holds no state: each
member is a read of, or a forward to, one of the core's components (the step registry, the
checkpoints, the local chunks, the job namespace, the budget, the own files), so that the
facade the FUSE adapter calls (:class:`mtcfs.core.core.Filesystem`) stays the adapter's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from mtcfs.base.manifest import StepManifest
from mtcfs.base.ns_ops import NsOp
from mtcfs.core.budget import RamBudget
from mtcfs.core.checkpoints import Checkpoints
from mtcfs.core.chunkmap import ChunkIndex
from mtcfs.core.eviction import Eviction
from mtcfs.core.faultin import LocalChunks
from mtcfs.core.files import OpenFiles
from mtcfs.core.inodes import InodeTable
from mtcfs.core.jobns import JobNamespace
from mtcfs.core.model import ROOT_INO, Version
from mtcfs.core.own_files import OwnFiles
from mtcfs.core.records import StepRecord
from mtcfs.core.step_registry import StepRegistry
from mtcfs.core.store.meta import MetaDB
from mtcfs.core.versions import VersionStore

if TYPE_CHECKING:
    from mtcfs.core.core import Filesystem

__all__ = ["TierApi"]


class TierApi:
    """The ports' reads and requests (see mtcfs/core/ports.py for who uses which).

    Args:
        fs: the core's facade: its events (subscribe), errors and statfs.
        step_registry, checkpoints, chunks, jobns, tree, vstore, budget, eviction,
            chunk_index, open_files, own_files: the core's components, read or called.
        db: the store's metadata database (its key/value table).
    """

    def __init__(self, fs: Filesystem, *, step_registry: StepRegistry, checkpoints: Checkpoints,
                 chunks: LocalChunks, jobns: JobNamespace, tree: InodeTable,
                 vstore: VersionStore, budget: RamBudget, eviction: Eviction,
                 chunk_index: ChunkIndex, open_files: OpenFiles, own_files: OwnFiles,
                 db: MetaDB) -> None:
        self._fs = fs
        self._registry = step_registry
        self._checkpoints = checkpoints
        self._chunks = chunks
        self._jobns = jobns
        self._tree = tree
        self._vstore = vstore
        self._budget = budget
        self._eviction = eviction
        self._chunk_index = chunk_index
        self._open_files = open_files
        self._own_files = own_files
        #: The store's key/value table (the peer tier keeps its etcd member id there).
        self.db = db

    # ------------------------------------------------------------------ every tier (CoreView)

    @property
    def steps(self) -> Mapping[str, StepRecord]:
        """Committed step name -> its record (read it; the core changes it)."""
        return self._registry.records

    @property
    def capacity(self) -> int:
        """Bytes of file data the RAM tier may hold (``size=``)."""
        return self._budget.capacity

    def step_versions(self, rec: StepRecord) -> list[Version]:
        """The current versions of the files below step ``rec``, in walk order."""
        return self._registry.versions_of(rec)

    def step_sealed(self, rec: StepRecord) -> bool:
        """True when every file below the step is sealed (no writer, no seal running)."""
        return self._registry.sealed(rec)

    def step_in_ram(self, rec: StepRecord) -> bool:
        """True when every chunk of every file of the step is in RAM (nothing to fault in)."""
        return self._registry.in_ram(rec)

    def statfs(self) -> dict[str, int]:
        """Capacity figures in bytes (see :meth:`Filesystem.statfs`)."""
        return self._fs.statfs()

    def subscribe(self, observer: Callable[[str, Any], None]) -> None:
        """Register ``observer(event, obj)`` (see :meth:`Filesystem.subscribe`)."""
        self._fs.subscribe(observer)

    def report_error(self, msg: str) -> None:
        """Log ``msg`` as an error and show it in ``mtcfs status``."""
        self._fs.report_error(msg)

    # ------------------------------------------------------------------ snapshots and pins

    def snapshot_step(self, name: str) -> tuple[StepManifest, list[Version]]:
        """The manifest of committed step ``name`` and its pinned versions; unpin them when
        done. Raises FsError ENOENT (no such step) or EAGAIN (a file in it is unsealed)."""
        return self._registry.snapshot(name)

    def chunk_reader(self, versions: list[Version], *,
                     verify: bool = True) -> Callable[[str], bytes]:
        """A thread-safe ``read_chunk(digest) -> bytes`` over pinned versions; it raises
        FsError(EIO) for a chunk not in RAM or corrupt (:meth:`Checkpoints.chunk_reader`)."""
        return self._checkpoints.chunk_reader(versions, verify=verify)

    def unpin(self, versions: Iterable[Version]) -> None:
        """Release pins taken by a snapshot or :meth:`pin_chunk`."""
        self._checkpoints.unpin(versions)

    def pin_chunk(self, digest: str) -> tuple[Version, int, int] | None:
        """Pin a version holding chunk ``digest``: (version, offset, length), or None."""
        return self._checkpoints.pin_chunk(digest)

    def has_local_chunk(self, digest: str) -> bool:
        """Whether this node's own files hold chunk ``digest`` in RAM now (any thread; the
        answer may be stale when used)."""
        return self._chunk_index.holds(digest)

    def read_chunk_at(self, v: Version, off: int, length: int, digest: str | None) -> bytes | None:
        """``length`` bytes at ``off`` of pinned ``v``, verified against ``digest``; None on
        a mismatch (thread-safe: :meth:`VersionStore.read_verified`)."""
        return self._vstore.read_verified(v, off, length, digest)

    # ------------------------------------------------------------------ the backup tier

    def mark_backed_up(self, name: str, versions: list[Version]) -> bool:
        """Record that step ``name`` (with these versions) is complete in the backup tier;
        False when the step changed during its upload (not backed up: upload it again)."""
        return self._registry.mark_backed_up(name, versions)

    def backup_pending(self) -> str | None:
        """The step whose backup started and had not completed when the daemon stopped."""
        return self._registry.backup_pending()

    def set_backup_pending(self, name: str | None) -> None:
        """Record (durably) that the backup of ``name`` started; None: it completed."""
        self._registry.set_backup_pending(name)

    def backup_retired(self, kept: set[str]) -> list[str]:
        """The backup tier now holds only ``kept``; the names of the local steps deleted."""
        return self._registry.retired(kept)

    def evict(self, need: int | None = None) -> list[str]:
        """Evict checkpoints from RAM; the names of the evicted steps."""
        return self._eviction.evict(need)

    def mark_all_backed_up(self) -> None:
        """Every version here came from the backup tier (a restore of the job's namespace
        from it): none needs uploading again."""
        for v in self._vstore.versions.values():
            v.backed_up = True

    # ------------------------------------------------------------------ the peer tier

    @property
    def used(self) -> int:
        """Bytes the store's data files hold (the budget's)."""
        return self._budget.used

    @property
    def last_write(self) -> float:
        """time.monotonic() of the application's last write."""
        return self._open_files.last_write

    # ------------------------------------------------------------------ fault-in, restores

    async def fault_in(self, v: Version, off: int, size: int) -> None:
        """Wait until bytes ``[off, off+size)`` of ``v`` are here (:meth:`LocalChunks.fault_in`;
        raises FsError EIO at the fault-in deadline)."""
        await self._chunks.fault_in(v, off, size)

    def pending_fault_in(self) -> list[tuple[Version, int]]:
        """(version, chunk index) pairs still missing in current versions, in path order."""
        return self._chunks.pending()

    async def deliver_chunk(self, digest: str, data: bytes | memoryview,
                            where: list[tuple[Version, int]]) -> int:
        """Store a verified chunk fetched in bulk wherever it is missing; places filled."""
        return await self._chunks.deliver(digest, data, where)

    def expect_chunks(self, digests: list[str]) -> None:
        """``digests`` are being fetched in bulk: a read of one waits for that delivery
        instead of fetching it again; :meth:`settle_chunks` ends the wait."""
        self._chunks.expect(digests)

    def settle_chunks(self, digests: list[str]) -> None:
        """The bulk deliveries of ``digests`` ended (stored, or given up)."""
        self._chunks.settle(digests)

    def import_step(self, m: StepManifest, *, backed_up: bool = True) -> StepRecord:
        """Create the namespace of a restored step with no data yet; raises FsError(EEXIST)
        if its directory exists (:meth:`Checkpoints.import_step`)."""
        return self._checkpoints.import_step(m, backed_up=backed_up)

    def namespace_empty(self) -> bool:
        """True when the root directory has no entries (nothing to lose by a restore)."""
        return not self._tree.inodes[ROOT_INO].children

    # ------------------------------------------------------------------ Orbax mtc (own files)

    @property
    def errors(self) -> Sequence[str]:
        """The last 50 errors reported (``mtcfs status``)."""
        return self._fs.errors

    @property
    def errors_total(self) -> int:
        """Errors ever reported."""
        return self._fs.errors_total

    def root_entries(self) -> Mapping[bytes, int]:
        """The root directory's entries, name -> inode number: a read-only view that
        follows changes to the directory until a namespace install (scope=job) replaces
        the root; take it again rather than keep it."""
        children = self._tree.inodes[ROOT_INO].children
        assert children is not None  # the root is a directory
        return MappingProxyType(children)

    def is_directory(self, ino: int) -> bool:
        """Whether inode ``ino`` exists and is a directory."""
        node = self._tree.inodes.get(ino)
        return node is not None and node.is_dir

    async def write_own_file(self, name: bytes, data: bytes, *, parent: int = ROOT_INO,
                             mode: int = 0o644) -> None:
        """Write ``parent/name`` atomically (:meth:`OwnFiles.write`)."""
        await self._own_files.write(name, data, parent=parent, mode=mode)

    async def read_own_file(self, name: bytes, *, parent: int = ROOT_INO) -> bytes:
        """The whole content of ``parent/name``, at most 1 MiB (:meth:`OwnFiles.read`)."""
        return await self._own_files.read(name, parent=parent)

    async def remove_own(self, name: bytes, *, parent: int = ROOT_INO) -> bool:
        """Remove ``parent/name``, a whole tree for a directory (:meth:`OwnFiles.remove`)."""
        return await self._own_files.remove(name, parent=parent)

    async def rename_own(self, old: bytes, new: bytes, *, parent: int = ROOT_INO) -> None:
        """Rename ``parent/old`` to ``parent/new``, which must not exist
        (:meth:`OwnFiles.rename`)."""
        await self._own_files.rename(old, new, parent=parent)

    # ------------------------------------------------------------------ scope=job's log

    def ns_apply(self, op: NsOp | dict[str, Any], seq: int, epoch: int
                 ) -> tuple[dict[str, Any], list[Version]]:
        """Apply the op at ``(epoch, seq)`` of the job's log and record that position
        (:meth:`JobNamespace.apply_at`). Raises FsError: the op is refused; StoreFull:
        no room for its rows, nothing changed."""
        return self._jobns.apply_at(op, seq, epoch)

    def ns_check_room(self, op: NsOp) -> None:
        """Raise StoreFull when the store has no room for ``op``'s rows
        (:meth:`JobNamespace.check_room`)."""
        self._jobns.check_room(op)

    def ns_position(self) -> tuple[int, int]:
        """(epoch, seq) of the last op applied here ((0, 0) when none)."""
        return self._jobns.position()

    def ns_set_position(self, epoch: int, seq: int) -> None:
        """Record the log position without applying an op."""
        self._jobns.set_position(epoch, seq)

    def ns_snapshot(self) -> dict[str, Any]:
        """The whole namespace as a JSON-able dict (:meth:`JobNamespace.snapshot`)."""
        return self._jobns.snapshot()

    def ns_install(self, snap: dict[str, Any]) -> None:
        """Replace this node's namespace with ``snap`` (:meth:`JobNamespace.install`)."""
        self._jobns.install(snap)

    def chunk_origin(self, digest: str) -> int | None:
        """The rank that wrote chunk ``digest`` (scope=job), None when unknown."""
        return self._jobns.chunk_origin(digest)
