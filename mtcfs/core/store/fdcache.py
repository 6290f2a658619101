"""Descriptors of data files, opened when needed and kept in a bounded LRU.

The daemon used to keep one descriptor per file version it had touched, so the number of
files was limited by ``RLIMIT_NOFILE`` (EMFILE at ~20,000 small files, issue 12). Now a
version's ``fd`` (``-1``: not open) is a cache entry: at most ``limit`` of them stay open,
the least recently used are closed, and a data file is reopened by path when needed.

Who may do what (docs/architecture.md, "Concurrency protocol", has the same rules):

- :meth:`FdCache.get` runs on the FUSE loop only. It returns the version's descriptor,
  opening it if needed, and closes least recently used ones beyond ``limit``. Only the loop
  evicts, so the descriptor it returns stays open until the loop's next ``get``/``adopt``/
  ``drop``: use it at once, never across an ``await``.
- :meth:`FdCache.lease` is for any thread, and for the loop across an ``await``: the
  cached descriptor with a lease taken on it (a leased descriptor is never closed, so its
  number is never reused under its user), or, when none is cached, a private one opened for
  this use. :meth:`FdCache.unlease` gives it back; a private descriptor is closed then, and
  so is one that was dropped while leased (by its last lease).
- :meth:`FdCache.keep`: the version's descriptor is never evicted (a version a namespace
  snapshot install replaced: its path may name other data now) until :meth:`FdCache.drop`.
- :meth:`FdCache.drop`: the version's data is going: its descriptor is closed now, or by
  the last lease.

The entries are the version objects themselves (compared by identity); all that is used of
them is ``vid`` (to open) and ``fd``.
"""

from __future__ import annotations

import os
import resource
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

#: The cache's share of the daemon's descriptor limit: the rest is for FUSE, SQLite, gRPC
#: sockets, the control socket and the private descriptors of worker threads.
SHARE = 4
MIN_LIMIT, MAX_LIMIT = 16, 1024


def default_limit() -> int:
    """``RLIMIT_NOFILE`` / 4, within [16, 1024]."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return MAX_LIMIT
    return max(MIN_LIMIT, min(MAX_LIMIT, soft // SHARE))


class FdCache:
    """A bounded LRU of data file descriptors.

    Args:
        opener: ``opener(vid) -> fd``, the data file of version ``vid`` opened read-write.
        limit: descriptors kept open (leased and kept ones may go beyond it meanwhile).
    """

    def __init__(self, opener: Callable[[int], int], limit: int | None = None) -> None:
        self._opener = opener
        self.limit = max(1, limit if limit is not None else default_limit())
        self._lock = threading.Lock()
        self._lru: OrderedDict[Any, None] = OrderedDict()  # evictable, oldest first
        self._kept: set[Any] = set()
        self._leases: dict[Any, int] = {}  # version -> leases on its cached descriptor
        self._dropped: dict[int, int] = {}  # fd dropped while leased -> leases left
        self._private: set[int] = set()  # descriptors opened for one lease
        #: counters for status and benchmarks
        self.opens = 0
        self.evictions = 0

    def __len__(self) -> int:
        """Descriptors open now (cached, kept, private, dropped but leased)."""
        with self._lock:
            return len(self._lru) + len(self._kept) + len(self._private) + len(self._dropped)

    # ------------------------------------------------------------------ the loop

    def get(self, v: Any) -> int:
        """``v``'s descriptor, opened if needed (loop only; use it before the next await)."""
        with self._lock:
            if v.fd >= 0:
                if v in self._lru:
                    self._lru.move_to_end(v)
                return v.fd
        return self.adopt(v, self._opener(v.vid))

    def adopt(self, v: Any, fd: int) -> int:
        """Cache ``fd``, just opened by the caller, as ``v``'s descriptor (loop only)."""
        with self._lock:
            assert v.fd < 0, "a version has one cached descriptor"
            v.fd = fd
            self._lru[v] = None
            self.opens += 1
            victims = []
            excess = len(self._lru) - self.limit
            if excess > 0:
                # Oldest first, and only as far as needed: with the cache full, every adopt
                # evicts one, so a scan of the whole LRU (or a copy of it) would make each
                # new file cost O(limit) (docs/benchmarks.md 6a, "create").
                chosen = []
                for old in self._lru:
                    if old is not v and not self._leases.get(old):
                        chosen.append(old)
                        if len(chosen) == excess:
                            break
                for old in chosen:
                    del self._lru[old]
                    victims.append(old.fd)
                    old.fd = -1
            self.evictions += len(victims)
        for n in victims:
            os.close(n)
        return fd

    def keep(self, v: Any) -> None:
        """Open ``v``'s descriptor if needed and never evict it until :meth:`drop` (loop)."""
        self.get(v)
        with self._lock:
            self._lru.pop(v, None)
            self._kept.add(v)

    def kept(self) -> list[Any]:
        """The versions whose descriptors :meth:`keep` holds."""
        with self._lock:
            return list(self._kept)

    def unkeep(self, v: Any) -> None:
        """``v``'s path names its data again: its descriptor may be evicted (loop)."""
        with self._lock:
            if v in self._kept:
                self._kept.discard(v)
                self._lru[v] = None

    def drop(self, v: Any) -> None:
        """``v``'s data is going: close its descriptor now, or at its last lease (loop)."""
        with self._lock:
            fd = v.fd
            if fd < 0:
                return
            v.fd = -1
            self._lru.pop(v, None)
            self._kept.discard(v)
            n = self._leases.pop(v, 0)
            if n:
                self._dropped[fd] = n
                return
        os.close(fd)

    def close_all(self) -> None:
        """Close every cached and kept descriptor (the daemon is shutting down)."""
        with self._lock:
            vs = list(self._lru) + list(self._kept)
            self._lru.clear()
            self._kept.clear()
            fds = []
            for v in vs:
                n = self._leases.pop(v, 0)
                if n:  # a thread abandoned at shutdown still reads it: its unlease closes
                    self._dropped[v.fd] = n
                else:
                    fds.append(v.fd)
                v.fd = -1
        for fd in fds:
            os.close(fd)

    # ------------------------------------------------------------------ any thread

    def lease(self, v: Any) -> int:
        """A descriptor of ``v`` that stays open until :meth:`unlease` (any thread)."""
        with self._lock:
            if v.fd >= 0:
                self._leases[v] = self._leases.get(v, 0) + 1
                return v.fd
        fd = self._opener(v.vid)
        with self._lock:
            self._private.add(fd)
        return fd

    def unlease(self, v: Any, fd: int) -> None:
        """Give back a descriptor from :meth:`lease` (any thread)."""
        with self._lock:
            if fd in self._private:
                self._private.discard(fd)
            elif fd in self._dropped:
                left = self._dropped[fd] - 1
                if left:
                    self._dropped[fd] = left
                    return
                del self._dropped[fd]
            else:
                left = self._leases.get(v, 0) - 1
                if left > 0:
                    self._leases[v] = left
                else:
                    self._leases.pop(v, None)
                return
        os.close(fd)
