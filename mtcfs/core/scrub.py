"""Verified reads of the RAM tier: first-read verification after a start, the background
scrub, and what happens to a chunk whose bytes no longer match its hash.

A part of :class:`mtcfs.core.core.Filesystem` (mixed in); see that module for the
concurrency protocol every method follows, and docs/reliability.md for the policy:

- every chunk held in RAM when the daemon starts is *unverified* (the store may have been
  changed behind the daemon's back while it was down); the first read of it hashes it
  before any of its bytes are served;
- the scrub re-hashes every chunk held in RAM every ``scrub_interval`` seconds, reading at
  most ``scrub_rate`` bytes per second;
- a chunk that mismatches is treated as missing: marked missing (persisted), its bytes
  dropped from the data file, counted (``corrupt_chunks``), logged with its file and chunk,
  and faulted in like any missing chunk (another local copy, a peer, the backup tier). With
  no other source the read fails with EIO naming the file and chunk; the wrong bytes are
  never served.

Every verification of a ``(version, chunk)`` goes through :meth:`ScrubOps._verify_chunk`,
one at a time per chunk (a second caller waits for the first one's answer), so a verdict
that arrives after the chunk was already marked and refetched cannot mark the good bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time

import trio

from mtcfs.base.chunking import chunk_hash, chunk_span
from mtcfs.core.model import Version

log = logging.getLogger("mtcfs.core.core")

#: Default seconds between the end of one scrub pass and the start of the next (and from
#: the daemon's start to the first pass): a day. The first read after a start is verified
#: anyway, so the scrub is for damage done while the daemon runs.
SCRUB_INTERVAL_S = 24 * 3600.0
#: Default bytes per second a scrub pass reads (blake3 runs at about 2 GB/s on one core,
#: so this is about 5 % of one core while a pass runs).
SCRUB_RATE = 100 * 1024 * 1024

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = None


def punch_hole(fd: int, off: int, length: int) -> bool:
    """Free ``[off, off+length)`` of ``fd`` (reads return zeros; tmpfs gives the RAM back).
    Returns False where the filesystem cannot (the bytes then stay, marked missing)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                        ctypes.c_int64]
        return _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, off,
                               length) == 0
    except (OSError, AttributeError):
        return False


#: Chunks up to this many bytes are hashed on the FUSE loop itself (blake3: about 10 us
#: for 64 KiB), larger ones in a worker thread.
INLINE_VERIFY_BYTES = 64 * 1024


def _hash_matches(fd: int, off: int, length: int, digest: str) -> bool:
    """Worker-thread half of a verification."""
    return chunk_hash(os.pread(fd, length, off)) == digest


class ScrubOps:
    """First-read verification, the background scrub, and corrupt chunks."""

    def _init_scrub(self) -> None:
        """Every chunk held in RAM at start is unverified (called once the store is loaded)."""
        #: vid -> chunk indices held in RAM and not hashed since this daemon started.
        self._unverified: dict[int, set[int]] = {}
        self._verifying: dict[tuple[int, int], trio.Event] = {}
        self.scrub_interval_s = SCRUB_INTERVAL_S
        self.scrub_rate = SCRUB_RATE
        #: what ``mtcfs status`` shows of the scrub (times are wall-clock seconds)
        self.scrub_state: dict = {"passes": 0, "running": False, "done_bytes": 0,
                                  "total_bytes": 0, "last_started": None,
                                  "last_finished": None, "last_seconds": None,
                                  "last_chunks": 0, "last_corrupt": 0, "next": None}
        for v in self.versions.values():
            if v.sealed and v.chunks:
                held = set(range(len(v.chunks))) - v.missing
                if held:
                    self._unverified[v.vid] = held

    def needs_verify(self, v: Version) -> bool:
        """Whether some chunk of ``v`` must be hashed before it is served (cheap)."""
        return v.vid in self._unverified

    def unverified_chunks(self) -> int:
        """Chunks of registered versions not hashed since start (status, metrics)."""
        return sum(len(s) for vid, s in self._unverified.items() if vid in self.versions)

    async def _verify_range(self, v: Version, off: int, size: int) -> None:
        """Hash the unverified chunks of ``v`` that ``[off, off+size)`` touches; the ones
        that mismatch become missing (the caller then faults them in)."""
        todo = self._unverified.get(v.vid)
        if not todo:
            return
        cs = v.chunk_size
        first, last = off // cs, (off + max(size, 1) - 1) // cs
        wanted = [i for i in range(first, last + 1) if i in todo]
        if len(wanted) == 1:
            await self._verify_chunk(v, wanted[0])
            return
        async with trio.open_nursery() as n:
            for i in wanted:
                n.start_soon(self._verify_chunk, v, i)

    async def _verify_chunk(self, v: Version, idx: int, *, scrub: bool = False) -> bool:
        """Hash chunk ``idx`` of ``v`` (held in RAM) in a worker thread; True if it matches.

        A mismatch marks it corrupt (:meth:`_mark_corrupt`). One verification per chunk at
        a time; a caller that finds one under way waits for its verdict.
        """
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
            self._verified(v.vid, idx)  # evicted or dropped: it comes back verified
            return False
        if self.versions.get(v.vid) is not v and v.fd < 0:
            return False  # replaced and no longer held: its path may name other data
        ev = self._verifying[key] = trio.Event()
        v.pins += 1
        try:
            off, length = chunk_span(idx, v.size, v.chunk_size)
            if length <= INLINE_VERIFY_BYTES:
                # A small chunk hashes in microseconds: on the loop, without the thread
                # round trip that would dominate (many small files read after a restart).
                ok = _hash_matches(self._fd(v), off, length, v.chunks[idx])
            else:
                fd = self.fds.lease(v)  # open while the thread hashes (store/fdcache.py)
                try:
                    ok = await trio.to_thread.run_sync(_hash_matches, fd, off, length,
                                                       v.chunks[idx], limiter=self.cpu_limiter)
                finally:
                    self.fds.unlease(v, fd)
            if idx in v.missing:
                return False
            if self.versions.get(v.vid) is not v:
                # Replaced (a snapshot install) but still read through a handle's kept
                # descriptor: a mismatch is never served; the chunk becomes missing on this
                # object only (no hole punched: the inode may be another version's now),
                # and fault-in writes good bytes through that descriptor.
                if not ok:
                    v.missing.add(idx)
                    self.counters.corrupt_chunks += 1
                    how = "scrub" if scrub else "first read after start"
                    self._error(f"corrupt chunk in the RAM tier ({how}): version {v.vid} "
                                f"(replaced, still open), chunk {idx}; to be fetched from "
                                "another tier")
                return ok
            self._verified(v.vid, idx)
            if not ok:
                self._mark_corrupt(v, idx, "scrub" if scrub else "first read after start")
            return ok
        finally:
            del self._verifying[key]
            ev.set()
            v.pins -= 1
            self._release_version(v)

    def _carry_unverified(self, old: Version, new: Version) -> None:
        """``new`` took over the data file of ``old`` (scope=job snapshot install): the
        chunks of ``old`` not hashed since start are unverified under ``new``."""
        held = old.handles or old.pins  # still read through its kept descriptor
        todo = self._unverified.get(old.vid) if held else self._unverified.pop(old.vid, None)
        if todo:
            self._unverified[new.vid] = set(todo)

    def _verified(self, vid: int, idx: int) -> None:
        """Chunk ``idx`` of version ``vid`` needs no first-read hash any more."""
        todo = self._unverified.get(vid)
        if todo is not None:
            todo.discard(idx)
            if not todo:
                del self._unverified[vid]

    def _mark_corrupt(self, v: Version, idx: int, found_by: str) -> None:
        """Chunk ``idx`` of ``v`` does not match its hash: make it missing (fault-in then
        fetches it from another tier), drop its bytes, count it and log it."""
        if idx in v.missing:
            return
        off, length = chunk_span(idx, v.size, v.chunk_size)
        registered = self.versions.get(v.vid) is v
        v.missing.add(idx)
        self._verified(v.vid, idx)
        if registered or v.fd >= 0:  # (a replaced version's path may name other data)
            fd = self.fds.lease(v)
            try:
                punch_hole(fd, off, length)
            finally:
                self.fds.unlease(v, fd)
        self.counters.corrupt_chunks += 1
        ino = self.inodes.get(v.ino)
        path = self.path_of(ino) if ino is not None and ino.vid == v.vid else None
        self._error(f"corrupt chunk in the RAM tier ({found_by}): "
                    f"{path if path is not None else f'version {v.vid}'}, chunk {idx} "
                    f"(bytes {off}..{off + length}) does not match {v.chunks[idx][:16]}; "
                    "dropped, to be fetched from another tier")
        if registered:
            self.budget.account(v)  # the punched hole no longer counts against size=
            self.chunk_index.forget(v.chunks[idx], v.vid)
            with self.db.transaction():
                self._write_version(v)
            if self.chunk_source is not None and self._nursery is not None:
                self._nursery.start_soon(self._repair_chunk, v, idx)  # repair now, unread

    # ------------------------------------------------------------------ the scrub

    async def scrub_loop(self) -> None:
        """Background task: a scrub pass every ``scrub_interval_s`` (0: never)."""
        if not self.scrub_interval_s:
            return
        while True:
            self.scrub_state["next"] = time.time() + self.scrub_interval_s
            await trio.sleep(self.scrub_interval_s)
            self.scrub_state["next"] = None
            try:
                await self.scrub_pass()
            except Exception as exc:  # a pass that failed is logged; the next one runs
                self._error(f"scrub pass failed: {exc!r}")
                self.scrub_state["running"] = False

    async def scrub_pass(self) -> int:
        """Hash every chunk held in RAM of every sealed version, at most ``scrub_rate``
        bytes per second; repair the corrupt ones it can (fault-in). Returns how many
        mismatched."""
        st = self.scrub_state
        work = [(v, i) for v in list(self.versions.values()) if v.sealed
                for i in range(len(v.chunks)) if i not in v.missing]
        st.update(running=True, done_bytes=0, last_started=time.time(),
                  total_bytes=sum(chunk_span(i, v.size, v.chunk_size)[1] for v, i in work))
        t0 = trio.current_time()
        done = checked = bad = 0
        try:
            for v, i in work:
                if self.versions.get(v.vid) is not v or i in v.missing or not v.sealed:
                    continue
                length = chunk_span(i, v.size, v.chunk_size)[1]
                if not await self._verify_chunk(v, i, scrub=True) and i in v.missing:
                    bad += 1
                checked += 1
                done += length
                st["done_bytes"] = done
                if self.scrub_rate:
                    # never ahead of scrub_rate bytes/s since the pass began
                    await trio.sleep_until(t0 + done / self.scrub_rate)
                else:
                    await trio.sleep(0)
        finally:
            st.update(running=False, last_finished=time.time(),
                      last_seconds=round(trio.current_time() - t0, 3), last_chunks=checked,
                      last_corrupt=bad, passes=st["passes"] + 1)
        return bad

    async def _repair_chunk(self, v: Version, idx: int) -> None:
        """Fetch a chunk found corrupt, as a read would (bounded by the fault-in
        deadline; a failure is logged and counted there, and a read asks again)."""
        if self.versions.get(v.vid) is not v:
            return
        off, length = chunk_span(idx, v.size, v.chunk_size)
        v.pins += 1
        try:
            await self.fault_in(v, off, length)
        except Exception as exc:  # noqa: BLE001 (logged by fault-in; a read asks again)
            log.info("scrub could not repair chunk %d of version %d: %s", idx, v.vid, exc)
        finally:
            v.pins -= 1
            self._release_version(v)
