"""The one error type the core raises: an errno with a message.

Every layer below the FUSE adapter reports failures a user can see as :class:`FsError`;
the adapter turns it into ``pyfuse3.FUSEError`` and nothing else escapes to the kernel.
"""

from __future__ import annotations

import errno
import os


class FsError(OSError):
    """A filesystem-level failure with the errno the application will see.

    Args:
        err: an ``errno`` constant (ENOENT, ENOSPC, EIO, ...).
        msg: why, for logs and ``mtcfs status``; defaults to ``os.strerror(err)``.
    """

    def __init__(self, err: int, msg: str | None = None) -> None:
        super().__init__(err, msg or os.strerror(err))


class StoreFull(OSError):
    """The store's filesystem has no room for the metadata an op would add (ENOSPC),
    raised before anything changed: the same op can be applied again once there is room
    (a scope=job node waits at it rather than skip it: docs/reliability.md)."""

    def __init__(self, msg: str) -> None:
        super().__init__(errno.ENOSPC, msg)


ENOATTR = getattr(errno, "ENOATTR", errno.ENODATA)
