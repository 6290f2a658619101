"""The strict decoders of the coordination records read back from etcd (issue 39): member
records, step records, restore decisions, restore rounds (round number, entries,
decisions), the ranks in their keys and lock holders' names.

Fuzzed with hypothesis: for arbitrary bytes, arbitrary JSON values and structure-aware
objects (the fields each record has, with values of every JSON type, out of range, huge,
fractional, non-finite), each decoder returns a valid record or raises
:class:`~mtcfs.base.untrusted.BadRecord` with a one-line message, never another exception;
what the encoders write decodes back to the same record.

Then, against the tests' real etcd, what the callers do with a record that does not
decode: skip it, report it (``untrusted.REJECTED``), and carry on: the member view (also
after its watch failed), registration, the restore decision, restore rounds and a lock.

Short form (the test suite): a few hundred inputs per decoder, derandomized. Long form:
``MTCFS_FUZZ_EXAMPLES=20000`` (docs/fuzzing.md).
"""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from mtcfs.base import untrusted
from mtcfs.base.limits import MAX_NODES, MAX_STEP
from mtcfs.tiers.coord.etcd import prefix_end, put_op
from mtcfs.tiers.coord.keys import rank_of_key
from mtcfs.tiers.coord.lock import MAX_HOLDER_LEN, EtcdLock, holder_name
from mtcfs.tiers.coord.membership import MemberRecord, MemberView, Membership, member_key
from mtcfs.tiers.coord.rounds import (
    RestoreRounds, decode_round_decision, decode_round_entry, decode_round_number,
    encode_round_entry,
)
from mtcfs.tiers.coord.steps import (
    StepRecord, StepRecords, decode_decision, decode_step_record,
)
from support.etcd import etcd_client, etcd_prefix, etcd_server  # noqa: F401 (fixtures)
from support.fuzzing import decoded_or_bad, fuzz, one_line


# -- inputs ---------------------------------------------------------------------------------

#: Numbers near and past every bound a record has (ranks, steps, int64, floats).
ODD_NUMBERS = [0, 1, -1, 5, MAX_NODES - 1, MAX_NODES, MAX_STEP, MAX_STEP + 1, -MAX_STEP - 2,
               10 ** 30, 1.5, -0.0, 1e300, 2.0, 1e11, 1e12, True, False]
json_scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(ODD_NUMBERS),
                         st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                         st.text(max_size=20),
                         st.sampled_from(["", "1", "x" * 400, "a\nb", "\x00", "\u2028"]))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)),
    max_leaves=20)
#: Raw texts JSON parsers disagree on or that Python's json takes too kindly.
ODD_TEXTS = [b"", b"not json", b"[1]", b"null", b"5", b'"x"', b"NaN", b"Infinity",
             b'{"rank":1e400}', b'{"rank":NaN}', b'{"rank":1,"labels":5}', b"\xff\xfe",
             b"[" * 100_000 + b"]" * 100_000, b'{"rank":' + b"9" * 5000 + b"}",
             b'{"rank":1,"rank":2}', b"\xef\xbb\xbf{}", b"{} {}", b'{"a":"\\ud800"}']


def objects(fields: dict) -> st.SearchStrategy:
    """JSON objects with some of ``fields`` (name -> strategy of plausible values), their
    values at times replaced by any JSON value, plus a stray field."""
    def one(name, plausible):
        return st.tuples(st.just(name), st.one_of(plausible, json_values))
    return st.builds(
        lambda picked, extra: dict(picked + extra),
        st.lists(st.one_of(*[one(n, s) for n, s in fields.items()]), max_size=len(fields) + 1),
        st.lists(st.tuples(st.text(max_size=6), json_values), max_size=1))


ranks = st.one_of(st.integers(0, MAX_NODES - 1), st.sampled_from(ODD_NUMBERS))
steps_lists = st.one_of(st.lists(st.integers(0, MAX_STEP), max_size=20),
                        st.lists(st.sampled_from(ODD_NUMBERS), max_size=5),
                        st.just(list(range(2000))))
MEMBER = objects({"rank": ranks, "address": st.sampled_from(["127.0.0.1:7470", "", "a\x01"]),
                  "labels": st.dictionaries(st.text(max_size=5), st.text(max_size=5),
                                            max_size=3),
                  "boot": st.text(max_size=70), "incarnation": st.integers(),
                  "since": st.floats()})
STEPS = objects({"rank": ranks, "steps": steps_lists, "boot": st.text(max_size=70),
                 "at": st.floats()})
DECISION = objects({"step": st.one_of(st.none(), st.integers()), "ranks_recorded": ranks,
                    "missing": st.lists(ranks, max_size=4), "decided_by": ranks,
                    "at": st.floats(), "incarnation": st.one_of(st.integers(), st.text())})
ENTRY = objects({"rank": ranks, "steps": steps_lists, "nonce": st.text(max_size=70),
                 "at": st.floats()})
ROUND_DECISION = objects({"round": st.integers(), "step": st.one_of(st.none(), st.integers()),
                          "decided_by": ranks, "at": st.floats()})


def bodies(structured: st.SearchStrategy) -> st.SearchStrategy:
    """What a record's value may be: bytes, any JSON, or an object of its own fields."""
    return st.one_of(st.binary(max_size=200), st.sampled_from(ODD_TEXTS),
                     json_values.map(lambda v: json.dumps(v).encode()),
                     structured.map(lambda v: json.dumps(v).encode()))


def _valid_member(r: MemberRecord) -> None:
    assert 0 <= r.rank < MAX_NODES and isinstance(r.rank, int) and not isinstance(r.rank, bool)
    assert isinstance(r.address, str) and len(r.address) <= 300 and r.address.isprintable()
    assert isinstance(r.labels, dict) and len(r.labels) <= 64
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in r.labels.items())
    assert isinstance(r.boot, str) and len(r.boot) <= 64
    assert type(r.incarnation) is int and 0 <= r.incarnation <= untrusted.INT64_MAX
    assert isinstance(r.since, float) and math.isfinite(r.since) and 0 <= r.since <= 1e11
    time.localtime(r.since)  # what status and RankTaken's message do with it


# -- the decoders, fuzzed -------------------------------------------------------------------

@fuzz(200)
@given(bodies(MEMBER), st.one_of(st.none(), st.integers(0, 9)))
@example(b"[1]", 9)
@example(b'{"rank":1e400}', None)
@example(b'{"rank":1,"labels":5}', 1)
@example(b'{"rank":1,"address":"127.0.0.1:1"}', 3)
def test_member_record_decodes_or_is_refused(body, key_rank):
    rec = decoded_or_bad(MemberRecord.decode, body, key_rank)
    if rec is not None:
        _valid_member(rec)
        assert key_rank is None or rec.rank == key_rank


@fuzz(200)
@given(st.builds(MemberRecord, rank=st.integers(0, MAX_NODES - 1),
                 address=st.sampled_from(["", "127.0.0.1:7470", "[::1]:1", "h" * 300]),
                 labels=st.dictionaries(st.sampled_from(["zone", "block", "rack"]),
                                        st.text(max_size=20).filter(str.isprintable)),
                 boot=st.text(max_size=64).filter(str.isprintable),
                 incarnation=st.integers(0, untrusted.INT64_MAX),
                 since=st.floats(0, 1e11)))
def test_member_record_round_trips(rec):
    assert MemberRecord.decode(rec.encode(), rec.rank) == rec


@fuzz(200)
@given(bodies(STEPS), st.one_of(st.none(), st.integers(0, 3)))
@example(b'{"rank":1,"steps":[1e400]}', 1)
@example(b'{"rank":1,"steps":[1.0]}', 1)
@example(b'{"rank":1,"steps":[-1]}', 1)
def test_step_record_decodes_or_is_refused(body, key_rank):
    rec = decoded_or_bad(decode_step_record, body, key_rank)
    if rec is not None:
        assert key_rank is None or rec.rank == key_rank
        assert len(rec.steps) <= 1024
        assert all(type(s) is int and 0 <= s <= MAX_STEP for s in rec.steps)
        assert math.isfinite(rec.at) and isinstance(rec.boot, str)


@fuzz(100)
@given(st.builds(StepRecord, rank=st.integers(0, MAX_NODES - 1),
                 steps=st.frozensets(st.integers(0, MAX_STEP), max_size=16),
                 boot=st.text(max_size=64), at=st.floats(0, 1e10)))
def test_step_record_round_trips(rec):
    assert decode_step_record(rec.encode(), rec.rank) == rec


@fuzz(200)
@given(bodies(DECISION))
@example(b"not json")
@example(b"[1]")
@example(b'{"step":1e400}')
@example(b'{"step":true}')
def test_restore_decision_decodes_or_is_refused(body):
    d = decoded_or_bad(decode_decision, body)
    if d is not None:
        assert d["step"] is None or (type(d["step"]) is int and 0 <= d["step"] <= MAX_STEP)
        assert all(0 <= r < MAX_NODES for r in d["missing"])
        assert 0 <= d["decided_by"] < MAX_NODES and math.isfinite(d["at"])
        json.dumps(d, allow_nan=False)  # shown in mtcfs status --json as it is


@fuzz(100)
@given(st.fixed_dictionaries({"step": st.one_of(st.none(), st.integers(0, MAX_STEP)),
                              "ranks_recorded": st.integers(0, MAX_NODES),
                              "missing": st.lists(st.integers(0, MAX_NODES - 1), max_size=8),
                              "decided_by": st.integers(0, MAX_NODES - 1),
                              "at": st.floats(0, 1e10)},
                             optional={"incarnation": st.one_of(st.integers(0, 99),
                                                                st.text(max_size=64))}))
def test_restore_decision_round_trips(decision):
    assert decode_decision(json.dumps(decision, separators=(",", ":")).encode()) == decision


@fuzz(150)
@given(st.one_of(st.binary(max_size=30), st.integers().map(lambda i: str(i).encode()),
                 st.sampled_from([b"0", b"1", b" 1", b"1 ", b"+1", b"1_0", b"\xd9\xa3",
                                  b"9" * 19, b"9" * 20, str(untrusted.INT64_MAX).encode()])))
def test_round_number_decodes_or_is_refused(body):
    k = decoded_or_bad(decode_round_number, body)
    if k is not None:
        assert 1 <= k <= untrusted.INT64_MAX and body == str(k).encode().rjust(len(body), b"0")


@fuzz(150)
@given(bodies(ENTRY), st.one_of(st.none(), st.integers(0, 3)))
def test_round_entry_decodes_or_is_refused(body, key_rank):
    got = decoded_or_bad(decode_round_entry, body, key_rank)
    if got is not None:
        steps, nonce = got
        assert all(type(s) is int and 0 <= s <= MAX_STEP for s in steps)
        assert isinstance(nonce, str) and len(nonce) <= 64


@fuzz(100)
@given(st.integers(0, MAX_NODES - 1), st.lists(st.integers(0, MAX_STEP), max_size=20),
       st.text(max_size=64), st.floats(0, 1e10))
def test_round_entry_round_trips(rank, steps, nonce, at):
    body = encode_round_entry(rank, steps, nonce, at)
    assert decode_round_entry(body, rank) == (sorted(set(steps)), nonce)


@fuzz(150)
@given(bodies(ROUND_DECISION))
def test_round_decision_decodes_or_is_refused(body):
    step = decoded_or_bad(decode_round_decision, body)
    assert step is None or (type(step) is int and 0 <= step <= MAX_STEP)


@fuzz(150)
@given(st.one_of(st.binary(max_size=12).map(lambda b: b"/p/members/" + b),
                 st.integers(-5, 10 ** 7).map(lambda r: f"/p/members/{r:06d}".encode()),
                 st.sampled_from([b"/p/members/", b"/p/members/00000\xd9\xa3",
                                  b"/p/other/000001", b"/p/members/ 00001"])))
def test_rank_of_key(key):
    r = decoded_or_bad(rank_of_key, key, b"/p/members/")
    if r is not None:
        assert 0 <= r < MAX_NODES and key == b"/p/members/" + f"{r:06d}".encode()


@fuzz(200)
@given(st.binary(max_size=2000))
def test_holder_name_is_one_short_line(value):
    name = holder_name(value)
    assert len(name) <= MAX_HOLDER_LEN and name.isprintable()


# -- what the callers do with a bad record, against a real etcd -----------------------------

TTL = 2


def _refused(kind: str, key: bytes) -> int:
    """How many of the last refusals name ``key`` as ``kind``."""
    return sum(1 for x in untrusted.REJECTED.snapshot()["last"]
               if x["kind"] == kind and x["key"] == key.decode())


def _until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(0.02)
    return got


def test_member_view_skips_bad_records_and_joins(client, etcd_prefix):  # noqa: F811
    bad = {9: b"[1]", 8: b"null", 7: b"5", 6: b'{"rank":1e400}', 5: b'{"rank":1,"labels":5}',
           4: b"not json", 3: b'{"rank":1,"address":"10.9.9.9:1"}'}  # key and body disagree
    for r, body in bad.items():
        client.put(member_key(etcd_prefix, r), body)
    # rank 2's key holds a record no daemon wrote (no lease): rank 2 takes it at once
    client.put(member_key(etcd_prefix, 2), b"[2]")
    ms = [Membership(client, etcd_prefix, r, f"10.0.0.{r}:7000", ttl_s=TTL) for r in (1, 2)]
    try:
        t0 = time.monotonic()
        for m in ms:
            m.join(wait_s=30)
        assert time.monotonic() - t0 < TTL, "registration waited on a record nobody holds"
        view = ms[0].wait_for(2, timeout=5)
        assert sorted(view) == [1, 2] and view[1].address == "10.0.0.1:7000", view
        for r in bad:
            assert _refused("member", member_key(etcd_prefix, r)), r
        # one written while the watch runs is skipped too; a good record replaced by a bad
        # one leaves the view, as a reload would find
        client.put(member_key(etcd_prefix, 11), b'{"rank":11,"labels":{"a":1}}')
        client.put(member_key(etcd_prefix, 2), b'{"rank":2,"since":-1}')
        _until(lambda: sorted(ms[0].view()) == [1], 5, "rank 2's spoiled record leaves")
        assert _refused("member", member_key(etcd_prefix, 11))
        # and the watches live on: rank 1 leaving is seen by rank 2
        assert ms[1].alive(1)
        ms[0].leave()
        _until(lambda: not ms[1].alive(1), 5, "rank 1 seen gone")
    finally:
        for m in ms:
            m.leave()


def test_member_view_watch_restarts_after_any_failure(client, etcd_prefix,  # noqa: F811
                                                     monkeypatch):
    view = MemberView(client, etcd_prefix)
    real = MemberView._apply
    failures = []

    def flaky(self, events, revision):
        if events and not failures:
            failures.append(1)
            raise TypeError("a bug in the view")  # what a bad record used to raise
        return real(self, events, revision)

    monkeypatch.setattr(MemberView, "_apply", flaky)
    m = Membership(client, etcd_prefix, 0, "10.0.0.0:1", ttl_s=TTL, watch=False)
    view.start()
    try:
        m.join()
        # the event that failed is not lost: the restarted watch reads the view again
        _until(lambda: view.alive(0), 10, "rank 0 seen after the watch's restart")
        assert failures and view._thread is not None and view._thread.is_alive()
        # ... and says so: mtcfs status's restarted_loops (and its 'restarts:' line)
        row = untrusted.RESTARTS.snapshot()["membership watch"]
        assert row["restarts"] >= 1 and "a bug in the view" in row["last_error"]
        m.stop()  # as kill -9: the lease expires
        _until(lambda: not view.alive(0), 3 * TTL + 5, "rank 0 seen dead")
    finally:
        view.stop()
        m.leave()


def test_a_loop_that_keeps_failing_is_restarted_ever_more_slowly_and_never_given_up():
    """supervise(): restarts after pause_s, doubling to max_pause_s while the loop keeps
    failing (here 0.05 s doubling to 0.2 s), for as long as it fails; a run that lasted
    healthy_s starts the pause over; each restart is noted in untrusted.RESTARTS."""
    stop = threading.Event()
    runs: list[float] = []
    name = f"t1 loop {time.monotonic_ns()}"

    def loop():
        runs.append(time.monotonic())
        if len(runs) == 8:
            time.sleep(0.35)  # a healthy run (healthy_s=0.3): the pause starts over
        if len(runs) >= 10:
            stop.set()
            return
        raise OSError(f"failure {len(runs)}")

    untrusted.supervise(name, loop, stop, pause_s=0.05, max_pause_s=0.2, healthy_s=0.3)
    gaps = [b - a for a, b in zip(runs, runs[1:])]
    assert len(runs) == 10
    # 0.05, 0.1, 0.2, 0.2, ...: the cap holds and is reached
    assert gaps[0] < 0.15 and all(g >= 0.18 for g in gaps[2:7]), gaps
    assert gaps[7] < 0.35 + 0.15, gaps  # after the healthy run: 0.05 again, not 0.2
    row = untrusted.RESTARTS.snapshot()[name]
    assert row["restarts"] == 9 and row["last_error"] == "OSError: failure 9"


def test_bad_restore_decisions_are_decided_again(client, etcd_prefix):  # noqa: F811
    recs = [StepRecords(client, etcd_prefix, r) for r in range(2)]
    recs[0].record([10, 20])
    recs[1].record([10])
    current = f"{etcd_prefix}restore/current".encode()
    for body in (b"not json", b"[1]", b'{"step":1e400}', b'{"step":"20"}'):
        client.put(current, body)
        d = recs[1].decide_current(2)
        assert d["step"] == 10 and d["decided_by"] == 1, (body, d)
        assert decode_decision(client.get(current)[0].value) == d  # replaced, for all
        assert _refused("restore", current)
    # the per-incarnation decision: replaced too
    client.put(recs[0].decision_key(7), b"null")
    assert recs[0].decide_restore(2, 7, wait_s=0)["step"] == 10
    # a bad step record (its own rank's, or another's) is a rank without a record
    steps1 = f"{etcd_prefix}steps/000001".encode()
    client.put(steps1, b'{"rank":1,"steps":[1e400]}')
    assert recs[1].load() == set() and _refused("steps", steps1)
    d = recs[0].decide_current(2)
    assert d["step"] == 20 and d["missing"] == [1], d
    client.put(steps1, b'{"rank":0,"steps":[10,20,30]}')  # key and body disagree
    assert recs[0].records(2) == {0: {10, 20}}
    recs[1].record([10])
    assert recs[0].records(2) == {0: {10, 20}, 1: {10}}


def test_restore_rounds_survive_bad_records(client, etcd_prefix):  # noqa: F811
    rounds = [RestoreRounds(client, etcd_prefix, r, 2) for r in range(2)]
    round_key = f"{etcd_prefix}mtc/round".encode()
    # a round number that is none: replaced by one no round used yet
    client.put(round_key, b"x")
    out: list = []
    t = threading.Thread(target=lambda: out.append(rounds[0].agree_sync([1, 2], wait_s=20)))
    t.start()
    try:
        _until(lambda: rounds[0].waiting_for == [1], 10, "rank 0 waits for rank 1")
        k = rounds[0].last_round
        assert k > 1 and client.get(round_key)[0].value == str(k).encode()
        assert _refused("round", round_key)
        # the round's decision spoiled before it is taken, and rank 0's own entry
        # overwritten: rank 0 puts its entry back, the decision is taken again
        decision = f"{etcd_prefix}mtc/decision-{k}".encode()
        entry0 = f"{etcd_prefix}mtc/round-{k}/000000".encode()
        client.put(decision, b"[1]")
        client.put(entry0, b'{"rank":0,"steps":[1e400]}')
        assert rounds[1].agree_sync([2, 3], wait_s=20) == 2
    finally:
        t.join(30)
    assert out == [2]
    assert _refused("round_decision", decision) and _refused("round_entry", entry0)
    assert decode_round_decision(client.get(decision)[0].value) == 2


class _Polls:
    """An etcd client that counts its transactions (a waiting rank's polls)."""

    def __init__(self, real) -> None:
        self.real, self.txns = real, 0

    def txn(self, *args, **kw):
        self.txns += 1
        return self.real.txn(*args, **kw)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_spoiled_decision_then_a_newer_round_is_decided(client, etcd_prefix):  # noqa: F811
    """Ranks 0 and 2 wait in round 1 and read its decision, which does not decode; then a
    newer round opens and rank 1 joins it. The spoiled decision's revision was kept as the
    guard of the next round's decision, whose write then never succeeded: the ranks spun on
    it with no pause and no deadline (found in review)."""
    polls = {r: _Polls(client) for r in (0, 2)}
    ranks = {r: RestoreRounds(polls[r], etcd_prefix, r, 3) for r in (0, 2)}
    out: dict = {}
    ts = [threading.Thread(target=lambda r=r: out.__setitem__(
        r, ranks[r].agree_sync([4, 5], wait_s=20)), daemon=True) for r in ranks]
    for t in ts:
        t.start()
    area = f"{etcd_prefix}mtc/".encode()
    entries = area + b"round-1/"
    _until(lambda: len(client.range(entries, prefix_end(entries))[0]) == 2, 10,
           "ranks 0 and 2 in round 1")
    decision = area + b"decision-1"
    client.put(decision, b"[1]")
    seen = {r: polls[r].txns for r in polls}
    _until(lambda: all(polls[r].txns >= seen[r] + 2 for r in polls), 10,
           "both ranks polled the spoiled decision")
    client.put(area + b"round", b"2")  # a newer round (as a restarted rank opens one)
    assert RestoreRounds(client, etcd_prefix, 1, 3).join([5, 6]) == 2
    for t in ts:
        t.join(30)
    assert out == {0: 5, 2: 5}
    assert decode_round_decision(client.get(area + b"decision-2")[0].value) == 5


def test_lock_holder_name_from_any_bytes(client, etcd_prefix):  # noqa: F811
    key = f"{etcd_prefix}locks/sweep".encode()
    client.txn([], [put_op(key, b"\xff\xfe\n" + b"x" * 5000)])
    lock = EtcdLock(client, etcd_prefix, "sweep", ttl_s=TTL)
    name = lock.holder()
    assert name is not None and name.isprintable() and len(name) <= MAX_HOLDER_LEN
    with pytest.raises(Exception) as exc:
        lock.acquire(timeout=0.2)
    one_line(str(exc.value))
