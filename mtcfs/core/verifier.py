"""Verification of the RAM tier's chunks: first-read verification after a start, and the
background scrub.

:class:`Verifier` owns which chunks are still unverified since this daemon started, the one
verification in flight per ``(version, chunk)`` (a second caller waits for the first one's
verdict), and the scrub's settings and status. The policy (docs/reliability.md):

- every chunk held in RAM when the daemon starts is *unverified* (the store may have been
  changed behind the daemon's back while it was down); the first read of it hashes it
  before any of its bytes are served;
- the *start pass* (:meth:`Verifier.start_pass`, the first thing :meth:`Verifier.loop`
  does) hashes them all in the background right after the start, the newest versions
  first, ``hash_threads`` at once, so that the trainer that restarts with the daemon finds
  its checkpoint verified (and a passthrough open has nothing left to hash);
- the scrub re-hashes every chunk held in RAM every ``interval_s`` seconds, reading at most
  ``rate`` bytes per second;
- a chunk that mismatches is handed to the core (``Host.mark_corrupt``, core/faultin.py):
  marked missing, its bytes dropped, counted, logged, and faulted in again.

Every verification of a chunk goes through :meth:`Verifier.verify_chunk`, one at a time per
chunk, so a verdict that arrives after the chunk was already marked and refetched cannot
mark the good bytes. It reaches the rest of the core only through :class:`Host`.

Concurrency: on the trio thread; a chunk over :data:`INLINE_VERIFY_BYTES` is hashed in a
worker thread with a leased descriptor, its version pinned: a first read's chunks under
:attr:`Verifier.hash_limiter` (``hash_threads`` at once: :meth:`Verifier.verify_version`
verifies a whole file with all of them), the scrub's and ``mtcfs verify``'s under the core's
``cpu_limiter``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import Protocol

import trio

from mtcfs.base import pools
from mtcfs.base.chunking import DEFAULT_HASH_THREADS, chunk_span
from mtcfs.core.model import Version
from mtcfs.core.records import Counters
from mtcfs.core.store.fdcache import FdCache
from mtcfs.core.versions import Releaser, hash_range

__all__ = ["INLINE_VERIFY_BYTES", "SCRUB_INTERVAL_S", "SCRUB_RATE", "Host", "Verifier"]

#: Default seconds between the end of one scrub pass and the start of the next (and from
#: the daemon's start to the first pass): a day. The first read after a start is verified
#: anyway, so the scrub is for damage done while the daemon runs.
SCRUB_INTERVAL_S = 24 * 3600.0
#: Default bytes per second a scrub pass reads (blake3 runs at about 2 GB/s on one core,
#: so this is about 5 % of one core while a pass runs).
SCRUB_RATE = 100 * 1024 * 1024
#: Chunks up to this many bytes are hashed on the FUSE loop itself (blake3: about 10 us
#: for 64 KiB), larger ones in a worker thread.
INLINE_VERIFY_BYTES = 64 * 1024
#: Rounds of the verification at start (:meth:`Verifier.start_pass`): each takes what is
#: still unverified and was not tried yet (a version that took another's data file over).
START_PASS_ROUNDS = 3


def _hash_matches(fds: FdCache, v: Version, off: int, length: int, digest: str) -> bool:
    """Worker-thread half of a verification (or inline, for a small chunk)."""
    return hash_range(fds, v, off, length) == digest


class Host(Protocol):
    """What :class:`Verifier` may use of its owner (:class:`mtcfs.core.faultin.LocalChunks`)."""

    versions: dict[int, Version]

    @property
    def vstore(self) -> Releaser: ...  # core/versions.py: ``release(v)``

    def mark_corrupt(self, v: Version, idx: int, found_by: str) -> None: ...
    def report_error(self, msg: str) -> None: ...


class Verifier:
    """First-read verification and the scrub of one core.

    Args:
        host: its owner (see :class:`Host`).
        fds: the core's descriptor cache.
        counters: the core's counters (``corrupt_chunks`` of replaced versions).
        cpu_limiter: the core's worker-thread limiter.

    Settable by the daemon: :attr:`interval_s` (seconds, 0: no scrub), :attr:`rate`
    (bytes per second, 0: unbounded), :attr:`threads` (``hash_threads``: chunks of first
    reads hashed at once). :attr:`state` is what ``mtcfs status`` shows.
    """

    def __init__(self, host: Host, fds: FdCache, counters: Counters,
                 cpu_limiter: trio.CapacityLimiter) -> None:
        self._host = host
        self._fds = fds
        self._counters = counters
        self._cpu = cpu_limiter
        #: The threads that hash first reads' chunks (``hash_threads`` tokens).
        self.hash_limiter = pools.limiter("verify", DEFAULT_HASH_THREADS)
        #: vid -> chunk indices held in RAM and not hashed since this daemon started.
        self._unverified: dict[int, set[int]] = {}
        self._verifying: dict[tuple[int, int], trio.Event] = {}
        self.interval_s = SCRUB_INTERVAL_S
        self.rate = SCRUB_RATE
        #: what ``mtcfs status`` shows of the scrub (times are wall-clock seconds)
        self.state: dict = {"passes": 0, "running": False, "done_bytes": 0,
                            "total_bytes": 0, "last_started": None,
                            "last_finished": None, "last_seconds": None,
                            "last_chunks": 0, "last_corrupt": 0, "next": None,
                            # the start pass (start_pass): running, bytes of it done and
                            # in all, its seconds and chunks hashed once finished
                            "start_running": False, "start_done_bytes": 0,
                            "start_total_bytes": 0, "start_seconds": None,
                            "start_chunks": 0}

    def start(self) -> None:
        """Every chunk held in RAM now is unverified (called once the store is loaded)."""
        for v in self._host.versions.values():
            if v.sealed and v.chunks:
                held = set(range(len(v.chunks))) - v.missing
                if held:
                    self._unverified[v.vid] = held

    @property
    def threads(self) -> int:
        """Chunks of first reads hashed at once (mount option ``hash_threads``)."""
        return int(self.hash_limiter.total_tokens)

    @threads.setter
    def threads(self, n: int) -> None:
        self.hash_limiter.total_tokens = n

    def drop(self, vid: int) -> None:
        """Nothing of version ``vid`` needs a first-read hash (freed, or hashed whole)."""
        self._unverified.pop(vid, None)

    def needs(self, v: Version) -> bool:
        """Whether some chunk of ``v`` must be hashed before it is served (cheap)."""
        return v.vid in self._unverified

    def unverified_chunks(self) -> int:
        """Chunks of registered versions not hashed since start (status, metrics)."""
        return sum(len(s) for vid, s in self._unverified.items() if vid in self._host.versions)

    async def verify_range(self, v: Version, off: int, size: int) -> None:
        """Hash the unverified chunks of ``v`` that ``[off, off+size)`` touches; the ones
        that mismatch become missing (the caller then faults them in)."""
        todo = self._unverified.get(v.vid)
        if not todo:
            return
        cs = v.chunk_size
        first, last = off // cs, (off + max(size, 1) - 1) // cs
        wanted = [i for i in range(first, last + 1) if i in todo]
        if len(wanted) == 1:
            await self.verify_chunk(v, wanted[0], limiter=self.hash_limiter)
            return
        await self._verify_all(v, wanted)

    async def verify_version(self, v: Version) -> bool:
        """Hash every chunk of ``v`` still unverified since start, :attr:`threads` at once
        (before the kernel is handed the data file: a passthrough open). Each goes through
        :meth:`verify_chunk`: a mismatch is marked corrupt, and a chunk another caller is
        verifying is not hashed twice (its verdict is waited for).

        Returns:
            True if every chunk of ``v`` is here and verified; False if one is missing (a
            mismatch, now marked, or missing before: ``fault_in`` brings it).
        """
        todo = self._unverified.get(v.vid)
        if todo:
            await self._verify_all(v, sorted(todo))
        return not v.missing and not self.needs(v) and v.sealed

    async def _verify_all(self, v: Version, wanted: list[int]) -> None:
        async with trio.open_nursery() as n:
            for i in wanted:
                n.start_soon(functools.partial(self.verify_chunk, v, i,
                                               limiter=self.hash_limiter))

    async def verify_chunk(self, v: Version, idx: int, *, scrub: bool = False,
                           limiter: trio.CapacityLimiter | None = None,
                           how: str | None = None) -> bool:
        """Hash chunk ``idx`` of ``v`` (held in RAM) in a worker thread; True if it matches.

        A mismatch marks it corrupt (the host's ``mark_corrupt``). One verification per chunk at
        a time; a caller that finds one under way waits for its verdict. ``limiter``: of the
        worker thread (default the core's ``cpu_limiter``). ``how``: who found a mismatch,
        in the log and the error list (default "scrub" or "first read after start").
        """
        how = how or ("scrub" if scrub else "first read after start")
        key = (v.vid, idx)
        while True:
            ev = self._verifying.get(key)
            if ev is None:
                break
            await ev.wait()
            if not scrub:
                todo = self._unverified.get(v.vid)
                if not todo or idx not in todo:
                    return idx not in v.missing
        if idx in v.missing or not v.sealed:
            self.verified(v.vid, idx)  # evicted or dropped: it comes back verified
            return False
        if self._host.versions.get(v.vid) is not v and v.fd < 0:
            return False  # replaced and no longer held: its path may name other data
        ev = self._verifying[key] = trio.Event()
        v.pins += 1
        try:
            off, length = chunk_span(idx, v.size, v.chunk_size)
            if length <= INLINE_VERIFY_BYTES:
                # A small chunk hashes in microseconds: on the loop, without the thread
                # round trip that would dominate (many small files read after a restart).
                ok = _hash_matches(self._fds, v, off, length, v.chunks[idx])
            else:  # (the read leases a descriptor: store/fdcache.py)
                # The scrub is background work (base/background.py); a read waits for a
                # first-read verification.
                run = pools.run_background if scrub else trio.to_thread.run_sync
                ok = await run(_hash_matches, self._fds, v, off, length, v.chunks[idx],
                               limiter=limiter or self._cpu)
            if idx in v.missing:
                return False
            if self._host.versions.get(v.vid) is not v:
                # Replaced (a snapshot install) but still read through a handle's kept
                # descriptor: a mismatch is never served; the chunk becomes missing on this
                # object only (no hole punched: the inode may be another version's now),
                # and fault-in writes good bytes through that descriptor.
                if not ok:
                    v.missing.add(idx)
                    self._counters.corrupt_chunks += 1
                    self._host.report_error(f"corrupt chunk in the RAM tier ({how}): version {v.vid} "
                                f"(replaced, still open), chunk {idx}; to be fetched from "
                                "another tier")
                return ok
            self.verified(v.vid, idx)
            if not ok:
                self._host.mark_corrupt(v, idx, how)
            return ok
        finally:
            del self._verifying[key]
            ev.set()
            v.pins -= 1
            self._host.vstore.release(v)

    def carry(self, old: Version, new: Version) -> None:
        """``new`` took over the data file of ``old`` (scope=job snapshot install): the
        chunks of ``old`` not hashed since start are unverified under ``new``."""
        held = old.handles or old.pins  # still read through its kept descriptor
        todo = self._unverified.get(old.vid) if held else self._unverified.pop(old.vid, None)
        if todo:
            self._unverified[new.vid] = set(todo)

    def verified(self, vid: int, idx: int) -> None:
        """Chunk ``idx`` of version ``vid`` needs no first-read hash any more."""
        todo = self._unverified.get(vid)
        if todo is not None:
            todo.discard(idx)
            if not todo:
                del self._unverified[vid]

    async def start_pass(self) -> int:
        """Hash every chunk still unverified since the start, in the background: the
        versions newest first (highest vid: the files written last, so the newest
        checkpoint comes first), :attr:`threads` chunks at once under
        :attr:`hash_limiter`, the limiter a first read's chunks take too. A read or a
        passthrough open that arrives meanwhile hashes its own chunks beside the pass (it
        waits at most for the chunks the pass has in flight, whose verdicts it then shares:
        :meth:`verify_chunk`); a chunk it verified is skipped here. A mismatch is marked and
        fetched again as on a first read.

        Why: after a daemon restart the trainer restarts too and reads the newest
        checkpoint; hashing it while the trainer starts (imports, process groups) takes the
        hash off its first read, and damage is found (and repaired from another tier)
        before anyone reads it. The cost is one hash of what the RAM tier holds, once per
        start: what the first reads would pay for the same chunks.

        Returns:
            the chunks hashed.
        """
        st = self.state
        st.update(start_running=True, start_done_bytes=0, start_total_bytes=0)
        t0 = trio.current_time()
        hashed = 0
        tried: set[tuple[int, int]] = set()
        items: Iterator[tuple[int, int]] = iter(())

        async def worker() -> None:
            nonlocal hashed
            for vid, idx in items:  # (shared by the workers: each item is taken once)
                todo = self._unverified.get(vid)
                v = self._host.versions.get(vid)
                if v is None or not todo or idx not in todo:
                    continue  # verified meanwhile (a read), freed or replaced
                try:
                    await self.verify_chunk(v, idx, limiter=self.hash_limiter,
                                            how="verification at start")
                except OSError as exc:
                    self._host.report_error(f"verification at start: version {vid} chunk "
                                            f"{idx}: {exc}")
                    continue
                hashed += 1
                st["start_done_bytes"] += chunk_span(idx, v.size, v.chunk_size)[1]

        try:
            # Rounds: a version that took another's data file over meanwhile (a scope=job
            # snapshot install: carry) has its unverified chunks under a new vid.
            for _round in range(START_PASS_ROUNDS):
                vids = sorted(self._unverified, reverse=True)
                work = [(vid, i) for vid in vids for i in sorted(self._unverified.get(vid, ()))
                        if (vid, i) not in tried and vid in self._host.versions]
                if not work:
                    break
                tried.update(work)
                st["start_total_bytes"] += sum(
                    chunk_span(i, self._host.versions[vid].size,
                               self._host.versions[vid].chunk_size)[1] for vid, i in work)
                items = iter(work)
                async with trio.open_nursery() as n:
                    for _ in range(max(1, min(self.threads, len(work)))):
                        n.start_soon(worker)
        finally:
            st.update(start_running=False, start_chunks=hashed,
                      start_seconds=round(trio.current_time() - t0, 3))
        return hashed

    async def loop(self) -> None:
        """Background task: the start pass (:meth:`start_pass`), then a scrub pass every
        ``interval_s`` (0: never)."""
        await self.start_pass()
        if not self.interval_s:
            return
        while True:
            self.state["next"] = time.time() + self.interval_s
            await trio.sleep(self.interval_s)
            self.state["next"] = None
            try:
                await self.scrub_pass()
            except Exception as exc:  # a pass that failed is logged; the next one runs
                self._host.report_error(f"scrub pass failed: {exc!r}")
                self.state["running"] = False

    async def scrub_pass(self) -> int:
        """Hash every chunk held in RAM of every sealed version, at most ``rate``
        bytes per second; repair the corrupt ones it can (fault-in). Returns how many
        mismatched."""
        st = self.state
        work = [(v, i) for v in list(self._host.versions.values()) if v.sealed
                for i in range(len(v.chunks)) if i not in v.missing]
        st.update(running=True, done_bytes=0, last_started=time.time(),
                  total_bytes=sum(chunk_span(i, v.size, v.chunk_size)[1] for v, i in work))
        t0 = trio.current_time()
        done = checked = bad = 0
        try:
            for v, i in work:
                if self._host.versions.get(v.vid) is not v or i in v.missing or not v.sealed:
                    continue
                length = chunk_span(i, v.size, v.chunk_size)[1]
                if not await self.verify_chunk(v, i, scrub=True) and i in v.missing:
                    bad += 1
                checked += 1
                done += length
                st["done_bytes"] = done
                if self.rate:
                    # never ahead of scrub_rate bytes/s since the pass began
                    await trio.sleep_until(t0 + done / self.rate)
                else:
                    await trio.sleep(0)
        finally:
            st.update(running=False, last_finished=time.time(),
                      last_seconds=round(trio.current_time() - t0, 3), last_chunks=checked,
                      last_corrupt=bad, passes=st["passes"] + 1)
        return bad
