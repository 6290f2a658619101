"""Review of FUSE passthrough (issue 40): ordinary checkpoint workflows that must not get
EIO from open(2), nor lose or mix bytes, nor leak backing files."""

from __future__ import annotations

import os
import random

import blake3
import pytest

MiB = 1 << 20


def _data(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _fuse(m) -> dict:
    return m.status()["fuse"]


@pytest.fixture
def pt_mount(make_mount):
    m = make_mount("pt")
    if not _fuse(m)["passthrough"]:
        pytest.skip(f"passthrough is off here: {_fuse(m)['passthrough_off']}")
    return m


def test_overwrite_while_the_last_version_is_sealing_and_read(pt_mount):
    """save latest.pt, a reader opens it at once (its seal is still running), the next
    save truncates it: the save's open must not fail, and everyone sees the new bytes."""
    m = pt_mount
    p = m.path("latest.pt")
    old, new = _data(96 * MiB, 1), _data(MiB + 7, 2)
    for attempt in range(5):
        with open(p, "wb") as f:
            f.write(old)
        r = os.open(p, os.O_RDONLY)
        try:
            sealing = os.getxattr(p, "user.mtcfs.state") == b"writing"
            with open(p, "wb") as f:  # must not raise
                f.write(new)
            assert os.pread(r, len(new) + 10, 0) in (new, old[:len(new) + 10])
        finally:
            os.close(r)
        if sealing:
            break
    m.wait_state("latest.pt", "local", 60)
    assert p.read_bytes() == new
    assert os.getxattr(p, "user.mtcfs.blake3").decode() == blake3.blake3(new).hexdigest()
    assert _fuse(m)["backing_files"] == 0


@pytest.mark.parametrize("how", ["truncate", "rdonly_trunc"])
def test_truncate_by_path_under_a_reader_leaves_the_file_openable(pt_mount, how):
    """A reader holds a checkpoint open; another process empties it with truncate(2) by
    path (or an O_RDONLY|O_TRUNC open) and writes it again: every later open succeeds and
    reads the new bytes."""
    m = pt_mount
    p = m.path("ckpt")
    old, new = _data(2 * MiB, 3), _data(MiB + 3, 4)
    p.write_bytes(old)
    m.wait_state("ckpt", "local", 30)
    r = os.open(p, os.O_RDONLY)
    try:
        assert os.pread(r, 16, 0) == old[:16]
        if how == "truncate":
            os.truncate(p, 0)
        else:
            os.close(os.open(p, os.O_RDONLY | os.O_TRUNC))
        assert os.stat(p).st_size == 0
        with open(p, "r+b") as f:  # must not fail while the reader is open
            f.write(new)
        with open(p, "rb") as f:
            assert f.read() == new
    finally:
        os.close(r)
    m.wait_state("ckpt", "local", 30)
    assert p.read_bytes() == new
    assert os.getxattr(p, "user.mtcfs.blake3").decode() == blake3.blake3(new).hexdigest()
    assert _fuse(m)["backing_files"] == 0


def test_the_cli_finds_its_mount_among_many_mounts(make_mount, tmp_path):
    """Every mtcfs mount now brings a tmpfs of its own (its data directory), so a host's
    mount table is soon longer than one page: `mtcfs status` must still find the mount
    (a read(2) of /proc/self/mountinfo returns at most a page of it)."""
    import subprocess

    from mtcfs.base import mountinfo

    made = []
    try:
        while len(open("/proc/self/mountinfo").read()) < 3 * 4096:
            d = tmp_path / ("x" * 150 + str(len(made)))
            d.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "rvtmp", str(d)],
                           check=True)
            made.append(d)
        m = make_mount("many")
        assert m.status()["pid"] > 0
        assert mountinfo.is_mounted(m.mnt)
        assert all(mountinfo.is_mounted(d) for d in made)
    finally:
        for d in made:
            subprocess.run(["umount", str(d)], check=False)
