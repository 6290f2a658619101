"""The RAM budget: what the RAM tier holds against ``size=``, and the room a change needs.

:class:`RamBudget` is the only code that changes :attr:`RamBudget.used`,
:attr:`RamBudget.in_flight` and ``Version.alloc`` (docs/architecture.md, "The core"). It owns:

- ``capacity``: bytes of file data the tier may hold (``size=``);
- ``used``: the allocated bytes of every registered version's data file
  (``st_blocks`` x 512, ``Version.alloc``); holes cost nothing, as on tmpfs;
- ``in_flight``: bytes set aside for chunks fault-in threads are writing, not yet in
  ``used`` (:meth:`hold`);
- ``shared_used``: a hook, the bytes of the same budget used outside the core (the replicas
  this node keeps for its peers), read on every reservation and by :meth:`figures`.

Room is made by the core's eviction policy, which the budget calls back
(``make_room(need, keep_unsaved)``) after waiting for releases in flight (``settle()``):
the policy decides *what* goes, the budget decides *whether* it must and whether it fits.

With a data tmpfs of its own (store/datafs.py; FUSE passthrough writes go straight into
it, unseen by the daemon) the budget also reads that filesystem's use by statfs
(``data_usage``, :meth:`room`) and keeps a headroom free ahead of need (:meth:`make_room`,
awaited by the open of a passthrough writer, and :meth:`after_seal`).

Every method runs on the trio thread. Only :meth:`reserve` and :meth:`make_room` await; a
caller relies on nothing it read before them (docs/architecture.md, concurrency protocol).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Awaitable, Callable, Iterable, Iterator

import trio

from mtcfs.base.errors import FsError
from mtcfs.core.model import Version

__all__ = ["HEADROOM_MAX", "PAGE", "RamBudget"]

#: Allocation unit assumed for a reservation (tmpfs allocates pages), bytes.
PAGE = 4096
#: The headroom :meth:`RamBudget.make_room` keeps free is ``min(capacity / 2, this)``.
HEADROOM_MAX = 4 << 30
#: Seconds between two looks at the room left while writers the kernel serves are open
#: (RamBudget.watch): one statfs(2) each.
WATCH_S = 0.02
#: Free bytes under which the data tmpfs counts as full (RamBudget.data_full).
FULL_BELOW = 64 * 1024


async def _nothing() -> None:
    return None


class RamBudget:
    """The RAM tier's budget against ``size=``.

    Args:
        capacity: bytes of file data the tier may hold (``size=``).
        fd_of: ``fd_of(version) -> int``: the version's data file descriptor, usable at once
            (the core's descriptor cache).
        counters: the core's :class:`~mtcfs.core.records.Counters`; ``enospc`` is counted
            here when a reservation is refused.
        settle: awaited before eviction when a reservation is short: waits (boundedly) for
            RELEASEs of unlinked files whose space is about to come back.
        make_room: ``make_room(need_bytes, keep_unsaved)``: evict at least ``need_bytes``
            if it can (the eviction policy); ``keep_unsaved`` forbids deleting steps no other
            tier holds.
    """

    def __init__(self, capacity: int, *, fd_of: Callable[[Version], int], counters: object,
                 settle: Callable[[], Awaitable[None]] = _nothing,
                 make_room: Callable[[int, bool], object] = lambda need, keep_unsaved: None
                 ) -> None:
        self.capacity = capacity
        self._used = 0
        self._in_flight = 0
        #: Bytes of the same budget used outside the core (replicas held for peers);
        #: wired by the peer tier; called on every reservation, so it must be cheap.
        self.shared_used: Callable[[], int] = lambda: 0
        self._fd_of = fd_of
        self._counters = counters
        self._settle = settle
        self._make_room = make_room
        #: ``() -> (size, used) | None``: bytes of the data directory's own tmpfs by statfs
        #: (``Store.data_usage``), None when it has none; wired by the core.
        self.data_usage: Callable[[], tuple[int, int] | None] = lambda: None
        #: ``(nbytes)``: let that many bytes past the data tmpfs's size (a read past
        #: ``size=``, :meth:`reserve` with ``best_effort``), and ``(in_flight)``: take that
        #: back once there is room for what it holds and the bytes in flight
        #: (``Store.grow_data``, ``Store.shrink_data``); wired by the core, no-ops without
        #: a data tmpfs.
        self.grow_data: Callable[[int], None] = lambda nbytes: None
        self.shrink_data: Callable[[int], None] = lambda in_flight: None
        #: Whether :meth:`after_seal` keeps the headroom: set by the first
        #: :meth:`make_room` (writes the daemon does not see are then under way).
        self.headroom_active = False

    # ------------------------------------------------------------------ figures

    @property
    def used(self) -> int:
        """Bytes the registered versions' data files hold (replicas not included)."""
        return self._used

    @property
    def in_flight(self) -> int:
        """Bytes reserved for chunk writes under way (:meth:`hold`), not yet in ``used``."""
        return self._in_flight

    def free(self) -> int:
        """Bytes left under ``size=``: capacity less ``used`` and the replicas (never < 0)."""
        return max(0, self.capacity - self._used - self.shared_used())

    def figures(self, files: int) -> dict[str, int]:
        """statfs figures, bytes: ``capacity``, ``used`` (files and replicas), ``replicas``,
        ``free``, and ``files`` (the count given)."""
        shared = self.shared_used()
        return {"capacity": self.capacity, "used": self._used + shared, "replicas": shared,
                "free": max(0, self.capacity - self._used - shared), "files": files}

    def fits(self, nbytes: int, *, in_flight: bool = True) -> bool:
        """Whether ``nbytes`` more fit now (counting bytes in flight unless told not to)."""
        extra = self.shared_used() + (self._in_flight if in_flight else 0)
        return self._used + extra + nbytes <= self.capacity

    # ------------------------------------------------------------------ accounting

    def account(self, v: Version) -> None:
        """Measure what ``v``'s data file really holds (st_blocks) and count the change
        against size=: the accounting rule (docs/architecture.md, "Capacity"). A file that
        cannot be measured (gone) leaves the figures as they were."""
        kept, group = v.preserved, v.shared
        try:
            if kept is None:
                alloc = os.fstat(self._fd_of(v)).st_blocks * 512
            else:
                # A reader of a shared data file (core/versions.py): its preserved chunks,
                # and the file itself only once its writer has left (the first reader).
                alloc = sum(len(b) for b in kept.values())  # (changed on the loop only)
                if group is not None and group.writer is None and group.readers[:1] == [v]:
                    alloc += os.fstat(self._fd_of(v)).st_blocks * 512
        except OSError:
            return
        self._used += alloc - v.alloc
        v.alloc = alloc

    def measure_all(self, versions: Iterable[Version], path_of: Callable[[int], str]) -> None:
        """Start over: measure each version's data file at ``path_of(vid)`` and make
        ``used`` their sum (a store loaded at start)."""
        total = 0
        for v in versions:
            v.alloc = os.stat(path_of(v.vid)).st_blocks * 512
            total += v.alloc
        self._used = total

    def clear(self) -> None:
        """No version is registered any more (a namespace snapshot install starts over);
        the versions that join again are :meth:`add`-ed."""
        self._used = 0

    def add(self, v: Version) -> None:
        """A version measured before joins the registered ones: count its ``alloc``."""
        self._used += v.alloc

    def remove(self, v: Version) -> None:
        """A version leaves (freed): its ``alloc`` no longer counts, and is zeroed."""
        self._used -= v.alloc
        v.alloc = 0

    def new_bytes(self, v: Version, off: int, end: int) -> int:
        """At most how many bytes writing ``[off, end)`` of ``v`` adds to the store: the pages
        of the range from its first hole on (none when the range is all data)."""
        start = off
        if off < v.size:
            try:
                start = os.lseek(self._fd_of(v), off, os.SEEK_HOLE)
            except OSError:
                start = off
            if start >= end:
                return 0
        return (-(-end // PAGE) - start // PAGE) * PAGE

    # ------------------------------------------------------------------ headroom (passthrough)

    @property
    def headroom(self) -> int:
        """Bytes :meth:`make_room` keeps free: ``min(capacity / 2, 4 GiB)`` (a writer the
        kernel serves is not seen write by write; :meth:`watch` evicts as it goes, and the
        headroom is what it may write between two looks: about 1.3 s at tmpfs speed)."""
        return min(self.capacity // 2, HEADROOM_MAX)

    async def watch(self, busy: Callable[[], bool]) -> None:
        """While ``busy()`` (writers the kernel serves are open), look at the room left
        every :data:`WATCH_S` seconds and evict (:meth:`make_room`) when less than half the
        headroom is left: eviction to make room as the bytes arrive, which a write on the
        daemon's path does at each write (:meth:`reserve`). Returns when not busy."""
        while busy():
            if self.room() < self.headroom // 2:
                await self.make_room()
            await trio.sleep(WATCH_S)

    def data_full(self) -> bool:
        """The data directory's own tmpfs has less than :data:`FULL_BELOW` bytes free (a
        write the kernel served for a passthrough handle has most likely been refused)."""
        fs = self.data_usage()
        return fs is not None and fs[0] - fs[1] < FULL_BELOW

    def room(self) -> int:
        """Bytes that may still be written under ``size=`` now: the capacity less the
        replicas and less what the files hold, taken as the larger of ``used`` and the data
        tmpfs's statfs figure (which counts writes the daemon did not see, passthrough);
        never < 0. Without a data tmpfs, :meth:`free`."""
        held = self._used
        fs = self.data_usage()
        if fs is not None:
            held = max(held, fs[1])
        return max(0, self.capacity - held - self.shared_used())

    async def make_room(self, headroom: int | None = None) -> int:
        """Evict old checkpoints until at least ``headroom`` bytes (default
        :attr:`headroom`) may be written under ``size=`` (:meth:`room`), as far as the
        eviction policy allows; returns :meth:`room` afterwards.

        Contract, for the open of a file whose writes the kernel passes through to its data
        file: await it before the open returns. It never raises for want of room (a write
        past the data tmpfs then gets ENOSPC from the kernel, at that write(2)); it follows
        the same policy as a write's :meth:`reserve` (never the newest complete checkpoint,
        nor one being backed up; a checkpoint no other tier holds only with
        ``evict_unsaved``). It awaits (RELEASEs in flight): the caller relies on nothing it
        read before it. Calling it also sets :attr:`headroom_active`, so that each seal
        then keeps the headroom too (:meth:`after_seal`). Pages freed by the reaper thread
        count as free at once (``Store.data_usage``).
        """
        self.headroom_active = True
        self.shrink_data(self._in_flight)
        want = self.headroom if headroom is None else headroom
        if self.room() < want:
            await self._settle()
            room = self.room()
            if room < want:
                self._make_room(want - room, False)
        return self.room()

    def after_seal(self) -> None:
        """The watermark check after a seal: once :attr:`headroom_active`, evict until
        :attr:`headroom` is free again (as :meth:`make_room`, without awaiting)."""
        self.shrink_data(self._in_flight)
        if not self.headroom_active:
            return
        room = self.room()
        if room < self.headroom:
            self._make_room(self.headroom - room, False)

    # ------------------------------------------------------------------ reservations

    async def reserve(self, nbytes: int, *, best_effort: bool = False) -> bool:
        """Make room for ``nbytes`` more bytes of data, evicting checkpoints if needed.

        ``best_effort``: when eviction cannot free enough, return False instead of raising
        (a fault-in: the read is served even so, docs/usage.md); eviction then never deletes
        a step no other tier holds. Returns True with room. Nothing is set aside: the
        caller writes before its next ``await`` (or holds the bytes, :meth:`hold`).

        Raises:
            FsError: ENOSPC (counted) when eviction cannot free enough (unless
                ``best_effort``).
        """
        if self.fits(nbytes):
            self.shrink_data(self._in_flight)
            return True
        await self._settle()
        shared = self.shared_used() + self._in_flight
        if self._used + shared + nbytes <= self.capacity:
            return True
        self._make_room(self._used + shared + nbytes - self.capacity, best_effort)
        if self._used + shared + nbytes > self.capacity:
            if best_effort:
                # the kernel's limit follows the budget's exception (a read is never
                # refused for room): the data tmpfs grows for these bytes
                self.grow_data(nbytes + self._in_flight)
                return False
            self._counters.enospc += 1  # type: ignore[attr-defined]
            raise FsError(errno.ENOSPC, f"RAM tier full ({self._used} bytes of files and"
                          f" {shared} of peer replicas and chunks being fetched, of"
                          f" {self.capacity} bytes)")
        return True

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Set ``nbytes`` aside (``in_flight``) while a thread writes them, until they are
        counted: other reservations see them meanwhile."""
        self._in_flight += nbytes
        try:
            yield
        finally:
            self._in_flight -= nbytes
