"""A backend on Google Cloud Storage, through the google-cloud-storage client library.

Objects are stored as ``gs://BUCKET/PREFIX/KEY``. Design choices:

* **One retry policy.** Every library call passes ``retry=None``, so the library does not
  retry on its own; failures are mapped to :class:`TransientError` / :class:`BackupError`
  and :class:`mtcfs.tiers.backup.retry.RetryingBackend` decides. Two stacked policies would
  multiply waits and hide errors from our counters.
* **Simple uploads.** ``upload_from_string`` with a known size and ``blob.chunk_size`` unset
  sends objects up to 8 MiB (every chunk at the default 4 MiB chunk size) in one multipart
  request; bigger objects (large ``chunk_size=`` options) go through a resumable session the
  library opens and finishes within the same call. No precondition (``if_generation_match``)
  is relied on: puts are idempotent because keys are content addresses or write-once markers.
* **Integrity in transit** is left to the library's default CRC32C checking; integrity of
  content is checked one level up by blake3 (:mod:`mtcfs.tiers.backup.chunk_store`).
* **Emulator.** When ``STORAGE_EMULATOR_HOST`` is set (``http://127.0.0.1:9023``) or an
  ``endpoint`` is passed, anonymous credentials are used, so no real credentials are needed.
  Otherwise Application Default Credentials (GCE/GKE metadata server, workload identity,
  ``GOOGLE_APPLICATION_CREDENTIALS``).
* **Threads.** Each thread gets its own ``storage.Client`` (and so its own HTTP session); the
  clients share one credentials object, which is resolved lazily on first use, so
  constructing a backend does no I/O.
"""

from __future__ import annotations

import http.client
import os
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

from mtcfs.tiers.backup.backend import Backend, validate_key, validate_prefix
from mtcfs.tiers.backup.errors import BackupError, NotFound, TransientError

#: Default (connect, read) timeouts in seconds for one HTTP request.
DEFAULT_TIMEOUT: tuple[float, float] = (10.0, 120.0)

#: HTTP status codes worth retrying (request timeout, throttling, server errors).
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})

#: Project reported to the emulator, which needs some project id but checks nothing.
_EMULATOR_PROJECT = "mtcfs-emulator"


def _fail(exc: BaseException, what: str) -> NoReturn:
    """Raise what :func:`translate_error` maps ``exc`` to, chained to ``exc``."""
    err = translate_error(exc, what)
    if err is exc:
        raise exc
    raise err from exc


def translate_error(exc: BaseException, what: str) -> BaseException:
    """Map an exception from the GCS client library to the backup error hierarchy.

    Args:
        exc: what the library raised.
        what: the operation and object, for the message ("get gs://b/p/key").

    Returns:
        :class:`NotFound` for 404; :class:`TransientError` for 408, 429, 5xx, connection
        resets, refused connections, timeouts, truncated bodies and in-transit checksum
        mismatches; :class:`BackupError` for other library, HTTP or auth errors; ``exc``
        itself for anything else (a programming error must not be retried or disguised).
    """
    from google.api_core import exceptions as gexc
    from google.auth import exceptions as auth_exc
    from google.cloud.storage.exceptions import DataCorruption, InvalidResponse
    import requests

    msg = f"{what}: {type(exc).__name__}: {exc}"
    if isinstance(exc, gexc.NotFound):
        return NotFound(msg)
    if isinstance(exc, gexc.GoogleAPICallError):
        if exc.code in _TRANSIENT_STATUS or (isinstance(exc.code, int) and exc.code >= 500):
            return TransientError(msg)
        return BackupError(msg)
    if isinstance(exc, InvalidResponse):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status == 404:
            return NotFound(msg)
        if status in _TRANSIENT_STATUS or (isinstance(status, int) and status >= 500):
            return TransientError(msg)
        return BackupError(msg)
    if isinstance(exc, DataCorruption):
        return TransientError(msg)  # the bytes were damaged on the way: fetch again
    if isinstance(exc, (requests.ConnectionError, requests.Timeout,
                        requests.exceptions.ChunkedEncodingError, ConnectionError,
                        TimeoutError, http.client.HTTPException, auth_exc.TransportError)):
        return TransientError(msg)
    if isinstance(exc, auth_exc.RefreshError) and getattr(exc, "retryable", False):
        return TransientError(msg)
    if isinstance(exc, (requests.RequestException, auth_exc.GoogleAuthError, OSError)):
        return BackupError(msg)
    return exc


class GCSBackend(Backend):
    """Objects in a GCS bucket below an optional prefix.

    Args:
        bucket: bucket name (must exist; the backend never creates buckets).
        prefix: object-name prefix without leading or trailing '/'; "" for the bucket root.
        endpoint: API endpoint URL (an emulator or proxy, ``http://127.0.0.1:9023``); default
            ``STORAGE_EMULATOR_HOST`` if set, else the real service. With an endpoint the
            client uses anonymous credentials.
        project: project id for the client; only the emulator path needs one and gets a
            placeholder.
        timeout: seconds per HTTP request, a number or (connect, read).
        credentials: google.auth credentials to use instead of the default ones (or of
            anonymous ones when an endpoint is set, e.g. a Private Service Connect endpoint).

    Raises:
        ValueError: if ``bucket`` is empty or ``prefix`` is malformed.
    """

    def __init__(self, bucket: str, prefix: str = "", *, endpoint: str | None = None,
                 project: str | None = None,
                 timeout: float | tuple[float, float] = DEFAULT_TIMEOUT,
                 credentials: Any = None) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"bad GCS bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            validate_prefix(prefix)
        self._bucket_name = bucket
        self._prefix = prefix + "/" if prefix else ""
        self._endpoint = endpoint or os.environ.get("STORAGE_EMULATOR_HOST") or None
        if self._endpoint and "://" not in self._endpoint:
            self._endpoint = "http://" + self._endpoint
        self._project = project
        self._timeout = timeout
        self._local = threading.local()
        self._cred_lock = threading.Lock()
        self._credentials: Any = credentials

    def describe(self) -> str:
        url = f"gs://{self._bucket_name}/{self._prefix}".rstrip("/")
        return f"{url} (endpoint {self._endpoint})" if self._endpoint else url

    # -- client plumbing -------------------------------------------------------------------

    def _resolve_credentials(self) -> tuple[Any, str | None]:
        with self._cred_lock:
            if self._credentials is None:
                if self._endpoint:
                    from google.auth.credentials import AnonymousCredentials
                    self._credentials = AnonymousCredentials()
                    self._project = self._project or _EMULATOR_PROJECT
                else:
                    import google.auth
                    try:
                        creds, project = google.auth.default()
                    except Exception as exc:
                        _fail(exc, f"finding credentials for {self.describe()}")
                    self._credentials = creds
                    self._project = self._project or project
            return self._credentials, self._project

    def _bucket(self) -> Any:
        bucket = getattr(self._local, "bucket", None)
        if bucket is None:
            from google.cloud import storage
            creds, project = self._resolve_credentials()
            options = {"api_endpoint": self._endpoint} if self._endpoint else None
            client = storage.Client(project=project, credentials=creds, client_options=options)
            # google-cloud-storage 3.17 fetches bucket metadata in a background thread on a
            # client's first call, for tracing attributes: an extra request that needs
            # storage.buckets.get and bypasses our retry policy. We trace nothing: off.
            if getattr(client, "_bucket_metadata_cache", None) is not None:
                client._bucket_metadata_cache = None
            bucket = client.bucket(self._bucket_name)
            self._local.bucket = bucket
        return bucket

    def _name(self, key: str) -> str:
        return self._prefix + validate_key(key)

    def _url(self, key: str) -> str:
        return f"gs://{self._bucket_name}/{self._prefix}{key}"

    # -- operations ------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """Upload ``data`` as object ``key`` (replacing it).

        Raises:
            TransientError: on 408/429/5xx, connection and timeout errors.
            BackupError: on other errors (403, bucket missing, ...).
        """
        name = self._name(key)
        try:
            blob = self._bucket().blob(name)
            blob.chunk_size = None  # one request where the size allows (<= 8 MiB)
            blob.upload_from_string(bytes(data), content_type="application/octet-stream",
                                    timeout=self._timeout, retry=None)
        except Exception as exc:
            _fail(exc, f"put {self._url(key)}")

    def get(self, key: str) -> bytes:
        """Download object ``key``.

        Raises:
            NotFound: if it does not exist.
            TransientError, BackupError: see :meth:`put`.
        """
        name = self._name(key)
        try:
            data: bytes = self._bucket().blob(name).download_as_bytes(timeout=self._timeout,
                                                                      retry=None)
            return data
        except Exception as exc:
            _fail(exc, f"get {self._url(key)}")

    def exists(self, key: str) -> bool:
        name = self._name(key)
        try:
            return bool(self._bucket().blob(name).exists(timeout=self._timeout, retry=None))
        except Exception as exc:
            _fail(exc, f"stat {self._url(key)}")

    def list(self, prefix: str) -> Iterator[str]:
        """Yield keys starting with ``prefix``, in lexicographic order, page by page.

        Raises:
            TransientError, BackupError: while iterating, if a page request fails.
        """
        validate_prefix(prefix)
        return self._list(prefix)

    def _list(self, prefix: str) -> Iterator[str]:
        full = self._prefix + prefix
        cut = len(self._prefix)
        try:
            bucket = self._bucket()
            pages = bucket.client.list_blobs(
                bucket, prefix=full or None, fields="items(name),nextPageToken",
                timeout=self._timeout, retry=None)
            for blob in pages:
                yield blob.name[cut:]
        except Exception as exc:
            _fail(exc, f"list {self._url(prefix)}")

    def delete(self, key: str) -> None:
        name = self._name(key)
        try:
            self._bucket().blob(name).delete(timeout=self._timeout, retry=None)
        except Exception as exc:
            if translate_error(exc, "delete").__class__ is NotFound:
                return
            _fail(exc, f"delete {self._url(key)}")
