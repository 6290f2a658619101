"""Tier-2 fuzz test of the Peer service with hostile input (issue 14).

One real Peer server (``serve()`` over a ReplicaStore on tmpfs) in a process of its own
(tests/support/peer_daemon.py), fed by hypothesis: valid protobufs with extreme or
inconsistent fields (ranks negative or huge, digests malformed or not matching their bytes,
piece offsets out of order, overlapping or beyond ``total_size``, huge totals, thousands of
repeated digests, manifests whose paths hold ``..``, absolute paths or NUL, step names like
``..``, step numbers negative or huge, ``of_rank`` out of range, another job), and bytes that
are no message at all, sent through a generic channel. For every input:

- the answer is a status the protocol documents (never INTERNAL or UNKNOWN), with a short,
  one-line reason that does not name this job to a caller that did not name it;
- the server keeps serving: a valid call after each input answers, and sees every chunk it
  held before;
- what the store holds on disk changes only by a valid store: a chunk whose bytes hash to
  its name and that the input carried, or a manifest the call acknowledged (and which then
  lists back bit-exact);
- the server process's memory stays bounded over the whole run.

Short form (the test suite): a few hundred inputs, derandomized (the same inputs every run).
Long form: ``make fuzz`` (``MTCFS_FUZZ_EXAMPLES=20000``, random inputs; docs/fuzzing.md).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mtcfs.base.chunking import chunk_hash
from mtcfs.tiers.peer._pb import mtcfs_peer_pb2 as pb
from mtcfs.tiers.peer._pb import mtcfs_peer_pb2_grpc as pb_grpc
from mtcfs.tiers.peer.limits import MAX_CHUNK_BYTES, MAX_DIGESTS_PER_CALL, PIECE_BYTES
from support.peer_daemon import PeerDaemon

#: A distinctive job name: no refusal may show it to a caller that did not send it.
JOB = "fuzzjob-5c1e7a"
NODES = 4
CAPACITY = 1 << 30
SERVICE = "/mtcfs.peer.v1.Peer/"
TIMEOUT = 20.0
#: Statuses a whole call may end with (docs/peer-protocol.md, "Status codes"). UNAVAILABLE
#: is for injected partitions (none here), INTERNAL for a failing disk (none here).
CALL_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
#: Codes a PutChunksReply may give one chunk.
CHUNK_CODES = {grpc.StatusCode.DATA_LOSS.value[0], grpc.StatusCode.INVALID_ARGUMENT.value[0],
               grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]}
#: Longest reason a refusal may carry, characters.
MAX_DETAILS = 1024
#: Growth of the server's RSS allowed over the whole module, bytes: generous (grpc's and
#: the allocator's pools), yet far below what keeping the inputs would take.
RSS_GROWTH = 200 << 20

U64 = 2 ** 64 - 1
I64 = 2 ** 63 - 1


def fuzz(short: int, most: int | None = None) -> settings:
    """Hypothesis settings of one fuzz test: ``short`` examples in the suite (derandomized:
    the same inputs every run), MTCFS_FUZZ_EXAMPLES (at most ``most``) in the long form
    (random inputs; ``--hypothesis-seed=N`` repeats a run)."""
    long = os.environ.get("MTCFS_FUZZ_EXAMPLES")
    n = min(int(long), most or int(long)) if long else short
    return settings(
        max_examples=n, deadline=None, database=None, derandomize=not long, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.large_base_example, HealthCheck.filter_too_much])


# -- data the fuzzer mixes in ---------------------------------------------------------------

_rng = random.Random(14)
#: Chunks the server holds from the start (put by a member), and their digests.
HELD = [_rng.randbytes(n) for n in (1, 1000, 64 * 1024, 200_000)]
HELD_DIGESTS = [chunk_hash(d) for d in HELD]
#: Chunks it does not hold; the fuzzer sends them, so some inputs are valid stores.
FRESH = [_rng.randbytes(n) for n in (0, 7, 4096, 70_000)]
FRESH_DIGESTS = [chunk_hash(d) for d in FRESH]
BY_DIGEST = dict(zip(HELD_DIGESTS + FRESH_DIGESTS, HELD + FRESH))

hex64 = st.text("0123456789abcdef", min_size=64, max_size=64)
BAD_DIGESTS = [
    "", "not-a-digest", "../../etc/passwd", "/" + "a" * 63, "a" * 31 + "/" + "a" * 32,
    "A" * 64, "g" * 64, "a" * 63, "a" * 65, "a" * 64 + "\n", "a" * 64 + "\0",
    "\u0661" * 64, "a" * 5000, HELD_DIGESTS[0].upper(), " " + HELD_DIGESTS[0][1:],
]
digests_one = st.one_of(st.sampled_from(HELD_DIGESTS), st.sampled_from(FRESH_DIGESTS), hex64,
                        st.sampled_from(BAD_DIGESTS), st.text(max_size=70))
#: Short digests repeated to and past the per-call limit.
digests_many = st.builds(lambda d, n: [d] * n,
                         st.one_of(st.sampled_from(HELD_DIGESTS), hex64, st.just("x")),
                         st.sampled_from([4096, MAX_DIGESTS_PER_CALL,
                                          MAX_DIGESTS_PER_CALL + 1, 100_000]))
digest_lists = st.one_of(st.lists(digests_one, max_size=24), digests_many)
jobs = st.one_of(st.just(JOB), st.just(JOB), st.just(JOB),
                 st.sampled_from(["", "other", JOB + "x", JOB.upper(), JOB + "\0", " " + JOB]),
                 st.text(max_size=24))
ranks = st.one_of(st.integers(0, NODES - 1), st.integers(0, NODES - 1),
                  st.sampled_from([-1, NODES, NODES + 1, -(2 ** 31), 2 ** 31 - 1]),
                  st.integers(-(2 ** 31), 2 ** 31 - 1))
u64 = st.one_of(st.integers(0, 300_000), st.sampled_from(
    [0, 1, MAX_CHUNK_BYTES, MAX_CHUNK_BYTES + 1, 2 ** 32, 2 ** 32 - 1, I64, I64 + 1, U64]),
    st.integers(0, U64))
i64 = st.one_of(st.integers(0, 1000), st.sampled_from([-1, I64, -I64 - 1, 2 ** 53 + 1]),
                st.integers(-I64 - 1, I64))
STEP_NAMES = ["100", "step_7", "..", ".", "", "../x", "a/b", "/abs", "x\0y", "x\n", "\x7f",
              "x" * 250, "x" * 251, "x" * 300, "\u00f1" * 128, "ckpt-\u2603"]
#: Few distinct names, so that the manifests stored in a long run stay few.
steps = st.one_of(st.sampled_from(STEP_NAMES), st.text("ab1.\0/", max_size=4))

# -- the server -----------------------------------------------------------------------------


class Server:
    """The daemon under test, a channel to it, and the checks made after every input."""

    def __init__(self, daemon: PeerDaemon) -> None:
        self.daemon = daemon
        self.channel = grpc.insecure_channel(daemon.address, options=[
            ("grpc.max_receive_message_length", 256 << 20),
            ("grpc.max_send_message_length", 256 << 20)])
        self.stub = pb_grpc.PeerStub(self.channel)
        self.rss_start = 0

    def raw(self, method: str, kind: str = "unary_unary"):
        """A generic callable for ``method`` that sends and returns bytes as they are."""
        return getattr(self.channel, kind)(SERVICE + method)

    def check_serving(self) -> None:
        """The server answers a valid call and still holds every chunk it held at start."""
        assert self.daemon.alive(), f"the server died:\n{self.daemon.log_tail()}"
        reply = self.stub.HasChunks(pb.HasChunksRequest(job=JOB, rank=0, digests=HELD_DIGESTS),
                                    timeout=TIMEOUT)
        assert reply.count == len(HELD) and reply.present == bytes([0b1111])


@pytest.fixture(scope="module")
def server():
    root = Path(tempfile.mkdtemp(prefix="mtcfs-fuzz-", dir="/dev/shm"))
    daemon = PeerDaemon(root / "replicas", JOB, NODES, CAPACITY, root / "server.log")
    s = Server(daemon)
    try:
        for h, data in zip(HELD_DIGESTS, HELD):
            reply = s.stub.PutChunks(iter([pb.PutChunksRequest(job=JOB, rank=1, piece=pb.ChunkPiece(
                digest=h, offset=0, total_size=len(data), data=data))]), timeout=TIMEOUT)
            assert list(reply.accepted) == [h]
        s.check_serving()
        s.rss_start = daemon.rss()
        yield s
        s.check_serving()
        end = daemon.rss()
        print(f"fuzzed peer server: RSS {s.rss_start >> 20} MiB at start, {end >> 20} MiB "
              "at the end")
        assert end - s.rss_start < RSS_GROWTH, f"server RSS grew by {(end - s.rss_start) >> 20} MiB"
        s.channel.close()
        assert daemon.close() == 0
        log = daemon.log.read_text(errors="replace")
        assert "Traceback" not in log and "Exception" not in log, daemon.log_tail(80)
    finally:
        s.channel.close()
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)


def outcome(call) -> tuple[grpc.StatusCode, str, object]:
    """Run ``call()``; return (status code, details, result or None)."""
    try:
        return grpc.StatusCode.OK, "", call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", None


def check_status(code: grpc.StatusCode, details: str, sent: bytes) -> None:
    """A documented status; a refusal says why in one short line, without this job's name
    unless the caller sent it."""
    assert code in CALL_CODES, (code, details)
    if code is grpc.StatusCode.OK:
        return
    assert details.strip(), code
    assert len(details) <= MAX_DETAILS, (code, len(details))
    assert "\n" not in details, details
    if JOB.encode() not in sent:
        assert JOB not in details, details
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        assert "job" in details, details


def changes(before: dict, after: dict) -> tuple[set[str], set[str]]:
    """(paths added, paths removed or modified) between two ``stored()`` listings."""
    added = set(after) - set(before)
    touched = {k for k in before if after.get(k) != before[k]}
    return added, touched


def serialized(msgs) -> bytes:
    return b"".join(m.SerializeToString() for m in msgs)


# -- unary requests: HasChunks, GetChunks, ListManifests ------------------------------------

@fuzz(120)
@given(job=jobs, rank=ranks, digests=digest_lists)
@example(job=JOB, rank=0, digests=["a" * 64 + "\n"])
@example(job="other", rank=0, digests=HELD_DIGESTS)
@example(job=JOB, rank=-1, digests=[])
def test_has_and_get_chunks(server, job, rank, digests):
    before = server.daemon.stored()
    has_req = pb.HasChunksRequest(job=job, rank=rank, digests=digests)
    code, details, reply = outcome(lambda: server.stub.HasChunks(has_req, timeout=TIMEOUT))
    check_status(code, details, has_req.SerializeToString())
    valid_call = job == JOB and 0 <= rank < NODES
    well_formed = len(digests) <= MAX_DIGESTS_PER_CALL and all(
        len(h) == 64 and set(h) <= set("0123456789abcdef") for h in digests)
    if valid_call and well_formed:
        assert code is grpc.StatusCode.OK, details
        assert reply.count == len(digests)
        flags = [bool(reply.present[i >> 3] >> (i & 7) & 1) for i in range(len(digests))]
        assert flags == [h in HELD_DIGESTS or held_now(server, h) for h in digests]
    elif code is grpc.StatusCode.OK:
        pytest.fail(f"accepted: job={job!r} rank={rank} digests={digests[:3]!r}...")

    get_req = pb.GetChunksRequest(job=job, rank=rank, digests=digests[:64])
    code, details, items = outcome(lambda: list(server.stub.GetChunks(get_req,
                                                                         timeout=TIMEOUT)))
    check_status(code, details, get_req.SerializeToString())
    if valid_call and well_formed:
        assert code is grpc.StatusCode.OK, details
    if code is grpc.StatusCode.OK:
        got = reassemble(items)
        for h, data in got.items():
            assert chunk_hash(data) == h
            if h in BY_DIGEST:
                assert data == BY_DIGEST[h]
        assert set(got) | set(unavailable(items)) == set(digests[:64])
    assert changes(before, server.daemon.stored()) == (set(), set())
    server.check_serving()


def held_now(server: Server, h: str) -> bool:
    """Whether the server stores chunk ``h`` on disk (an earlier input stored it)."""
    return (server.daemon.root / "chunks" / h[:2] / h).exists()


def reassemble(items) -> dict[str, bytes]:
    """GetChunks replies -> digest: bytes, checking the piece sequence."""
    out: dict[str, bytes] = {}
    cur, parts, total = None, [], 0
    for it in items:
        if it.WhichOneof("item") != "piece":
            assert cur is None
            continue
        p = it.piece
        if p.offset == 0:
            assert cur is None
            cur, parts, total = p.digest, [], p.total_size
        assert p.digest == cur and p.offset == sum(map(len, parts))
        parts.append(p.data)
        if sum(map(len, parts)) == total:
            out[cur] = b"".join(parts)
            cur = None
    assert cur is None
    return out


def unavailable(items) -> list[str]:
    out = []
    for it in items:
        if it.WhichOneof("item") == "unavailable":
            u = it.unavailable
            assert u.code in (grpc.StatusCode.NOT_FOUND.value[0],
                              grpc.StatusCode.DATA_LOSS.value[0])
            out.append(u.digest)
    return out


@fuzz(60)
@given(job=jobs, rank=ranks, of_rank=ranks, step=steps, without=st.booleans())
def test_list_manifests(server, job, rank, of_rank, step, without):
    before = server.daemon.stored()
    req = pb.ListManifestsRequest(job=job, rank=rank, of_rank=of_rank, step=step,
                                  without_manifest=without)
    code, details, items = outcome(lambda: list(server.stub.ListManifests(req,
                                                                           timeout=TIMEOUT)))
    check_status(code, details, req.SerializeToString())
    if code is grpc.StatusCode.OK:
        assert job == JOB and 0 <= rank < NODES and 0 <= of_rank < NODES
        for m in items:
            assert m.rank == of_rank and (not step or m.step == step)
            assert m.step_number >= 0 and m.created_ns >= 0
            if not without:
                on_disk = server.daemon.read(f"manifests/{m.rank}/{m.step}.json")
                assert m.manifest == on_disk
    assert changes(before, server.daemon.stored()) == (set(), set())
    server.check_serving()


# -- PutChunks: piece sequences -------------------------------------------------------------

def _cut(data: bytes, cuts: list[int]) -> list[tuple[int, bytes]]:
    edges = [0, *sorted(set(c for c in cuts if 0 < c < len(data))), len(data)]
    return [(a, data[a:b]) for a, b in zip(edges, edges[1:])] or [(0, b"")]


@st.composite
def put_streams(draw) -> list[pb.PutChunksRequest]:
    """A PutChunks request stream: chunks cut into pieces, then broken in a few places."""
    job, rank = draw(jobs), draw(ranks)
    pieces: list[dict] = []
    for _ in range(draw(st.integers(0, 4))):
        data = draw(st.one_of(st.sampled_from(HELD + FRESH), st.binary(max_size=2048)))
        h = draw(st.one_of(st.just(chunk_hash(data)), st.just(chunk_hash(data)), digests_one))
        total = draw(st.one_of(st.just(len(data)), st.just(len(data)), u64))
        cuts = draw(st.lists(st.integers(0, max(len(data), 1)), max_size=3))
        pieces += [dict(digest=h, offset=off, total_size=total, data=part)
                   for off, part in _cut(data, cuts)]
    msgs = [dict(job=job, rank=rank, piece=p) for p in pieces]
    for _ in range(draw(st.integers(0, 3))):
        if not msgs:
            break
        i = draw(st.integers(0, len(msgs) - 1))
        what = draw(st.sampled_from(["swap", "drop", "dup", "offset", "total", "digest",
                                     "data", "job", "rank"]))
        p = dict(msgs[i]["piece"])
        if what == "swap" and i + 1 < len(msgs):
            msgs[i], msgs[i + 1] = msgs[i + 1], msgs[i]
        elif what == "drop":
            del msgs[i]
        elif what == "dup":
            msgs.insert(i, dict(msgs[i]))
        elif what in ("offset", "total"):
            p["offset" if what == "offset" else "total_size"] = draw(u64)
            msgs[i] = dict(msgs[i], piece=p)
        elif what == "digest":
            p["digest"] = draw(digests_one)
            msgs[i] = dict(msgs[i], piece=p)
        elif what == "data":
            p["data"] = draw(st.binary(max_size=512))
            msgs[i] = dict(msgs[i], piece=p)
        else:
            msgs[i] = dict(msgs[i], **{what: draw(jobs if what == "job" else ranks)})
    return [pb.PutChunksRequest(job=m["job"], rank=m["rank"], piece=pb.ChunkPiece(**m["piece"]))
            for m in msgs]


def check_put(server: Server, before: dict, msgs, code, reply) -> None:
    """Only chunks the stream carried whole, with bytes that hash to their names, were
    added; nothing held before changed; an OK reply accounts for every chunk it took."""
    added, touched = changes(before, server.daemon.stored())
    assert not touched, touched
    sent = {m.piece.digest for m in msgs}
    for rel in added:
        assert rel.startswith("chunks/"), rel
        h = os.path.basename(rel)
        assert h in sent, rel
        assert chunk_hash(server.daemon.read(rel)) == h
    if code is grpc.StatusCode.OK:
        assert {os.path.basename(r) for r in added} <= set(reply.accepted)
        for st_ in reply.rejected:
            assert st_.code in CHUNK_CODES and st_.message, st_
            assert len(st_.message) <= MAX_DETAILS
        for h in reply.accepted:
            assert (server.daemon.root / "chunks" / h[:2] / h).exists(), h
        assert reply.bytes_received == sum(len(m.piece.data) for m in msgs)


@fuzz(150)
@given(msgs=put_streams())
def test_put_chunks(server, msgs):
    before = server.daemon.stored()
    code, details, reply = outcome(lambda: server.stub.PutChunks(iter(msgs), timeout=TIMEOUT))
    check_status(code, details, serialized(msgs))
    check_put(server, before, msgs, code, reply)
    server.check_serving()


#: Up to 3 MiB chunks from 64 seeds (a long run stores at most these and small ones).
big_chunks = st.integers(0, 63).map(
    lambda i: random.Random(i).randbytes(1 + (i * 1_234_567) % (3 << 20)))


@fuzz(40, most=2000)
@given(data=st.one_of(st.binary(min_size=1, max_size=4096), big_chunks),
       cuts=st.lists(st.integers(1, 3 << 20), max_size=4), rank=st.integers(0, NODES - 1))
def test_a_member_gets_back_what_it_put_bit_exact(server, data, cuts, rank):
    h = chunk_hash(data)
    msgs = [pb.PutChunksRequest(job=JOB, rank=rank, piece=pb.ChunkPiece(
        digest=h, offset=off, total_size=len(data), data=part)) for off, part in _cut(data, cuts)]
    reply = server.stub.PutChunks(iter(msgs), timeout=TIMEOUT)
    assert list(reply.accepted) == [h] and not reply.rejected
    items = list(server.stub.GetChunks(pb.GetChunksRequest(job=JOB, rank=(rank + 1) % NODES,
                                                           digests=[h]), timeout=TIMEOUT))
    assert reassemble(items) == {h: data}


# -- PublishManifest ------------------------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(),
              st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
#: What a numeric field may hold instead of a sane int.
odd_numbers = st.one_of(
    st.sampled_from([-1, I64, I64 + 1, U64, U64 + 1, 2 ** 70, -(2 ** 70), -I64 - 2,
                     float("inf"), float("-inf"), float("nan"), 1.5, 1e300, "7", True, None]),
    st.integers())
#: Step names a member would use (the odd ones are in STEP_NAMES).
good_steps = st.sampled_from(["100", "step_7", "ckpt-\u2603", "x" * 250, "0"])
NUMBER_FIELDS = ["step_number", "created_ns", "rank", "format"]
ENTRY_NUMBERS = ["mode", "mtime_ns", "size", "chunk_size", "rdev"]


@st.composite
def manifest_bodies(draw, step: str, step_number: int, rank: int) -> bytes:
    """A StepManifest JSON of (step, step_number, rank): valid, then (mostly) broken in
    one or two places; or arbitrary JSON; or no JSON at all."""
    kind = draw(st.sampled_from(["structured"] * 8 + ["json", "garbage", "nested"]))
    if kind == "garbage":
        return draw(st.binary(max_size=200))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    if kind == "nested":
        depth = draw(st.sampled_from([100, 5000, 200_000]))
        opener = draw(st.sampled_from(['[', '{"a":']))
        return (opener * depth + "1" + ("]" if opener == "[" else "}") * depth).encode()
    entries: list[dict] = [dict(path=step, kind="dir", mode=0o755, mtime_ns=1)]
    for i in range(draw(st.integers(0, 3))):
        data = draw(st.sampled_from(HELD + FRESH))
        chunk_size = draw(st.sampled_from([64 * 1024, 1 << 20]))
        chunks = [chunk_hash(data[o:o + chunk_size]) for o in range(0, len(data), chunk_size)]
        entries.append(dict(path=f"{step}/f{i}", kind="file", mode=0o644, mtime_ns=2,
                            size=len(data), chunk_size=chunk_size, chunks=chunks,
                            blake3=chunk_hash(data)))
    if draw(st.integers(0, 3)) == 0:
        n = draw(st.sampled_from([1000, 3000]))  # one digest referenced thousands of times
        entries.append(dict(path=f"{step}/many", kind="file", mode=0o644, mtime_ns=3,
                            size=n * 64 * 1024, chunk_size=64 * 1024,
                            chunks=[HELD_DIGESTS[2]] * n, blake3=HELD_DIGESTS[2]))
    doc = dict(format=1, job=JOB, step=step, step_number=step_number, created_ns=5, rank=rank,
               entries=entries)
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2]))):
        where = draw(st.sampled_from(["number", "number", "field", "entry", "path", "chunks",
                                      "kind", "huge-file"]))
        e = draw(st.sampled_from(entries))
        if where == "number":
            key = draw(st.sampled_from(NUMBER_FIELDS))
            n = doc.get(key) if isinstance(doc.get(key), int) else 0
            doc[key] = draw(st.one_of(odd_numbers, st.sampled_from(
                [n + 0.5, float(n), str(n), -n - 1])))
        elif where == "field":
            key = draw(st.sampled_from(["job", "step", "entries", "format", *NUMBER_FIELDS]))
            doc[key] = draw(st.one_of(json_values, st.just("other")))
            if draw(st.booleans()):
                del doc[key]
        elif where == "path":
            e["path"] = draw(st.sampled_from([
                "..", f"{step}/..", f"{step}/../../etc/cron.d/x", "/etc/passwd",
                f"/{step}/x", f"{step}/a\0b", f"{step}//x", f"{step}/./x", "", "other/x",
                f"{step}/" + "y" * 256, f"{step}/" + "y" * 5000, f"{step}\\..\\x", step]))
        elif where == "chunks":
            e["chunks"] = draw(st.one_of(st.lists(digests_one, max_size=5), json_values))
        elif where == "kind":
            e["kind"] = draw(st.sampled_from(["symlink", "special", "weird", "", "FILE"]))
            e["target"] = draw(st.sampled_from(["/etc", "../../..", "x", ""]))
            e["node"] = draw(st.sampled_from(["fifo", "char", "bogus"]))
        elif where == "huge-file":  # consistent, but sizes beyond what any counter holds
            n = draw(st.sampled_from([1, 2, 1024]))
            cs = draw(st.sampled_from([1 << 20, 1 << 28, 1 << 29, 1 << 62]))
            e.update(kind="file", size=n * cs, chunk_size=cs, chunks=[HELD_DIGESTS[0]] * n)
            if draw(st.booleans()):
                entries.append(dict(e, path=f"{step}/twin"))
        else:
            key = draw(st.sampled_from(ENTRY_NUMBERS))
            n = e.get(key, 0) if isinstance(e.get(key, 0), int) else 0
            e[key] = draw(st.one_of(odd_numbers, st.sampled_from([n + 0.5, str(n)])))
    return json.dumps(doc).encode()


@st.composite
def publish_requests(draw) -> pb.PublishManifestRequest:
    """Mostly a member's request with a manifest broken in one place; one in five has
    another job, an odd rank or an odd step name."""
    if draw(st.integers(0, 4)) == 0:
        job, rank, step = draw(jobs), draw(ranks), draw(steps)
    else:
        job, rank, step = JOB, draw(st.integers(0, NODES - 1)), draw(good_steps)
    step_number = draw(i64)
    if draw(st.integers(0, 5)) == 0:
        body_step, body_rank = draw(steps), draw(ranks)
    else:
        body_step, body_rank = step, rank
    body = draw(manifest_bodies(body_step, step_number, body_rank))
    return pb.PublishManifestRequest(job=job, rank=rank, step=step, step_number=step_number,
                                     manifest=body)


@fuzz(200)
@given(req=publish_requests())
@example(req=pb.PublishManifestRequest(job=JOB, rank=0, step="9", step_number=9, manifest=b"[]"))
def test_publish_manifest(server, req):
    before = server.daemon.stored()
    code, details, reply = outcome(lambda: server.stub.PublishManifest(req, timeout=TIMEOUT))
    check_status(code, details, req.SerializeToString())
    added, touched = changes(before, server.daemon.stored())
    if code is not grpc.StatusCode.OK:
        assert not added and not touched, (added, touched)
    else:
        rel = f"manifests/{req.rank}/{req.step}.json"
        assert (added | touched) <= {rel}
        assert server.daemon.read(rel) == req.manifest
        doc = json.loads(req.manifest)  # what was taken is what a member would send
        assert doc["job"] == JOB and doc["step"] == req.step
        for key, want in (("rank", req.rank), ("step_number", req.step_number)):
            assert type(doc.get(key, 0)) is int and doc.get(key, 0) == want, key
        assert type(doc["created_ns"]) is int and 0 <= doc["created_ns"] <= I64
        assert 0 <= req.step_number <= I64
        # what was stored lists back, bit-exact
        listed = list(server.stub.ListManifests(pb.ListManifestsRequest(
            job=JOB, rank=0, of_rank=req.rank, step=req.step), timeout=TIMEOUT))
        assert [m.manifest for m in listed] == [req.manifest]
        assert listed[0].step_number == req.step_number
    server.check_serving()


# -- bytes that are no message --------------------------------------------------------------

REQUEST_TYPES = {"HasChunks": pb.HasChunksRequest, "PutChunks": pb.PutChunksRequest,
                 "GetChunks": pb.GetChunksRequest, "PublishManifest": pb.PublishManifestRequest,
                 "ListManifests": pb.ListManifestsRequest}
KINDS = {"HasChunks": "unary_unary", "PutChunks": "stream_unary", "GetChunks": "unary_stream",
         "PublishManifest": "unary_unary", "ListManifests": "unary_stream"}
GOOD = {
    "HasChunks": pb.HasChunksRequest(job=JOB, rank=0, digests=HELD_DIGESTS),
    "PutChunks": pb.PutChunksRequest(job=JOB, rank=0, piece=pb.ChunkPiece(
        digest=HELD_DIGESTS[1], offset=0, total_size=len(HELD[1]), data=HELD[1])),
    "GetChunks": pb.GetChunksRequest(job=JOB, rank=0, digests=HELD_DIGESTS[:2]),
    "PublishManifest": pb.PublishManifestRequest(job=JOB, rank=0, step="1", step_number=1,
                                                 manifest=b"{}"),
    "ListManifests": pb.ListManifestsRequest(job=JOB, rank=0, of_rank=1),
}


@st.composite
def garbage(draw, method: str) -> bytes:
    good = GOOD[method].SerializeToString()
    kind = draw(st.sampled_from(["random", "flip", "truncate", "append", "bad-utf8",
                                 "huge-length", "groups", "wrong-type"]))
    if kind == "random":
        return draw(st.binary(max_size=600))
    if kind == "flip":
        b = bytearray(good)
        for _ in range(draw(st.integers(1, 8))):
            b[draw(st.integers(0, len(b) - 1))] = draw(st.integers(0, 255))
        return bytes(b)
    if kind == "truncate":
        return good[:draw(st.integers(0, len(good) - 1))]
    if kind == "append":
        return good + draw(st.binary(min_size=1, max_size=64))
    if kind == "bad-utf8":  # field 1 (job, a string) with bytes that are not UTF-8
        return b"\x0a\x04\xff\xfe\xc0\x80" + good
    if kind == "huge-length":  # field 1 claims 2^35 bytes
        return b"\x0a\x80\x80\x80\x80\x80\x01" + good
    if kind == "groups":  # start-group tags nested deeper than any parser allows
        return b"\x4b" * draw(st.sampled_from([50, 101, 5000])) + good
    other = draw(st.sampled_from(sorted(set(GOOD) - {method})))
    return GOOD[other].SerializeToString()


def parses(method: str, raw: bytes) -> bool:
    try:
        REQUEST_TYPES[method].FromString(raw)
        return True
    except DecodeError:
        return False


@fuzz(150)
@given(data=st.data(), method=st.sampled_from(sorted(REQUEST_TYPES)))
def test_bytes_that_are_no_message(server, data, method):
    raws = [data.draw(garbage(method)) for _ in range(
        data.draw(st.integers(1, 3)) if method == "PutChunks" else 1)]
    if method == "PutChunks" and data.draw(st.booleans()):
        raws.insert(0, GOOD[method].SerializeToString())  # a valid first message, then junk
    before = server.daemon.stored()
    call = server.raw(method, KINDS[method])
    if method == "PutChunks":
        code, details, _ = outcome(lambda: call(iter(raws), timeout=TIMEOUT))
    elif KINDS[method] == "unary_stream":
        code, details, _ = outcome(lambda: list(call(raws[0], timeout=TIMEOUT)))
    else:
        code, details, _ = outcome(lambda: call(raws[0], timeout=TIMEOUT))
    check_status(code, details, b"".join(raws))
    if not parses(method, raws[0]):
        assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert "not a valid" in details and REQUEST_TYPES[method].__name__ in details, details
    added, touched = changes(before, server.daemon.stored())
    assert not touched, touched
    for rel in added:
        h = os.path.basename(rel)
        assert rel == f"chunks/{h[:2]}/{h}" and chunk_hash(server.daemon.read(rel)) == h
    server.check_serving()


# -- limits that need a large input: one example each ---------------------------------------

def test_a_piece_larger_than_the_piece_limit_is_invalid_argument(server):
    data = b"\0" * (PIECE_BYTES + 1)
    before = server.daemon.stored()
    code, details, _ = outcome(lambda: server.stub.PutChunks(iter([pb.PutChunksRequest(
        job=JOB, rank=0, piece=pb.ChunkPiece(digest=chunk_hash(data), offset=0,
                                             total_size=len(data), data=data))]),
        timeout=TIMEOUT))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "piece" in details, details
    assert changes(before, server.daemon.stored()) == (set(), set())
    server.check_serving()


def test_a_put_stream_of_more_chunks_than_the_limit_is_invalid_argument(server):
    """Tiny chunks that all fail their hash: the reply would list each one, so a stream is
    bounded in chunks too, not only in bytes."""
    n = MAX_DIGESTS_PER_CALL + 1
    msgs = (pb.PutChunksRequest(job=JOB, rank=0, piece=pb.ChunkPiece(
        digest=HELD_DIGESTS[0], offset=0, total_size=1, data=b"?")) for _ in range(n))
    before = server.daemon.stored()
    code, details, _ = outcome(lambda: server.stub.PutChunks(msgs, timeout=60))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "chunks" in details, details
    assert changes(before, server.daemon.stored()) == (set(), set())
    server.check_serving()
