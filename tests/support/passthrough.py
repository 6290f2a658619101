"""Helpers of the passthrough tests (tests/t4_passthrough_test.py and its review)."""

from __future__ import annotations

import os
import random

import blake3
import pytest


def data(n: int, seed: int) -> bytes:
    """``n`` reproducible random bytes."""
    return random.Random(seed).randbytes(n)


def fuse_status(m) -> dict:
    """The ``fuse`` part of mount ``m``'s status (passthrough on or off, and why)."""
    return m.status()["fuse"]


def passthrough_mount(make_mount, name: str = "pt", **options):
    """A started mount with passthrough on; the test is skipped, with the reason the mount
    gives, where it is off (an old kernel, no root)."""
    m = make_mount(name, **options)
    st = fuse_status(m)
    if not st["passthrough"]:
        pytest.skip(f"passthrough is off here: {st['passthrough_off']}")
    return m


def held_checkpoint(m, name: str = "ckpt") -> tuple:
    """A sealed 2 MiB file ``name`` of mount ``m`` held open by a reader (its first bytes
    read, through passthrough), and the bytes that are to replace it: ``(path, new, fd)``.
    The caller closes ``fd``."""
    p = m.path(name)
    old, new = data(2 << 20, 3), data((1 << 20) + 3, 4)
    p.write_bytes(old)
    m.wait_state(name, "local", 30)
    r = os.open(p, os.O_RDONLY)
    try:
        assert os.pread(r, 16, 0) == old[:16]
    except BaseException:
        os.close(r)
        raise
    return p, new, r


def assert_sealed_as(m, name: str, want: bytes, timeout: float = 30) -> None:
    """File ``name`` of mount ``m`` gets sealed (within ``timeout`` seconds) holding
    ``want``, and says so in its ``user.mtcfs.blake3``."""
    m.wait_state(name, "local", timeout)
    p = m.path(name)
    assert p.read_bytes() == want
    assert os.getxattr(p, "user.mtcfs.blake3").decode() == blake3.blake3(want).hexdigest()
