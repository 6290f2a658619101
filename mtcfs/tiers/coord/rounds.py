"""Restore rounds in etcd: every rank of a restarting job restores the same step.

Orbax's multi-tier checkpointing restores each process from its own node's directory and
never checks that they restored the same step (../shared/reference/orbax-mtc-protocol.md);
given different steps, the global arrays silently mix them. Google's replicator takes the
decision in its ZeroMQ coordinator (GoogleCloudPlatform/checkpoint-replicator). Here etcd
orders it, with no protocol of our own beyond three kinds of keys under the job's prefix:

* ``<area>/round``: the current round number (created at 1);
* ``<area>/round-<k>/<rank:06d>``: rank's entry in round ``k``: the steps it can restore;
* ``<area>/decision-<k>``: the step round ``k`` restores, written once (create-if-absent)
  by whichever rank sees every rank's entry first: the newest step present in all of them,
  or null (nothing in common: start from scratch).

A rank that asks for a restore joins the current round, unless its entry is already there
(its trainer restarted since): then it opens round ``k + 1`` with a compare-and-set on
``<area>/round`` and joins that; the others, asking later, find it current. The same
transaction deletes round ``k - 1``'s entries and round ``k - 2``'s decision: etcd holds
the entries of two rounds and three decisions at most, never one set per restart. A rank that
asks after the decision of the round it joins takes that decision. The round waits for
every rank's entry up to ``wait_s``; past it, the caller gets :class:`RoundTimeout` naming
the ranks that never asked (a decision without them could name a step they lack).

Records read back are decoded strictly (:func:`decode_round_number`,
:func:`decode_round_entry`, :func:`decode_round_decision`) and one that does not decode is
refused (``untrusted.REJECTED``): a round number is replaced (compare-and-set) by its own
mod revision, above every round opened before, and the ranks follow that round; an entry
counts as not joined (a rank puts its own back); a decision is taken again.

Load: per restore, per rank, about three small transactions (the join's also counts the
round's entries: the rank that completes the round knows it and decides at once), then
polls of two keys (the decision, the round) capped near ``POLLS_PER_S`` in all, a count of
the entries every ``COUNT_EVERY_S`` s or so, and a read of them to name the missing ranks
every ``NAME_EVERY_S`` s or so (docs/benchmarks.md, "Coordination at scale").
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Iterable
from typing import Any

import trio

from mtcfs.base import untrusted
from mtcfs.base.limits import MAX_NODES, MAX_STEP
from mtcfs.base.untrusted import BadRecord
from mtcfs.tiers.coord._pb import etcd_v3_subset_pb2 as pb
from mtcfs.tiers.coord.etcd import (
    Etcd, EtcdError, EtcdUnavailable, absent, delete_op, get_op, mod_is, prefix_end, put_op,
)
from mtcfs.tiers.coord.keys import rank_key, rank_of_key

#: Seconds a round waits for every rank's entry.
WAIT_S = 600.0
#: Polls per second of all the waiting ranks together, once a wait is long (each rank
#: polls at most every ``max(0.5, nodes / POLLS_PER_S)`` s): at 1,000 ranks polling every
#: 0.5 s, etcd on 2 shared cores fell behind and leases expired (docs/benchmarks.md).
POLLS_PER_S = 250.0
#: Seconds between two reads of a round's entries while it fills (to name the missing
#: ranks; at least ``nodes / 10``); the polls between read the decision and the round.
NAME_EVERY_S = 5.0
#: Seconds between two counts of a round's entries by a waiting rank (at least
#: ``nodes / COUNTS_PER_S``): how long a round whose completing rank died before it
#: wrote the decision waits for another rank to write it.
COUNT_EVERY_S = 2.0
COUNTS_PER_S = 100.0


#: Largest round entry or decision accepted, bytes (an entry lists the steps a rank can
#: restore: RAM, peers and the backup tier).
MAX_ENTRY_BYTES = 1 << 20
#: Most steps a round entry may list.
MAX_ENTRY_STEPS = 1 << 16
#: Longest nonce an entry may carry (this code writes 32 hex digits).
MAX_NONCE_LEN = 64
#: Most digits of a round number (int64).
_ROUND_DIGITS = 19


class RoundTimeout(EtcdError):
    """Not every rank joined the round in time (one line names the missing ranks)."""


def decode_round_number(body: bytes) -> int:
    """The round number ``<area>/round`` holds: ASCII digits, ``1..2**63-1``.

    Raises:
        BadRecord: anything else (one line).
    """
    if not body or len(body) > _ROUND_DIGITS or not all(0x30 <= c <= 0x39 for c in body):
        raise BadRecord(f"not a round number ({len(body)} bytes, not 1-{_ROUND_DIGITS} "
                        "ASCII digits)")
    k = int(body)
    if not 1 <= k <= untrusted.INT64_MAX:
        raise BadRecord(f"round {k} is outside 1..{untrusted.INT64_MAX}")
    return k


def encode_round_entry(rank: int, steps: Iterable[int], nonce: str, at: float) -> bytes:
    """A round entry's JSON (what :func:`decode_round_entry` reads; steps ascending)."""
    return json.dumps({"rank": rank, "steps": sorted(set(int(s) for s in steps)),
                       "nonce": nonce, "at": at}, separators=(",", ":")).encode()


def decode_round_entry(body: bytes | str, rank: int | None = None) -> tuple[list[int], str]:
    """(steps, nonce) of a rank's round entry (``{"rank", "steps", "nonce", "at"}``).

    Args:
        body: the value read from etcd; rank: the rank its key names (the body must name
            the same), None: not checked.

    Raises:
        BadRecord: not a JSON object of at most :data:`MAX_ENTRY_BYTES`; ``rank`` missing,
            not a rank or not ``rank``; ``steps`` missing or not an array of at most
            :data:`MAX_ENTRY_STEPS` integers in ``0..MAX_STEP``; ``nonce`` not a string of
            at most 64 characters; ``at`` not a finite number >= 0 (one line).
    """
    d = untrusted.json_object(body, MAX_ENTRY_BYTES)
    got = untrusted.field_int(d, "rank", 0, MAX_NODES - 1)
    if rank is not None and got != rank:
        raise BadRecord(f"the entry names rank {got}, its key rank {rank}")
    steps = untrusted.field_int_list(d, "steps", 0, MAX_STEP, MAX_ENTRY_STEPS)
    nonce = untrusted.field_str(d, "nonce", MAX_NONCE_LEN, default="")
    untrusted.field_float(d, "at", default=0.0)
    return steps, nonce


def decode_round_decision(body: bytes | str) -> int | None:
    """The step a round's decision (``{"round", "step", "decided_by", "at"}``) restores
    (None: nothing in common).

    Raises:
        BadRecord: not a JSON object of at most :data:`MAX_ENTRY_BYTES`; ``step`` missing,
            or neither null nor an integer in ``0..MAX_STEP``; ``round`` not an integer
            >= 1; ``decided_by`` not a rank; ``at`` not a finite number >= 0 (one line).
    """
    d = untrusted.json_object(body, MAX_ENTRY_BYTES)
    if "step" not in d:
        raise BadRecord("step is missing")
    untrusted.field_int(d, "round", 1, default=1)
    untrusted.field_int(d, "decided_by", 0, MAX_NODES - 1, default=0)
    untrusted.field_float(d, "at", default=0.0)
    return None if d["step"] is None else untrusted.field_int(d, "step", 0, MAX_STEP)


class RestoreRounds:
    """One rank's side of the restore rounds under ``<prefix><area>/``.

    Args:
        etcd: the job's etcd client.
        prefix: the job's key prefix; area: the sub-prefix (``mtc`` for Orbax's protocol).
        rank, nodes: this rank and the job's size.
    """

    def __init__(self, etcd: Etcd, prefix: str, rank: int, nodes: int,
                 area: str = "mtc") -> None:
        self.etcd = etcd
        self.rank = rank
        self.nodes = nodes
        self.base = f"{prefix}{area}/"
        self.round_key = f"{self.base}round".encode()
        self.last_round = 0
        #: Entries round :attr:`last_round` had when this rank joined it (0: not known).
        self.joined_count = 0
        self.waiting_for: list[int] = []

    def _entries(self, k: int) -> bytes:
        return f"{self.base}round-{k}/".encode()

    def _entry(self, k: int) -> bytes:
        return self._entries(k) + rank_key(self.rank)

    def _entry_body(self, steps: Iterable[int], nonce: str) -> bytes:
        return encode_round_entry(self.rank, steps, nonce, round(time.time(), 3))

    def _round_of(self, kv: Any) -> int | None:
        """The round number ``kv`` (``<area>/round``) holds; None when it does not decode:
        then it is replaced (compare-and-set on its mod revision, so every rank writes
        the same) by that mod revision, a number above every round opened before (each
        round number was written at a revision at least as high), and the caller reads
        it again."""
        try:
            return decode_round_number(kv.value)
        except BadRecord as exc:
            untrusted.REJECTED.reject("round", kv.key, str(exc))
        self.etcd.txn([mod_is(self.round_key, kv.mod_revision)],
                      [put_op(self.round_key, str(int(kv.mod_revision)).encode())],
                      retry=True)
        return None

    def _decision(self, k: int) -> bytes:
        return f"{self.base}decision-{k}".encode()

    def _count_op(self, k: int) -> pb.RequestOp:
        """A count-only range of round ``k``'s entries (one number, not N records)."""
        entries = self._entries(k)
        return pb.RequestOp(request_range=pb.RangeRequest(
            key=entries, range_end=prefix_end(entries), count_only=True))

    def join(self, steps: Iterable[int], *, timeout: float = 30.0, nonce: str = "") -> int:
        """Join the current round (or open the next, see the module docstring) with the
        steps this rank can restore; returns the round number. :attr:`joined_count` is
        then the number of entries the round had with this one (0: not known, a join
        etcd had applied before its answer was lost).

        Raises:
            EtcdError: etcd did not answer within ``timeout``.
        """
        # the nonce tells this restore's own entry (an attempt etcd applied whose answer was
        # lost, then retried) from an entry of an earlier restart of this rank
        nonce = nonce or uuid.uuid4().hex
        body = self._entry_body(steps, nonce)
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:
                raise EtcdError(f"could not join a restore round within {timeout:g} s")
            kv, _rev = self.etcd.get(self.round_key)
            if kv is None:
                self.etcd.txn([absent(self.round_key)], [put_op(self.round_key, b"1")],
                              retry=True)
                continue
            k = self._round_of(kv)
            if k is None:
                continue
            r = self.etcd.txn([mod_is(self.round_key, kv.mod_revision),
                               absent(self._entry(k))],
                              [put_op(self._entry(k), body), self._count_op(k)],
                              [get_op(self._entry(k))], retry=True)
            got = [] if r.succeeded else r.responses[0].response_range.kvs
            if r.succeeded or (got and _nonce_of(got[0].value) == nonce):
                self.last_round = k
                self.joined_count = (int(r.responses[1].response_range.count)
                                     if r.succeeded else 0)
                return k
            if got:
                # This rank is in round k already: its trainer restarted, so the job
                # restarts again: open round k + 1 (unless the round moved meanwhile),
                # and delete round k - 1's entries (no rank reads them once round k is
                # open: etcd keeps two rounds' entries) and round k - 2's decision (a
                # rank still behind in round k - 1 finds that one's).
                older = self._entries(k - 1)
                self.etcd.txn([mod_is(self.round_key, kv.mod_revision)],
                              [put_op(self.round_key, str(k + 1).encode()),
                               delete_op(older, prefix_end(older)),
                               delete_op(self._decision(k - 2))], retry=True)
            if time.monotonic() > deadline:
                raise EtcdError(f"could not join a restore round within {timeout:g} s")

    def agree_sync(self, steps: Iterable[int], *, wait_s: float = WAIT_S) -> int | None:
        """Join a round with ``steps`` and return the step it restores (None: nothing),
        once every rank joined. When a newer round opens before this one is decided (a
        rank's trainer restarted again), this rank follows it with the same steps.

        Raises:
            RoundTimeout: ranks missing after ``wait_s`` (one line naming them).
            EtcdError: etcd did not answer (after its own deadline).
        """
        steps = list(steps)
        deadline = time.monotonic() + wait_s
        nonce = uuid.uuid4().hex  # one per restore: a retried join finds its own entry
        while True:  # a busy etcd's timeouts are retried within the round's wait
            try:
                return self._agree(steps, nonce, deadline, wait_s)
            except RoundTimeout:
                raise
            except EtcdUnavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(random.uniform(0.5, 1.5))

    def _agree(self, steps: list[int], nonce: str, deadline: float,
               wait_s: float) -> int | None:
        """The wait of :meth:`agree_sync` for round ``k``'s decision.

        The rank whose join completes the round (its join's count is ``nodes``) reads the
        entries once and writes the decision at once; the others poll the decision and the
        round number only (two keys), at most ``POLLS_PER_S`` polls per second in all, and
        count the entries every ``COUNT_EVERY_S`` s or so (the decision of a round whose
        completing rank died before it wrote one), reading them when the count is complete
        and every ``NAME_EVERY_S`` s or so to name the missing ranks. A round is then
        read whole about once (by the rank that completes it), O(N) records, where every
        rank reading every entry when its poll found the round complete was O(N^2)
        (45 s for a round of 1,000: docs/benchmarks.md, "Coordination at scale").
        """
        k = self.join(steps, nonce=nonce)
        complete = self.joined_count >= self.nodes
        pause = 0.1
        # N ranks poll while a round fills: their rate is capped near POLLS_PER_S in all
        most = max(0.5, self.nodes / POLLS_PER_S)
        count_every = max(COUNT_EVERY_S, self.nodes / COUNTS_PER_S)
        # and the reads of every entry (N records each) at most ~10 per second in all
        name_every = max(NAME_EVERY_S, self.nodes / 10.0)
        # when the entries were last counted, and read (the first read, to name the
        # missing ranks, NAME_EVERY_S after the join)
        counted = time.monotonic()
        named = counted - name_every + NAME_EVERY_S
        self.waiting_for = []
        bad = 0  # mod revision of a decision that does not decode (replaced when decided)
        while True:
            dkey = self._decision(k)
            if not complete:
                r = self.etcd.txn([], [get_op(dkey), get_op(self.round_key)], retry=True)
                got = r.responses[0].response_range.kvs
                if got:
                    try:
                        step = decode_round_decision(got[0].value)
                        self.waiting_for = []
                        return step
                    except BadRecord as exc:
                        untrusted.REJECTED.reject("round_decision", got[0].key, str(exc))
                        bad = int(got[0].mod_revision)
                current = r.responses[1].response_range.kvs
                if current:
                    now = self._round_of(current[0])
                    if now is None or now > k:
                        # undecided, left behind (or the round number was replaced): follow
                        k = self.join(steps, nonce=nonce)
                        complete = self.joined_count >= self.nodes
                        bad, self.waiting_for = 0, []  # (the old round's, not this one's)
                        continue
                t = time.monotonic()
                if t >= counted + count_every or t >= min(deadline, named + name_every):
                    counted = t
                    n = self.etcd.txn([], [self._count_op(k)], retry=True)
                    complete = int(n.responses[0].response_range.count) >= self.nodes
                if not (complete or t >= min(deadline, named + name_every)):
                    time.sleep(pause * random.uniform(0.8, 1.2))
                    pause = min(pause * 1.5, most)
                    continue
            # complete, or time to say again who is missing: read the entries
            named = time.monotonic()
            decided, step = self._decide(k, steps, nonce, bad)
            if decided:
                self.waiting_for = []
                return step
            complete = False  # (not every rank's entry decodes, or another rank decided)
            if time.monotonic() >= deadline:
                raise RoundTimeout(
                    f"restore round {k}: rank(s) {self.waiting_for[:10]} did not ask for a "
                    f"restore within {wait_s:g} s" if self.waiting_for else
                    f"restore round {k}: every rank asked, but no decision could be written"
                    f" or read within {wait_s:g} s")
            time.sleep(pause * random.uniform(0.8, 1.2))
            pause = min(pause * 1.5, most)

    def _decide(self, k: int, steps: list[int], nonce: str,
                bad: int) -> tuple[bool, int | None]:
        """Read round ``k``'s entries; when every rank's is there, write the decision
        (create-if-absent, or over a decision at mod revision ``bad`` that does not
        decode). Returns (True, step) when this rank wrote it, else (False, None), with
        :attr:`waiting_for` the ranks whose entries are missing (empty when the round was
        complete but another rank's decision came first: the next poll reads it)."""
        entries, dkey = self._entries(k), self._decision(k)
        kvs, _rev, _more, _n = self.etcd.range(entries, prefix_end(entries))
        joined: dict[int, set[int]] = {}
        mine_bad = 0  # mod revision of this rank's own entry when it does not decode
        for kv in kvs:
            try:
                rank = rank_of_key(kv.key, entries)
                got_steps, _nonce = decode_round_entry(kv.value, rank)
            except BadRecord as exc:
                untrusted.REJECTED.reject("round_entry", kv.key, str(exc))
                if kv.key == self._entry(k):
                    mine_bad = int(kv.mod_revision)
                continue
            if rank < self.nodes:
                joined[rank] = set(got_steps)
        if mine_bad:
            # this rank's entry was overwritten: put it back (the others wait for it)
            self.etcd.txn([mod_is(self._entry(k), mine_bad)],
                          [put_op(self._entry(k), self._entry_body(steps, nonce))],
                          retry=True)
        self.waiting_for = [x for x in range(self.nodes) if x not in joined]
        if self.waiting_for:
            return False, None
        common = set.intersection(*joined.values()) if joined else set()
        step = max(common) if common else None
        body = json.dumps({"round": k, "step": step, "decided_by": self.rank,
                           "at": round(time.time(), 3)}, separators=(",", ":")).encode()
        guard = mod_is(dkey, bad) if bad else absent(dkey)
        w = self.etcd.txn([guard], [put_op(dkey, body)], [get_op(dkey)], retry=True)
        return (True, step) if w.succeeded else (False, None)

    async def agree(self, steps: Iterable[int], *, wait_s: float = WAIT_S) -> int | None:
        """:meth:`agree_sync` in a worker thread."""
        steps = list(steps)
        return await trio.to_thread.run_sync(lambda: self.agree_sync(steps, wait_s=wait_s),
                                             abandon_on_cancel=True)


def _nonce_of(body: bytes) -> str:
    """The nonce of an entry ("" when it does not decode: not this restore's)."""
    try:
        return decode_round_entry(body)[1]
    except BadRecord:
        return ""
