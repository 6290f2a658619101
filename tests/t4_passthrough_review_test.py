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
