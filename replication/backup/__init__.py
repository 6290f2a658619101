"""The backup tier: checkpoints in object storage (GCS) or on a shared POSIX file system.

Content-addressed, zstd-compressed chunks plus per-step manifests and a completion marker
written last; each unique chunk uploaded once per bucket; transient errors retried with
jittered backoff; retention by mark-and-sweep. Everything here is synchronous and meant to
run in the daemon's worker threads.

Typical use::

    store = open_store("gs://my-bucket/jobs/llama", stop=shutdown_event)
    stats = store.put_step(manifest, read_chunk=ram_tier.read_chunk)
    store.retain(keep=2)
    latest = store.latest_step()
    data = store.get_chunk(h)
"""

from replication.backup.backend import Backend, open_backend
from replication.backup.chunk_store import BackupStore
from replication.backup.errors import BackupError, ChunkCorrupt, NotFound, TransientError
from replication.backup.factory import open_store
from replication.backup.file_backend import FileBackend
from replication.backup.records import BackupStats, RetentionStats, StepInfo
from replication.backup.retry import RetryingBackend, RetryPolicy

__all__ = [
    "Backend", "BackupError", "BackupStats", "BackupStore", "ChunkCorrupt", "FileBackend",
    "GCSBackend", "NotFound", "RetentionStats", "RetryPolicy", "RetryingBackend", "StepInfo",
    "TransientError", "open_backend", "open_store",
]


def __getattr__(name: str):  # GCSBackend on demand: google-cloud-storage is slow to import
    if name == "GCSBackend":
        from replication.backup.gcs_backend import GCSBackend
        return GCSBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
