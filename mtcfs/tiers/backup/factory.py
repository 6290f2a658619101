"""From a ``backup=`` URL to a backend (:func:`open_backend`) and to a ready
:class:`BackupStore` with retries (:func:`open_store`). Kept apart from backend.py, which
the implementations import: the factory imports them."""

from __future__ import annotations

import re
import threading
from urllib.parse import unquote, urlsplit

from mtcfs.tiers.backup.backend import Backend, validate_prefix
from mtcfs.tiers.backup.chunk_store import BackupStore
from mtcfs.tiers.backup.codec import DEFAULT_LEVEL
from mtcfs.tiers.backup.gate import SweepGate
from mtcfs.tiers.backup.retry import RetryingBackend, RetryPolicy

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
_USAGE = "expected gs://BUCKET[/PREFIX] or file:///ABSOLUTE/PATH"


def open_backend(url: str) -> Backend:
    """Build the backend a ``backup=`` URL names. Performs no I/O.

    Args:
        url: ``gs://bucket[/prefix]`` (Google Cloud Storage; honours
            ``STORAGE_EMULATOR_HOST``) or ``file:///absolute/path`` (any POSIX file system,
            e.g. NFS or Lustre).

    Returns:
        A :class:`FileBackend` or :class:`GCSBackend` (not wrapped in retries; see
        :func:`mtcfs.tiers.backup.factory.open_store`).

    Raises:
        ValueError: with a one-line message naming ``url`` if it is not one of those forms
            (unknown scheme, missing bucket, relative path, query or fragment, '..').
    """
    def bad(why: str) -> ValueError:
        return ValueError(f"bad backup URL {url!r}: {why}; {_USAGE}")

    if not isinstance(url, str) or not url.strip():
        raise bad("empty")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise bad(str(exc)) from None
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise bad("query strings and fragments are not allowed")
    scheme = parts.scheme.lower()
    if scheme == "gs":
        bucket = parts.netloc
        if not bucket:
            raise bad("missing bucket name")
        if not _BUCKET_RE.match(bucket) or ".." in bucket:
            raise bad(f"invalid bucket name {bucket!r}")
        prefix = parts.path.strip("/")
        if prefix:
            try:
                validate_prefix(prefix)
            except ValueError:
                raise bad(f"invalid object prefix {prefix!r}") from None
        from mtcfs.tiers.backup.gcs_backend import GCSBackend
        return GCSBackend(bucket, prefix)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise bad("a file URL needs an absolute path, three slashes: file:///path "
                      f"(host part {parts.netloc!r} given)")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise bad("a file URL needs an absolute path")
        if any(seg in (".", "..") for seg in path.split("/")):
            raise bad("'.' and '..' are not allowed in the path")
        from mtcfs.tiers.backup.file_backend import FileBackend
        return FileBackend(path)
    if not scheme:
        raise bad("no scheme")
    raise bad(f"unsupported scheme {parts.scheme!r}")


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
