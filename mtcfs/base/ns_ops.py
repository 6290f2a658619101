"""Namespace ops: every change of the namespace, as a typed, frozen value.

The FUSE-facing methods of the core (mkdir, create, rename, ...) build one op and hand it
to the mount's namespace log (:mod:`mtcfs.core.ns_log`); applying the op
(``JobNamespace.apply_op``, core/jobns.py) is the only way the namespace changes, in both scopes.

In scope=job the ops travel through etcd as small JSON objects (the *wire* form):
:meth:`NsOp.to_wire` gives exactly the dict nodes have always stored there, and
:func:`from_wire` reads one back (``{"op": <kind>, <fields>..., "rank", "id"}``). Names and
symlink targets are ``bytes`` here and surrogate-escaped ``str`` on the wire; a publish's
inline ``data`` is ``bytes`` here and base64 on the wire; chunk lists are tuples here and
lists on the wire. Keys the reader does not know are ignored (a newer node's addition).

==========  ==========  ==================================================================
kind        class       fields (``None``: unchanged / absent)
==========  ==========  ==================================================================
mkdir       Mkdir       parent, name, mode, uid, gid -> {"ino"}
create      Create      parent, name, mode, uid, gid, excl -> {"ino", "existed"}
symlink     Symlink     parent, name, target, uid, gid -> {"ino"}
mknod       Mknod       parent, name, mode (with the S_IFMT bits), rdev, uid, gid -> {"ino"}
link        Link        ino, new_parent, new_name (a hard link; never of a directory)
unlink      Unlink      parent, name
rmdir       Rmdir       parent, name
rename      Rename      parent, name, new_parent, new_name, flags
setattr     SetAttr     ino, mode, uid, gid, mtime_ns, atime_ns
publish     Publish     ino, vid (at the origin), size, chunk_size, chunks, blake3, mtime_ns,
                        data (files up to INLINE_BYTES), expect (a publication tried again)
noop        Noop        (none: changes nothing; kept for logs written before etcd ordered
                        them)
==========  ==========  ==================================================================

Every op also carries its envelope, set by the log that orders it: ``rank`` (the node
that submitted it; None until submitted) and ``id`` (the submitter's unique id; etcd's
create-if-absent key, None for ops that never leave the node).
"""

from __future__ import annotations

import base64
import binascii
import errno
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from mtcfs.base.errors import FsError
from mtcfs.base.untrusted import INT64_MAX, MAX_RECORD_BYTES, BadRecord, json_type

__all__ = [
    "OP_TYPES",
    "Create",
    "Link",
    "MalformedOp",
    "Mkdir",
    "Mknod",
    "Noop",
    "NsOp",
    "Publish",
    "Rename",
    "Rmdir",
    "SetAttr",
    "Symlink",
    "Unlink",
    "from_wire",
]


class MalformedOp(FsError, BadRecord):
    """A wire dict that is no valid op: not a dict, an unknown kind, a field missing, of
    the wrong type or out of its range. Its errno is EINVAL, the answer every node gives to
    such an op (the same everywhere, so it is a refusal, not a divergence); it is also a
    :class:`mtcfs.base.untrusted.BadRecord` (a ValueError), the error of every strict
    decoder of what is read back from etcd."""

    def __init__(self, message: str) -> None:
        FsError.__init__(self, errno.EINVAL, message)


#: Bounds of the wire's integer fields, inclusive (ints of the wire are int64 at most:
#: SQLite's INTEGER; a larger one would be refused at the commit on some node).
INT64_MIN = -(1 << 63)
UINT32_MAX = (1 << 32) - 1
#: Longest name or symlink target on the wire, in bytes once encoded (PATH_MAX: FUSE sends
#: no longer name; names over NAME_MAX are the namespace's to refuse, ENAMETOOLONG).
MAX_NAME_BYTES = 4096
#: Longest id, hash or ``expect`` string, and longest chunk digest, in characters.
MAX_TEXT = 256
MAX_DIGEST = 128
#: Largest inline ``data`` on the wire, base64 characters (a record is at most
#: untrusted.MAX_RECORD_BYTES in all).
MAX_DATA_B64 = MAX_RECORD_BYTES


# Wire codecs of a field: (to wire, from wire, optional: omitted from the wire when None).
# A decoder raises TypeError("<what the field must be>").
def _int_range(lo: int, hi: int, what: str = "an integer") -> Any:
    def decode(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(what)
        if not lo <= v <= hi:
            raise TypeError(f"{what} in {lo}..{hi}")
        return v
    return decode


_int_in = _int_range(0, INT64_MAX)


def _opt(decode: Any) -> Any:
    def opt(v: Any) -> Any:
        return None if v is None else decode(v)
    return opt


def _bool_in(v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError("true or false")
    return v


def _str_in(v: Any, max_len: int = MAX_TEXT) -> str:
    if not isinstance(v, str):
        raise TypeError("a string")
    if len(v) > max_len:
        raise TypeError(f"a string of at most {max_len} characters")
    return v


def _name_in(v: Any) -> bytes:
    if not isinstance(v, str):
        raise TypeError("a string")
    try:
        b = v.encode(errors="surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate no file name decodes to
        raise TypeError("a file name (surrogate-escaped bytes)") from None
    if len(b) > MAX_NAME_BYTES or b"\x00" in b:
        raise TypeError(f"a file name of at most {MAX_NAME_BYTES} bytes without NUL")
    return b


def _name_out(v: bytes) -> str:
    return v.decode(errors="surrogateescape")


def _chunks_in(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(d, str) for d in v):
        raise TypeError("a list of strings")
    for d in v:
        if not 0 < len(d) <= MAX_DIGEST or not d.isascii() or not d.isalnum():
            raise TypeError(f"a list of digests (letters and digits, at most {MAX_DIGEST})")
    return tuple(v)


def _b64_in(v: Any) -> bytes:
    try:
        return base64.b64decode(_str_in(v, MAX_DATA_B64), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise TypeError(f"base64 ({exc})") from None


def _same(v: Any) -> Any:
    return v


_CODECS: dict[str, tuple[Any, Any, bool]] = {
    "int": (_same, _int_in, False),
    "ino": (_same, _int_range(1, INT64_MAX), False),
    "chunk_size": (_same, _int_range(1, INT64_MAX), False),
    "mode": (_same, _int_range(0, 0o177777), False),
    "id32": (_same, _int_range(0, UINT32_MAX), False),
    "time": (_same, _int_range(INT64_MIN, INT64_MAX), False),
    "opt_mode": (_same, _opt(_int_range(0, 0o177777)), False),
    "opt_id32": (_same, _opt(_int_range(0, UINT32_MAX)), False),
    "opt_time": (_same, _opt(_int_range(INT64_MIN, INT64_MAX)), False),
    "bool": (_same, _bool_in, False),
    "str": (_same, _str_in, False),
    "name": (_name_out, _name_in, False),
    "chunks": (list, _chunks_in, False),
    "data": (lambda b: base64.b64encode(b).decode(), _b64_in, True),
    "omit_str": (_same, _str_in, True),
    "omit_int": (_same, _int_in, True),
}


@dataclass(frozen=True, kw_only=True)
class NsOp:
    """One namespace change. Subclasses name their ``KIND`` (the wire's ``"op"``) and the
    wire codec of each field in ``WIRE`` (field order there is the order on the wire)."""

    KIND: ClassVar[str] = ""
    WIRE: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: (envelope) the rank that submitted the op; set by the log
    rank: int | None = None
    #: (envelope) the submitter's id of the op (etcd's create-if-absent key); set by the log
    id: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """The op as stored in the job's log in etcd: ``{"op": KIND, fields..., "rank",
        "id"}``, JSON-able; envelope and optional fields that are None are left out."""
        out: dict[str, Any] = {"op": self.KIND}
        for name, codec in self.WIRE + (("rank", "omit_int"), ("id", "omit_str")):
            value = getattr(self, name)
            encode, _decode, optional = _CODECS[codec]
            if value is None and optional:
                continue
            out[name] = None if value is None else encode(value)
        return out

    @classmethod
    def _from_fields(cls, wire: dict[str, Any]) -> NsOp:
        kw: dict[str, Any] = {}
        for name, codec in cls.WIRE + (("rank", "omit_int"), ("id", "omit_str")):
            _encode, decode, optional = _CODECS[codec]
            if name not in wire:
                if optional:
                    continue
                raise MalformedOp(f"namespace op {cls.KIND!r} lacks field {name!r}")
            value = wire[name]
            if value is None and optional:
                continue
            try:
                kw[name] = decode(value)
            except TypeError as exc:
                raise MalformedOp(f"namespace op {cls.KIND!r}: field {name!r} must be "
                                  f"{exc}, not {value!r:.60}") from None
        return cls(**kw)


@dataclass(frozen=True, kw_only=True)
class Mkdir(NsOp):
    """A directory ``name`` in directory ``parent``. Result: ``{"ino"}``."""

    KIND = "mkdir"
    WIRE = (("parent", "ino"), ("name", "name"), ("mode", "mode"), ("uid", "id32"),
            ("gid", "id32"))
    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int


@dataclass(frozen=True, kw_only=True)
class Create(NsOp):
    """A regular file ``name`` in ``parent`` (``excl``: EEXIST when the name exists; else
    an existing file is the result). Result: ``{"ino", "existed"}``."""

    KIND = "create"
    WIRE = (("parent", "ino"), ("name", "name"), ("mode", "mode"), ("uid", "id32"),
            ("gid", "id32"), ("excl", "bool"))
    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int
    excl: bool


@dataclass(frozen=True, kw_only=True)
class Symlink(NsOp):
    """A symlink ``name`` -> ``target`` in ``parent``. Result: ``{"ino"}``."""

    KIND = "symlink"
    WIRE = (("parent", "ino"), ("name", "name"), ("target", "name"), ("uid", "id32"),
            ("gid", "id32"))
    parent: int
    name: bytes
    target: bytes
    uid: int
    gid: int


@dataclass(frozen=True, kw_only=True)
class Mknod(NsOp):
    """A FIFO, socket or device node (``mode`` with its S_IFMT bits; ``rdev`` 0 but for
    devices). Result: ``{"ino"}``."""

    KIND = "mknod"
    WIRE = (("parent", "ino"), ("name", "name"), ("mode", "mode"), ("rdev", "int"),
            ("uid", "id32"), ("gid", "id32"))
    parent: int
    name: bytes
    mode: int
    rdev: int
    uid: int
    gid: int


@dataclass(frozen=True, kw_only=True)
class Link(NsOp):
    """A hard link ``new_name`` in ``new_parent`` to inode ``ino`` (never a directory)."""

    KIND = "link"
    WIRE = (("ino", "ino"), ("new_parent", "ino"), ("new_name", "name"))
    ino: int
    new_parent: int
    new_name: bytes


@dataclass(frozen=True, kw_only=True)
class Unlink(NsOp):
    """Remove the non-directory ``name`` from ``parent``."""

    KIND = "unlink"
    WIRE = (("parent", "ino"), ("name", "name"))
    parent: int
    name: bytes


@dataclass(frozen=True, kw_only=True)
class Rmdir(NsOp):
    """Remove the empty directory ``name`` from ``parent``."""

    KIND = "rmdir"
    WIRE = (("parent", "ino"), ("name", "name"))
    parent: int
    name: bytes


@dataclass(frozen=True, kw_only=True)
class Rename(NsOp):
    """Move ``parent``/``name`` to ``new_parent``/``new_name``; ``flags``: RENAME_NOREPLACE
    (1) or 0 (anything else is refused with EINVAL when applied)."""

    KIND = "rename"
    WIRE = (("parent", "ino"), ("name", "name"), ("new_parent", "ino"), ("new_name", "name"),
            ("flags", "id32"))
    parent: int
    name: bytes
    new_parent: int
    new_name: bytes
    flags: int = 0


@dataclass(frozen=True, kw_only=True)
class SetAttr(NsOp):
    """Attributes of inode ``ino`` (still named, or the root); None: unchanged. Times in
    nanoseconds since the epoch."""

    KIND = "setattr"
    WIRE = (("ino", "ino"), ("mode", "opt_mode"), ("uid", "opt_id32"), ("gid", "opt_id32"),
            ("mtime_ns", "opt_time"), ("atime_ns", "opt_time"))
    ino: int
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    mtime_ns: int | None = None
    atime_ns: int | None = None

    def changes(self) -> bool:
        """Whether the op changes anything."""
        return any(v is not None for v in (self.mode, self.uid, self.gid, self.mtime_ns,
                                           self.atime_ns))


@dataclass(frozen=True, kw_only=True)
class Publish(NsOp):
    """scope=job: sealed version ``vid`` (its number at the origin rank) of file ``ino`` is
    the job's content of the file: ``size`` bytes in chunks of ``chunk_size`` with digests
    ``chunks``, whole-file hash ``blake3``; ``data``: the bytes themselves for a small file;
    ``expect``: the name of the job's version it may replace (a publication tried again;
    core/jobns.py: ``publication_id``, or an older mtcfs's whole-file blake3)."""

    KIND = "publish"
    WIRE = (("ino", "ino"), ("vid", "int"), ("size", "int"), ("chunk_size", "chunk_size"),
            ("chunks", "chunks"), ("blake3", "str"), ("mtime_ns", "time"), ("data", "data"),
            ("expect", "omit_str"))
    ino: int
    vid: int
    size: int
    chunk_size: int
    chunks: tuple[str, ...]
    blake3: str
    mtime_ns: int
    data: bytes | None = None
    expect: str | None = None


@dataclass(frozen=True, kw_only=True)
class Noop(NsOp):
    """Changes nothing."""

    KIND = "noop"


#: Every op class by its wire kind.
OP_TYPES: dict[str, type[NsOp]] = {
    c.KIND: c for c in (Mkdir, Create, Symlink, Mknod, Link, Unlink, Rmdir, Rename, SetAttr,
                        Publish, Noop)}


def from_wire(wire: Any) -> NsOp:
    """The op of a wire dict (as :meth:`NsOp.to_wire` makes, or as read from etcd): the
    one strict decoder of an op. Integers are int64 at most, inode numbers positive, modes
    16 bits, uids, gids and rename flags 32 bits; names and targets are strings of at most
    :data:`MAX_NAME_BYTES` bytes (surrogate-escaped) without NUL; ids and hashes at most
    :data:`MAX_TEXT` characters; chunk digests letters and digits.

    Raises:
        MalformedOp: (an FsError, EINVAL, and a BadRecord) ``wire`` is not a dict, names no
            known kind, or lacks a field or has one of the wrong type or out of range.
    """
    if not isinstance(wire, dict):
        raise MalformedOp(f"a namespace op is a JSON object, not {json_type(wire)}")
    kind = wire.get("op")
    cls = OP_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MalformedOp(f"unknown namespace op {kind!r:.60}")
    return cls._from_fields(wire)


def _check_wire_fields() -> None:
    for cls in OP_TYPES.values():
        names = {f.name for f in fields(cls)}
        for name, codec in cls.WIRE:
            assert name in names and codec in _CODECS, (cls.KIND, name)


_check_wire_fields()
