"""hash_threads= on a real mount (issue 40): a closed file's seal hashes its chunks on up
to N threads and records the same digests whatever N; ``user.mtcfs.blake3`` is the blake3
of the bytes; the first read after a restart verifies many chunks at once and never serves
a chunk changed in the store while the daemon was down; a bad value is refused (exit 2)."""

from __future__ import annotations

import errno
import os
import random
import sqlite3
import subprocess
import sys
from pathlib import Path

import blake3
import pytest

from support.mount import is_mounted, one_line_error

CHUNK = 128 * 1024  # hashed in worker threads (chunks up to 64 KiB are hashed inline)
MiB = 1 << 20


def _data(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _row(store: Path, name: str) -> tuple[int, list[str]]:
    """The data file number and recorded chunk digests of top-level file ``name``."""
    db = sqlite3.connect(f"file:{store / 'meta.sqlite3'}?mode=ro", uri=True)
    try:
        (vid,) = db.execute("SELECT vid FROM inodes WHERE parent=1 AND name=?",
                            (name.encode(),)).fetchone()
        (chunks,) = db.execute("SELECT chunks FROM versions WHERE vid=?", (vid,)).fetchone()
    finally:
        db.close()
    return vid, chunks.split()


@pytest.mark.parametrize("threads", [1, 4])
def test_a_seal_with_n_threads_records_the_chunks_and_the_file_hash(make_mount, threads):
    data = _data(40 * CHUNK + 1000, threads)
    m = make_mount("n", chunk_size="128K", hash_threads=threads)
    p = m.path("model.bin")
    p.write_bytes(data)
    m.wait_state("model.bin", "local", 30)
    _, chunks = _row(m.store, "model.bin")
    assert chunks == [blake3.blake3(data[i:i + CHUNK]).hexdigest()
                      for i in range(0, len(data), CHUNK)]
    assert os.getxattr(p, "user.mtcfs.blake3").decode() == blake3.blake3(data).hexdigest()
    assert os.getxattr(p, "user.mtcfs.blake3").decode() == blake3.blake3(data).hexdigest()
    st = m.status()
    assert st["hash_threads"] == threads
    assert st["counters"]["seal_bytes_hashed"] == len(data)  # each byte hashed once
    assert st["counters"]["file_hash_bytes"] == len(data)  # once more, when first asked
    assert p.read_bytes() == data


def test_a_chunk_changed_while_down_is_found_by_the_parallel_first_read(make_mount):
    data = _data(48 * CHUNK, 7)
    m = make_mount("n", chunk_size="128K", hash_threads=4)
    p = m.path("model.bin")
    p.write_bytes(data)
    m.wait_state("model.bin", "local", 30)
    m.stop()
    vid, _ = _row(m.store, "model.bin")
    f = m.store / "data" / str(vid)
    fd = os.open(f, os.O_RDWR)
    try:  # chunk 30, as bit rot would
        b = os.pread(fd, 1, 30 * CHUNK + 77)
        os.pwrite(fd, bytes([b[0] ^ 0x10]), 30 * CHUNK + 77)
    finally:
        os.close(fd)
    m.start()
    with open(p, "rb", buffering=0) as fh:
        with pytest.raises(OSError) as exc:  # the whole file: many chunks verified at once
            fh.read()
        assert exc.value.errno == errno.EIO
        for off in range(0, len(data), MiB):  # 8 chunks a read
            if off <= 30 * CHUNK < off + MiB:
                try:  # up to the bad chunk at most (pages read ahead before it)
                    got = os.pread(fh.fileno(), MiB, off)
                except OSError as e:
                    assert e.errno == errno.EIO
                else:
                    assert off + len(got) <= 30 * CHUNK and got == data[off:off + len(got)]
            else:
                assert os.pread(fh.fileno(), MiB, off) == data[off:off + MiB]
        with pytest.raises(OSError) as exc:  # known bad, never served
            os.pread(fh.fileno(), 100, 30 * CHUNK + 50)
        assert exc.value.errno == errno.EIO
    st = m.status()
    assert st["counters"]["corrupt_chunks"] == 1
    assert "model.bin, chunk 30" in st["reads"]["last_failure"]


@pytest.mark.parametrize("value", ["0", "65", "four"])
def test_a_bad_hash_threads_is_one_line_exit_2_nothing_mounted(shm_dir, value):
    mnt = shm_dir / "mnt"
    mnt.mkdir()
    r = subprocess.run([sys.executable, "-m", "mtcfs", "job", str(mnt), "-o",
                        f"store={shm_dir}/s,hash_threads={value}"],
                       capture_output=True, text=True, timeout=60)
    one_line_error(r, 2, f"hash_threads={value}")
    assert not is_mounted(str(mnt))
    assert not (shm_dir / "s").exists()
