"""Chunk-sized scratch buffers that cost the GIL nothing to create.

``bytearray(n)`` fills its ``n`` bytes with zeros while holding the GIL. For a 4 MiB chunk
buffer on pages the process has not touched yet that is 1,024 page faults: 1.7-2.6 ms on
this project's VMs. A hashing thread that made its buffer right after a close(2) kept the FUSE
loop, which needs the GIL for every request, from answering the stat(2) or open(2) that
followed (docs/benchmarks.md, "RAM-disk speed": the stall after a close).

:func:`scratch` maps anonymous memory instead: the kernel hands out zeroed pages when
they are first written, inside the ``preadv(2)`` or ``recv_into`` that fills the buffer,
with the GIL released.
"""

from __future__ import annotations

import mmap

__all__ = ["scratch"]


def scratch(n: int) -> mmap.mmap:
    """A writable buffer of ``n`` (> 0) bytes, all zero, whose pages are allocated when
    first written. Use it through a ``memoryview``; it is unmapped when the last reference
    to it (a view included) goes, or at ``close()`` (``BufferError`` while a view is held)."""
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
