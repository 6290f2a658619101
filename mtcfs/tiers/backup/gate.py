"""The sweep gate: what keeps a chunk sweep on one node from losing a chunk an upload on
another node relies on.

Two hazards, in a multi-node job whose ranks share one bucket (any rank may sweep):

* **A stale index.** An uploader's in-memory
  :class:`~mtcfs.tiers.backup.chunk_index.ChunkIndex` says chunk X is stored (it uploaded X
  weeks ago), but a sweep elsewhere deleted X since, when no kept manifest referenced it. A
  new step containing X would skip it and be marked COMPLETE without it.
* **A sweep in flight.** The sweeper read the manifests before the uploader wrote its intent
  manifest, so it does not know the new step needs X, and deletes X after the uploader
  decided to skip it.

The gate is a readers-writer lock shared by the whole job plus a **sweep generation**:

* an upload (:meth:`~mtcfs.tiers.backup.chunk_store.BackupStore.put_step`, and
  ``commit_step``) holds it **shared** from before its intent manifest until COMPLETE is
  written; a chunk sweep holds it **exclusive** from before it reads the manifests until its
  last delete. So no sweep is ever in flight while an upload decides what to skip or marks a
  step complete (second hazard), and a sweep that starts after an upload's COMPLETE reads
  its manifest and keeps its chunks;
* a sweep that is about to delete chunks first bumps the generation (a write fenced on its
  hold: it applies only while the hold is alive). An uploader, once it holds the gate
  shared, compares the generation with the one its index was last true at; if it changed,
  it forgets its index and lists ``chunks/`` again (first hazard). Bumping *before* the
  first delete, not after the last, means a sweep that dies (or loses its hold) half way
  still told everybody.

Why a full listing rather than the list of deleted digests: a sweep usually retires a whole
step, and a training step rewrites nearly every chunk, so the list would be about one
step's chunk count (250,000 digests for 1 TiB in 4 MiB chunks, 16 MiB of hex: far above
what one etcd value may hold, 1.5 MiB by default), and a node that missed two sweeps would
need both lists. The listing costs one request per 1,000 chunks, once per node and sweep
(about once per retired step), against one upload request per new chunk of the step that
follows it: less than ``keep``/1,000 of that upload's requests.

A holder must stop once its hold is lost: a sweep checks the hold before each chunk delete
(:meth:`GateHold.check`, which needs its lease certainly alive for a margin more), an
upload before its COMPLETE marker. The one window left is a delete request issued inside
that margin that takes longer than the margin to reach the bucket (a request stuck in
retries) while the sweeper's lease ends, another node's upload takes the gate, lists
``chunks/`` before the delete lands, and skips that very chunk.

:class:`SweepGate` is the interface the backup tier uses; the implementation on etcd is
:class:`mtcfs.tiers.coord.backup_gate.EtcdSweepGate` (the daemon builds it for multi-node
mounts). A multi-node store without a gate does not sweep chunks (it still retires steps).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol


class GateHold(Protocol):
    """One hold of the gate."""

    def check(self) -> None:
        """Raise :class:`~mtcfs.tiers.backup.errors.GateLost` unless the hold is certainly
        still alive (with a margin). Cheap: no request."""
        ...


class SweepGate(Protocol):
    """Shared for uploads, exclusive for sweeps, plus the sweep generation.

    Every method raises :class:`~mtcfs.tiers.backup.errors.GateError` (a
    :class:`~mtcfs.tiers.backup.errors.BackupError`) on failure:
    :class:`~mtcfs.tiers.backup.errors.GateTimeout` when a wait reaches its deadline,
    :class:`~mtcfs.tiers.backup.errors.GateLost` when a hold ended.
    """

    def shared(self) -> AbstractContextManager[GateHold]:
        """Hold the gate shared for the ``with`` block (waits while a sweep holds it or
        waits for it, up to a deadline)."""
        ...

    def exclusive(self) -> AbstractContextManager[GateHold]:
        """Hold the gate alone for the ``with`` block (waits for earlier holders, up to a
        deadline)."""
        ...

    def generation(self) -> int:
        """The sweep generation now (0: no sweep ever deleted a chunk); read so that it
        reflects every bump made before the call."""
        ...

    def bump(self, hold: GateHold) -> tuple[int, int]:
        """Under ``exclusive()``, before deleting chunks: change the generation, only while
        ``hold`` is alive. Returns (generation before, generation after)."""
        ...

    def describe(self) -> str:
        """Where the gate lives (for messages)."""
        ...
