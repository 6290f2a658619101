"""Fuzz and unit tests of the strict decoders of the scope=job namespace log's records in
etcd (issue 39): ops (mtcfs/base/ns_ops.py ``from_wire``), the base, its snapshot, the
seeding candidates, ``ns/last`` and the snapshot part keys (mtcfs/tiers/namespace/records.py).

For any input, each decoder returns a valid record or raises BadRecord (a ValueError) with a
one-line message: never another exception (TypeError, KeyError, UnicodeEncodeError,
OverflowError, RecursionError...), never a value outside the documented bounds. Valid wire
forms round-trip. Every node runs the same decoder on the same bytes, so a record refused
on one node is refused on all (docs/consistency.md, "A record no node wrote").

Short form (the test suite): a few hundred inputs per decoder, derandomized. Long form:
``make fuzz`` (``MTCFS_FUZZ_EXAMPLES=20000``; docs/fuzzing.md).
"""

from __future__ import annotations

import errno
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtcfs.base.errors import FsError
from mtcfs.base.limits import MAX_NODES
from mtcfs.base.ns_ops import (
    INT64_MIN, MAX_NAME_BYTES, OP_TYPES, UINT32_MAX, Create, MalformedOp, Mkdir, Noop, NsOp,
    Publish, Rename, SetAttr, Symlink, from_wire,
)
from mtcfs.base.untrusted import INT64_MAX, BadRecord
from mtcfs.tiers.namespace import records
from support.fuzzing import decoded_or_bad, fuzz, one_line


# -- strategies -----------------------------------------------------------------------------

ODD_INTS = st.sampled_from([0, 1, -1, 2, 0o177777, 0o200000, UINT32_MAX, UINT32_MAX + 1,
                            INT64_MAX, INT64_MAX + 1, INT64_MIN, INT64_MIN - 1, 10**30,
                            -(10**30)])
ODD_STRS = st.sampled_from(["", "x", ".", "..", "a/b", "\0", "a\0b", "\ud800", "\udcff",
                            "\udcff.bin", "../../etc", "é", "x" * 255, "x" * 256,
                            "x" * MAX_NAME_BYTES, "x" * (MAX_NAME_BYTES + 1), "YWJj", "a",
                            "==", "0" * 64, "g" * 64])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), ODD_INTS,
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
                    ODD_STRS)
JSON = st.recursive(SCALARS, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=12)
#: JSON text with what json.dumps never writes: NaN, Infinity, huge numbers, deep nesting.
ODD_TEXT = st.sampled_from([b"", b"null", b"NaN", b"Infinity", b"-Infinity", b"1e400",
                            b'{"op":"noop","rank":1e400}', b"[" * 5000 + b"]" * 5000,
                            b'{"a":' * 3000 + b"1" + b"}" * 3000, b"\xff\xfe", b"9" * 5000,
                            b'{"op":"mkdir"}', b'"\\ud800"'])


def wire_dicts() -> st.SearchStrategy[dict]:
    """Op-shaped dicts: a known kind (or not) with its fields, each valid or odd."""
    field_names = sorted({name for c in OP_TYPES.values() for name, _ in c.WIRE}
                         | {"rank", "id"})
    kinds = st.one_of(st.sampled_from(sorted(OP_TYPES)), SCALARS)

    @st.composite
    def build(draw) -> dict:
        kind = draw(kinds)
        cls = OP_TYPES.get(kind) if isinstance(kind, str) else None
        names = [n for n, _ in cls.WIRE] + ["rank", "id"] if cls else field_names
        d: dict = {"op": kind}
        for n in names:
            if draw(st.integers(0, 9)) == 0:
                continue  # left out
            d[n] = draw(st.one_of(ODD_INTS, ODD_STRS, SCALARS, JSON,
                                  st.lists(ODD_STRS, max_size=3)))
        return d
    return build()


NAMES = st.binary(min_size=1, max_size=300).filter(lambda b: b"\0" not in b)
UINT32 = st.integers(0, UINT32_MAX)
INO = st.integers(1, INT64_MAX)
TIME = st.integers(INT64_MIN, INT64_MAX)
DIGEST = st.text("0123456789abcdef", min_size=64, max_size=64)
ENVELOPE = {"rank": st.integers(0, MAX_NODES - 1), "id": st.text(max_size=40)}
VALID_OPS = st.one_of(
    st.builds(Mkdir, parent=INO, name=NAMES, mode=st.integers(0, 0o177777), uid=UINT32,
              gid=UINT32, **ENVELOPE),
    st.builds(Create, parent=INO, name=NAMES, mode=st.integers(0, 0o177777), uid=UINT32,
              gid=UINT32, excl=st.booleans(), **ENVELOPE),
    st.builds(Symlink, parent=INO, name=NAMES, target=NAMES, uid=UINT32, gid=UINT32,
              **ENVELOPE),
    st.builds(Rename, parent=INO, name=NAMES, new_parent=INO, new_name=NAMES, flags=UINT32,
              **ENVELOPE),
    st.builds(SetAttr, ino=INO, mode=st.one_of(st.none(), st.integers(0, 0o7777)),
              uid=st.one_of(st.none(), UINT32), mtime_ns=st.one_of(st.none(), TIME),
              **ENVELOPE),
    st.builds(Publish, ino=INO, vid=st.integers(0, INT64_MAX), size=st.integers(0, 1 << 40),
              chunk_size=st.integers(1, 1 << 26), chunks=st.lists(DIGEST, max_size=4).map(tuple),
              blake3=DIGEST, mtime_ns=TIME, data=st.one_of(st.none(), st.binary(max_size=64)),
              expect=st.one_of(st.none(), st.text(max_size=20)), **ENVELOPE),
    st.builds(Noop, **ENVELOPE),
)


def check_op(op: NsOp) -> None:
    """What a decoded op may hold (the bounds from_wire promises)."""
    w = op.to_wire()
    assert from_wire(json.loads(json.dumps(w))) == op
    for name, codec in type(op).WIRE:
        v = getattr(op, name)
        if isinstance(v, int) and not isinstance(v, bool):
            assert INT64_MIN <= v <= INT64_MAX, (name, v)
        if codec == "name":
            assert isinstance(v, bytes) and len(v) <= MAX_NAME_BYTES and b"\0" not in v


# -- ops ------------------------------------------------------------------------------------

@fuzz(300)
@given(st.one_of(st.binary(max_size=200), ODD_TEXT))
def test_op_from_any_bytes_is_an_op_or_bad_record(body):
    op = decoded_or_bad(records.decode_op, body)
    if op is not None:
        check_op(op)


@fuzz(300)
@given(JSON)
def test_op_from_any_json_value_is_an_op_or_bad_record(value):
    op = decoded_or_bad(records.decode_op, json.dumps(value).encode())
    if op is not None:
        check_op(op)


@fuzz(200)
@given(wire_dicts())
def test_op_shaped_dicts_decode_or_are_refused_with_einval(wire):
    try:
        op = from_wire(wire)
    except MalformedOp as exc:
        assert exc.errno == errno.EINVAL and isinstance(exc, BadRecord)
        one_line(str(exc))
        return
    check_op(op)


@fuzz(300)
@given(VALID_OPS)
def test_valid_ops_round_trip_through_their_json_bytes(op):
    body = json.dumps(op.to_wire(), separators=(",", ":")).encode()
    assert records.decode_op(body) == op


@pytest.mark.parametrize(("wire", "says"), [
    ({"op": "setattr", "ino": 1, "mode": 1e400}, "field 'mode' must be"),
    ({"op": "mkdir", "parent": 1, "name": "d", "mode": 0o755, "uid": 10**24, "gid": 0},
     "field 'uid' must be an integer in 0..4294967295"),
    ({"op": "mkdir", "parent": 0, "name": "d", "mode": 0o755, "uid": 0, "gid": 0},
     "field 'parent' must be an integer in 1.."),
    ({"op": "mkdir", "parent": 1, "name": "\ud800", "mode": 0o755, "uid": 0, "gid": 0},
     "field 'name' must be a file name"),
    ({"op": "mkdir", "parent": 1, "name": "a\0b", "mode": 0o755, "uid": 0, "gid": 0},
     "without NUL"),
    ({"op": "unlink", "parent": 1, "name": "x" * (MAX_NAME_BYTES + 1)}, "at most 4096 bytes"),
    ({"op": "publish", "ino": 1, "vid": 1, "size": 1, "chunk_size": 1,
      "chunks": ["../../x"], "blake3": "h", "mtime_ns": 1}, "a list of digests"),
    ({"op": "publish", "ino": 1, "vid": 1, "size": 1, "chunk_size": 0,
      "chunks": [], "blake3": "h", "mtime_ns": 1}, "field 'chunk_size' must be"),
    ({"op": "publish", "ino": 1, "vid": 1, "size": 1, "chunk_size": 1, "chunks": [],
      "blake3": "h", "mtime_ns": 1, "data": "YW Jj"}, "field 'data' must be base64"),
    ({"op": "rename", "parent": 1, "name": "a", "new_parent": 1, "new_name": "b",
      "flags": -1}, "field 'flags' must be"),
    ({"op": "noop", "id": "x" * 1000}, "field 'id' must be a string of at most"),
])
def test_out_of_range_fields_are_refused(wire, says):
    with pytest.raises(MalformedOp) as got:
        from_wire(wire)
    assert isinstance(got.value, FsError) and isinstance(got.value, BadRecord)
    assert got.value.errno == errno.EINVAL
    assert says in str(got.value), str(got.value)


def test_a_name_of_undecodable_bytes_round_trips():
    op = Create(parent=1, name=b"\xff\xfe.bin", mode=0o644, uid=0, gid=0, excl=False,
                rank=0, id="a.1")
    assert records.decode_op(json.dumps(op.to_wire()).encode()) == op


# -- base, snapshot, candidates, ns/last, part keys ------------------------------------------

def _snapshot(entries: list[dict], next_ino: int = 100, steps: list | None = None) -> bytes:
    return json.dumps({"epoch": 1, "seq": 5, "next_ino": next_ino, "entries": entries,
                       "steps": steps or []}).encode()


def _entry(ino: int, parent: int, name: str, kind: str = "file", **kw) -> dict:
    mode = {"dir": 0o40755, "symlink": 0o120777, "special": 0o10644}.get(kind, 0o100644)
    return {"ino": ino, "parent": parent, "name": name, "kind": kind, "mode": mode,
            "uid": 0, "gid": 0, "mtime_ns": 1, "target": "", **kw}


VERSION = {"size": 3, "chunk_size": 65536, "chunks": ["a" * 64], "blake3": "b" * 64,
           "rank": 1}
GOOD_SNAPSHOT = [
    _entry(2, 1, "step_1", "dir", mode=0o40755),
    _entry(3, 2, "__0_0.distcp", version=VERSION),
    _entry(3, 1, "hard"),  # another name of inode 3
    _entry(4, 1, "latest", "symlink", mode=0o120777, target="step_1"),
    _entry(5, 2, "fifo", "special", mode=0o10600, rdev=0),
]


def test_a_valid_snapshot_decodes_to_the_same_entries():
    steps = [{"name": "step_1", "number": 1, "ino": 2, "source": "marker",
              "committed_ns": 7}]
    snap = records.decode_snapshot(_snapshot(GOOD_SNAPSHOT, steps=steps))
    assert snap == {"next_ino": 100, "entries": GOOD_SNAPSHOT, "steps": steps}


@pytest.mark.parametrize(("entries", "says"), [
    ([_entry(3, 2, "f")], "parent 2 is not a directory before it"),
    ([_entry(2, 1, "f"), _entry(3, 2, "g")], "parent 2 is not a directory before it"),
    ([_entry(2, 1, "f"), _entry(3, 1, "f")], "a second entry 'f'"),
    ([_entry(2, 1, "d", "dir"), _entry(2, 1, "e", "dir")], "inode 2 named twice"),
    ([_entry(2, 1, "f"), _entry(2, 1, "g", "symlink")], "inode 2 named twice"),
    ([_entry(1, 1, "root")], "ino=1 is outside 2..99"),
    ([_entry(100, 1, "f")], "ino=100 is outside 2..99"),
    ([_entry(2, 1, "a/../..\0")], "not a file name"),
    ([_entry(2, 1, "d", "dir", version=VERSION)], "a dir with a version"),
    ([_entry(2, 1, "f", version={**VERSION, "chunks": ["../x"]})], "not a digest"),
    ([_entry(2, 1, "f", kind="socket")], "kind 'socket'"),
    ([_entry(2, 1, "f", mtime_ns=1e400)], "not JSON"),
])
def test_a_snapshot_install_could_not_finish_is_refused(entries, says):
    with pytest.raises(BadRecord) as got:
        records.decode_snapshot(_snapshot(entries))
    assert says in str(got.value), str(got.value)
    one_line(str(got.value))


@fuzz(300)
@given(st.one_of(st.binary(max_size=200), ODD_TEXT, JSON.map(lambda v: json.dumps(v).encode())))
def test_every_record_decoder_gives_a_record_or_bad_record(body):
    base = decoded_or_bad(records.decode_base, body)
    if base is not None:
        assert base["incarnation"] >= 1 and base["rev"] >= 0 and base["parts"] >= 1
        assert "/" not in base["tag"]
    cand = decoded_or_bad(records.decode_candidate, body)
    if cand is not None:
        assert cand["newest_step"] >= -1 and cand["entries"] >= 0
    decoded_or_bad(records.decode_snapshot, body)
    decoded_or_bad(records.check_last, body, b"/p/ns/op/")
    part = decoded_or_bad(records.snap_part_index, b"/p/ns/snap/t/" + body, b"/p/ns/snap/t/", 4)
    assert part is None or 0 <= part < 4


@fuzz(120)
@given(st.lists(st.fixed_dictionaries({
    "ino": st.one_of(st.integers(1, 8), ODD_INTS), "parent": st.integers(1, 8),
    "name": st.one_of(st.sampled_from(["a", "b"]), ODD_STRS),
    "kind": st.sampled_from(["file", "dir", "symlink", "special", "x"]),
    "mode": st.one_of(st.just(0o644), ODD_INTS), "uid": st.just(0), "gid": st.just(0),
    "mtime_ns": st.one_of(st.just(0), ODD_INTS), "target": st.one_of(st.just(""), ODD_STRS)},
    optional={"version": st.one_of(st.just(VERSION), JSON), "rdev": ODD_INTS}), max_size=6))
def test_snapshot_shaped_input_decodes_to_an_installable_namespace_or_is_refused(entries):
    snap = decoded_or_bad(records.decode_snapshot, _snapshot(entries, next_ino=9))
    if snap is None:
        return
    dirs, kinds = {1}, {}
    for e in snap["entries"]:  # what JobNamespace.install relies on
        assert e["parent"] in dirs and 2 <= e["ino"] < 9
        assert kinds.setdefault(e["ino"], e["kind"]) == e["kind"]
        if e["kind"] == "dir":
            dirs.add(e["ino"])


def test_base_and_part_keys():
    body = b'{"incarnation":7,"rev":0,"parts":2,"tag":"seed-0-7","seeded_by":0}'
    assert records.decode_base(body) == {"incarnation": 7, "rev": 0, "parts": 2,
                                         "tag": "seed-0-7"}
    for bad in (b'{"incarnation":7,"rev":0,"parts":2,"tag":"../x"}',
                b'{"incarnation":0,"rev":0,"parts":2,"tag":"t"}',
                b'{"incarnation":7,"rev":0,"parts":0,"tag":"t"}', b"x", b"[1]"):
        with pytest.raises(BadRecord):
            records.decode_base(bad)
    p = b"/p/ns/snap/t/"
    assert records.snap_part_index(p + b"1", p, 2) == 1
    for bad in (b"01", b"2", b"-1", b"x", b"1/2", b""):
        with pytest.raises(BadRecord):
            records.snap_part_index(p + bad, p, 2)
    records.check_last(b"/p/ns/op/000001/abc.1", b"/p/ns/op/")
    for bad in (b"x", b"/p/ns/op/", b"/p/ns/op/1/2/3", b"/q/ns/op/000001/a"):
        with pytest.raises(BadRecord):
            records.check_last(bad, b"/p/ns/op/")
