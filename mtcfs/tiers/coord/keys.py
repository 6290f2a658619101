"""The ranks in the job's etcd keys (``members/<rank:06d>``, ``steps/<rank:06d>``,
``mtc/round-<k>/<rank:06d>``), read back strictly."""

from __future__ import annotations

from mtcfs.base.limits import MAX_NODES
from mtcfs.base.untrusted import BadRecord

#: Digits of the rank at the end of a per-rank key (``f"{rank:06d}"``).
RANK_DIGITS = 6


def rank_key(rank: int) -> bytes:
    """The rank part of a per-rank key: six ASCII digits."""
    return f"{rank:0{RANK_DIGITS}d}".encode()


def rank_of_key(key: bytes, prefix: bytes) -> int:
    """The rank named by ``key`` = ``prefix`` + six ASCII digits, in ``0..MAX_NODES-1``.

    Raises:
        BadRecord: the key is not ``prefix`` followed by exactly six ASCII digits, or the
            rank is out of range (one line).
    """
    if not key.startswith(prefix):
        raise BadRecord(f"key is not under {prefix.decode(errors='replace')}")
    tail = key[len(prefix):]
    if len(tail) != RANK_DIGITS or not all(0x30 <= c <= 0x39 for c in tail):
        raise BadRecord(f"key does not end in a {RANK_DIGITS}-digit rank")
    rank = int(tail)
    if rank >= MAX_NODES:
        raise BadRecord(f"rank {rank} in the key is outside 0..{MAX_NODES - 1}")
    return rank
