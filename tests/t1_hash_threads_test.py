"""Hashing with a thread budget (issue 40): the chunk digests of a file hashed with
``threads`` = 1 or more are the same, each byte read once; a stop gives the finished prefix
of chunks; a rewrite's rehash agrees; the ``hash_threads=`` option. On temp files, no mount
(the seal of a mounted file is in t4_hash_threads_test.py)."""

from __future__ import annotations

import itertools
import os
import threading

import blake3
import pytest

from mtcfs.base.chunking import (DEFAULT_HASH_THREADS, EMPTY_HASH, HashStopped, hash_fd,
                                 rehash_fd)
from mtcfs.options import OptionError, parse_mount_options

CS = 64 * 1024


def _file(tmp_path, data: bytes) -> int:
    p = tmp_path / "f"
    p.write_bytes(data)
    return os.open(p, os.O_RDONLY)


def _digests(data: bytes) -> tuple[str, ...]:
    return tuple(blake3.blake3(data[i:i + CS]).hexdigest() for i in range(0, len(data), CS))


@pytest.mark.parametrize("threads", [1, 2, 4, 64])
def test_chunk_digests_do_not_depend_on_threads(tmp_path, threads):
    data = os.urandom(37 * CS + 1234)
    fd = _file(tmp_path, data)
    try:
        r = hash_fd(fd, len(data), CS, threads=threads)
        assert r.chunks == _digests(data) and r.size == r.hashed == len(data)
        assert r.file_hash == ""  # more than one chunk: computed when asked
        w = hash_fd(fd, len(data), CS, threads=threads, whole=True)
        assert w.chunks == r.chunks and w.file_hash == blake3.blake3(data).hexdigest()
    finally:
        os.close(fd)


def test_one_chunk_and_empty_files_carry_their_whole_hash(tmp_path):
    data = os.urandom(CS - 7)
    fd = _file(tmp_path, data)
    try:
        r = hash_fd(fd, len(data), CS, threads=4)
        assert r.file_hash == r.chunks[0] == blake3.blake3(data).hexdigest()
        assert hash_fd(fd, 0, CS, threads=4).file_hash == EMPTY_HASH
    finally:
        os.close(fd)


@pytest.mark.parametrize("threads", [1, 4])
def test_a_stop_gives_the_finished_prefix(tmp_path, threads):
    data = os.urandom(40 * CS)
    fd = _file(tmp_path, data)
    asks = itertools.count()
    seen: set[str] = set()

    def stop() -> bool:
        seen.add(threading.current_thread().name)
        return next(asks) >= 13  # asked before each chunk: chunks 0..12 are hashed

    try:
        with pytest.raises(HashStopped) as ei:
            hash_fd(fd, len(data), CS, stop=stop, threads=threads)
    finally:
        os.close(fd)
    assert ei.value.chunks == _digests(data)[:13]
    assert ei.value.hashed == 13 * CS
    assert len(seen) >= 1


def test_a_file_shorter_than_asked_is_an_oserror_with_every_thread(tmp_path):
    data = os.urandom(9 * CS)
    fd = _file(tmp_path, data)
    try:
        with pytest.raises(OSError, match="shorter"):
            hash_fd(fd, len(data) + 3 * CS, CS, threads=4)
    finally:
        os.close(fd)


@pytest.mark.parametrize("threads", [1, 4])
def test_a_rewrite_rehashes_its_dirty_chunks_and_the_new_ones(tmp_path, threads):
    old = os.urandom(20 * CS)
    new = bytearray(old) + os.urandom(5 * CS + 99)
    for i in (2, 7, 8):
        new[i * CS + 5] ^= 0xFF
    new[23 * CS:24 * CS] = bytes(CS)
    p = tmp_path / "f"
    p.write_bytes(bytes(new[:23 * CS]))
    with open(p, "r+b") as f:  # chunk 23 a hole (digest of zeros, not read)
        f.truncate(24 * CS)
        f.seek(24 * CS)
        f.write(new[24 * CS:])
    fd = os.open(p, os.O_RDONLY)
    try:
        r = rehash_fd(fd, len(new), CS, _digests(old), {2, 7, 8}, threads=threads)
    finally:
        os.close(fd)
    assert r.chunks == _digests(bytes(new)) and r.file_hash == ""
    assert r.hashed == 3 * CS + len(new) - 20 * CS - CS


def test_hash_threads_option():
    assert parse_mount_options("j", "/m", []).hash_threads == DEFAULT_HASH_THREADS
    assert DEFAULT_HASH_THREADS == min(4, os.cpu_count() or 1)
    assert parse_mount_options("j", "/m", ["hash_threads=1"]).hash_threads == 1
    assert parse_mount_options("j", "/m", ["hash_threads=64"]).hash_threads == 64
    for bad, word in (("0", "at least 1"), ("65", "at most 64"), ("x", "integer"),
                      ("-2", "integer"), ("", "needs a value")):
        with pytest.raises(OptionError) as ei:
            parse_mount_options("j", "/m", [f"hash_threads={bad}"])
        msg = str(ei.value)
        assert "hash_threads" in msg and word in msg and "\n" not in msg, msg
