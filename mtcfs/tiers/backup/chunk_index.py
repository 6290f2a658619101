"""Which chunks the bucket holds, as far as this process knows, and who is uploading which.

The set is filled by one listing of ``chunks/`` on first use (a paginated list: about one
request per 1,000 chunks) and then kept current by this process's own uploads and sweeps.
Digests are kept as 32-byte ``bytes`` (about 80 bytes per chunk with set overhead: 1 M
chunks, i.e. 4 TiB of unique data at 4 MiB per chunk, cost about 80 MiB).

It can be stale in one direction only, harmlessly: a chunk another node uploaded after the
listing is believed absent and uploaded again. The other direction (a chunk believed present
but deleted by a sweep elsewhere) is what retention's ordering rules prevent on a
single-node store (see :mod:`mtcfs.tiers.backup.retention`) and what the sweep gate
prevents on multi-node stores: the store forgets the index when the sweep generation moved
(see :mod:`mtcfs.tiers.backup.gate`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from mtcfs.tiers.backup.backend import Backend
from mtcfs.tiers.backup.layout import CHUNKS_PREFIX, check_hash, parse_chunk_key

log = logging.getLogger(__name__)


class ChunkIndex:
    """A thread-safe, lazily loaded set of chunk digests with upload claims.

    Args:
        backend: the backend whose ``chunks/`` it mirrors.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._known: set[bytes] | None = None
        self._lock = threading.Lock()       # guards _known's content and _inflight
        self._load_lock = threading.Lock()  # one initial listing at a time
        self._inflight: dict[bytes, threading.Event] = {}

    def _set(self) -> set[bytes]:
        known = self._known
        if known is not None:
            return known
        with self._load_lock:
            if self._known is None:
                found: set[bytes] = set()
                for key in self._backend.list(CHUNKS_PREFIX):
                    h = parse_chunk_key(key)
                    if h is not None:
                        found.add(bytes.fromhex(h))
                log.debug("chunk index of %s: %d chunks", self._backend.describe(), len(found))
                with self._lock:
                    self._known = found
            return self._known

    def load(self) -> None:
        """List ``chunks/`` now unless already done. Raises BackupError if listing fails."""
        self._set()

    def reset(self) -> None:
        """Forget everything known; the next use lists ``chunks/`` again.

        Uploads in flight are unaffected (their claims stay); a chunk one of them stores
        after the new listing was taken is believed absent and, at worst, uploaded again.
        """
        with self._load_lock, self._lock:
            self._known = None

    def size(self) -> int:
        """Number of chunks known, or -1 before the index is loaded."""
        with self._lock:
            return -1 if self._known is None else len(self._known)

    def contains(self, h: str) -> bool:
        """Whether chunk ``h`` is known to be in the bucket (loads the index on first use).

        Raises:
            ValueError: if ``h`` is not a hex blake3 digest.
            BackupError: if the first listing fails.
        """
        digest = bytes.fromhex(check_hash(h))
        known = self._set()
        with self._lock:
            return digest in known

    def missing(self, hashes: Iterable[str]) -> list[str]:
        """The ``hashes`` not known to be in the bucket, in the given order."""
        known = self._set()
        with self._lock:
            return [h for h in hashes if bytes.fromhex(h) not in known]

    def add(self, h: str) -> None:
        """Record that chunk ``h`` is in the bucket."""
        known = self._set()
        with self._lock:
            known.add(bytes.fromhex(h))

    def forget(self, digest: bytes) -> None:
        """Record that the chunk with 32-byte ``digest`` was deleted (no-op before loading)."""
        with self._lock:
            if self._known is not None:
                self._known.discard(digest)

    def claim(self, h: str) -> bool:
        """Decide whether the caller should upload chunk ``h``.

        Returns False if the chunk is known to be there (waiting first if another thread is
        uploading it). Returns True if the caller now owns the upload and must call
        :meth:`release` when done, successful or not.
        """
        digest = bytes.fromhex(h)
        known = self._set()
        while True:
            with self._lock:
                if digest in known:
                    return False
                event = self._inflight.get(digest)
                if event is None:
                    self._inflight[digest] = threading.Event()
                    return True
            event.wait()  # then it is known, or that upload failed and we try ourselves

    def release(self, h: str, stored: bool) -> None:
        """End a claim; ``stored`` says whether the chunk is now in the bucket."""
        digest = bytes.fromhex(h)
        with self._lock:
            if stored and self._known is not None:
                self._known.add(digest)
            event = self._inflight.pop(digest)
        event.set()
