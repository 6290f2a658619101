"""Manifests: the recorded shape of sealed file versions and of checkpoints (steps).

A :class:`FileManifest` describes one sealed version of one file: its path relative to the
job root, size, mode, mtime and chunk list. A :class:`StepManifest` is the set of entries
(files, directories, symlinks, special files) below one checkpoint directory at the moment it was taken;
it is what the backup tier stores per step and what a restore rebuilds the namespace from.

Both serialise to plain JSON so that a human can read a backup bucket with ``gsutil cat``.
"""

from __future__ import annotations

import json
import re
import stat
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 1

#: Bounds of a manifest's numbers (an int64, as on the wire and in SQLite): step numbers,
#: times, sizes, and the sum of a step's file sizes. A manifest can come from a peer or a
#: bucket; :meth:`StepManifest.from_bytes` refuses one that leaves them.
INT64_MAX = 2 ** 63 - 1
INT64_MIN = -(2 ** 63)
#: Largest ``chunk_size`` an entry may name, bytes (mtcfs.base.chunking.MAX_CHUNK_SIZE).
MAX_ENTRY_CHUNK_SIZE = 256 * 1024 * 1024
#: Longest name of one path component, bytes (Linux NAME_MAX).
NAME_MAX = 255

_HEX64 = re.compile(r"[0-9a-f]{64}")

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
        """The entry a manifest's JSON object describes, validated.

        Raises:
            ManifestError: not an object, a field missing or of the wrong JSON type, a
                number out of its bounds, or an entry :meth:`validate` refuses.
        """
        if not isinstance(d, dict):
            raise ManifestError(f"bad manifest entry: a JSON {_json_type(d)}, not an object")
        chunks = d.get("chunks", [])
        if not isinstance(chunks, list):
            raise ManifestError(f"bad manifest entry: chunks of {d.get('path')!r} are a JSON "
                                f"{_json_type(chunks)}, not an array")
        e = cls(
            path=_str(d, "path"), kind=_str(d, "kind"), mode=_int(d, "mode", 0, 0o7777),
            mtime_ns=_int(d, "mtime_ns", INT64_MIN, INT64_MAX),
            size=_int(d, "size", 0, INT64_MAX, 0),
            chunk_size=_int(d, "chunk_size", 0, MAX_ENTRY_CHUNK_SIZE, 0),
            chunks=tuple(chunks), blake3=_str(d, "blake3", ""), target=_str(d, "target", ""),
            node=_str(d, "node", ""), rdev=_int(d, "rdev", 0, 2 ** 64 - 1, 0),
        )
        e.validate()
        return e

    def validate(self) -> None:
        """Raise :class:`ManifestError` if the entry could escape the job or is inconsistent:
        a path that is empty, absolute, has an empty, '.' or '..' component, a NUL or a
        component above :data:`NAME_MAX` bytes; an unknown kind; a file whose chunk list does
        not cover its size or whose digests are not lowercase hex blake3."""
        parts = self.path.split("/")
        if not self.path or self.path.startswith("/") or "\0" in self.path \
                or any(p in ("", ".", "..") for p in parts):
            raise ManifestError(f"bad path in manifest: {self.path!r}")
        if any(len(p.encode(errors="surrogateescape")) > NAME_MAX for p in parts):
            raise ManifestError(f"a name in path {self.path[:64]!r}... is longer than "
                                f"{NAME_MAX} bytes")
        if self.kind not in ("file", "dir", "symlink", "special"):
            raise ManifestError(f"bad entry kind {self.kind!r} for {self.path!r}")
        if self.kind == "special" and self.node not in SPECIAL_MODES:
            raise ManifestError(f"bad special file type {self.node!r} for {self.path!r}")
        if self.kind == "file":
            if self.size < 0 or self.chunk_size <= 0 and self.size > 0:
                raise ManifestError(f"bad size/chunk_size for {self.path!r}")
            if self.size > 0 and len(self.chunks) != -(-self.size // self.chunk_size):
                raise ManifestError(f"chunk list of {self.path!r} does not cover its size")
            if not _all_hex64(self.chunks):
                raise ManifestError(f"bad chunk digest in {self.path!r}")
            if self.blake3 and not _HEX64.fullmatch(self.blake3):
                raise ManifestError(f"bad blake3 digest of {self.path!r}")


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
        """Parse and validate :meth:`to_bytes`'s output (which may come from a peer or a
        bucket: anything).

        Raises:
            ManifestError: not JSON, nested too deeply, not a manifest object, a field
                missing or of the wrong JSON type, ``step_number`` or ``created_ns`` outside
                0..2^63-1, file sizes summing above that, an entry outside the step, or an
                entry :meth:`Entry.validate` refuses.
        """
        try:
            d = json.loads(raw, parse_constant=_no_constant)
        except RecursionError:
            raise ManifestError("bad step manifest: JSON nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError, bad UTF-8, an int of > 4300 digits
            raise ManifestError(f"bad step manifest: {exc}") from None
        if not isinstance(d, dict):
            raise ManifestError(f"bad step manifest: a JSON {_json_type(d)}, not an object")
        if d.get("format") != FORMAT_VERSION:
            raise ManifestError(f"unsupported manifest format {d.get('format')!r}")
        entries = d.get("entries")
        if not isinstance(entries, list):
            raise ManifestError(f"bad step manifest: entries is a JSON {_json_type(entries)}, "
                                "not an array")
        m = cls(job=_str(d, "job"), step=_str(d, "step"),
                step_number=_int(d, "step_number", 0, INT64_MAX),
                created_ns=_int(d, "created_ns", 0, INT64_MAX),
                rank=_int(d, "rank", 0, INT64_MAX, 0),
                entries=[Entry.from_json(e) for e in entries])
        for e in m.entries:
            if e.path != m.step and not e.path.startswith(m.step + "/"):
                raise ManifestError(f"entry {e.path!r} is outside step {m.step!r}")
        if m.total_bytes > INT64_MAX:
            raise ManifestError(f"the files of step {m.step!r} add up to more than "
                                f"{INT64_MAX} bytes")
        return m


def _all_hex64(digests: tuple[str, ...]) -> bool:
    """Whether every item is a string of 64 lowercase hex digits (in bulk: a manifest may
    list a million)."""
    try:
        joined = "".join(digests).encode("ascii")
    except (TypeError, UnicodeEncodeError):
        return False
    return not joined.translate(None, b"0123456789abcdef") and all(
        len(c) == 64 for c in digests)


_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
               float: "number with a fraction", type(None): "null"}


def _json_type(v: Any) -> str:
    """What a value from json.loads was in the JSON text."""
    return _JSON_TYPES.get(type(v), type(v).__name__)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


_MISSING = object()


def _field(d: dict[str, Any], key: str, default: Any) -> Any:
    v = d.get(key, default)
    if v is _MISSING:
        raise ManifestError(f"bad manifest: {key} is missing")
    return v


def _str(d: dict[str, Any], key: str, default: Any = _MISSING) -> str:
    """``d[key]`` if it is a string (``default`` when absent, if given)."""
    v = _field(d, key, default)
    if not isinstance(v, str):
        raise ManifestError(f"bad manifest: {key} is a JSON {_json_type(v)}, not a string")
    return v


def _int(d: dict[str, Any], key: str, lo: int, hi: int, default: Any = _MISSING) -> int:
    """``d[key]`` if it is an integer in ``lo..hi`` (``default`` when absent, if given)."""
    v = _field(d, key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ManifestError(f"bad manifest: {key} is a JSON {_json_type(v)}, not an integer")
    if not lo <= v <= hi:
        digits = len(str(abs(v)))
        shown = v if digits <= 40 else f"(a {digits}-digit number)"
        raise ManifestError(f"bad manifest: {key} {shown} is outside {lo}..{hi}")
    return v
