"""The exceptions of the backup tier.

Every failure a backend or the backup store reports is a :class:`BackupError`. Callers tell
three cases apart: the object is not there (:class:`NotFound`), trying again later may work
(:class:`TransientError`, the only kind :mod:`mtcfs.tiers.backup.retry` retries), and data
came back that does not match its hash (:class:`ChunkCorrupt`). Anything else is permanent
(bad credentials, permission denied, disk full) and needs a person.
"""

from __future__ import annotations


class BackupError(Exception):
    """A backup-tier operation failed; the message names the object and the cause."""


class NotFound(BackupError):
    """The requested object (chunk, manifest, marker) does not exist in the backend."""


class TransientError(BackupError):
    """A failure that may go away on its own: timeout, throttling (429), server error (5xx),
    a reset or refused connection, an NFS hiccup. Safe to retry because every backend
    operation is idempotent."""


class ChunkCorrupt(BackupError):
    """A stored chunk does not decode, or its bytes do not hash to its name.

    Attributes:
        chunk: the hex blake3 digest the chunk was requested by.
    """

    def __init__(self, chunk: str, reason: str) -> None:
        super().__init__(f"backup chunk {chunk} is corrupt: {reason}")
        self.chunk = chunk


class GateError(BackupError):
    """The sweep gate of a multi-node bucket (:mod:`mtcfs.tiers.backup.gate`) failed: its
    coordination service did not answer, or refused."""


class GateTimeout(GateError):
    """The sweep gate was not granted within the wait's deadline (the message names the
    holder waited for). An upload fails and is retried later; a sweep is skipped."""


class GateLost(GateError):
    """A hold of the sweep gate ended under its holder (its lease expired): whatever was
    safe only under it must not be done."""
