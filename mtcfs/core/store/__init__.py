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

import contextlib
import fcntl
import json
import logging
import os
import shutil
import sqlite3
import stat
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

from mtcfs.base import mountinfo
from mtcfs.base.untrusted import BadRecord, field_float, field_int, field_str, json_object
from mtcfs.base.failpoints import failpoint
from mtcfs.core.store import datafs
from mtcfs.core.store.meta import MetaDB, NewerSchemaError
from mtcfs.core.store.reaper import REAP_MIN_BYTES, Reaper

STORE_FORMAT = 1
log = logging.getLogger("mtcfs.core.store")

#: Names mtcfs itself may have put into a store directory before its STORE marker: the
#: daemon's log (opened before the store), ``lock``, the marker's temporary, an empty
#: ``data/`` and ``reap/``, and the metadata (a new store's marker is written last, after
#: its metadata; a daemon of an older version wrote it first). Anything else without the
#: marker is someone else's directory.
_OWN_BEFORE_MARKER = {"mtcfs.log", "lock", "STORE.tmp", "data", "reap", "meta.sqlite3",
                      "meta.sqlite3-wal", "meta.sqlite3-shm"}
#: Of those, the ones that are directories (every other one is a regular file).
_OWN_DIRS = {"data", "reap"}

#: Largest STORE marker accepted, in bytes (mtcfs writes about 100).
MARKER_MAX_BYTES = 4096
#: Tables an existing store's metadata must hold (the others are added in place).
_REQUIRED_TABLES = ("inodes", "dentries", "versions", "kv")
#: Every table of mtcfs's metadata (mtcfs.core.store.meta.SCHEMA).
_MTCFS_TABLES = {"inodes", "dentries", "versions", "rewrite_dirty", "xattrs", "steps", "kv"}
_SQLITE_HEADER = b"SQLite format 3\x00"


class StoreError(Exception):
    """The store directory cannot be used (locked by another daemon, other job, bad format,
    damaged); nothing in it was created, changed or deleted by the check that raised it."""


def _recover_hint(path: str) -> str:
    return (f"nothing was touched: move it aside (mv {path} {path}.damaged) and mount on an "
            "empty store (the job's checkpoints come back from its peer or backup tier)")


def _kind(st: os.stat_result) -> str:
    m = st.st_mode
    if stat.S_ISLNK(m):
        return "a symbolic link"
    if stat.S_ISDIR(m):
        return "a directory"
    if stat.S_ISREG(m):
        return "a file"
    return "not a regular file"


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _check_owner(path: str, full: str, st: os.stat_result) -> None:
    """Refuse an entry ``full`` of store ``path`` that neither this process's user nor root
    owns (another user made it, in a store directory others could write, and could change
    what the daemon keeps there).

    Raises:
        StoreError: one line.
    """
    if st.st_uid not in (0, os.geteuid()):
        raise StoreError(f"store={path} refused: {full} is owned by uid {st.st_uid}, not by "
                         f"the daemon's user (uid {os.geteuid()}) or root: another user made "
                         "it and could change what the daemon keeps there; nothing was "
                         "touched: remove it or give another store")


def read_marker(path: str) -> dict[str, Any] | None:
    """The STORE marker of store directory ``path``, checked; None when there is none.

    Read without following a symbolic link and without changing anything. A valid marker is
    a regular file of at most :data:`MARKER_MAX_BYTES` holding a strict JSON object with
    ``format`` (integer), ``job`` (string), ``chunk_size`` (positive integer) and, if
    present, ``created`` (a finite number, seconds).

    Raises:
        StoreError: one line naming the path and what is wrong (another format included).
    """
    full = os.path.join(path, "STORE")
    st = _lstat(full)
    if st is None:
        return None
    why = None
    _check_owner(path, full, st)
    if not stat.S_ISREG(st.st_mode):
        why = f"it is {_kind(st)}"
    elif st.st_size > MARKER_MAX_BYTES:
        why = f"it has {st.st_size} bytes, more than {MARKER_MAX_BYTES}"
    else:
        try:
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                body = os.read(fd, MARKER_MAX_BYTES + 1)
            finally:
                os.close(fd)
        except OSError as exc:
            raise StoreError(f"store={path} refused: its STORE marker cannot be read: "
                             f"{exc.strerror or exc}") from None
        try:
            info = json_object(body, MARKER_MAX_BYTES)
            field_int(info, "format", 0)
            field_str(info, "job", 256)
            field_int(info, "chunk_size", 1)
            field_float(info, "created", default=0.0)
        except BadRecord as exc:
            why = str(exc)
        else:
            if info["format"] != STORE_FORMAT:
                raise StoreError(f"store={path} refused: it has unsupported format "
                                 f"{info['format']} (this mtcfs reads {STORE_FORMAT}); nothing "
                                 "was changed")
            return info
    raise StoreError(f"store={path} refused: its STORE entry is not an mtcfs store marker "
                     f"({why}); nothing was touched: if it is someone else's directory give "
                     f"an empty or new one, if it is a damaged store move it aside (mv {path} "
                     f"{path}.damaged) and mount on an empty store")


def _check_metadata(path: str, conn: sqlite3.Connection, marked: bool) -> None:
    """Refuse metadata that does not check out (read only): an existing store's must hold
    mtcfs's tables and its schema version; without a root directory (a store whose first
    start stopped before it made one) it must list nothing and ``data/`` must hold no data
    file. ``marked``: the directory has a STORE marker.

    Raises:
        StoreError: one line.
    """
    meta = os.path.join(path, "meta.sqlite3")
    try:
        tables = {r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type='table'")}
        if not marked and tables <= _MTCFS_TABLES and not _data_names(path) and not any(
                conn.execute(f"SELECT 1 FROM {t} LIMIT 1").fetchone()
                for t in sorted(tables - {"kv"})):
            # a first start that stopped before its marker: its schema made so far (one
            # table at a time) and no schema version yet, nothing in it anyone's
            return
        missing = [t for t in _REQUIRED_TABLES if t not in tables]
        if missing:
            raise StoreError(f"store={path} refused: damaged, {meta} lacks mtcfs's tables "
                             f"({', '.join(missing)}); {_recover_hint(path)}")
        row = conn.execute("SELECT value FROM kv WHERE key='schema_version'").fetchone()
        if row is None or not str(row[0]).isdigit():
            raise StoreError(f"store={path} refused: damaged, {meta} records no schema "
                             f"version; {_recover_hint(path)}")
        has_root = conn.execute("SELECT 1 FROM inodes WHERE ino=1").fetchone() is not None
        lost = conn.execute("SELECT ino, vid FROM inodes WHERE vid IS NOT NULL AND vid NOT IN"
                            " (SELECT vid FROM versions) LIMIT 1").fetchone()
        if lost is not None:
            # (one transaction writes an inode's vid and its version's row: never a crash's)
            raise StoreError(f"store={path} refused: damaged, {meta} names version {lost[1]}"
                             f" of inode {lost[0]} but has no row for it; "
                             f"{_recover_hint(path)}")
        if has_root and not marked:
            raise StoreError(f"store={path} refused: damaged, it has metadata but no STORE "
                             f"marker; {_recover_hint(path)}")
        if not has_root:
            listed = [t for t in ("inodes", "dentries", "versions", "steps") if t in tables
                      and conn.execute(f"SELECT 1 FROM {t} LIMIT 1").fetchone()]
            if listed or _data_names(path):
                what = (f"its {', '.join(listed)} rows" if listed else "the data files in "
                        f"{os.path.join(path, 'data')}")
                raise StoreError(f"store={path} refused: damaged, {meta} has no root "
                                 f"directory but {what} remain; {_recover_hint(path)}")
    except sqlite3.Error as exc:
        raise StoreError(f"store={path} refused: damaged, {meta} cannot be read ({exc}); "
                         f"{_recover_hint(path)}") from None


def _data_names(path: str) -> list[str]:
    """Names in ``<path>/data`` that are version numbers (plain decimal digits)."""
    try:
        names = os.listdir(os.path.join(path, "data"))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [n for n in names if n.isascii() and n.isdigit() and n == str(int(n))]


@contextlib.contextmanager
def _metadata_readonly(path: str, locked: bool) -> Iterator[sqlite3.Connection | None]:
    """A read-only connection to ``<path>/meta.sqlite3`` that creates nothing in ``path``.

    Without a WAL the database file is all there is (opened immutable: no ``-wal``/``-shm``
    created); a WAL and its index are read as they are. A WAL without its index (a store
    copied or restored without ``-shm``) cannot be read without SQLite creating that index
    next to it: unless ``locked`` (the caller holds the store's lock and opens it next), the
    database and its WAL are read from a private copy, removed afterwards; None when no copy
    can be made (the daemon's check after its lock then reads it).

    Raises:
        sqlite3.Error: it cannot be opened.
    """
    meta = os.path.join(path, "meta.sqlite3")
    wal = os.path.exists(meta + "-wal")
    tmp = None
    if wal and not locked and not os.path.exists(meta + "-shm"):
        try:
            tmp = tempfile.mkdtemp(prefix="mtcfs-check-")
            for suffix in ("", "-wal"):  # both regular files (checked, never followed)
                with open(meta + suffix, "rb", opener=_nofollow) as src, \
                        open(os.path.join(tmp, "meta.sqlite3" + suffix), "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        except OSError as exc:  # no room for a copy: the daemon checks it after its lock
            log.warning("the metadata of %s is checked once it is locked (no private copy: "
                        "%s)", path, exc)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            yield None
            return
        meta = os.path.join(tmp, "meta.sqlite3")
    mode = "mode=ro" if wal else "mode=ro&immutable=1"
    try:
        conn = sqlite3.connect(f"file:{urllib.parse.quote(meta)}?{mode}", uri=True)
        try:
            yield conn
        finally:
            conn.close()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def check_store_contents(path: str, *, marked: bool, deep: bool = True,
                         locked: bool = False) -> None:
    """Refuse a store directory whose own files do not check out, touching nothing.

    Checked, never following a symbolic link: ``meta.sqlite3`` (with a STORE marker it must
    be a non-empty SQLite database; then, when ``deep``, :func:`_check_metadata`), its
    ``-wal``/``-shm``, ``lock``, ``mtcfs.log``, ``STORE.tmp`` are regular files; ``data/``
    and ``reap/`` are directories (not links); every version-numbered entry in ``data/`` is
    a regular file. A missing ``data/`` is fine (its versions' chunks become missing).
    ``locked``: the caller holds the store's lock (the metadata may then be read even when
    that makes SQLite create its ``-shm`` index). A mount on ``data/`` must be mtcfs's own
    data tmpfs (store/datafs.py: tmpfs, source ``mtcfs-data``, root's, mode 0700).

    Raises:
        StoreError: one line naming the entry and how to recover.
    """
    for name in sorted(_OWN_BEFORE_MARKER):
        full = os.path.join(path, name)
        st = _lstat(full)
        if st is None:
            continue
        want_dir = name in _OWN_DIRS
        ok = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
        if not ok:
            raise StoreError(f"store={path} refused: damaged, {full} is {_kind(st)}, not "
                             f"{'a directory' if want_dir else 'a file'} of mtcfs's; "
                             f"{_recover_hint(path)}")
        _check_owner(path, full, st)
    meta = os.path.join(path, "meta.sqlite3")
    st = _lstat(meta)
    if marked and (st is None or st.st_size == 0):
        raise StoreError(f"store={path} refused: damaged, it has a STORE marker but "
                         f"{meta} is {'missing' if st is None else 'empty'}; "
                         f"{_recover_hint(path)}")
    if st is not None and st.st_size > 0:
        try:
            with open(meta, "rb", opener=_nofollow) as f:
                header = f.read(len(_SQLITE_HEADER))
        except OSError as exc:
            raise StoreError(f"store={path} refused: {meta} cannot be read: "
                             f"{exc.strerror or exc}") from None
        if header != _SQLITE_HEADER:
            raise StoreError(f"store={path} refused: damaged, {meta} is not a SQLite "
                             f"database; {_recover_hint(path)}")
    data = os.path.join(path, "data")
    mounted = datafs.mount_of_data(data) if os.path.isdir(data) else None
    if mounted is not None and not datafs.is_ours(data, mounted):
        raise StoreError(f"store={path} refused: {data} is a mount that is not mtcfs's data "
                         f"tmpfs ({mounted.fstype} from {mounted.source!r}): the daemon would "
                         "keep file data and delete files there; nothing was touched: "
                         f"unmount it (umount {data}) or give another store")
    if os.path.isdir(data):
        with os.scandir(data) as it:
            for e in it:
                n = e.name
                if (n.isascii() and n.isdigit() and n == str(int(n))
                        and not e.is_file(follow_symlinks=False)):
                    raise StoreError(f"store={path} refused: damaged, data/{n} is "
                                     f"{_kind(e.stat(follow_symlinks=False))}, not a data "
                                     f"file; {_recover_hint(path)}")
    if deep and st is not None and st.st_size > 0:
        try:
            with _metadata_readonly(path, locked) as conn:
                if conn is not None:
                    _check_metadata(path, conn, marked)
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"store={path} refused: damaged, {meta} cannot be opened "
                             f"({exc}); {_recover_hint(path)}") from None


def _nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)


def _open_to_others(p: str) -> str | None:
    """Why another user could replace store directory ``p`` (absolute) or what is in it, or
    None. Each existing element of ``p`` and of the path it resolves to (``p`` itself and a
    symbolic link included) must be owned by root or this process's user, and no directory
    above ``p`` may be writable by others without the sticky bit (``/dev/shm`` has it), nor
    by a group other than root's and this process's. Read only."""
    me, my_gid = os.geteuid(), os.getegid()
    real = os.path.realpath(p)
    for path in (p, real) if real != p else (p,):
        parts = [part for part in path.split("/") if part]
        for i in range(len(parts) + 1):
            q = "/" + "/".join(parts[:i])
            try:
                lst, st = os.lstat(q), os.stat(q)
            except OSError:
                break  # missing (made by the daemon), not a directory...: checked later
            for s in (lst, st):
                if s.st_uid not in (0, me):
                    return f"{q} is owned by uid {s.st_uid}"
            m = st.st_mode
            if i == len(parts) or m & stat.S_ISVTX:
                continue  # the store itself is made 0700 when the daemon opens it
            if m & 0o002 or (m & 0o020 and st.st_gid not in (0, my_gid)):
                return (f"{q} may be written by other users (mode {stat.S_IMODE(m):04o}, "
                        f"group {st.st_gid}, no sticky bit)")
    return None


def _below_same_directory(inner: str, outer: str) -> bool:
    """Whether ``inner`` or one of its existing parents is the very directory ``outer`` is
    (same device and inode), whatever the paths (a bind mount of it). Read only."""
    try:
        want = os.stat(outer)
    except OSError:
        return False
    cur = os.path.realpath(inner)
    while True:
        try:
            st = os.stat(cur)
        except OSError:
            st = None
        if st is not None and (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            return True
        parent = os.path.dirname(cur)
        if parent == cur:
            return False
        cur = parent


def check_store_dir(path: str, mountpoint: str | None = None, job: str | None = None,
                    *, deep: bool = True, locked: bool = False) -> dict[str, Any] | None:
    """Refuse a store directory that mtcfs must not write into, touching nothing.

    Refused: ``/``; the mount point or a path inside it; a mount point inside the store
    (as given or resolved: the daemon would serve its own files through its own mount); a
    path inside any mtcfs mount; a path that exists and is not a directory; an existing
    directory that holds anything but an mtcfs store (no ``STORE`` marker and something
    besides what mtcfs itself creates before the marker, see ``_OWN_BEFORE_MARKER``); a
    ``STORE`` entry that is not a valid marker (:func:`read_marker`); a store of another
    ``job`` (if given); a store whose own files do not check out
    (:func:`check_store_contents`: a marker without metadata is a damaged store, not a new
    one). A missing directory is fine (it is created). ``deep`` and ``locked``: see
    :func:`check_store_contents`.

    Returns:
        The store's marker (a dict), or None when it has none (a new store).

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
        if within(mnt, p) or within(os.path.realpath(mnt), os.path.realpath(p)) or \
                _below_same_directory(mnt, p):  # a bind mount of the store, say
            raise StoreError(f"mount point {mountpoint} refused: it is inside the store "
                             f"{path} (the daemon would read its own files through its own "
                             "mount); give a mount point outside the store")
        if _below_same_directory(p, mnt):
            raise StoreError(f"store={path} refused: it is the mount point {mnt} or inside it")
    why = _open_to_others(p)
    if why:
        raise StoreError(f"store={path} refused: {why}, so another user could replace what "
                         "the daemon reads and deletes there; nothing was touched: give a "
                         "store whose parents only root or you can change")
    if not os.path.lexists(p):
        return None
    if not os.path.isdir(p):
        raise StoreError(f"store={path} refused: it exists and is not a directory")
    marker = read_marker(p)
    if marker is not None:
        if job is not None and marker["job"] != job:
            raise StoreError(f"store={path} refused: it belongs to job {marker['job']!r}, not "
                             f"{job!r}; nothing was changed: give this job's store")
        check_store_contents(p, marked=True, deep=deep, locked=locked)
        return marker
    foreign = []
    for name in sorted(os.listdir(p)):
        full = os.path.join(p, name)
        if name not in _OWN_BEFORE_MARKER or (name in _OWN_DIRS and (
                not os.path.isdir(full) or os.path.islink(full) or os.listdir(full))):
            foreign.append(name)
    if foreign:
        raise StoreError(f"store={path} refused: the directory is not empty and is not an "
                         f"mtcfs store (no STORE marker; it holds {', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}); nothing was touched: give "
                         "an empty or new directory")
    check_store_contents(p, marked=False, deep=deep, locked=locked)
    return None


class Store:
    """A store directory opened by one daemon.

    Args:
        path: the store directory; created (mode 0700) if missing, made 0700 if not.
        job: the job name; a store created for one job refuses to serve another.
        chunk_size: chunk size in bytes for new versions.
        lock_wait: seconds to wait for a previous daemon to release the store.

        mountpoint: the mount point it is for; the store may not be it or inside it.
        data_size: bytes: give ``data/`` a tmpfs of its own of this size when the store is
            on tmpfs and the process is root (store/datafs.py: ``prepare``; the daemon
            passes ``datafs.tmpfs_size(capacity, chunk_size)``); None: never (in-process
            tests, tools).

    Raises:
        StoreError: another daemon holds the store, it belongs to another job/format, it
            is damaged (a marker without its metadata, a data file or ``reap/`` that is a
            link...), or the directory is not for a store (:func:`check_store_dir`; then
            nothing in it was created, changed or deleted).
    """

    def __init__(self, path: str, job: str, chunk_size: int, *, lock_wait: float = 5.0,
                 mountpoint: str | None = None, data_size: int | None = None) -> None:
        self.path = os.path.abspath(path)
        self.data_dir = os.path.join(self.path, "data")
        self._lock_fd = -1
        #: The byte size of ``data/``'s own tmpfs when this store sized one (the kernel
        #: then refuses a write past it with ENOSPC, passthrough writes included); None
        #: otherwise (a store not on tmpfs, not root, no ``data_size``): only the daemon's
        #: per-write check holds size= then, so writes must go through the daemon.
        self.data_limit: int | None = None
        self._data_grown = False  # grow_data() set it above data_limit
        check_store_dir(self.path, mountpoint, job)  # before anything is created in it
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        # Only its user may enter it: file data, metadata, the log and the control socket
        # are there (docs/security-local.md); a directory made beforehand is closed too, at
        # once: what another user makes in it before is refused by the check below, and
        # after, nothing can be.
        if stat.S_IMODE(os.stat(self.path).st_mode) & 0o077:
            os.chmod(self.path, 0o700)
        self._lock_fd = os.open(os.path.join(self.path, "lock"),
                                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
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
            # again, now that no one else changes it: marker, metadata, data/ and reap/
            info = check_store_dir(self.path, mountpoint, job, locked=True)
        except StoreError:
            self.close()
            raise
        failpoint("store.checked")  # tests: what another user may do now
        self.created = info is None
        if data_size is not None:
            try:
                self.data_limit = datafs.prepare(self.path, data_size)
                self._data_grown = self.data_limit is not None  # (shrink_data checks once)
            except datafs.DataMountError as exc:
                self.close()
                raise StoreError(str(exc)) from None
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
        if info is None:
            # The marker last: a marker without its metadata is never one of mtcfs's (a
            # damaged store, refused), and a start that stops before it leaves a store
            # without a marker and with empty metadata, which the next start takes as new.
            marker = os.path.join(self.path, "STORE")
            tmp = marker + ".tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"format": STORE_FORMAT, "job": job, "chunk_size": chunk_size,
                           "created": time.time()}, f)
            os.replace(tmp, marker)

    @property
    def control_socket(self) -> str:
        return os.path.join(self.path, "control.sock")

    @property
    def log_path(self) -> str:
        return os.path.join(self.path, "mtcfs.log")

    def data_path(self, vid: int) -> str:
        return os.path.join(self.data_dir, str(vid))

    def open_data(self, vid: int, *, create: bool = False) -> int:
        """Open the data file of version ``vid`` read-write; returns the fd. A symbolic link
        there is never followed (OSError ELOOP)."""
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
        return os.open(self.data_path(vid), flags, 0o600)

    def remove_data(self, vid: int, allocated: int = 0) -> None:
        """Delete the data file of ``vid`` (nothing if it has none). ``allocated``: its
        bytes in RAM, if known; from :data:`~mtcfs.core.store.reaper.REAP_MIN_BYTES` on the
        pages are freed by the reaper thread, off the caller's (the FUSE loop's) time."""
        path = self.data_path(vid)
        if allocated >= REAP_MIN_BYTES:
            try:
                self.reaper.take(path, allocated)
            except OSError as exc:  # cannot happen on one filesystem; free it here then
                log.warning("could not move %s to be freed off the loop: %s", path, exc)
            else:
                self._room_while_reaping()
                return
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

    def data_usage(self) -> tuple[int, int] | None:
        """(size, used) in bytes of ``data/``'s own tmpfs by statfs, ``used`` less what the
        reaper has still to free (already gone for the budget); None when it has none
        (:attr:`data_limit` None) or it cannot be measured."""
        if self.data_limit is None:
            return None
        try:
            size, used = datafs.usage(self.data_dir)
        except OSError:
            return None
        return size, max(0, used - self.reaper.pending_bytes)

    def grow_data(self, nbytes: int) -> None:
        """Let ``nbytes`` more bytes into the data tmpfs beyond its size (a fault-in the
        budget lets past ``size=`` because nothing can be evicted: a read is never refused
        for room, docs/usage.md): grow it to what it holds plus ``nbytes`` plus 4 chunks.
        :meth:`shrink_data` takes it back to :attr:`data_limit` once it holds no more than
        that. Nothing without a data tmpfs; a failure is logged."""
        if self.data_limit is None:
            return
        try:
            size, used = datafs.usage(self.data_dir)
            want = used + nbytes + 4 * self.chunk_size
            if want > size:
                datafs.resize(self.data_dir, want)
                self._data_grown = True
                log.warning("data tmpfs %s grown past size= to %d bytes for chunks read in "
                            "(nothing could be evicted)", self.data_dir, want)
        except OSError as exc:
            log.warning("cannot grow the data tmpfs %s: %s", self.data_dir, exc)

    def _room_while_reaping(self) -> None:
        """The pages the reaper thread has still to free count as free at once (for the
        budget: :meth:`data_usage`), so the data tmpfs lets that many bytes past its size
        meanwhile: else a write the budget let in (the kernel's, for a passthrough writer,
        or the daemon's) got ENOSPC from the tmpfs while the old pages were being freed.
        :meth:`shrink_data` takes it back once they are."""
        if self.data_limit is None:
            return
        try:
            size, _ = datafs.usage(self.data_dir)
            want = self.data_limit + self.reaper.pending_bytes
            if want > size:
                datafs.resize(self.data_dir, want)
                self._data_grown = True
        except OSError as exc:
            log.warning("cannot grow the data tmpfs %s while freeing: %s", self.data_dir, exc)

    def shrink_data(self, in_flight: int = 0) -> None:
        """Set a data tmpfs :meth:`grow_data` grew back to :attr:`data_limit` (plus the
        bytes the reaper has still to free) if it holds no more than that now, with
        ``in_flight`` more bytes (chunk writes under way that the budget let in: set back
        under them, a write made short by a page and a read served that page as zeros).
        Cheap when it was not grown."""
        if not self._data_grown or self.data_limit is None:
            return
        try:
            size, used = datafs.usage(self.data_dir)
            # (less the bytes the reaper has still to free: :meth:`_room_while_reaping`)
            pending = self.reaper.pending_bytes
            target = -(-(self.data_limit + pending) // datafs.PAGE) * datafs.PAGE
            if used + in_flight <= target:
                if size != target:
                    datafs.resize(self.data_dir, target)
                    if not pending:
                        log.info("data tmpfs %s back to %d bytes", self.data_dir,
                                 self.data_limit)
                self._data_grown = pending > 0
        except OSError as exc:
            log.warning("cannot shrink the data tmpfs %s: %s", self.data_dir, exc)

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
