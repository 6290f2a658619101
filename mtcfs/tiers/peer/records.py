"""Plain result records of the peer tier: what a put, a publish, a listing, a gc returned,
and the members of the job. Shared by the replica store, the service and the client."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ManifestInfo:
    """One step manifest a replica store holds.

    Attributes:
        rank: whose manifest (the rank that wrote the step).
        step: step directory name ("100", "step_100").
        step_number: integer step.
        created_ns: when the manifest was taken, ns since the epoch.
        total_bytes: file bytes in the step.
        chunks_total: unique chunks the manifest references.
        chunks_missing: of those, chunks the store does not hold now (neither as a replica
            nor, when it has one, in its node's own RAM tier). 0 means the replica is
            complete.
        manifest_bytes: length of the manifest JSON, bytes.
        manifest: the manifest JSON (StepManifest.to_bytes()), or b"" when not asked for.
    """

    rank: int
    step: str
    step_number: int
    created_ns: int
    total_bytes: int
    chunks_total: int
    chunks_missing: int
    manifest_bytes: int = 0
    manifest: bytes = b""


@dataclass(frozen=True)
class PublishResult:
    """What storing one manifest did (:meth:`ReplicaStore.put_manifest`,
    :meth:`PeerClient.publish_manifest`).

    Attributes:
        chunks_total: unique chunks the manifest references.
        missing: referenced chunks not held yet; the replica is complete when empty.
        replaced: an earlier manifest of the same (rank, step) was replaced.
    """

    chunks_total: int
    missing: tuple[str, ...] = ()
    replaced: bool = False

    @property
    def complete(self) -> bool:
        """True when the peer holds every chunk the manifest references."""
        return not self.missing


@dataclass(frozen=True)
class PutResult:
    """What :meth:`PeerClient.put_chunks` did.

    Attributes:
        accepted: digests the peer verified and holds now (stored by this call or already
            there when the stream reached it).
        skipped: digests not sent because the peer said it held them (HasChunks).
        rejected: digest -> "STATUS_NAME: reason" for chunks the peer refused (DATA_LOSS for
            bytes that do not match the digest, RESOURCE_EXHAUSTED when its store is full).
        chunks_sent: chunks whose bytes were streamed.
        bytes_sent: chunk payload bytes streamed, retries included; 0 when the peer held
            everything (the data-parallel case).
    """

    accepted: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    rejected: dict[str, str] = field(default_factory=dict)
    chunks_sent: int = 0
    bytes_sent: int = 0

    @property
    def ok(self) -> bool:
        """True when the peer holds every chunk offered."""
        return not self.rejected


@dataclass(frozen=True)
class GcStats:
    """What :meth:`ReplicaStore.gc` did.

    Attributes:
        manifests_deleted: (rank, step) of each manifest dropped.
        manifests_kept: manifests still held.
        chunks_deleted: chunk files deleted (no manifest referred to them and they were
            last stored or asked for longer ago than the grace period).
        chunks_kept: chunk files still held.
        bytes_freed: chunk and manifest bytes freed.
    """

    manifests_deleted: list[tuple[int, str]] = field(default_factory=list)
    manifests_kept: int = 0
    chunks_deleted: int = 0
    chunks_kept: int = 0
    bytes_freed: int = 0


@dataclass(frozen=True)
class StepRef:
    """A step by name and number."""

    step: str
    step_number: int


@dataclass(frozen=True)
class MemberInfo:
    """One member of the job as etcd's membership records say.

    Attributes:
        rank: the member's rank.
        address: host:port of its Peer service.
        labels: its topology labels.
        alive: its etcd lease is alive (False: known earlier, gone since).
        age_s: seconds since it registered (its record's ``since``).
    """

    rank: int
    address: str
    labels: dict[str, str]
    alive: bool
    age_s: float
