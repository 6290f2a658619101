"""The RAM tier on disk: a store directory (normally on tmpfs) holding file data and metadata.

Layout (documented in docs/architecture.md, "On-disk format of the store")::

    <store>/STORE            JSON marker: format, job, chunk_size, created
    <store>/meta.sqlite3     namespace, versions, steps (see mtcfs.store.meta.SCHEMA)
    <store>/data/<vid>       bytes of file version <vid> (sparse while being restored)
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
import os
import time

from mtcfs.store.meta import MetaDB

STORE_FORMAT = 1


class StoreError(Exception):
    """The store directory cannot be used (locked by another daemon, other job, bad format)."""


class Store:
    """A store directory opened by one daemon.

    Args:
        path: the store directory; created (mode 0700) if missing.
        job: the job name; a store created for one job refuses to serve another.
        chunk_size: chunk size in bytes for new versions.
        lock_wait: seconds to wait for a previous daemon to release the store.

    Raises:
        StoreError: another daemon holds the store, or it belongs to another job/format.
    """

    def __init__(self, path: str, job: str, chunk_size: int, *, lock_wait: float = 5.0) -> None:
        self.path = os.path.abspath(path)
        self.data_dir = os.path.join(self.path, "data")
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
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
        self.job = job
        self.chunk_size = chunk_size
        self.db = MetaDB(os.path.join(self.path, "meta.sqlite3"))

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

    def remove_data(self, vid: int) -> None:
        try:
            os.unlink(self.data_path(vid))
        except FileNotFoundError:
            pass

    def data_vids(self) -> set[int]:
        """Version ids that have a data file."""
        out = set()
        for name in os.listdir(self.data_dir):
            if name.isdigit():
                out.add(int(name))
            else:  # a stray temporary; never referenced
                os.unlink(os.path.join(self.data_dir, name))
        return out

    def statvfs(self) -> os.statvfs_result:
        return os.statvfs(self.data_dir)

    def close(self) -> None:
        db = getattr(self, "db", None)
        if db is not None:
            db.close()
            self.db = None  # type: ignore[assignment]
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
