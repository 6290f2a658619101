"""Whole writes at an offset: a short count from ``pwrite(2)`` is never taken for the whole.

tmpfs (the RAM tier's filesystem) writes what it has pages for and returns a short count
when it runs out; only the next call fails (ENOSPC). A caller that writes once and ignores
the count leaves a hole, which reads back as zeros: a fault-in did so (tests/
t4_space_test.py, a create among chunk writes past size=).
"""

from __future__ import annotations

import errno
import os

__all__ = ["ShortWrite", "pwrite_all"]


class ShortWrite(OSError):
    """``pwrite_all`` could not write everything: :attr:`written` bytes from the start of
    the data are in the file, the rest is not. ``errno`` is the last call's (ENOSPC when a
    call wrote nothing without an error)."""

    def __init__(self, err: int, msg: str, written: int) -> None:
        super().__init__(err, msg)
        self.written = written


def pwrite_all(fd: int, data: bytes | memoryview, off: int) -> None:
    """Write all of ``data`` (bytes) at byte offset ``off`` of ``fd``, calling ``pwrite(2)``
    until it is written.

    Raises:
        ShortWrite: an OSError (ENOSPC when the filesystem is full, or the error of the call
            that failed) saying how many of the bytes were written before it.
    """
    view = memoryview(data).cast("B")
    n = 0
    while n < len(view):
        try:
            k = os.pwrite(fd, view[n:], off + n)
        except OSError as exc:
            raise ShortWrite(exc.errno or errno.EIO,
                             f"{exc.strerror} after {n} of {len(view)} bytes at {off}",
                             n) from None
        if not k:  # (not seen from tmpfs: a loop that could not end otherwise)
            raise ShortWrite(errno.ENOSPC, f"the file took none of the {len(view) - n} bytes"
                             f" left at {off + n}", n)
        n += k
