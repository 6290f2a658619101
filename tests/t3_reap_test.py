"""Freeing the data of removed versions: off the FUSE loop for large files (core/store/reaper.py).

Unlinking a large tmpfs file frees its pages inside the syscall, about 140 ms per GiB on the
test machine; done on the trio loop it held up every FUSE request meanwhile (a keep=N
eviction of a 10 GiB step: over a second of no I/O for the trainer). The failpoint
``store.free_data`` pauses the freeing, so "the core went on meanwhile" is certain instead of
a matter of timing.
"""

import os

import trio

from mtcfs.base import failpoints
from mtcfs.core.model import ROOT_INO
from support.corefs import run, run_to_crash, sealed, write_file

BIG = 16 << 20  # above the reaper's threshold (core/store/reaper.py: REAP_MIN_BYTES)
PAUSE = 3.0


def _data_names(tmp_path) -> set[str]:
    return set(os.listdir(tmp_path / "store" / "data"))


def _reap_names(tmp_path) -> set[str]:
    d = tmp_path / "store" / "reap"
    return set(os.listdir(d)) if d.exists() else set()


def test_an_unlink_returns_and_the_core_answers_while_a_large_file_is_freed(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setitem(failpoints._ACTIVE, "store.free_data", PAUSE)
    big = os.urandom(BIG)

    async def body(fs):
        ino = await write_file(fs, ROOT_INO, b"big", big)
        v = await sealed(fs, ino)
        small = await write_file(fs, ROOT_INO, b"small", b"kept bytes")
        await sealed(fs, small)
        used = fs.budget.used
        t0 = trio.current_time()
        await fs.unlink(ROOT_INO, b"big")
        fs.forget([(ino, 1)])
        # the unlink did not wait for the pages to be freed...
        assert trio.current_time() - t0 < PAUSE / 3
        assert str(v.vid) not in _data_names(tmp_path)
        assert fs.budget.used <= used - BIG
        # ...and the core answers while they are: a read of another file
        fh, _ = await fs.open(small, os.O_RDONLY)
        assert await fs.read(fh, 0, 100) == b"kept bytes"
        await fs.release(fh)
        assert trio.current_time() - t0 < PAUSE / 3
        with trio.fail_after(PAUSE + 10):
            while _reap_names(tmp_path):
                await trio.sleep(0.05)
    run(body, tmp_path)
    assert _reap_names(tmp_path) == set()


def test_data_left_to_free_at_a_crash_is_freed_at_the_next_start(tmp_path, monkeypatch):
    monkeypatch.setitem(failpoints._ACTIVE, "store.free_data", PAUSE)
    vids = []

    async def first(fs):
        ino = await write_file(fs, ROOT_INO, b"big", os.urandom(BIG))
        vids.append((await sealed(fs, ino)).vid)
        await write_file(fs, ROOT_INO, b"small", b"kept bytes")
        await fs.unlink(ROOT_INO, b"big")
        fs.forget([(ino, 1)])
    run_to_crash(first, tmp_path)
    assert _reap_names(tmp_path), "the crash came while the data was still to be freed"
    monkeypatch.delitem(failpoints._ACTIVE, "store.free_data")

    async def second(fs):
        assert _reap_names(tmp_path) == set()
        assert str(vids[0]) not in _data_names(tmp_path)
        small = fs.inodes[ROOT_INO].children[b"small"]
        fh, _ = await fs.open(small, os.O_RDONLY)
        assert await fs.read(fh, 0, 100) == b"kept bytes"
        await fs.release(fh)
    run(second, tmp_path)
