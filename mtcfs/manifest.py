"""Manifests: the recorded shape of sealed file versions and of checkpoints (steps).

A :class:`FileManifest` describes one sealed version of one file: its path relative to the
job root, size, mode, mtime and chunk list. A :class:`StepManifest` is the set of entries
(files, directories, symlinks, special files) below one checkpoint directory at the moment it was taken;
it is what the backup tier stores per step and what a restore rebuilds the namespace from.

Both serialise to plain JSON so that a human can read a backup bucket with ``gsutil cat``.
"""

from __future__ import annotations

import json
import stat
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 1

#: Special file types a manifest names (``Entry.node``) -> their S_IFMT bits.
SPECIAL_MODES = {"fifo": stat.S_IFIFO, "socket": stat.S_IFSOCK, "char": stat.S_IFCHR,
                 "block": stat.S_IFBLK}


def special_node(mode: int) -> str:
    """The ``Entry.node`` name of a special file's ``st_mode``."""
    fmt = stat.S_IFMT(mode)
    return next(k for k, v in SPECIAL_MODES.items() if v == fmt)


class ManifestError(ValueError):
    """A manifest is malformed (bad JSON, missing field, wrong format version)."""


@dataclass(frozen=True)
class Entry:
    """One namespace entry below a step directory.

    Attributes:
        path: path relative to the job root, '/'-separated, never absolute, no '..'.
        kind: "file", "dir", "symlink" or "special" (a FIFO, socket or device node:
            metadata only, no data).
        mode: permission bits (st_mode & 0o7777).
        mtime_ns: modification time in nanoseconds since the epoch.
        size: file size in bytes (0 for dirs; target length for symlinks).
        chunk_size: chunk size in bytes the chunk list was cut with (files only).
        chunks: hex blake3 digests, in file order (files only).
        blake3: hex blake3 digest of the whole file (files only).
        target: symlink target (symlinks only).
        node: the special file's type, one of :data:`SPECIAL_MODES` (special only).
        rdev: the device number of a "char" or "block" node (special only).

    ``node`` and ``rdev`` are written only for special entries, so a manifest without
    special files is the same JSON as before they existed.
    """

    path: str
    kind: str
    mode: int
    mtime_ns: int
    size: int = 0
    chunk_size: int = 0
    chunks: tuple[str, ...] = ()
    blake3: str = ""
    target: str = ""
    node: str = ""
    rdev: int = 0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["chunks"] = list(self.chunks)
        if self.kind != "special":
            del d["node"], d["rdev"]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Entry":
        try:
            e = cls(
                path=str(d["path"]), kind=str(d["kind"]), mode=int(d["mode"]),
                mtime_ns=int(d["mtime_ns"]), size=int(d.get("size", 0)),
                chunk_size=int(d.get("chunk_size", 0)),
                chunks=tuple(str(c) for c in d.get("chunks", ())),
                blake3=str(d.get("blake3", "")), target=str(d.get("target", "")),
                node=str(d.get("node", "")), rdev=int(d.get("rdev", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"bad manifest entry {d!r}: {exc}") from exc
        e.validate()
        return e

    def validate(self) -> None:
        """Raise :class:`ManifestError` if the entry could escape the job or is inconsistent."""
        parts = self.path.split("/")
        if not self.path or self.path.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ManifestError(f"bad path in manifest: {self.path!r}")
        if self.kind not in ("file", "dir", "symlink", "special"):
            raise ManifestError(f"bad entry kind {self.kind!r} for {self.path!r}")
        if self.kind == "special" and self.node not in SPECIAL_MODES:
            raise ManifestError(f"bad special file type {self.node!r} for {self.path!r}")
        if self.kind == "file":
            if self.size < 0 or self.chunk_size <= 0 and self.size > 0:
                raise ManifestError(f"bad size/chunk_size for {self.path!r}")
            if self.size > 0 and len(self.chunks) != -(-self.size // self.chunk_size):
                raise ManifestError(f"chunk list of {self.path!r} does not cover its size")
            if any(len(c) != 64 for c in self.chunks):
                raise ManifestError(f"bad chunk digest in {self.path!r}")


@dataclass
class StepManifest:
    """All entries of one checkpoint directory (step), as backed up.

    Attributes:
        job: job name (the mount source).
        step: the step directory's name at the job root (e.g. "100", "step_100").
        step_number: the integer step parsed from the name.
        created_ns: when the manifest was taken, ns since the epoch.
        entries: the step directory itself first, then everything below it, parents before
            children.
        rank: the rank that wrote it (0 on a single node).
    """

    job: str
    step: str
    step_number: int
    created_ns: int
    entries: list[Entry] = field(default_factory=list)
    rank: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries if e.kind == "file")

    def chunk_set(self) -> set[str]:
        return {c for e in self.entries if e.kind == "file" for c in e.chunks}

    def to_bytes(self) -> bytes:
        return json.dumps({
            "format": FORMAT_VERSION, "job": self.job, "step": self.step,
            "step_number": self.step_number, "created_ns": self.created_ns, "rank": self.rank,
            "entries": [e.to_json() for e in self.entries],
        }, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "StepManifest":
        try:
            d = json.loads(raw)
            if d.get("format") != FORMAT_VERSION:
                raise ManifestError(f"unsupported manifest format {d.get('format')!r}")
            m = cls(job=str(d["job"]), step=str(d["step"]), step_number=int(d["step_number"]),
                    created_ns=int(d["created_ns"]), rank=int(d.get("rank", 0)),
                    entries=[Entry.from_json(e) for e in d["entries"]])
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            if isinstance(exc, ManifestError):
                raise
            raise ManifestError(f"bad step manifest: {exc}") from exc
        for e in m.entries:
            if e.path != m.step and not e.path.startswith(m.step + "/"):
                raise ManifestError(f"entry {e.path!r} is outside step {m.step!r}")
        return m
