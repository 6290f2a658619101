"""Freeing the data files of removed versions off the FUSE loop.

Unlinking a tmpfs file frees its pages inside the ``unlink`` syscall: about 140 ms per GiB
on the reference machine (docs/benchmarks.md, "Freeing data off the loop"). On the trio
loop that held up every FUSE request for that long. A data file of at least
:data:`REAP_MIN_BYTES` is therefore renamed into ``<store>/reap/`` (a rename costs
microseconds, whatever the size) and unlinked there by one long-lived thread; a smaller one
is unlinked at once, which costs no more than the rename would.

The rename frees the name ``data/<vid>`` at once, so a new file under it (a detached
version's fresh file, core/versions.py: ``_fresh_data``) never meets one being freed. A
crash leaves what was still to be freed in ``reap/``; the next
:class:`~mtcfs.core.store.Store` empties it before anything else (:meth:`Reaper.sweep`).
Nothing reads ``reap/``: what is there is already deleted for the namespace, the versions
and the RAM budget.

When ``data/`` is a tmpfs of its own (store/datafs.py) the rename fails with EXDEV: the
file is then opened, its name unlinked at once, and the thread closes the descriptor, which
frees the pages (nothing is left to free after a crash: the kernel closes it).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import queue
import re
import stat
import threading

from mtcfs.base.failpoints import failpoint

log = logging.getLogger("mtcfs.core.store")

#: Data files from this size (bytes allocated) on are freed by the reaper thread.
REAP_MIN_BYTES = 8 << 20
#: The names :meth:`Reaper.take` gives: ``<vid>.<sequence>``.
_REAP_NAME = re.compile(r"[0-9]+\.[0-9]+")


class Reaper:
    """Unlinks files moved into ``path`` from one daemon thread, ``mtcfs-reaper``.

    Args:
        path: the reap directory (created, mode 0700; must be on the data directory's
            filesystem, so that :meth:`take` is a rename).

    Raises:
        OSError: ENOTDIR, ``path`` exists and is not a directory (a symbolic link to one
            included: its files are not the store's to delete).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(path, mode=0o700, exist_ok=True)
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise OSError(errno.ENOTDIR, f"{path} is not a directory of the store's")
        self._seq = itertools.count()
        self._queue: queue.SimpleQueue[tuple[str | int, int] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def pending_bytes(self) -> int:
        """Bytes taken (as :meth:`take` was told) and not freed yet."""
        return self._pending

    def sweep(self) -> int:
        """Unlink what a crash left to free in the reap directory now: the regular files
        named as :meth:`take` names them. Anything else there is not mtcfs's: left alone
        and named in the log, never deleted or followed. Returns how many were freed."""
        n = 0
        strays = []
        with os.scandir(self.path) as it:
            entries = list(it)
        for e in entries:
            if not (_REAP_NAME.fullmatch(e.name) and e.is_file(follow_symlinks=False)):
                strays.append(e.name)
                continue
            try:
                os.unlink(e.path)
                n += 1
            except FileNotFoundError:
                pass
        if n:
            log.info("freed %d data file(s) a previous daemon left to free", n)
        if strays:
            log.warning("%s holds entries that are not data files of mtcfs's, left alone: %s",
                        self.path, ", ".join(sorted(strays)[:20]))
        return n

    def take(self, src: str, nbytes: int = 0) -> None:
        """Move file ``src`` into the reap directory and have the thread unlink it; on
        another filesystem (EXDEV), unlink ``src`` now and have the thread close a
        descriptor of it. ``nbytes``: its allocated bytes (:attr:`pending_bytes` until
        freed).

        Nothing if ``src`` does not exist. Raises OSError from the rename otherwise."""
        dst = os.path.join(self.path, f"{os.path.basename(src)}.{next(self._seq)}")
        item: str | int = dst
        try:
            os.rename(src, dst)
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            try:
                item = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except FileNotFoundError:
                return
            try:
                os.unlink(src)
            except BaseException:
                os.close(item)
                raise
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mtcfs-reaper", daemon=True)
            self._thread.start()
        with self._lock:
            self._pending += nbytes
        self._queue.put((item, nbytes))

    def _run(self) -> None:
        while True:
            got = self._queue.get()
            if got is None:
                return
            item, nbytes = got
            failpoint("store.free_data")
            try:
                if isinstance(item, int):
                    os.close(item)  # the last reference, unless a reader still has one
                else:
                    os.unlink(item)
            except FileNotFoundError:
                pass
            except OSError as exc:  # left for the next start's sweep
                log.warning("could not free %s: %s", item, exc)
            finally:
                with self._lock:
                    self._pending -= nbytes

    def close(self, timeout: float = 10.0) -> None:
        """Free what is queued (at most ``timeout`` seconds; the rest stays for the next
        start's sweep) and end the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None
