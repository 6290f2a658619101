"""Plain result records of the backup store: what an upload, a listing, a retention did."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BackupStats:
    """What one :meth:`BackupStore.put_step` did.

    Attributes:
        step: the step name.
        chunks_total: unique chunks the step references.
        chunks_uploaded: chunks this node uploaded in this call (the others were already
            there, or another node uploaded them); includes ``chunks_taken_over`` and
            ``chunks_resent``.
        bytes_logical: file bytes in the step (sum of file sizes, duplicates included).
        bytes_new: uncompressed bytes of the chunks uploaded.
        bytes_uploaded: compressed chunk bytes actually sent.
        bytes_metadata: manifest and marker bytes sent.
        seconds: wall time of the call.
        chunks_by_others: chunks the bucket lacked when the call started that another node
            uploaded meanwhile (its share; found while waiting or just before uploading).
        chunks_taken_over: other nodes' shares this node uploaded itself because they were
            still missing after ``share_wait_s``.
        chunks_resent: chunks this store believed stored that a sweep on another node had
            deleted since (the sweep generation moved), uploaded again (multi-node stores).
        seconds_waiting: seconds spent waiting for other nodes' shares and for the sweep
            gate (a sweep in progress elsewhere).
    """

    step: str
    chunks_total: int
    chunks_uploaded: int
    bytes_logical: int
    bytes_new: int
    bytes_uploaded: int
    bytes_metadata: int
    seconds: float
    chunks_by_others: int = 0
    chunks_taken_over: int = 0
    chunks_resent: int = 0
    seconds_waiting: float = 0.0


@dataclass(frozen=True)
class StepInfo:
    """A complete step in the backup (of one rank, in a multi-node job), as its COMPLETE
    marker describes it.

    Attributes:
        step: directory name of the step ("100", "step_100").
        step_number: integer step.
        created_ns: when the manifest was taken, ns since the epoch.
        completed_ns: when the upload finished, ns since the epoch.
        total_bytes: file bytes in the step.
        chunks: unique chunks the step references.
        world_size: ranks of the job that wrote it (multi-node); None in a single-node
            store and in markers written before it was recorded.
    """

    step: str
    step_number: int
    created_ns: int
    completed_ns: int
    total_bytes: int
    chunks: int
    world_size: int | None = None


@dataclass(frozen=True)
class RetentionStats:
    """What one :meth:`BackupStore.retain` did.

    Attributes:
        steps_kept: complete steps kept, oldest first (multi-node store: the steps complete
            on every rank that are kept).
        steps_deleted: complete steps deleted (multi-node: steps of which at least one
            rank's complete manifest was deleted).
        incomplete_deleted: abandoned incomplete steps deleted (multi-node: steps of which at
            least one rank's abandoned manifest was deleted).
        chunks_kept: chunk objects still referenced.
        chunks_deleted: chunk objects deleted.
        swept: False if no chunk sweep ran: an unreadable manifest (its chunks cannot be
            known, so nothing is deleted), or, on a multi-node store, a call that deleted no
            manifest and was not asked to sweep.
        seconds: wall time of the call.
    """

    steps_kept: list[str] = field(default_factory=list)
    steps_deleted: list[str] = field(default_factory=list)
    incomplete_deleted: list[str] = field(default_factory=list)
    chunks_kept: int = 0
    chunks_deleted: int = 0
    swept: bool = True
    seconds: float = 0.0
