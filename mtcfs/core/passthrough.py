"""FUSE passthrough: the store's data files handed to the kernel, which then reads, writes
and maps them itself (Linux >= 6.9, libfuse >= 3.17 and mtcfs's pyfuse3 patch,
third_party/pyfuse3/passthrough.patch; docs/passthrough.md).

:class:`Passthrough` owns the backing files this mount registered with the kernel
(``FUSE_DEV_IOC_BACKING_OPEN`` on the session's /dev/fuse descriptor, which returns a
backing id; ``FUSE_DEV_IOC_BACKING_CLOSE`` gives it back) and whether passthrough is in
effect, with the reason when it is not. It decides nothing about *which* opens may pass
through: that is :class:`~mtcfs.core.files.OpenFiles`'s (complete, verified, unshared
data only).

The kernel's rule it keeps (fs/fuse/iomode.c): while any open file of an inode is in
passthrough mode, every other open of that inode must be too, **on the same backing
file** (else the caller's open(2) fails with EIO); and an inode with open files on the
page-cache path cannot get a passthrough one. So there is one registration per inode at a
time (:class:`Backing`), shared by its passthrough handles and given back at the last
one's RELEASE. The kernel holds its own reference to the backing file from each open, so
giving the id back early never pulls a file from under an open descriptor.

The daemon opens every backing file itself, from its own store, by number; no path or
descriptor of the caller is ever accepted. Registering needs CAP_SYS_ADMIN in the
daemon's user namespace.

Not thread-safe: the trio thread only.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
from dataclasses import dataclass, field

from mtcfs.base import mountinfo

__all__ = ["Backing", "Passthrough", "why_unavailable"]

log = logging.getLogger(__name__)


def _iow(magic: int, nr: int, size: int) -> int:
    """Linux's ``_IOW(magic, nr, size)`` (the asm-generic encoding: x86-64, arm64)."""
    return (1 << 30) | (size << 16) | (magic << 8) | nr


#: struct fuse_backing_map { int32 fd; uint32 flags; uint64 padding; } (linux/fuse.h)
_BACKING_MAP = struct.Struct("<iIQ")
FUSE_DEV_IOC_BACKING_OPEN = _iow(229, 1, _BACKING_MAP.size)
FUSE_DEV_IOC_BACKING_CLOSE = _iow(229, 2, 4)

#: CAP_SYS_ADMIN's bit in /proc/self/status CapEff.
_CAP_SYS_ADMIN = 21

#: Filesystems that are themselves stacked on another one: the kernel refuses them as
#: backing files at the stack depth this mount asks for (0).
_STACKED = {"overlay", "ecryptfs", "fuse", "fuseblk"}


def _has_cap_sys_admin() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except (OSError, ValueError):
        pass
    return False


def why_unavailable(data_dir: str, fuse_api: bool) -> str:
    """Why passthrough cannot be used for a store whose data files are in ``data_dir``, or
    "" when nothing known rules it out (the kernel still has its say at FUSE INIT and at
    the first backing file). Checked before mounting: asking the kernel for passthrough
    costs the connection its writeback cache, so it is asked for only where it can work.
    ``fuse_api``: the FUSE library can register backing files (mtcfs's pyfuse3).
    """
    if not fuse_api:
        return ("this pyfuse3 cannot register backing files (the stock one; "
                "scripts/build_fuse.sh builds mtcfs's)")
    release = os.uname().release
    try:
        major, minor = (int(x) for x in release.split(".")[:2])
    except ValueError:
        major, minor = 0, 0
    if (major, minor) < (6, 9):
        return f"kernel {release} has no FUSE passthrough (6.9 or newer)"
    if not _has_cap_sys_admin():
        return "the daemon lacks CAP_SYS_ADMIN, which registering a backing file needs"
    kind = mountinfo.mount_of(data_dir)[1]
    if kind in _STACKED:
        return f"the store is on {kind}, a stacked filesystem the kernel does not pass through to"
    return ""


@dataclass(eq=False)
class Backing:
    """One backing file registered for one inode: its id, the data file it is (device and
    inode number, to tell whether an open of another version can share it) and the
    passthrough handles using it."""

    ino: int
    backing_id: int
    dev_ino: tuple[int, int]
    handles: set[int] = field(default_factory=set)


class Passthrough:
    """The passthrough state of one mount.

    Args:
        wanted: the mount option ``passthrough`` (yes by default).
    """

    def __init__(self, wanted: bool) -> None:
        self.wanted = wanted
        #: In effect: the kernel granted FUSE_PASSTHROUGH and no backing file was refused.
        self.on = False
        #: Why it is not in effect ("" while it is).
        self.why_off = "" if wanted else "turned off by the mount option passthrough=no"
        self._dev = -1
        self._by_ino: dict[int, Backing] = {}
        self._by_fh: dict[int, Backing] = {}
        #: handles opened in passthrough mode (reading, writing) and on the daemon's path
        #: with passthrough on, by reason (status, metrics)
        self.opened_read = 0
        self.opened_write = 0
        self.daemon_path: dict[str, int] = {}

    def start(self, granted: bool, dev_fd: int) -> None:
        """FUSE INIT is done: ``granted`` says whether the kernel agreed to passthrough;
        ``dev_fd`` is the session's /dev/fuse descriptor."""
        if not self.wanted:
            return
        if not self.why_off and not granted:
            self.why_off = "the kernel did not grant FUSE_PASSTHROUGH at FUSE INIT"
        self._dev = dev_fd
        self.on = granted and dev_fd >= 0 and not self.why_off
        log.info("passthrough: %s", "on" if self.on else f"off: {self.why_off}")

    def refuse(self, why: str) -> None:
        """Passthrough will not be used here (decided before mounting): say why."""
        if self.wanted and not self.why_off:
            self.why_off = why

    def live(self, ino: int) -> Backing | None:
        """The registration inode ``ino`` has, if any of its handles is in passthrough mode."""
        return self._by_ino.get(ino)

    def attach(self, ino: int, fh: int, data_fd: int, writable: bool) -> int:
        """Open handle ``fh`` of inode ``ino`` in passthrough mode on the data file open as
        ``data_fd``: the backing id for the open's reply, or 0 when it must take the
        daemon's path (passthrough off; the kernel refused the file, which turns it off
        for the mount and says why; or the inode's handles already pass through to
        another data file: :meth:`live` tells the caller beforehand).
        """
        if not self.on:
            return 0
        st = os.fstat(data_fd)
        key = (st.st_dev, st.st_ino)
        b = self._by_ino.get(ino)
        if b is not None and b.dev_ino != key:
            self.count_daemon_path("another version of the file is open in passthrough mode")
            return 0
        if b is None:
            try:
                bid = fcntl.ioctl(self._dev, FUSE_DEV_IOC_BACKING_OPEN,
                                  bytearray(_BACKING_MAP.pack(data_fd, 0, 0)), True)
            except OSError as exc:
                self.on = False
                self.why_off = f"the kernel refused a backing file ({exc.strerror})"
                log.warning("passthrough off for this mount: %s", self.why_off)
                return 0
            b = Backing(ino, int(bid), key)
            self._by_ino[ino] = b
        b.handles.add(fh)
        self._by_fh[fh] = b
        if writable:
            self.opened_write += 1
        else:
            self.opened_read += 1
        return b.backing_id

    def forget_inode(self, ino: int) -> None:
        """The inode's passthrough handles are all released: the next open may register
        another data file (the kernel dropped its own hold before each RELEASE)."""
        b = self._by_ino.pop(ino, None)
        if b is not None and not b.handles:
            self._close(b)

    def detach(self, fh: int) -> bool:
        """Handle ``fh`` is released; True if it was in passthrough mode. The backing id
        is given back with the last handle using it."""
        b = self._by_fh.pop(fh, None)
        if b is None:
            return False
        b.handles.discard(fh)
        if not b.handles:
            if self._by_ino.get(b.ino) is b:
                del self._by_ino[b.ino]
            self._close(b)
        return True

    def is_passthrough(self, fh: int) -> bool:
        return fh in self._by_fh

    def _close(self, b: Backing) -> None:
        if self._dev < 0:
            return
        try:
            fcntl.ioctl(self._dev, FUSE_DEV_IOC_BACKING_CLOSE, struct.pack("<I", b.backing_id))
        except OSError as exc:  # (the connection is gone: the kernel freed them all)
            log.debug("backing id %d not given back: %s", b.backing_id, exc)

    def count_daemon_path(self, why: str) -> None:
        """An open took the daemon's path although passthrough is on, for ``why``."""
        self.daemon_path[why] = self.daemon_path.get(why, 0) + 1

    def status(self) -> dict[str, object]:
        """The ``fuse`` part of ``mtcfs status`` for passthrough."""
        return {"passthrough": self.on,
                "passthrough_off": self.why_off,
                "passthrough_opens_read": self.opened_read,
                "passthrough_opens_write": self.opened_write,
                "daemon_path_opens": dict(self.daemon_path),
                "backing_files": len({id(b) for b in self._by_fh.values()})}
