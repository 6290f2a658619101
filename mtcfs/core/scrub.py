"""Verified reads of the RAM tier, the facade's part: corrupt chunks and their repair.

Which chunks are unverified, the verifications in flight and the scrub are
:class:`mtcfs.core.verifier.Verifier` (``Filesystem.verifier``); this mixin is what the
verifier and fault-in call back when a chunk's bytes no longer match its hash
(:meth:`ScrubOps._mark_corrupt`), and the settings the daemon reads and sets. Policy:
docs/reliability.md; components: docs/architecture.md, "The core".

A chunk that mismatches is treated as missing: marked missing (persisted), its bytes
dropped from the data file, counted (``corrupt_chunks``), logged with its file and chunk,
and faulted in like any missing chunk (another local copy, a peer, the backup tier). With
no other source the read fails with EIO naming the file and chunk; the wrong bytes are
never served.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from mtcfs.base.chunking import chunk_span
from mtcfs.core.model import Version
from mtcfs.core.verifier import INLINE_VERIFY_BYTES, SCRUB_INTERVAL_S, SCRUB_RATE

__all__ = ["INLINE_VERIFY_BYTES", "SCRUB_INTERVAL_S", "SCRUB_RATE", "ScrubOps", "punch_hole"]

log = logging.getLogger("mtcfs.core.core")

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



class ScrubOps:
    """Corrupt chunks and their repair; the verifier's settings (core/verifier.py)."""

    @property
    def scrub_interval_s(self) -> float:
        """Seconds between scrub passes (0: never; ``scrub_interval=``)."""
        return self.verifier.interval_s

    @scrub_interval_s.setter
    def scrub_interval_s(self, seconds: float) -> None:
        self.verifier.interval_s = seconds

    @property
    def scrub_rate(self) -> int:
        """Bytes per second a scrub pass reads at most (``scrub_rate=``)."""
        return self.verifier.rate

    @scrub_rate.setter
    def scrub_rate(self, rate: int) -> None:
        self.verifier.rate = rate

    @property
    def scrub_state(self) -> dict:
        """What ``mtcfs status`` shows of the scrub (times are wall-clock seconds)."""
        return self.verifier.state

    def needs_verify(self, v: Version) -> bool:
        """Whether some chunk of ``v`` must be hashed before it is served (cheap)."""
        return self.verifier.needs(v)

    def unverified_chunks(self) -> int:
        """Chunks of registered versions not hashed since start (status, metrics)."""
        return self.verifier.unverified_chunks()

    async def scrub_loop(self) -> None:
        """Background task: a scrub pass every ``scrub_interval_s`` (0: never)."""
        await self.verifier.loop()

    def _mark_corrupt(self, v: Version, idx: int, found_by: str) -> None:
        """Chunk ``idx`` of ``v`` does not match its hash: make it missing (fault-in then
        fetches it from another tier), drop its bytes, count it and log it."""
        if idx in v.missing:
            return
        off, length = chunk_span(idx, v.size, v.chunk_size)
        registered = self.versions.get(v.vid) is v
        v.missing.add(idx)
        self.verifier.verified(v.vid, idx)
        if registered or v.fd >= 0:  # (a replaced version's path may name other data)
            fd = self.fds.lease(v)
            try:
                punch_hole(fd, off, length)
            finally:
                self.fds.unlease(v, fd)
        self.counters.corrupt_chunks += 1
        ino = self.inodes.get(v.ino)
        path = self.tree.path_of(ino) if ino is not None and ino.vid == v.vid else None
        self.report_error(f"corrupt chunk in the RAM tier ({found_by}): "
                    f"{path if path is not None else f'version {v.vid}'}, chunk {idx} "
                    f"(bytes {off}..{off + length}) does not match {v.chunks[idx][:16]}; "
                    "dropped, to be fetched from another tier")
        if registered:
            self.budget.account(v)  # the punched hole no longer counts against size=
            self.chunk_index.forget(v.chunks[idx], v.vid)
            with self.db.transaction():
                self.vstore.write(v)
            if self.chunk_source is not None and self._nursery is not None:
                self._nursery.start_soon(self._repair_chunk, v, idx)  # repair now, unread

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
            self.vstore.release(v)
