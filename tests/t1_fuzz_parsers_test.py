"""Fuzz tests of what mtcfs parses from people and programs (issue 14, "hostile input"):
mount options, ``replicator.yaml`` and step manifests.

For any input, each parser returns a valid result or raises its one documented error type,
with a one-line message: :class:`~mtcfs.options.OptionError`,
:class:`~mtcfs.tiers.mtc.config.ReplicatorConfigError`,
:class:`~mtcfs.base.manifest.ManifestError`. Never another exception (TypeError, KeyError,
RecursionError, OverflowError, ...), and never a result that breaks the documented bounds.
The inputs are structure-aware: option names the parser knows with values near and past
their bounds, YAML documents with the keys Orbax writes, manifests with odd fields.

Short form (the test suite): a few hundred inputs per parser, derandomized. Long form:
``make fuzz`` (``MTCFS_FUZZ_EXAMPLES=20000``; docs/fuzzing.md). The inputs the fuzzer found
are kept below as plain regression tests.
"""

from __future__ import annotations

import json
import math
import re
import threading

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from mtcfs import options as mopts
from mtcfs.base.chunking import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from mtcfs.base.manifest import INT64_MAX, ManifestError, StepManifest
from mtcfs.options import MountOptions, OptionError, parse_mount_options
from mtcfs.tiers.mtc.config import (
    KNOWN_KEYS, MAX_BACKUP_MINUTES, ReplicatorConfig, ReplicatorConfigError,
    parse_replicator_yaml,
)
from support.fuzzing import fuzz, one_line


# -- mount options --------------------------------------------------------------------------

#: Characters that look like what a parser wants but are not ASCII: Unicode digits, the long
#: s and the Kelvin sign (which case-insensitive regexes match as 's' and 'k').
LOOKALIKES = ["\u0663", "\u00b2", "\uff11", "\u017f", "\u212a", "\u0130", "\u0131"]
ODD = ["", " ", "\0", "\n", "\t", ",", ";", "+", "=", "[", "]", ":", "/", "..", "-1",
       "9" * 40, "1e3", "inf", "nan", "0x10", "1_000", *LOOKALIKES]
NAMES = sorted(mopts._KNOWN | mopts._FLAGS) + ["rw", "x-systemd.automount", "comment",
                                                "bogus", "size ", " size", "Size"]
VALUE_PARTS = ["0", "1", "2", "3", "4", "7", "16", "65535", "65536", "65537", "1000", "1001",
               "512M", "1G", "60G", "1.5G", "64K", "256M", "512M", "1024P", "1025P", "4KiB",
               "1s", "0.5s", "10m", "1h", "30d", "31d", "3600", "5ckpt", "0ckpt", "latest",
               "none", "yes", "no", "node", "job", "ring", "group", "off", "gs://b/p",
               "file:///b", "file://rel", "etcd://127.0.0.1:2379", "127.0.0.1:7470",
               "[::1]:7470", "::1:7470", "host:", ":1", "h:99999", "zone=a", "block=3",
               "/dev/shm/x", "relative/store", "/mtcfs/job", "100M/s"]
#: Numbers with units, the way sizes, durations and intervals are written.
numbers_with_units = st.builds(
    "{}{}{}".format, st.sampled_from(["0", "1", "10", "1.5", "60", "9" * 25, *LOOKALIKES[:3]]),
    st.sampled_from(["", " "]),
    st.sampled_from(["", "s", "m", "h", "d", "K", "M", "G", "P", "KiB", "ckpt", "/s",
                     *LOOKALIKES[3:]]))
#: host:port, with ports that only look like numbers.
addresses = st.builds(
    "{}:{}".format, st.sampled_from(["h", "127.0.0.1", "[::1]", "[fe80::1%eth0]", "a.b-c_d"]),
    st.sampled_from(["7470", "0", "65535", "65536", "", "-1", "\u0663\u0663", "\u00b2",
                     "\uff17\uff14", "7470\n"]))
values = st.one_of(
    st.sampled_from(VALUE_PARTS), numbers_with_units, addresses,
    st.lists(st.sampled_from(VALUE_PARTS + ODD), min_size=1, max_size=3).map("".join),
    st.text(max_size=12))
items = st.one_of(
    st.builds(lambda n, v: f"{n}={v}", st.sampled_from(NAMES), values),
    st.builds(lambda n, v: f"{n}={v}", st.sampled_from(
        ["listen", "peers", "coord", "jax_coordinator"]), addresses),
    st.builds(lambda n, v: f"{n}={v}", st.sampled_from(
        ["size", "chunk_size", "read_timeout", "backup_interval", "coord_timeout",
         "scrub_interval", "scrub_rate", "mount_timeout", "hash_threads"]),
        numbers_with_units),
    st.sampled_from(NAMES),
    values,  # a bare token: continues peers=, coord=, topology=, or is unknown
    st.text(max_size=10))
option_groups = st.lists(st.lists(items, max_size=5).map(",".join), max_size=3)
jobs = st.one_of(st.sampled_from(["myjob", "a" * 128, "a" * 129, "j\n", "j.1_x-2", "-j", ""]),
                 st.text(max_size=12))

_JOB = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+(%[A-Za-z0-9._-]+)?\]|[A-Za-z0-9_][A-Za-z0-9._-]*)"
                      r":[0-9]{1,5}")


def check_options(o: MountOptions) -> None:
    """The bounds docs/usage.md gives every option hold in a parsed result."""
    assert _JOB.fullmatch(o.job), o.job
    assert 1 <= o.nodes <= mopts.MAX_NODES and 0 <= o.rank < o.nodes
    assert MIN_CHUNK_SIZE <= o.chunk_size <= MAX_CHUNK_SIZE
    assert o.chunk_size & (o.chunk_size - 1) == 0
    assert o.size is None or o.chunk_size <= o.size <= mopts.MAX_SIZE
    assert 1 <= o.keep <= mopts.MAX_KEEP and 1 <= o.backup_keep <= mopts.MAX_BACKUP_KEEP
    assert 0 <= o.replicas <= mopts.MAX_REPLICAS
    assert o.store.startswith("/") and "\0" not in o.store
    bi = o.backup_interval
    if bi.checkpoints is None:
        assert math.isfinite(bi.seconds) and 1 <= bi.seconds <= mopts.MAX_INTERVAL_S
    else:
        assert bi.seconds is None and 1 <= bi.checkpoints <= mopts.MAX_INTERVAL_CKPTS
    for t in (o.read_timeout, o.mount_timeout, o.coord_timeout):
        assert math.isfinite(t) and 1 <= t <= 3600
    assert o.scrub_interval == 0 or 1 <= o.scrub_interval <= 30 * 86400
    assert 1 <= o.hash_threads <= 64
    assert o.restore in ("latest", "none") or (o.restore.isascii() and o.restore.isdigit()
                                                and int(o.restore) <= mopts.MAX_STEP)
    for addr in [o.listen, o.jax_coordinator, *(o.peers or ()), *(o.coord or ())]:
        if addr is not None:
            m = _ADDRESS.fullmatch(addr)
            assert m and int(addr.rpartition(":")[2]) <= 65535, addr
    if o.peers is not None:
        assert len(o.peers) == o.nodes and len(set(o.peers)) == o.nodes
    if o.assume_data_parallelism is not None:
        assert o.nodes % o.assume_data_parallelism == 0


@fuzz(400)
@given(job=jobs, groups=option_groups)
def test_mount_options(job, groups):
    try:
        o = parse_mount_options(job, "/mnt/x", groups)
    except OptionError as exc:
        if not any(c in "".join([job, *groups]) for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85"
                   "\u2028\u2029"):
            one_line(str(exc))
        return
    check_options(o)


@pytest.mark.parametrize("opts", [
    # found by the fuzzer: a case-insensitive regex takes U+017F (long s) for "s", and the
    # unit table had no such key: KeyError
    ["read_timeout=10\u017f"], ["backup_interval=10\u017f"], ["coord_timeout=5\u017f"],
    # found by the fuzzer: str.isdigit() takes Unicode digits, so a port of Arabic-Indic
    # digits passed and listen= held an address no socket can bind
    ["nodes=2,rank=0,listen=h:\u0663\u0663,coord=etcd://e:1"],
    ["nodes=2,rank=0,peers=a:1,b:\u00b2,coord=etcd://e:1"], ["listen=0:\u0660"],
    # found by the fuzzer: a store path with a NUL byte was taken
    ["store=/dev/shm/a\0b"],
])
def test_regressions_options_are_refused_with_an_option_error(opts):
    with pytest.raises(OptionError) as exc:
        parse_mount_options("j", "/m", opts)
    one_line(str(exc.value))


@pytest.mark.parametrize("job", ["j\n", "myjob\n"])
def test_regression_a_job_name_with_a_trailing_newline_is_refused(job):
    # found by the fuzzer: "$" in the job name pattern matches before a final newline
    with pytest.raises(OptionError, match="bad job name"):
        parse_mount_options(job, "/m", [])


# -- replicator.yaml ------------------------------------------------------------------------

yaml_scalars = st.one_of(
    st.integers(-3, 70), st.sampled_from([0, 1, 2, 4, 65536, 65537, 2 ** 63, 2 ** 64,
                                          10 ** 100, MAX_BACKUP_MINUTES + 1]),
    st.integers(), st.booleans(), st.none(), st.floats(), st.text(max_size=8))
yaml_values = st.recursive(yaml_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=10)
yaml_keys = st.one_of(st.sampled_from(sorted(KNOWN_KEYS)), st.text(max_size=10))


@st.composite
def replicator_yamls(draw) -> str:
    """A replicator.yaml as Orbax writes it, with odd keys and values mixed in; or YAML
    that is not a mapping; or text that is not YAML."""
    kind = draw(st.sampled_from(["orbax"] * 6 + ["any", "text", "aliases", "deep", "digits"]))
    if kind == "text":
        return draw(st.text(max_size=200))
    if kind == "any":
        return yaml.safe_dump(draw(yaml_values))
    if kind == "deep":
        n = draw(st.sampled_from([100, 2000, 100_000]))
        return "job-name: " + "[" * n + "]" * n + "\nnodes: 1\nnode-rank: 0\n"
    if kind == "digits":
        key = draw(st.sampled_from(["nodes", "node-rank", "backup-interval-minutes"]))
        return (f"nodes: 2\nnode-rank: 0\n{key}: " + "9" * draw(st.sampled_from([19, 4300, 5000]))
                + "\n")
    if kind == "aliases":  # an alias bomb: 9 levels of 9 references to the level below
        levels = draw(st.integers(2, 9))
        text = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n"
        for i in range(1, levels):
            text += f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n"
        key = draw(st.sampled_from(["job-name", "framework", "peer-ranks", "nodes"]))
        return text + f"nodes: 2\nnode-rank: 0\n{key}: *a{levels - 1}\n"
    nodes = draw(st.integers(1, 8))
    doc = {"job-name": "run", "framework": "orbax", "node-rank": draw(st.integers(0, nodes - 1)),
           "nodes": nodes, "peer-ranks": [], "backup-interval-minutes": 30}
    for _ in range(draw(st.integers(0, 3))):
        key = draw(yaml_keys)
        if draw(st.integers(0, 4)) == 0:
            doc.pop(key, None)
        else:
            doc[key] = draw(yaml_values)
    return yaml.safe_dump(doc)


def check_config(c: ReplicatorConfig, nodes: int | None, rank: int | None) -> None:
    assert 1 <= c.nodes <= mopts.MAX_NODES and 0 <= c.node_rank < c.nodes
    assert nodes is None or c.nodes == nodes
    assert rank is None or c.node_rank == rank
    assert len(set(c.peer_ranks)) == len(c.peer_ranks)
    assert all(type(p) is int and 0 <= p < c.nodes and p != c.node_rank for p in c.peer_ranks)
    assert c.assume_data_parallelism is None or c.nodes % c.assume_data_parallelism == 0
    assert (c.backup_interval_minutes is None) != (c.backup_interval_steps is None)
    if c.backup_interval_minutes is not None:
        assert 1 <= c.backup_interval_minutes <= MAX_BACKUP_MINUTES
    else:
        assert 1 <= c.backup_interval_steps <= INT64_MAX
    assert isinstance(c.job_name, str) and isinstance(c.framework, str)
    for w in c.warnings:
        one_line(w)
        assert len(w) < 1000


@fuzz(400)
@given(text=replicator_yamls(), nodes=st.one_of(st.none(), st.integers(1, 8)),
       rank=st.one_of(st.none(), st.integers(0, 7)))
def test_replicator_yaml(text, nodes, rank):
    try:
        c = parse_replicator_yaml(text, nodes=nodes, rank=rank)
    except ReplicatorConfigError as exc:
        one_line(str(exc))
        assert len(str(exc)) < 1000
        return
    check_config(c, nodes, rank)


def _parse_within(text: str, seconds: float = 10.0):
    """parse_replicator_yaml(text) in a thread; fails the test if it takes longer."""
    out: list = []

    def run() -> None:
        try:
            out.append(parse_replicator_yaml(text))
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"parsing took more than {seconds} s"
    return out[0]


def _bomb(key: str) -> str:
    text = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n"
    for i in range(1, 9):
        text += f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n"
    return text + f"nodes: 2\nnode-rank: 0\n{key}: *a8\n"


@pytest.mark.parametrize("text,words", [
    # found by the fuzzer: an alias bomb in framework (3 levels: a warning of 3,888
    # characters); 9 levels in job-name or framework made str() build 9^9 elements, and in
    # peer-ranks repr() did the same in the message: parsing never returned
    (_bomb("job-name"), ["job-name", "string"]),
    (_bomb("framework"), ["framework", "string"]),
    (_bomb("peer-ranks"), ["peer-ranks", "list of integers"]),
    # found by the fuzzer: PyYAML's int() of more than 4300 digits raised ValueError
    ("nodes: " + "9" * 5000 + "\nnode-rank: 0\n", ["nodes"]),
    # found by the fuzzer: nesting deeper than the recursion limit raised RecursionError,
    # after a second or more (PyYAML's scanner is quadratic in the depth of [ and {)
    ("job-name: " + "[" * 20_000 + "]" * 20_000 + "\nnodes: 1\nnode-rank: 0\n",
     ["nested 20000 levels deep"]),
    ("- " * 20_000 + "x\n", ["nested too deeply"]),
    ("job-name: " + "[" * 100_000 + "]" * 100_000 + "\n", ["200011 characters"]),
    # found by the fuzzer: nodes had no upper bound (it took 9999999999999999999)
    ("nodes: 65537\nnode-rank: 0\n", ["nodes: 65537", "at most 65536"]),
    # found while writing the fuzzer: no upper bound, so 60.0 * minutes raised
    # OverflowError in the replicator after the yaml was accepted
    ("nodes: 2\nnode-rank: 0\nbackup-interval-minutes: " + "9" * 400 + "\n",
     ["backup-interval-minutes", "at most"]),
])
def test_regressions_replicator_yaml_is_refused_at_once(text, words):
    exc = _parse_within(text)
    assert isinstance(exc, ReplicatorConfigError), exc
    one_line(str(exc))
    for w in words:
        assert w in str(exc)


# -- step manifests -------------------------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
ENTRY_KEYS = ["path", "kind", "mode", "mtime_ns", "size", "chunk_size", "chunks", "blake3",
              "target", "node", "rdev"]


@st.composite
def manifest_texts(draw) -> bytes:
    kind = draw(st.sampled_from(["manifest"] * 4 + ["json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=100))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    entry = {"path": "7/f", "kind": "file", "mode": 0o644, "mtime_ns": 1, "size": 3,
             "chunk_size": 65536, "chunks": ["a" * 64], "blake3": "b" * 64}
    doc = {"format": 1, "job": "j", "step": "7", "step_number": 7, "created_ns": 1, "rank": 0,
           "entries": [{"path": "7", "kind": "dir", "mode": 0o755, "mtime_ns": 1}, entry]}
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from([doc, entry]))
        key = draw(st.sampled_from(list(doc) if target is doc else ENTRY_KEYS))
        target[key] = draw(st.one_of(json_values, st.sampled_from(
            [2 ** 63, 2 ** 64, -1, 2 ** 100, 1.5, "1", True, None, [], {}, "../x", "7/\0"])))
    return json.dumps(doc).encode()


@fuzz(400)
@given(raw=manifest_texts())
def test_step_manifest_from_bytes(raw):
    try:
        m = StepManifest.from_bytes(raw)
    except ManifestError as exc:
        assert str(exc).strip()
        return
    assert 0 <= m.step_number <= INT64_MAX and 0 <= m.created_ns <= INT64_MAX
    assert 0 <= m.total_bytes <= INT64_MAX
    for e in m.entries:
        assert e.path == m.step or e.path.startswith(m.step + "/")
        assert ".." not in e.path.split("/") and "\0" not in e.path
    assert StepManifest.from_bytes(m.to_bytes()).to_bytes() == m.to_bytes()
