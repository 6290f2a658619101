"""A backend on a POSIX directory: a local disk, NFS, Lustre, GPFS, a Filestore share.

Each key is a file below the root (``chunks/ab/ab12....zst`` is ``ROOT/chunks/ab/ab12....zst``).
A put writes a temporary file in the target directory, fsyncs it and renames it over the
target, so a reader (on this node or another one mounting the same share) sees the old
object, the new one, or none, never a torn one; this needs only the close-to-open consistency
and atomic same-directory rename that NFS and Lustre give. Directories are created as needed
and pruned when a delete empties them.

Temporary files are named ``.mtcfs-tmp-*``; listings skip them and keys may not use that
name. A writer that crashes leaves one behind; they are harmless and may be removed by hand.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator

from mtcfs.tiers.backup.backend import TEMP_PREFIX, Backend, validate_key, validate_prefix
from mtcfs.tiers.backup.errors import BackupError, NotFound, TransientError


#: errno values a network file system returns for conditions that clear up by themselves.
_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name) for name in (
        "EIO", "ETIMEDOUT", "ESTALE", "EAGAIN", "EINTR", "EBUSY", "ENOLCK", "ECONNRESET",
        "ECONNREFUSED", "ECONNABORTED", "EHOSTUNREACH", "ENETUNREACH", "ENETDOWN",
        "EREMOTEIO", "ECOMM",
    ) if hasattr(errno, name)
)


def _translate(exc: OSError, what: str) -> BackupError:
    """Map an OSError from ``what`` to the backup error hierarchy."""
    msg = f"{what}: {exc.strerror or exc}"
    if exc.errno in _TRANSIENT_ERRNOS:
        return TransientError(msg)
    return BackupError(msg)


class FileBackend(Backend):
    """Objects as files below ``root``.

    Args:
        root: absolute path of the backup root; created on the first put.

    Raises:
        ValueError: if ``root`` is not absolute.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        root = os.fspath(root)
        if not os.path.isabs(root):
            raise ValueError(f"backup root must be an absolute path, got {root!r}")
        self._root = os.path.normpath(root)

    @property
    def root(self) -> str:
        """The absolute path of the backup root."""
        return self._root

    def describe(self) -> str:
        return f"file://{self._root}"

    def _path(self, key: str) -> str:
        validate_key(key)  # also refuses segments named like our temporary files
        return os.path.join(self._root, *key.split("/"))

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` (bytes) to the file for ``key`` atomically and durably.

        Raises:
            TransientError: on an I/O error an NFS client reports for a server hiccup.
            BackupError: on any other OS error (no space, permission denied, ...).
        """
        path = self._path(key)
        parent = os.path.dirname(path)
        tmp = ""
        try:
            for attempt in range(5):
                tmp = os.path.join(parent, TEMP_PREFIX + secrets.token_hex(8))
                try:
                    os.makedirs(parent, exist_ok=True)
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                    break
                except FileNotFoundError:
                    # A concurrent delete pruned the directory between makedirs and open.
                    if attempt == 4:
                        raise
            try:
                with open(fd, "wb", closefd=True) as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
                tmp = ""
            finally:
                if tmp:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
            self._fsync_dir(parent)
        except OSError as exc:
            raise _translate(exc, f"writing {path}") from exc

    @staticmethod
    def _fsync_dir(path: str) -> None:
        """Make a rename durable; some network file systems refuse a directory fsync."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def get(self, key: str) -> bytes:
        """Return the content of the file for ``key``.

        Raises:
            NotFound: if the file does not exist.
            TransientError, BackupError: on other OS errors (see :meth:`put`).
        """
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise NotFound(f"no backup object {key!r} in {self.describe()}") from exc
        except OSError as exc:
            raise _translate(exc, f"reading {path}") from exc

    def exists(self, key: str) -> bool:
        path = self._path(key)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise _translate(exc, f"checking {path}") from exc
        return stat.S_ISREG(st.st_mode)  # a directory is a key prefix, not an object

    def list(self, prefix: str) -> Iterator[str]:
        """Yield keys starting with ``prefix``, in sorted order per directory.

        Raises:
            TransientError, BackupError: on OS errors other than a directory vanishing.
        """
        validate_prefix(prefix)
        # Walk only the deepest directory the prefix names entirely.
        dir_part = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = os.path.join(self._root, *dir_part.split("/")) if dir_part else self._root
        return self._walk(top, prefix)

    def _walk(self, top: str, prefix: str) -> Iterator[str]:
        def onerror(exc: OSError) -> None:
            if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
                return  # the directory went away under us (pruned by a delete)
            raise _translate(exc, f"listing {exc.filename or top}") from exc

        for dirpath, dirnames, filenames in os.walk(top, onerror=onerror):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, self._root)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
            for name in sorted(filenames):
                if name.startswith(TEMP_PREFIX):
                    continue
                key = rel_dir + name
                if key.startswith(prefix):
                    yield key

    def delete(self, key: str) -> None:
        """Remove the file for ``key`` (missing is fine) and prune emptied directories.

        Raises:
            TransientError, BackupError: on OS errors other than the file being absent.
        """
        path = self._path(key)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return  # nothing stored under this key (a directory is only a prefix)
        except OSError as exc:
            raise _translate(exc, f"deleting {path}") from exc
        parent = os.path.dirname(path)
        while parent != self._root and parent.startswith(self._root + os.sep):
            try:
                os.rmdir(parent)
            except OSError:
                break  # not empty (or already gone): stop pruning
            parent = os.path.dirname(parent)
