"""The RAM tier on disk: a store directory (normally on tmpfs) holding file data and metadata.

Layout (documented in docs/architecture.md, "On-disk format of the store")::

    <store>/STORE            JSON marker: format, job, chunk_size, created
    <store>/meta.sqlite3     namespace, versions, steps (see mtcfs.core.store.meta.SCHEMA)
    <store>/data/<vid>       bytes of file version <vid> (sparse while being restored)
    <store>/reap/            data files of removed versions, being freed (store/reaper.py)
    <store>/lock             flock()ed by the daemon that serves this store
    <store>/control.sock     the running daemon's control socket
    <store>/mtcfs.log        the daemon's log when it runs in the background

Data lives here, not in the daemon's heap: the daemon can crash and restart without losing
sealed files, its memory stays flat whatever the checkpoint size, and the replication side
reads chunks straight from the data files.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
import time

from mtcfs.base import mountinfo
from mtcfs.base.failpoints import failpoint
from mtcfs.core.store.meta import MetaDB, NewerSchemaError
from mtcfs.core.store.reaper import REAP_MIN_BYTES, Reaper

STORE_FORMAT = 1
log = logging.getLogger("mtcfs.core.store")

#: Names mtcfs itself may have put into a store directory before its STORE marker: the
#: daemon's log (opened before the store), and ``lock`` and an empty ``data/`` left by a
#: daemon of an older version that crashed at its first start. Anything else without the
#: marker is someone else's directory.
_OWN_BEFORE_MARKER = {"mtcfs.log", "lock", "STORE.tmp", "data"}


class StoreError(Exception):
    """The store directory cannot be used (locked by another daemon, other job, bad format)."""


def check_store_dir(path: str, mountpoint: str | None = None) -> None:
    """Refuse a store directory that mtcfs must not write into, touching nothing.

    Refused: ``/``; the mount point or a path inside it; a path inside any mtcfs mount; a
    path that exists and is not a directory; an existing directory that holds anything but
    an mtcfs store (no ``STORE`` marker and something besides what mtcfs itself creates
    before the marker, see ``_OWN_BEFORE_MARKER``). A missing directory is fine (it is
    created).

    Raises:
        StoreError: the reason, in one line naming the path.
    """
    p = os.path.abspath(path)

    def within(inner: str, outer: str) -> bool:
        return inner == outer or inner.startswith(outer.rstrip("/") + "/")

    if p == "/" or os.path.realpath(p) == "/":
        raise StoreError("store=/ refused: the store must be a directory of its own")
    for mp, fstype in mountinfo.mounts():  # by text first: never stat a stuck FUSE mount
        if fstype == "fuse.mtcfs" and within(p, mp):
            raise StoreError(f"store={path} refused: it is inside the mtcfs mount {mp}")
    if mountpoint is not None:
        mnt = os.path.abspath(mountpoint)
        if within(p, mnt) or within(os.path.realpath(p), os.path.realpath(mnt)):
            raise StoreError(f"store={path} refused: it is the mount point {mnt} or inside it")
    if not os.path.lexists(p):
        return
    if not os.path.isdir(p):
        raise StoreError(f"store={path} refused: it exists and is not a directory")
    if os.path.exists(os.path.join(p, "STORE")):
        return
    foreign = []
    for name in sorted(os.listdir(p)):
        full = os.path.join(p, name)
        if name not in _OWN_BEFORE_MARKER or (name == "data" and (
                not os.path.isdir(full) or os.path.islink(full) or os.listdir(full))):
            foreign.append(name)
    if foreign:
        raise StoreError(f"store={path} refused: the directory is not empty and is not an "
                         f"mtcfs store (no STORE marker; it holds {', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}); nothing was touched: give "
                         "an empty or new directory")


class Store:
    """A store directory opened by one daemon.

    Args:
        path: the store directory; created (mode 0700) if missing, made 0700 if not.
        job: the job name; a store created for one job refuses to serve another.
        chunk_size: chunk size in bytes for new versions.
        lock_wait: seconds to wait for a previous daemon to release the store.

        mountpoint: the mount point it is for; the store may not be it or inside it.

    Raises:
        StoreError: another daemon holds the store, it belongs to another job/format, or
            the directory is not for a store (:func:`check_store_dir`; then nothing in it
            was created, changed or deleted).
    """

    def __init__(self, path: str, job: str, chunk_size: int, *, lock_wait: float = 5.0,
                 mountpoint: str | None = None) -> None:
        self.path = os.path.abspath(path)
        self.data_dir = os.path.join(self.path, "data")
        self._lock_fd = -1
        check_store_dir(self.path, mountpoint)  # before anything is created in it
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        self._lock_fd = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        # A daemon that was just unmounted may still be closing the store: give it a moment
        # (`umount` returns before the daemon exits), then refuse.
        deadline = time.monotonic() + lock_wait
        while True:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self._lock_fd)
                    raise StoreError(f"store {self.path} is in use by another mtcfs daemon"
                                     ) from None
                time.sleep(0.05)
        try:
            check_store_dir(self.path, mountpoint)  # again, now that no one else creates it
        except StoreError:
            self.close()
            raise
        # Only its user may enter it: file data, metadata, the log and the control socket
        # are there (docs/security-local.md); a directory made beforehand is closed too.
        if stat.S_IMODE(os.stat(self.path).st_mode) & 0o077:
            os.chmod(self.path, 0o700)
        marker = os.path.join(self.path, "STORE")
        if os.path.exists(marker):
            with open(marker) as f:
                info = json.load(f)
            if info.get("format") != STORE_FORMAT:
                self.close()
                raise StoreError(f"store {self.path} has unsupported format {info.get('format')}")
            if info.get("job") != job:
                self.close()
                raise StoreError(f"store {self.path} belongs to job {info.get('job')!r}, not {job!r}")
            self.created = False
        else:
            tmp = marker + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"format": STORE_FORMAT, "job": job, "chunk_size": chunk_size,
                           "created": time.time()}, f)
            os.replace(tmp, marker)
            self.created = True
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        self.reaper = Reaper(os.path.join(self.path, "reap"))
        self.reaper.sweep()  # what a crash left to free
        self._strays_logged: set[str] = set()
        self.job = job
        self.chunk_size = chunk_size
        try:
            self.db = MetaDB(os.path.join(self.path, "meta.sqlite3"))
        except NewerSchemaError as e:
            self.close()
            raise StoreError(f"store {self.path} refused: {e}") from None

    @property
    def control_socket(self) -> str:
        return os.path.join(self.path, "control.sock")

    @property
    def log_path(self) -> str:
        return os.path.join(self.path, "mtcfs.log")

    def data_path(self, vid: int) -> str:
        return os.path.join(self.data_dir, str(vid))

    def open_data(self, vid: int, *, create: bool = False) -> int:
        """Open the data file of version ``vid`` read-write; returns the fd."""
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        return os.open(self.data_path(vid), flags, 0o600)

    def remove_data(self, vid: int, allocated: int = 0) -> None:
        """Delete the data file of ``vid`` (nothing if it has none). ``allocated``: its
        bytes in RAM, if known; from :data:`~mtcfs.core.store.reaper.REAP_MIN_BYTES` on the
        pages are freed by the reaper thread, off the caller's (the FUSE loop's) time."""
        path = self.data_path(vid)
        if allocated >= REAP_MIN_BYTES:
            try:
                self.reaper.take(path)
                return
            except OSError as exc:  # cannot happen on one filesystem; free it here then
                log.warning("could not move %s to be freed off the loop: %s", path, exc)
        failpoint("store.free_data")
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def data_vids(self) -> set[int]:
        """Version ids that have a data file (names of plain decimal digits).

        Any other name in ``data/`` is not mtcfs's (mtcfs writes no temporaries there): it
        is left alone and named once in the log, never deleted.
        """
        out = set()
        strays = []
        for name in os.listdir(self.data_dir):
            if name.isascii() and name.isdigit() and name == str(int(name)):
                out.add(int(name))
            elif name not in self._strays_logged:
                strays.append(name)
        if strays:
            self._strays_logged.update(strays)
            log.warning("%s holds files that are not mtcfs's, left alone: %s",
                        self.data_dir, ", ".join(sorted(strays)[:20]))
        return out

    def statvfs(self) -> os.statvfs_result:
        return os.statvfs(self.data_dir)

    def close(self) -> None:
        reaper = getattr(self, "reaper", None)
        if reaper is not None:
            reaper.close()
        db = getattr(self, "db", None)
        if db is not None:
            db.close()
            self.db = None  # type: ignore[assignment]
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


#: Filesystems that keep a store in RAM, as intended.
RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def _existing(path: str) -> str:
    """``path``, or its nearest ancestor that exists."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def filesystem_size(path: str) -> int:
    """Total size in bytes of the filesystem that holds (or will hold) ``path``."""
    st = os.statvfs(_existing(path))
    return st.f_blocks * st.f_frsize


def check_size(path: str, size: int | None, given: str | None = None) -> None:
    """Refuse a RAM tier ``size`` (bytes) larger than the store's filesystem's total size.

    Raises:
        StoreError: one line naming ``size=`` as given and the filesystem's size.
    """
    if size is None:
        return
    total = filesystem_size(path)
    if size > total:
        mp, _ = mountinfo.mount_of(_existing(path))
        raise StoreError(f"bad option size={given or size}: larger than the store's "
                         f"filesystem ({mp}, {total / 1024 ** 3:.1f} GiB in all); give at most "
                         f"size={total // 1024 ** 2}M or put store= on a larger filesystem")


def filesystem_warning(path: str) -> dict[str, str | None]:
    """The filesystem type of the store and, unless it is in RAM (tmpfs, ramfs), a one-line
    warning: ``{"type": "ext4", "mount": "/", "warning": "..."}`` (``warning`` None on tmpfs).
    """
    mp, fstype = mountinfo.mount_of(_existing(path))
    warning = None
    if fstype not in RAM_FILESYSTEMS:
        warning = (f"warning: store {path} is on {fstype or 'an unknown filesystem'} ({mp}), "
                   "not tmpfs: the RAM tier runs at that disk's speed and wears it (put "
                   "store= on tmpfs, e.g. under /dev/shm)")
    return {"type": fstype, "mount": mp, "warning": warning}
