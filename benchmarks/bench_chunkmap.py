"""The local chunk index when many versions hold the same chunk (in process, no FUSE).

Zeros, frozen layers and unchanged optimizer state make one chunk appear in thousands of
files or steps. Each version is indexed (``ChunkIndex.add_version``), then forgotten one by
one in creation order, as unlinking the files does; the figure is microseconds per forget.
Before the index kept the other copies by version (``digest -> vid -> indices``), a forget
scanned every other copy: quadratic in the number of copies.

    python -m benchmarks.bench_chunkmap [--copies 2000,8000,20000]
"""

from __future__ import annotations

import argparse
import time

from mtcfs.core.chunkmap import ChunkIndex
from mtcfs.core.model import Version


def forget_all(n: int) -> float:
    """Seconds to forget ``n`` versions that each hold the one chunk ``"d"``."""
    versions: dict[int, Version] = {}
    index = ChunkIndex(versions)
    for vid in range(1, n + 1):
        v = Version(vid=vid, ino=vid, size=4096, chunk_size=4 << 20, sealed=True,
                    chunks=("d",))
        versions[vid] = v
        index.add_version(v)
    t = time.perf_counter()
    for vid in range(1, n + 1):
        index.forget_version(versions.pop(vid))
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--copies", default="2000,8000,20000",
                   help="comma-separated numbers of versions holding the chunk")
    a = p.parse_args()
    for n in (int(x) for x in a.copies.split(",")):
        dt = forget_all(n)
        print(f"{n:>7} copies of one chunk, forgotten one by one: {dt:.3f} s, "
              f"{dt / n * 1e6:.1f} us per forget")


if __name__ == "__main__":
    main()
