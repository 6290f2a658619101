"""The backup tier: checkpoints in object storage (GCS) or on a shared POSIX file system.

Content-addressed, zstd-compressed chunks plus per-step manifests (per rank in a multi-node
job) and a completion marker written last; each unique chunk uploaded once per bucket, also
across ranks; transient errors retried with jittered backoff; retention by mark-and-sweep.
Everything here is synchronous and meant to run in the daemon's worker threads.

Typical use::

    store = open_store("gs://my-bucket/jobs/llama", stop=shutdown_event)
    stats = store.put_step(manifest, read_chunk=ram_tier.read_chunk)
    store.retain(keep=2)
    latest = store.latest_step()
    data = store.get_chunk(h)

In a multi-node job each rank opens its own store on the same bucket::

    store = open_store(url, rank=3, world_size=8, gate=EtcdSweepGate(etcd, prefix))
    store.put_step(manifest, read, share=lambda d: int(d[:8], 16) % 2 == 1)
    job = store.complete_ranks()      # {step: (step_number, {ranks that completed it})}
"""

from typing import Any

from mtcfs.tiers.backup.backend import Backend
from mtcfs.tiers.backup.chunk_store import BackupStore
from mtcfs.tiers.backup.errors import BackupError, ChunkCorrupt, NotFound, TransientError
from mtcfs.tiers.backup.factory import open_backend, open_store
from mtcfs.tiers.backup.file_backend import FileBackend
from mtcfs.tiers.backup.records import BackupStats, RetentionStats, StepInfo
from mtcfs.tiers.backup.retry import RetryingBackend, RetryPolicy

__all__ = [
    "Backend", "BackupError", "BackupStats", "BackupStore", "ChunkCorrupt", "FileBackend",
    "GCSBackend", "NotFound", "RetentionStats", "RetryPolicy", "RetryingBackend", "StepInfo",
    "TransientError", "open_backend", "open_store",
]


def __getattr__(name: str) -> Any:  # GCSBackend on demand: google-cloud-storage is slow to import
    if name == "GCSBackend":
        from mtcfs.tiers.backup.gcs_backend import GCSBackend
        return GCSBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
