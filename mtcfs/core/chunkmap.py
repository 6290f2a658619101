"""The local chunk index: where in RAM each chunk this node holds can be read.

:class:`ChunkIndex` owns the map ``digest -> (vid, chunk index)`` of one local copy of each
chunk, and the other local copies of the same chunk (identical data in several files or
steps). It is the only code that changes them. The core tells it when a sealed chunk
arrives (:meth:`ChunkIndex.note`, :meth:`ChunkIndex.add_version`) and when a version stops
holding one (:meth:`ChunkIndex.forget`); fault-in, the peer tier (``has_chunk``) and the
hand-over of last copies ask it.

Threads: changes are made on the trio thread only. :meth:`holds` and :meth:`locate` may be
called from other threads (the peer tier's replica store, its gRPC pool): each is a dict
lookup and a set membership test, atomic under the GIL, and the primary entry is replaced
in one assignment, never deleted first, while another copy exists. The answer may be stale
by the time it is used; a reader pins the version on the loop before it reads.
"""

from __future__ import annotations

from mtcfs.core.model import Version

__all__ = ["ChunkIndex"]


class ChunkIndex:
    """Local copies of chunks, by digest.

    Args:
        versions: the core's registered versions (``vid -> Version``), read to skip copies
            that became missing; the same dict object for the core's lifetime.
    """

    def __init__(self, versions: dict[int, Version]) -> None:
        self._versions = versions
        #: digest -> (vid, chunk index) of one local copy.
        self._primary: dict[str, tuple[int, int]] = {}
        #: digest -> vid -> chunk indices: the other local copies, by version, so that
        #: forgetting one version's copies costs the same however many other versions
        #: hold the chunk (a chunk held by thousands of files or steps: zeros, frozen
        #: layers).
        self._alts: dict[str, dict[int, set[int]]] = {}

    def __len__(self) -> int:
        """Distinct chunks indexed."""
        return len(self._primary)

    # ------------------------------------------------------------------ changes (loop only)

    def note(self, digest: str, vid: int, idx: int) -> None:
        """Chunk ``digest`` is in RAM as chunk ``idx`` of version ``vid``."""
        loc = self._primary.get(digest)
        if loc is None:
            self._primary[digest] = (vid, idx)
        elif loc != (vid, idx):
            self._alts.setdefault(digest, {}).setdefault(vid, set()).add(idx)

    def add_version(self, v: Version) -> None:
        """Index every chunk a sealed ``v`` holds (not the missing ones)."""
        if not v.sealed:
            return
        for i, d in enumerate(v.chunks):
            if i not in v.missing:
                self.note(d, v.vid, i)

    def forget(self, digest: str, vid: int) -> None:
        """Version ``vid`` no longer holds ``digest`` in RAM; another local copy, if any,
        takes its place (the replica store counts on this node's copies)."""
        alts = self._alts.get(digest)
        if alts:
            alts.pop(vid, None)
        loc = self._primary.get(digest)
        if loc is not None and loc[0] == vid:
            # Replaced in one step, never deleted first: other threads (the replica
            # store's has_chunk) read this index without a lock. Stale copies (a version
            # gone, or the chunk missing in it) met on the way are dropped.
            while alts:
                ovid, idxs = alts.popitem()  # O(1), unlike taking the first key
                idx = idxs.pop()
                if idxs:
                    alts[ovid] = idxs
                other = self._versions.get(ovid)
                if other is not None and idx not in other.missing:
                    self._primary[digest] = (ovid, idx)
                    break
            else:
                del self._primary[digest]
        if alts is not None and not alts:
            del self._alts[digest]

    def forget_version(self, v: Version) -> None:
        """``v`` holds none of its chunks any more (freed, or its data dropped)."""
        for d in v.chunks:
            self.forget(d, v.vid)

    def clear(self) -> None:
        """Forget every copy (a namespace snapshot install indexes again)."""
        self._primary.clear()
        self._alts.clear()

    # ------------------------------------------------------------------ questions

    def locate(self, digest: str) -> tuple[Version, int] | None:
        """A registered version holding ``digest`` in RAM now, and the chunk's index in it.
        Thread-safe (see the module docstring); may be stale."""
        loc = self._primary.get(digest)
        if loc is None:
            return None
        v = self._versions.get(loc[0])
        if v is None or loc[1] in v.missing:
            return None
        return v, loc[1]

    def holds(self, digest: str) -> bool:
        """Whether this node's own files hold ``digest`` in RAM now (thread-safe)."""
        return self.locate(digest) is not None

    def last_copy(self, digest: str, vid: int) -> bool:
        """Whether version ``vid`` holds the only local copy of ``digest`` (it is the one
        indexed and no other version holds one)."""
        if self._primary.get(digest, (None,))[0] != vid:
            return False
        return not any(ovid != vid for ovid in self._alts.get(digest, ()))
