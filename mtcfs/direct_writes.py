"""Which handles write around the kernel's page cache (mount option ``direct_writes``).

A write-only handle that creates a file or opens it ``O_TRUNC`` is opened with FUSE's
``FOPEN_DIRECT_IO`` (:meth:`DirectWrites.choose` says which): each ``write(2)`` reaches
the daemon at once, one copy of each byte instead of two and no dirty-page throttling.
That makes a save of large tensors faster than the page cache can (docs/benchmarks.md,
"Direct writes"), but every request is a round trip the writer waits for (~70-110 us
here), where the page cache would have gathered many small writes into one 1 MiB
request: GNU tar's 10 KiB records or ``torch.save`` of thousands of small tensors ran
3-6x slower direct.

FUSE cannot change an open file's mode, so the choice is made at each open, from what the
opening **thread** (FUSE requests carry the thread id) wrote through its earlier direct
handles. Each direct write request scores for its thread: one of :data:`LARGE` bytes or
more (what direct writes are for) ``+size/LARGE``, up to +2 for a 1 MiB request; one under
:data:`SMALL` that is not the handle's first write (a file written whole in one small
write costs one round trip either way) ``-1``. A thread whose score falls to
``-``:data:`FLIP` gets the page cache for every file it opens from then on, for as long
as this mount remembers it (:data:`MAX_THREADS`, least recently seen forgotten first).
The handle that was open when it flipped stays direct: FUSE cannot change it. The score
is kept within ``±``:data:`CAP`, so a long past of large writes does not hide a run of
small ones. A request from a process outside the daemon's PID namespace carries thread
id 0 (a training pod beside a DaemonSet's daemon without ``hostPID``): such threads
cannot be told apart, so they are not scored and their files stay direct.

The thresholds come from ``make bench-write-sizes`` (one write(2) size per file, direct
against the page cache, docs/benchmarks.md): direct writes lose below 256 KiB (128 KiB
pieces: 0.7 of the page cache's speed, 4 KiB: 0.07), are even at 256 KiB and win from
512 KiB up (1.3-1.5x).

Not thread-safe: the FUSE adapter calls it from the trio thread only.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

KiB = 1024
#: A direct write request of fewer bytes than this, after the handle's first, counts
#: against its thread.
SMALL = 256 * KiB
#: A direct write request of at least this many bytes counts for its thread.
LARGE = 512 * KiB
#: The score at which a thread's new files go through the page cache.
FLIP = 32
#: The score is kept within [-CAP, CAP].
CAP = 64
#: Threads remembered (scores and those moved to the page cache), least recently seen
#: forgotten first.
MAX_THREADS = 4096

#: What :meth:`DirectWrites.choose` decides for a handle.
DIRECT, CACHED, SMALL_WRITER = "direct", "cached", "small writer"


@dataclass
class _Direct:
    """A handle opened direct: the thread that opened it, writes received so far."""
    tid: int
    writes: int = 0


class DirectWrites:
    """The direct-writes choice of one mount (see the module docstring).

    Args:
        wanted: the mount option ``direct_writes``; :attr:`on` says whether it is in
            effect (the kernel must grant ``FUSE_DIRECT_IO_ALLOW_MMAP``: set at INIT).
    """

    def __init__(self, wanted: bool) -> None:
        self.wanted = wanted
        #: In effect: wanted, and the kernel granted FUSE_DIRECT_IO_ALLOW_MMAP.
        self.on = False
        self._scores: OrderedDict[int, float] = OrderedDict()  # thread id -> score
        self._cached: OrderedDict[int, None] = OrderedDict()   # threads flipped
        self._handles: dict[int, _Direct] = {}                 # fh -> its direct state
        #: handles opened direct, and opened through the page cache because their thread
        #: writes small pieces (for status)
        self.opened_direct = 0
        self.opened_cached = 0

    def choose(self, flags: int, empty: bool, tid: int) -> str:
        """How to open a handle that is now open in the core: :data:`DIRECT`
        (FOPEN_DIRECT_IO), :data:`SMALL_WRITER` (through the page cache, because thread
        ``tid`` writes small pieces) or :data:`CACHED` (not a handle direct writes are
        for). Direct: a write-only handle (``O_WRONLY``, what ``open(path, "wb")``,
        torch.save and safetensors use) of a file it leaves empty (it created it, or
        truncated it), not ``O_APPEND`` (a log's appends). Never an ``O_RDWR`` one: through
        a direct handle reads go around the page cache too (a hole that another handle's
        unwritten pages extend reads as end of file), and a shared mapping of the file
        beside its write(2)s could lose bytes of a page both touch (review tests in
        tests/t4_direct_writes_test.py); nor a reopen that changes a few bytes.

        Args:
            flags: the open(2) flags.
            empty: the file is empty now that the open is done (created or truncated by
                it; an ``O_CREAT`` open that found a file with content is not).
            tid: the thread that opens it (the FUSE request's pid).
        """
        if not (self.on and flags & os.O_ACCMODE == os.O_WRONLY
                and not flags & os.O_APPEND and empty):
            return CACHED
        if tid in self._cached:
            self._cached.move_to_end(tid)
            return SMALL_WRITER
        return DIRECT

    def opened(self, fh: int, tid: int, choice: str) -> None:
        """Handle ``fh`` is open as :meth:`choose` said for thread ``tid`` (thread 0, one
        outside the daemon's PID namespace, is never scored)."""
        if choice == DIRECT:
            self.opened_direct += 1
            if tid:
                self._handles[fh] = _Direct(tid)
        elif choice == SMALL_WRITER:
            self.opened_cached += 1

    def wrote(self, fh: int, nbytes: int) -> None:
        """A write request of ``nbytes`` arrived on handle ``fh`` (any handle)."""
        h = self._handles.get(fh)
        if h is None:
            return
        h.writes += 1
        if nbytes >= LARGE:
            step = min(nbytes / LARGE, 2.0)
        elif nbytes < SMALL and h.writes > 1:
            step = -1.0
        else:
            return
        score = max(-CAP, min(CAP, self._scores.pop(h.tid, 0.0) + step))
        self._scores[h.tid] = score
        if len(self._scores) > MAX_THREADS:
            self._scores.popitem(last=False)
        if score <= -FLIP and h.tid not in self._cached:
            log.info("thread %d writes new files in small pieces (its direct write "
                     "requests mostly under %d KiB): its next files go through the page "
                     "cache", h.tid, SMALL // KiB)
            self._cached[h.tid] = None
            if len(self._cached) > MAX_THREADS:
                self._cached.popitem(last=False)

    def released(self, fh: int) -> None:
        """Handle ``fh`` is closed for good."""
        self._handles.pop(fh, None)

    def status(self) -> dict[str, Any]:
        """The ``fuse`` part of ``mtcfs status`` for direct writes."""
        return {"direct_writes": self.on, "direct_handles_opened": self.opened_direct,
                "small_writer_threads": len(self._cached),
                "small_writer_opens": self.opened_cached}
