"""The local chunk index (core/chunkmap.py) alone, then through the core in-process.

Each test ends with the consistency check: every indexed copy (primary or other) is a chunk
a registered, sealed version holds (not missing), and every chunk such a version holds is
indexed.
"""

from __future__ import annotations

import os

import trio
from support.corefs import CS, run

from mtcfs.core.chunkmap import ChunkIndex
from mtcfs.core.model import ROOT_INO, Version


def consistent(index: ChunkIndex, versions: dict[int, Version]) -> None:
    held = {(d, v.vid, i) for v in versions.values() if v.sealed
            for i, d in enumerate(v.chunks) if i not in v.missing}
    indexed = {(d, *loc) for d, loc in index._primary.items()}
    indexed |= {(d, vid, i) for d, alts in index._alts.items()
                for vid, idxs in alts.items() for i in idxs}
    assert indexed == held
    assert all(alts and all(alts.values()) for alts in index._alts.values())
    assert {d for d, _v, _i in held} == set(index._primary) and len(index) == len(index._primary)


def version(vid: int, chunks: tuple[str, ...], missing=()) -> Version:
    return Version(vid=vid, ino=vid + 100, size=len(chunks) * CS, chunk_size=CS, sealed=True,
                   chunks=chunks, missing=set(missing))


def test_copies_take_over_when_one_goes():
    versions: dict[int, Version] = {}
    index = ChunkIndex(versions)
    a, b, c = version(1, ("x", "y")), version(2, ("y", "z")), version(3, ("x",), missing=[0])
    for v in (a, b, c):
        versions[v.vid] = v
        index.add_version(v)
    consistent(index, versions)
    assert index.locate("x") == (a, 0) and not index.holds("w")
    assert index.last_copy("x", 1) and not index.last_copy("y", 1) and not index.last_copy("y", 2)
    del versions[1]
    index.forget_version(a)  # y's other copy in b takes over; x is gone (c lacks it)
    assert index.locate("y") == (b, 0) and not index.holds("x") and index.last_copy("y", 2)
    consistent(index, versions)
    b.missing.add(1)  # a copy that became missing is never answered
    assert not index.holds("z")
    index.forget("z", 2)
    consistent(index, versions)
    index.clear()
    assert len(index) == 0 and not index.holds("y")


def test_the_core_keeps_its_index_exact(tmp_path):
    data = os.urandom(3 * CS)

    async def body(fs) -> None:
        inos = []
        for name in (b"a", b"b"):  # the same bytes twice: two copies of each chunk
            fh, attr = await fs.create(ROOT_INO, name, 0o644,
                                       os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0, 0)
            await fs.write(fh, 0, data)
            await fs.release(fh)
            inos.append(attr.ino)
        for ino in inos:
            with trio.fail_after(10):
                await fs.open_files.wait_sealed(fs.inodes[ino])
        consistent(fs.chunk_index, fs.versions)
        v = fs.versions[fs.inodes[inos[0]].vid]
        assert all(fs.tier_api.has_local_chunk(d) for d in v.chunks)
        await fs.unlink(ROOT_INO, b"a")
        assert all(fs.tier_api.has_local_chunk(d) for d in v.chunks)  # b's copies took over
        consistent(fs.chunk_index, fs.versions)
        pinned = fs.tier_api.pin_chunk(v.chunks[1])
        assert pinned is not None and pinned[1] == CS and pinned[0].pins == 1
        fs.tier_api.unpin([pinned[0]])
        await fs.unlink(ROOT_INO, b"b")
        assert len(fs.chunk_index) == 0
        consistent(fs.chunk_index, fs.versions)

    run(body, tmp_path)
