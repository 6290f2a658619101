"""The object-store interface the backup tier is written against, and the URL parser.

A :class:`Backend` is a flat key/value store of immutable-ish blobs under one root (a bucket
prefix, a directory). Keys are '/'-separated relative paths such as
``chunks/ab/ab12....zst``. Every operation is idempotent (a put of the same key with the same
bytes, a delete of a missing key), which is what makes blind retries safe; see
:mod:`mtcfs.tiers.backup.retry`.

Implementations are synchronous and thread-safe: the daemon calls them from worker threads.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

from mtcfs.tiers.backup.errors import BackupError, NotFound, TransientError

__all__ = [
    "Backend", "BackupError", "NotFound", "TransientError", "validate_key",
    "validate_prefix",
]

_MAX_KEY_BYTES = 1024  # the GCS object-name limit, applied to every backend alike
_MAX_SEGMENT_BYTES = 255  # NAME_MAX: a segment is a file name on a FileBackend
#: The start of a FileBackend's temporary file names: no key segment may start with it.
TEMP_PREFIX = ".mtcfs-tmp-"


def validate_key(key: str) -> str:
    """Check that ``key`` is a safe relative object key and return it.

    Args:
        key: '/'-separated path relative to the backend root.

    Returns:
        ``key`` unchanged.

    Raises:
        ValueError: if the key is empty, absolute, has an empty, '.' or '..' segment, a
            control character, or is longer than 1024 bytes of UTF-8; or has a segment
            longer than 255 bytes of UTF-8 or starting with ``.mtcfs-tmp-``. Those two rules
            are the file system's (NAME_MAX, :class:`FileBackend`'s temporary files),
            applied to every backend so that a key one accepts every other one stores.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"bad backup object key {key!r}: empty")
    parts = key.split("/")
    _check_segments(key, parts)
    for p in parts:
        if len(p.encode("utf-8", "surrogatepass")) > _MAX_SEGMENT_BYTES:
            raise ValueError(f"bad backup object key {key[:40]!r}...: a path segment is "
                             f"longer than {_MAX_SEGMENT_BYTES} bytes")
        if p.startswith(TEMP_PREFIX):
            raise ValueError(f"bad backup object key {key!r}: {TEMP_PREFIX}* is "
                             f"reserved")
    return key


def validate_prefix(prefix: str) -> str:
    """Check a listing prefix: ``""`` or a key-like string that may end in '/'.

    Raises:
        ValueError: under the same rules as :func:`validate_key`.
    """
    if prefix == "":
        return prefix
    if not isinstance(prefix, str):
        raise ValueError(f"bad backup listing prefix {prefix!r}")
    parts = prefix.split("/")
    if parts[-1] == "":
        parts.pop()
    _check_segments(prefix, parts)
    return prefix


def _check_segments(text: str, parts: list[str]) -> None:
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"bad backup object key {text!r}: empty, '.' or '..' path segment")
    if any(ord(c) < 0x20 or c == "\x7f" for c in text):
        raise ValueError(f"bad backup object key {text!r}: control character")
    if len(text.encode("utf-8", "surrogatepass")) > _MAX_KEY_BYTES:
        raise ValueError(f"bad backup object key {text[:40]!r}...: longer than 1024 bytes")


class Backend(abc.ABC):
    """A flat store of blobs under one root, addressed by relative keys.

    All methods block; all may raise :class:`TransientError` (retry may help) or
    :class:`BackupError` (permanent), and :class:`ValueError` for a malformed key
    (:func:`validate_key`), before any I/O.

    A key must not also be the directory of another key (``a`` and ``a/b``): an object store
    keeps both, a file system refuses the second put with a permanent :class:`BackupError`
    and keeps the first. The backup layout never makes such a pair.

    ``tests/t2_backend_conformance_test.py`` checks every implementation against these
    promises (docs/conformance.md).
    """

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing what was there, all or nothing.

        Args:
            key: relative object key.
            data: the whole object, in memory (chunks are at most 256 MiB).
        """

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Return the whole object stored under ``key``.

        Raises:
            NotFound: if there is no such object.
        """

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Return whether an object is stored under ``key``."""

    @abc.abstractmethod
    def list(self, prefix: str) -> Iterator[str]:
        """Yield the keys (relative to the root) that start with ``prefix``.

        ``prefix`` is a plain string prefix, as in GCS, not a directory: ``"steps/1"`` matches
        ``steps/1/...`` and ``steps/10/...``. Order is unspecified. Errors may surface while
        iterating, not only at the call.
        """

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object under ``key``; a missing object is not an error."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Return a one-line human description (the URL), for logs and ``mtcfs status``."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"
