"""fallocate(2) on the store's data files: free a range (a corrupt chunk's bytes) or
allocate one (a user's fallocate through the mount), through libc (Python's ``os`` has
``posix_fallocate`` only, whose fallback writes bytes where the filesystem cannot).

Both work on tmpfs (the RAM tier) and on the usual local filesystems; where the filesystem
has no fallocate they report it instead of raising, and the caller keeps its meaning
without it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

__all__ = ["FALLOC_FL_KEEP_SIZE", "FALLOC_FL_PUNCH_HOLE", "allocate", "punch_hole"]

#: fallocate(2) mode bits (linux/falloc.h).
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

_libc: ctypes.CDLL | None = None


def _fallocate(fd: int, mode: int, off: int, length: int) -> int:
    """fallocate(2): 0, or the errno it failed with."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if _libc.fallocate(fd, mode, off, length) == 0:
        return 0
    return ctypes.get_errno() or errno.EIO


def punch_hole(fd: int, off: int, length: int) -> bool:
    """Free ``[off, off+length)`` of ``fd`` (reads return zeros; tmpfs gives the RAM back).
    Returns False where the filesystem cannot (the bytes then stay, marked missing)."""
    try:
        return _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, length) == 0
    except (OSError, AttributeError):
        return False


def allocate(fd: int, off: int, length: int) -> bool:
    """Give ``[off, off+length)`` of ``fd`` its pages now, without changing the file's
    size or a byte of it (``FALLOC_FL_KEEP_SIZE``). Returns False where the filesystem has
    no fallocate (the range then gets its pages at its first write, as before).

    Raises:
        OSError: ENOSPC (the filesystem, the data tmpfs sized to ``size=``, is full), or
            another error of fallocate(2) than "not supported".
    """
    err = _fallocate(fd, FALLOC_FL_KEEP_SIZE, off, length)
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    if err:
        raise OSError(err, os.strerror(err))
    return True
