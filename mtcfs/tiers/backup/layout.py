"""Object names of the backup layout, in one place.

Below the backend root::

    chunks/<h[0:2]>/<h>.zst                one chunk, zstd-compressed, named by the blake3 of
                                           its uncompressed bytes (the 2-character fan-out
                                           keeps file-system directories small and spreads
                                           GCS keys); shared by every rank of the job, so a
                                           chunk identical on two ranks is stored once
    steps/<step>/manifest.json             a single-node store's (rank None) checkpoint:
                                           StepManifest.to_bytes()
    steps/<step>/COMPLETE                  written last: the step is restorable (small JSON
                                           summary)
    steps/<step>/rank-<r>/manifest.json    rank ``r``'s files of the step in a multi-node job
    steps/<step>/rank-<r>/COMPLETE         written last: rank ``r``'s part is restorable

``<r>`` is the rank in decimal without leading zeros (``rank-0``, ``rank-12``). A step is
complete *on rank r* when ``rank-<r>/COMPLETE`` exists, and complete *in the job* when every
rank completed it. The two step layouts do not collide: a single-node key has two segments
below ``steps/``, a rank key three, and a step name never holds a '/'.

A bucket written by an older mtcfs may also hold ``sweeps/*.json``, the sweep journal that
the job's sweep gate in etcd replaced (:mod:`mtcfs.tiers.backup.gate`): nothing reads them
any more, and they may be deleted.
"""

from __future__ import annotations

import re

CHUNKS_PREFIX = "chunks/"
STEPS_PREFIX = "steps/"
MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
RANK_DIR_PREFIX = "rank-"

_HASH_RE = re.compile(r"[0-9a-f]{64}")  # fullmatch: "$" would let a trailing newline in
_CHUNK_KEY_RE = re.compile(r"^chunks/([0-9a-f]{2})/([0-9a-f]{64})\.zst$")
_RANK_DIR_RE = re.compile(r"^rank-(0|[1-9][0-9]{0,8})$")


def check_hash(h: str) -> str:
    """Return ``h`` if it is a 64-character lowercase hex blake3 digest.

    Raises:
        ValueError: otherwise (this also keeps odd strings out of object names).
    """
    if not isinstance(h, str) or not _HASH_RE.fullmatch(h):
        raise ValueError(f"not a blake3 hex digest: {h!r}")
    return h


def check_step(step: str) -> str:
    """Return ``step`` if it can be one path segment of an object name.

    Raises:
        ValueError: if it is empty, '.', '..', or has '/' or a control character.
    """
    if (not isinstance(step, str) or step in ("", ".", "..") or "/" in step
            or any(ord(c) < 0x20 or c == "\x7f" for c in step)):
        raise ValueError(f"bad step name {step!r}")
    return step


def chunk_key(h: str) -> str:
    """Object name of the chunk with hex digest ``h``. Raises ValueError on a bad digest."""
    check_hash(h)
    return f"{CHUNKS_PREFIX}{h[:2]}/{h}.zst"


def parse_chunk_key(key: str) -> str | None:
    """Return the digest a chunk object name stands for, or None if ``key`` is not one."""
    m = _CHUNK_KEY_RE.match(key)
    if m is None or m.group(2)[:2] != m.group(1):
        return None
    return m.group(2)


def check_rank(rank: int | None) -> int | None:
    """Return ``rank`` if it is None (a single-node store) or an int in 0..999,999,999.

    Raises:
        ValueError: otherwise (bools are refused too).
    """
    if rank is None:
        return None
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 10**9:
        raise ValueError(f"bad rank {rank!r}: expected None or an int in 0..999999999")
    return rank


def step_dir(step: str, rank: int | None = None) -> str:
    """Folder (ending in '/') holding the manifest and marker of ``step`` for ``rank``.

    ``steps/<step>/`` for rank None, ``steps/<step>/rank-<r>/`` otherwise.

    Raises:
        ValueError: on a bad step name or rank.
    """
    check_step(step)
    if check_rank(rank) is None:
        return f"{STEPS_PREFIX}{step}/"
    return f"{STEPS_PREFIX}{step}/{RANK_DIR_PREFIX}{rank}/"


def manifest_key(step: str, rank: int | None = None) -> str:
    """Object name of a step's manifest (of ``rank``; None: the single-node layout).

    Raises ValueError on a bad step name or rank."""
    return step_dir(step, rank) + MANIFEST


def complete_key(step: str, rank: int | None = None) -> str:
    """Object name of a step's completion marker (of ``rank``; None: single-node layout).

    Raises ValueError on a bad step name or rank."""
    return step_dir(step, rank) + COMPLETE


def parse_step_key(key: str) -> tuple[str, str] | None:
    """Split ``steps/<step>/<name>`` into ``(step, name)``; None for anything else."""
    if not key.startswith(STEPS_PREFIX):
        return None
    parts = key[len(STEPS_PREFIX):].split("/")
    if len(parts) != 2 or not parts[0] or not parts[1]:
        return None
    return parts[0], parts[1]


def parse_rank_step_key(key: str) -> tuple[str, int, str] | None:
    """Split ``steps/<step>/rank-<r>/<name>`` into ``(step, r, name)``; None for anything
    else (single-node keys included)."""
    if not key.startswith(STEPS_PREFIX):
        return None
    parts = key[len(STEPS_PREFIX):].split("/")
    if len(parts) != 3 or not parts[0] or not parts[2]:
        return None
    m = _RANK_DIR_RE.match(parts[1])
    if m is None:
        return None
    return parts[0], int(m.group(1)), parts[2]
