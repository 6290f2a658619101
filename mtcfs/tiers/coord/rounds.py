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
``<area>/round`` and joins that; the others, asking later, find it current. A rank that
asks after the decision of the round it joins takes that decision. The round waits for
every rank's entry up to ``wait_s``; past it, the caller gets :class:`RoundTimeout` naming
the ranks that never asked (a decision without them could name a step they lack).

Load: per restore, per rank, about four small transactions and a poll every 0.1–0.5 s while
waiting; a poll counts the round's entries (one number), and reads them only to name the
missing ranks once, and when the count is complete (docs/benchmarks.md, "Coordination at
scale").
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Iterable
from typing import Any

import trio

from mtcfs.tiers.coord._pb import etcd_v3_subset_pb2 as pb
from mtcfs.tiers.coord.etcd import (
    Etcd, EtcdError, EtcdUnavailable, absent, get_op, mod_is, prefix_end, put_op,
)

#: Seconds a round waits for every rank's entry.
WAIT_S = 600.0
#: Polls per second of all the waiting ranks together, once a wait is long (each rank
#: polls at most every ``max(0.5, nodes / POLLS_PER_S)`` s): at 1,000 ranks polling every
#: 0.5 s, etcd on 2 shared cores fell behind and leases expired (docs/benchmarks.md).
POLLS_PER_S = 250.0
#: Seconds between two reads of a round's entries while it fills (to name the missing
#: ranks; at least ``nodes / 10``); the polls between only count them.
NAME_EVERY_S = 5.0


class RoundTimeout(EtcdError):
    """Not every rank joined the round in time (one line names the missing ranks)."""


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
        self.waiting_for: list[int] = []

    def _entries(self, k: int) -> bytes:
        return f"{self.base}round-{k}/".encode()

    def _entry(self, k: int) -> bytes:
        return self._entries(k) + f"{self.rank:06d}".encode()

    def _decision(self, k: int) -> bytes:
        return f"{self.base}decision-{k}".encode()

    def join(self, steps: Iterable[int], *, timeout: float = 30.0, nonce: str = "") -> int:
        """Join the current round (or open the next, see the module docstring) with the
        steps this rank can restore; returns the round number.

        Raises:
            EtcdError: etcd did not answer within ``timeout``.
        """
        # the nonce tells this restore's own entry (an attempt etcd applied whose answer was
        # lost, then retried) from an entry of an earlier restart of this rank
        nonce = nonce or uuid.uuid4().hex
        body = json.dumps({"rank": self.rank, "steps": sorted(set(int(s) for s in steps)),
                           "nonce": nonce, "at": round(time.time(), 3)},
                          separators=(",", ":")).encode()
        deadline = time.monotonic() + timeout
        while True:
            kv, _rev = self.etcd.get(self.round_key)
            if kv is None:
                self.etcd.txn([absent(self.round_key)], [put_op(self.round_key, b"1")],
                              retry=True)
                continue
            k = int(kv.value)
            r = self.etcd.txn([mod_is(self.round_key, kv.mod_revision),
                               absent(self._entry(k))], [put_op(self._entry(k), body)],
                              [get_op(self._entry(k))], retry=True)
            got = [] if r.succeeded else r.responses[0].response_range.kvs
            if r.succeeded or (got and _nonce_of(got[0].value) == nonce):
                self.last_round = k
                return k
            if got:
                # This rank is in round k already: its trainer restarted, so the job
                # restarts again: open round k + 1 (unless the round moved meanwhile).
                self.etcd.txn([mod_is(self.round_key, kv.mod_revision)],
                              [put_op(self.round_key, str(k + 1).encode())], retry=True)
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
        k = self.join(steps, nonce=nonce)
        pause = 0.1
        # N ranks poll while a round fills: their rate is capped near POLLS_PER_S in all
        most = max(0.5, self.nodes / POLLS_PER_S)
        # and the reads of every entry (N records each) at most ~10 per second in all
        name_every = max(NAME_EVERY_S, self.nodes / 10.0)
        named = -1e9  # when the missing ranks were last read
        while True:
            dkey, entries = self._decision(k), self._entries(k)
            # while waiting, count the entries (one number, not N records per poll)
            r = self.etcd.txn([], [get_op(dkey), pb.RequestOp(request_range=pb.RangeRequest(
                key=entries, range_end=prefix_end(entries), count_only=True)),
                get_op(self.round_key)], retry=True)
            got = r.responses[0].response_range.kvs
            if got:
                self.waiting_for = []
                return _step_of(got[0].value)
            current = r.responses[2].response_range.kvs
            if current and int(current[0].value) > k:
                k = self.join(steps, nonce=nonce)  # undecided, left behind: follow the job
                continue
            if int(r.responses[1].response_range.count) < self.nodes and \
                    time.monotonic() < min(deadline, named + name_every):
                time.sleep(pause * random.uniform(0.8, 1.2))
                pause = min(pause * 1.5, most)
                continue
            # complete, or time to say again who is missing: read the entries
            named = time.monotonic()
            kvs, _rev, _more, _n = self.etcd.range(entries, prefix_end(entries))
            joined: dict[int, set[int]] = {}
            for kv in kvs:
                try:
                    rank = int(kv.key[len(entries):])
                    joined[rank] = {int(x) for x in json.loads(kv.value).get("steps", [])}
                except (ValueError, TypeError, AttributeError):
                    continue
            self.waiting_for = [x for x in range(self.nodes) if x not in joined]
            if not self.waiting_for:
                common = set.intersection(*joined.values()) if joined else set()
                body = json.dumps({"round": k, "step": max(common) if common else None,
                                   "decided_by": self.rank, "at": round(time.time(), 3)},
                                  separators=(",", ":")).encode()
                w = self.etcd.txn([absent(dkey)], [put_op(dkey, body)], [get_op(dkey)],
                                  retry=True)
                if w.succeeded:
                    self.waiting_for = []
                    return _step_of(body)
                continue
            if time.monotonic() >= deadline:
                raise RoundTimeout(f"restore round {k}: rank(s) {self.waiting_for[:10]} did "
                                   f"not ask for a restore within {wait_s:g} s")
            time.sleep(pause * random.uniform(0.8, 1.2))
            pause = min(pause * 1.5, most)

    async def agree(self, steps: Iterable[int], *, wait_s: float = WAIT_S) -> int | None:
        """:meth:`agree_sync` in a worker thread."""
        steps = list(steps)
        return await trio.to_thread.run_sync(lambda: self.agree_sync(steps, wait_s=wait_s),
                                             abandon_on_cancel=True)


def _nonce_of(body: bytes) -> str:
    try:
        return str(json.loads(body).get("nonce", ""))
    except (ValueError, AttributeError):
        return ""


def _step_of(body: bytes) -> int | None:
    step: Any = json.loads(body).get("step")
    return None if step is None else int(step)
