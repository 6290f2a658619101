"""Helpers for the peer-tier tests: deterministic chunk data and step manifests."""

from __future__ import annotations

import random

from mtcfs.base.chunking import chunk_hash
from mtcfs.base.manifest import Entry, StepManifest

#: The smallest chunk size mtcfs allows keeps the suites fast.
CHUNK = 64 * 1024


def blob(seed: int, size: int) -> bytes:
    """Deterministic random bytes."""
    return random.Random(seed).randbytes(size)


def chunks_of(data: bytes, chunk_size: int = CHUNK) -> dict[str, bytes]:
    """Cut ``data`` into chunks: digest -> bytes, in file order."""
    out: dict[str, bytes] = {}
    for off in range(0, len(data), chunk_size):
        piece = data[off:off + chunk_size]
        out[chunk_hash(piece)] = piece
    return out


def make_step(job: str, rank: int, step_number: int, files: dict[str, bytes], *,
              chunk_size: int = CHUNK, step: str | None = None) -> StepManifest:
    """A StepManifest of ``files`` (name -> content) below step directory ``step_number``."""
    name = step if step is not None else str(step_number)
    entries = [Entry(path=name, kind="dir", mode=0o755, mtime_ns=1)]
    for fname, data in sorted(files.items()):
        hashes = tuple(chunk_hash(data[o:o + chunk_size])
                       for o in range(0, len(data), chunk_size))
        entries.append(Entry(path=f"{name}/{fname}", kind="file", mode=0o644, mtime_ns=2,
                             size=len(data), chunk_size=chunk_size, chunks=hashes,
                             blake3=chunk_hash(data)))
    return StepManifest(job=job, step=name, step_number=step_number, created_ns=step_number,
                        entries=entries, rank=rank)


class LocalTier:
    """A node's own RAM tier, as a dict (the real one reads data files)."""

    def __init__(self, chunks: dict[str, bytes]) -> None:
        self.chunks = dict(chunks)

    def has_chunk(self, digest: str) -> bool:
        return digest in self.chunks

    def read_chunk(self, digest: str) -> bytes | None:
        return self.chunks.get(digest)
