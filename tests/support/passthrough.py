"""Helpers of the passthrough tests (tests/t4_passthrough_test.py and its review)."""

from __future__ import annotations

import random

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
