"""One call from a ``backup=`` URL to a ready :class:`BackupStore` with retries."""

from __future__ import annotations

import threading

from mtcfs.tiers.backup.backend import open_backend
from mtcfs.tiers.backup.chunk_store import BackupStore
from mtcfs.tiers.backup.codec import DEFAULT_LEVEL
from mtcfs.tiers.backup.gate import SweepGate
from mtcfs.tiers.backup.retry import RetryingBackend, RetryPolicy


def open_store(url: str, *, policy: RetryPolicy | None = None,
               stop: threading.Event | None = None, level: int = DEFAULT_LEVEL,
               check_remote: bool = False, rank: int | None = None,
               world_size: int | None = None, gate: SweepGate | None = None) -> BackupStore:
    """Build the backup store a URL names: backend, wrapped in the retry policy.

    Performs no I/O; the first operation contacts the backend.

    Args:
        url: ``gs://bucket[/prefix]`` or ``file:///absolute/path``.
        policy: retry policy; default ``RetryPolicy()`` (retry forever, 0.2 s .. 30 s).
        stop: set it at shutdown to end retry waits early.
        level: zstd level for chunks.
        check_remote: see :class:`BackupStore`.
        rank: None for a single-node mount, else this node's rank in the job (see
            :class:`BackupStore`).
        world_size: ranks in the job, with ``rank`` (see :class:`BackupStore`).
        gate: the job's sweep gate, with ``rank`` (see :class:`BackupStore`).

    Raises:
        ValueError: if the URL is not usable (message names it), or on a bad rank or
            world_size, or a gate without a rank.
    """
    backend = RetryingBackend(open_backend(url), policy, stop=stop)
    return BackupStore(backend, level=level, check_remote=check_remote, rank=rank,
                       world_size=world_size, gate=gate)
