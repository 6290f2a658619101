"""Plain result records of the backup store: what an upload, a listing, a retention did."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BackupStats:
    """What one :meth:`BackupStore.put_step` did.

    Attributes:
        step: the step name.
        chunks_total: unique chunks the step references.
        chunks_uploaded: chunks this call uploaded (the others were already there).
        bytes_logical: file bytes in the step (sum of file sizes, duplicates included).
        bytes_new: uncompressed bytes of the chunks uploaded.
        bytes_uploaded: compressed chunk bytes actually sent.
        bytes_metadata: manifest and marker bytes sent.
        seconds: wall time of the call.
    """

    step: str
    chunks_total: int
    chunks_uploaded: int
    bytes_logical: int
    bytes_new: int
    bytes_uploaded: int
    bytes_metadata: int
    seconds: float


@dataclass(frozen=True)
class StepInfo:
    """A complete step in the backup, as its COMPLETE marker describes it.

    Attributes:
        step: directory name of the step ("100", "step_100").
        step_number: integer step.
        created_ns: when the manifest was taken, ns since the epoch.
        completed_ns: when the upload finished, ns since the epoch.
        total_bytes: file bytes in the step.
        chunks: unique chunks the step references.
    """

    step: str
    step_number: int
    created_ns: int
    completed_ns: int
    total_bytes: int
    chunks: int


@dataclass(frozen=True)
class RetentionStats:
    """What one :meth:`BackupStore.retain` did.

    Attributes:
        steps_kept: complete steps kept, oldest first.
        steps_deleted: complete steps deleted.
        incomplete_deleted: abandoned incomplete steps deleted.
        chunks_kept: chunk objects still referenced.
        chunks_deleted: chunk objects deleted.
        swept: False if the chunk sweep was skipped (an unreadable manifest: its chunks
            cannot be known, so nothing is deleted).
        seconds: wall time of the call.
    """

    steps_kept: list[str] = field(default_factory=list)
    steps_deleted: list[str] = field(default_factory=list)
    incomplete_deleted: list[str] = field(default_factory=list)
    chunks_kept: int = 0
    chunks_deleted: int = 0
    swept: bool = True
    seconds: float = 0.0
