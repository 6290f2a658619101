"""Strict decoders of the records the scope=job namespace log reads back from etcd.

Any member of the job (or anyone, with ``insecure``) can write any key under the job's
prefix, so every record is decoded by one function per kind here before the log acts on
it; each raises :class:`mtcfs.base.untrusted.BadRecord` (a ValueError) and nothing else
for a record it does not accept:

==================  ======================  ==============================================
key                 decoder                 what it accepts
==================  ======================  ==============================================
ns/op/<rank>/<id>   :func:`decode_op`       an op's wire form (mtcfs/base/ns_ops.py)
ns/base             :func:`decode_base`     ``{"incarnation", "rev", "parts", "tag"}``
ns/snap/<tag>/<i>   :func:`snap_part_index`  the part number ``i`` of a snapshot
(parts joined)      :func:`decode_snapshot`  the namespace (JobNamespace.snapshot's form)
ns/seeders/<rank>   :func:`decode_candidate`  ``{"rank", "newest_step", "entries"}``
ns/last             :func:`check_last`      the key of an op under ``ns/op/``
==================  ======================  ==============================================
"""

from __future__ import annotations

import re
import stat
from typing import Any

from mtcfs.base.limits import MAX_NODES
from mtcfs.base.ns_ops import INT64_MIN, MAX_NAME_BYTES, UINT32_MAX, NsOp, from_wire
from mtcfs.base.untrusted import (
    INT64_MAX, BadRecord, field_int, field_str, json_object, json_type,
)

#: A snapshot tag (``seed-<rank>-<inc>`` or ``<rev>-<rank>``): part of a key path.
_TAG = re.compile(r"[A-Za-z0-9._-]{1,128}")
#: Most parts a base may name (1 MiB each: a 64 GiB snapshot).
MAX_PARTS = 1 << 16
#: Kinds of a snapshot entry (mtcfs/core/model.py).
KINDS = ("file", "dir", "symlink", "special")
ROOT_INO = 1
#: The S_IFMT bits each kind's mode has (as every node makes them: core/entries.py).
_KIND_FORMATS = {"file": (stat.S_IFREG,), "dir": (stat.S_IFDIR,), "symlink": (stat.S_IFLNK,),
                 "special": (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK)}


def decode_op(body: bytes) -> NsOp:
    """The op stored at ``ns/op/<rank>/<id>``, with its envelope: every op a node submits
    names its rank (``0..MAX_NODES-1``: its chunks are fetched from there) and its id.

    Raises:
        BadRecord: not a JSON object, not a valid op (ns_ops.MalformedOp, a BadRecord), or
            without a rank of a job or an id.
    """
    op = from_wire(json_object(body))
    if op.rank is None or not 0 <= op.rank < MAX_NODES or op.id is None:
        raise BadRecord(f"namespace op {op.KIND!r}: its envelope names no rank in "
                        f"0..{MAX_NODES - 1} and id ({op.rank!r:.30}, {op.id!r:.60})")
    return op


def decode_base(body: bytes, mod_revision: int | None = None) -> dict[str, Any]:
    """``ns/base``: ``{"incarnation": int >= 1, "rev": int >= 0, "parts": 1..MAX_PARTS,
    "tag": str}`` (other keys, such as ``seeded_by``, are dropped). ``mod_revision``: the
    revision the base was written at, when known: its ``rev`` (the last op it holds) is
    below it (a node installing a base from the future would skip every op up to it).

    Raises:
        BadRecord: not that.
    """
    d = json_object(body)
    rev_hi = INT64_MAX if mod_revision is None else max(0, mod_revision - 1)
    out: dict[str, Any] = {"incarnation": field_int(d, "incarnation", 1),
                           "rev": field_int(d, "rev", 0, rev_hi),
                           "parts": field_int(d, "parts", 1, MAX_PARTS)}
    tag = out["tag"] = field_str(d, "tag", 128)
    if not _TAG.fullmatch(tag):
        raise BadRecord(f"tag {tag[:40]!r} is not letters, digits, '.', '_' or '-'")
    return out


def snap_part_index(key: bytes, prefix: bytes, parts: int) -> int:
    """The part number of snapshot part ``key`` (``prefix`` + decimal, below ``parts``).

    Raises:
        BadRecord: the key's last component is not such a number.
    """
    tail = key[len(prefix):]
    if not key.startswith(prefix) or not tail.isdigit() or len(tail) > 6 or \
            (len(tail) > 1 and tail.startswith(b"0")) or int(tail) >= parts:
        raise BadRecord(f"{tail[:40]!r} is not a part number below {parts}")
    return int(tail)


def decode_candidate(body: bytes, nodes: int = MAX_NODES) -> dict[str, int]:
    """``ns/seeders/<rank>``: ``{"rank" (below ``nodes``), "newest_step" (-1: none),
    "entries"}``.

    Raises:
        BadRecord: not that.
    """
    d = json_object(body)
    return {"rank": field_int(d, "rank", 0, max(1, nodes) - 1),
            "newest_step": field_int(d, "newest_step", -1),
            "entries": field_int(d, "entries")}


def check_last(value: bytes, op_prefix: bytes) -> None:
    """``ns/last``'s value is the key of an op: ``op_prefix`` + ``<rank>/<id>``.

    Raises:
        BadRecord: it is not.
    """
    tail = value[len(op_prefix):]
    if not value.startswith(op_prefix) or tail.count(b"/") != 1 or len(tail) > 300:
        raise BadRecord(f"{value[:80]!r} is not the key of an op under "
                        f"{op_prefix.decode(errors='replace')}")


def _obj(v: Any, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise BadRecord(f"{what} is a JSON {json_type(v)}, not an object")
    return v


def _list(d: dict[str, Any], key: str) -> list[Any]:
    v = d.get(key)
    if not isinstance(v, list):
        raise BadRecord(f"{key} is a JSON {json_type(v)}, not an array")
    return v


def _name(d: dict[str, Any], key: str, what: str, empty: bool = False,
          entry: bool = True) -> str:
    """``d[key]``: a directory entry's name (``entry``: no ``/``, not ``.`` or ``..``, as
    every name a node makes; core/inodes.py check_name), or a symlink's target."""
    v = field_str(d, key, MAX_NAME_BYTES)
    try:
        b = v.encode(errors="surrogateescape")
    except UnicodeEncodeError:
        raise BadRecord(f"{what}: {key} is not a file name") from None
    if len(b) > MAX_NAME_BYTES or b"\x00" in b or (not b and not empty):
        raise BadRecord(f"{what}: {key} is not a file name of 1..{MAX_NAME_BYTES} bytes")
    if entry and (b"/" in b or b in (b".", b"..")):
        raise BadRecord(f"{what}: {key} {v[:40]!r} is not a file name (a '/', '.' or '..')")
    return v


def _version(v: Any, what: str) -> dict[str, Any]:
    d = _obj(v, f"{what}: version")
    chunks = _list(d, "chunks")
    for c in chunks:
        if not isinstance(c, str) or not 0 < len(c) <= 128 or not c.isascii() \
                or not c.isalnum():
            raise BadRecord(f"{what}: version.chunks holds {c!r:.60}, not a digest")
    return {"size": field_int(d, "size"), "chunk_size": field_int(d, "chunk_size", 1),
            "chunks": list(chunks), "blake3": field_str(d, "blake3", 256),
            "rank": field_int(d, "rank", 0, MAX_NODES - 1)}


def decode_snapshot(body: bytes) -> dict[str, Any]:
    """A base's snapshot (its parts joined): ``{"next_ino", "entries": [...], "steps":
    [...]}`` as ``JobNamespace.snapshot`` writes it, checked so that installing it cannot
    fail half way: every entry's parent is the root or an earlier directory entry, no
    (parent, name) twice, a directory's number once, another name of an inode of the same
    kind, every number below ``next_ino``, each mode of its entry's kind (its S_IFMT bits),
    each version's rank one of a job's; names are legal file names (never with a
    ``/``, nor ``.`` or ``..``: no node could list or remove such an entry); integers in
    range. A step that is not a directory at the root under its name is left out.
    Returns a new dict of only the checked fields.

    Raises:
        BadRecord: anything else.
    """
    d = json_object(body, max_bytes=MAX_PARTS * (1 << 20))
    next_ino = field_int(d, "next_ino", 2)
    entries: list[dict[str, Any]] = []
    kind_of: dict[int, str] = {ROOT_INO: "dir"}
    names: set[tuple[int, str]] = set()
    for i, raw in enumerate(_list(d, "entries")):
        what = f"entry {i}"
        e = _obj(raw, what)
        ino = field_int(e, "ino", 2, next_ino - 1)
        parent = field_int(e, "parent", 1)
        kind = field_str(e, "kind", 16)
        if kind not in KINDS:
            raise BadRecord(f"{what}: kind {kind!r} is not one of {', '.join(KINDS)}")
        if kind_of.get(parent) != "dir":
            raise BadRecord(f"{what}: parent {parent} is not a directory before it")
        name = _name(e, "name", what)
        if (parent, name) in names:
            raise BadRecord(f"{what}: a second entry {name[:40]!r} in directory {parent}")
        names.add((parent, name))
        if ino in kind_of and (kind == "dir" or kind_of[ino] != kind):
            raise BadRecord(f"{what}: inode {ino} named twice as a {kind_of[ino]} and a {kind}")
        kind_of[ino] = kind
        mode = field_int(e, "mode", 0, 0o177777)
        if stat.S_IFMT(mode) not in _KIND_FORMATS[kind]:
            raise BadRecord(f"{what}: a {kind} with mode {mode:o} (another kind's)")
        out = {"ino": ino, "parent": parent, "name": name, "kind": kind, "mode": mode,
               "uid": field_int(e, "uid", 0, UINT32_MAX),
               "gid": field_int(e, "gid", 0, UINT32_MAX),
               "mtime_ns": field_int(e, "mtime_ns", INT64_MIN, INT64_MAX),
               "target": _name(e, "target", what, empty=True, entry=False)}
        if "rdev" in e:
            out["rdev"] = field_int(e, "rdev")
        if e.get("version") is not None:
            if kind != "file":
                raise BadRecord(f"{what}: a {kind} with a version")
            out["version"] = _version(e["version"], what)
        entries.append(out)
    # a step is a directory at the root under its name (core/step_registry.py: a record
    # goes when its directory is removed or renamed); one that is not is left out: the
    # step rules would look up an inode that is not there
    root_dirs = {e["name"]: e["ino"] for e in entries
                 if e["parent"] == ROOT_INO and e["kind"] == "dir"}
    steps = []
    for i, raw in enumerate(_list(d, "steps")):
        s = _obj(raw, f"step {i}")
        step = {"name": _name(s, "name", f"step {i}"),
                "number": field_int(s, "number", -1),
                "ino": field_int(s, "ino", 0),
                "source": field_str(s, "source", 64),
                "committed_ns": field_int(s, "committed_ns", INT64_MIN)}
        if root_dirs.get(step["name"]) == step["ino"]:
            steps.append(step)
    return {"next_ino": next_ino, "entries": entries, "steps": steps}
