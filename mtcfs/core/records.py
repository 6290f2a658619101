"""Records the filesystem core keeps besides inodes and versions: committed checkpoints,
counters, and the protocol of chunk sources it faults data in from."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from mtcfs.base.counters import LATENCY_BOUNDS_S, Histogram
from mtcfs.base.steps import step_number

class ChunkSource(Protocol):
    """Where missing chunks come from (peers, the backup tier). Wired by the daemon."""

    async def fetch(self, digest: str, tried: list[str] | None = None) -> bytes:
        """Return the chunk's bytes, already verified against ``digest``.

        Args:
            digest: the chunk's hex blake3.
            tried: if given, one line is appended per source asked, as it is asked or
                given up on (``"rank 2: unreachable"``), so that a caller whose deadline
                ends the fetch can say what was tried.

        Raises:
            FsError: EIO when every source answered and none has a valid copy; EAGAIN when
                none served it and some source could not be asked (unreachable, no answer
                in time): asking again later may succeed.
        """
        ...


@dataclass
class StepRecord:
    """A committed checkpoint on this node."""

    name: str
    number: int
    ino: int
    committed_ns: int
    source: str
    backed_up_ns: int | None = None
    backing_up: bool = False
    #: Peers that confirmed holding this step as it is now, of ``replicas`` wanted (runtime
    #: state of the peer tier; recomputed after a restart by replicating again).
    replicated: int = 0
    replicas: int = 0
    #: Bumped whenever a file in the step changes after its commit (runtime): with
    #: ``committed_ns`` it names the content a peer confirmed.
    generation: int = 0


def oldest_first(records: Iterable[StepRecord]) -> list[StepRecord]:
    """Committed steps, oldest first: by step number, then commit time. A record whose
    name has no step number (a directory committed by ``mtcfs seal``, ``number`` 0) is
    placed by its commit time: right after the numbered steps committed before it, so
    that the newest seal counts as the newest checkpoint, not the oldest."""
    recs = list(records)
    numbered = sorted((r for r in recs if step_number(r.name) is not None),
                      key=lambda r: (r.number, r.committed_ns))

    def key(r: StepRecord) -> tuple[int, int]:
        if step_number(r.name) is not None:
            return (r.number, r.committed_ns)
        before = [n.number for n in numbered if n.committed_ns <= r.committed_ns]
        return (max(before, default=-1), r.committed_ns)
    return sorted(recs, key=key)


@dataclass
class Counters:
    """Monotonic counters for status and metrics."""

    bytes_written: int = 0
    bytes_read: int = 0
    seals: int = 0
    chunks_faulted: int = 0
    bytes_faulted: int = 0
    fault_errors: int = 0
    enospc: int = 0
    evicted_steps: int = 0
    #: chunks a read brought into a full RAM tier that nothing could make room for
    fault_in_over_size: int = 0
    #: chunks in RAM found not to match their hash (first read, scrub, verify; core/faultin.py)
    corrupt_chunks: int = 0
    #: Committed steps deleted from RAM under memory pressure while no other tier held them.
    deleted_unsaved_steps: int = 0
    #: Incomplete leftovers of saves a crash interrupted, deleted under memory pressure.
    evicted_leftovers: int = 0
    #: Chunk fetches from another tier that a read or the prefetcher waited for.
    fault_waits: int = 0
    #: ... of them, those that ended at the fault-in deadline (counted in fault_errors too).
    fault_timeouts: int = 0
    #: Bytes read and hashed by seals (a rewrite hashes only the chunks it changed).
    seal_bytes_hashed: int = 0
    #: Bytes hashed to compute a whole-file hash when asked (``user.mtcfs.blake3`` of a
    #: rewritten file; core/files.py: file_hash).
    file_hash_bytes: int = 0
    #: GETXATTRs of names outside ``user.*``: the kernel's ``security.capability`` before
    #: every write(2) when the mount lacks FUSE_HANDLE_KILLPRIV_V2 (docs/fuse-build.md).
    foreign_getxattrs: int = 0
    #: Seconds from the last writer's release to the version sealed (hashed, recorded).
    seal_seconds: Histogram = field(default_factory=lambda: Histogram(LATENCY_BOUNDS_S))


#: Linux's CLOCK_REALTIME_COARSE (the time module does not name it).
_CLOCK_REALTIME_COARSE = getattr(time, "CLOCK_REALTIME_COARSE", 5)


def now_ns() -> int:
    """Wall-clock time in ns from the kernel's coarse clock, the one it stamps inodes with.

    Under the writeback cache the kernel keeps the c/mtime of regular files itself and
    stamps them with this clock; times the core assigns (an O_TRUNC open, mkdir, ...) must
    come from the same clock, or a time stored here can be a few ms after the one the kernel
    showed for the same event.
    """
    return time.clock_gettime_ns(_CLOCK_REALTIME_COARSE)
