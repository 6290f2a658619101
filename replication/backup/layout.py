"""Object names of the backup layout, in one place.

Below the backend root::

    chunks/<h[0:2]>/<h>.zst       one chunk, zstd-compressed, named by the blake3 of its
                                  uncompressed bytes (the 2-character fan-out keeps file-system
                                  directories small and spreads GCS keys)
    steps/<step>/manifest.json    StepManifest.to_bytes() of one checkpoint
    steps/<step>/COMPLETE         written last: the step is restorable (small JSON summary)
"""

from __future__ import annotations

import re

CHUNKS_PREFIX = "chunks/"
STEPS_PREFIX = "steps/"
MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"

_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_CHUNK_KEY_RE = re.compile(r"^chunks/([0-9a-f]{2})/([0-9a-f]{64})\.zst$")


def check_hash(h: str) -> str:
    """Return ``h`` if it is a 64-character lowercase hex blake3 digest.

    Raises:
        ValueError: otherwise (this also keeps odd strings out of object names).
    """
    if not isinstance(h, str) or not _HASH_RE.match(h):
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


def manifest_key(step: str) -> str:
    """Object name of a step's manifest. Raises ValueError on a bad step name."""
    return f"{STEPS_PREFIX}{check_step(step)}/{MANIFEST}"


def complete_key(step: str) -> str:
    """Object name of a step's completion marker. Raises ValueError on a bad step name."""
    return f"{STEPS_PREFIX}{check_step(step)}/{COMPLETE}"


def parse_step_key(key: str) -> tuple[str, str] | None:
    """Split ``steps/<step>/<name>`` into ``(step, name)``; None for anything else."""
    if not key.startswith(STEPS_PREFIX):
        return None
    parts = key[len(STEPS_PREFIX):].split("/")
    if len(parts) != 2 or not parts[0] or not parts[1]:
        return None
    return parts[0], parts[1]
