"""The job's namespace log for scope=job: ordering, replication to every node, leases.

One node — the peer tier's coordinator, the lowest live rank — *leads*: it orders every
namespace op into one log (``seq`` 1, 2, ...), applies it to its own core, sends it to every
other member (``Apply``) and answers the submitter once every live member applied it. That
is what makes close-to-open hold job-wide without a round trip at open: when close(2)
returns on one node, every node already has the new version.

Primary-backup replication with leases, as in Chubby (Burrows, OSDI 2006) and GFS's master
(Ghemawat et al., SOSP 2003), simplified for a job whose members are known:

* A member serves namespace reads from its applied copy while it holds a *lease*: it had
  an Apply or a State answer from the leader within ``LEASE_S`` (counted from when it sent
  the request). Past that it asks the leader (``State``) before answering.
* The leader counts a member's lease from when it *answered*, which is later; a member that
  stops acknowledging is dropped from the broadcast, and the leader holds its answers until
  that member's lease has run out, so no node serves a name the job has changed.
* A new leader (the old one died) asks every member for its position and first takes the
  ops it lacks from the member furthest ahead: members' logs are prefixes of the old
  leader's log, and every acknowledged op is on every live member. It starts a new epoch.
* With a *quorum* (``ns_quorum=majority``, the default from 3 nodes) an op is acknowledged
  only once more than half of the job's nodes hold it, a node takes over only when more
  than half answer its claim, and the leader serves reads only while more than half heard
  from it within ``LEASE_S``. A node cut off in a minority then stops (calls wait, then
  EIO) instead of acknowledging changes the majority never sees; the first op of a new
  leader is a no-op of its own epoch, so nothing of an older epoch counts as acknowledged
  before one of its own reached a majority (Raft's commitment rule, Ongaro and Ousterhout,
  USENIX ATC 2014, section 5.4.2). Without a quorum (``live``) the only failures handled
  are crashes: a leader cut off from every member goes on alone after their leases end.
* A node that starts with no usable state installs a snapshot of the namespace.

Op bodies are JSON (mtcfs/fs/jobns.py lists the kinds). Every op carries its origin rank
and an id, and a retried op that was applied is answered from the record, not applied
twice.
"""

from __future__ import annotations

import collections
import errno
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from mtcfs.errors import FsError

log = logging.getLogger(__name__)


def _why(exc: BaseException) -> str:
    """One line for a failed call (grpc's own text spans several)."""
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            return f"{code().name}: {exc.details()}"  # type: ignore[attr-defined]
        except Exception:  # not a finished call
            pass
    return str(exc)

#: Seconds a member may serve reads without hearing from the leader.
LEASE_S = 3.0
#: How long a submitter keeps trying (leader takeover included) before EIO.
SUBMIT_DEADLINE_S = 60.0
#: Seconds a member may spend copying open files' data before it acknowledges an Apply
#: (below the leader's Apply timeout, service.APPLY_TIMEOUT_S).
KEEP_S = 4.0
#: Ops kept in memory for members that catch up (and for a new leader), at most this many
#: and this many bytes; a node further behind installs a snapshot.
TAIL_OPS = 50_000
TAIL_BYTES = 32 * 1024 * 1024


@dataclass
class _Pending:
    op: dict[str, Any]
    done: trio.Event = field(default_factory=trio.Event)
    reply: tuple[int, str, int, dict[str, Any]] = (0, "", 0, {})  # errno, message, seq, result


class JobNamespace:
    """The ``ns_log`` of a scope=job core, and the trio side of the JobNamespace service.

    Args:
        fs: the filesystem core.
        tier: the peer tier (membership, coordinator, addresses).
        transport: calls to other nodes' JobNamespace service (:mod:`.transport`).
        quorum: nodes (this one included) that must hold an op before it is acknowledged
            and answer a takeover: ``nodes // 2 + 1`` for ``ns_quorum=majority``, 1 for
            ``live`` (every live member is still sent every op and waited for).
    """

    def __init__(self, fs: Any, tier: Any, transport: Any, quorum: int = 1) -> None:
        self.fs = fs
        self.tier = tier
        self.rank = tier.rank
        self.transport = transport
        if not 1 <= quorum <= tier.cfg.nodes:
            raise ValueError(f"quorum {quorum} is outside 1..{tier.cfg.nodes}")
        self.quorum = quorum
        self.epoch, self.seq = fs.ns_position()
        #: (seq, epoch) of the op this node's tail starts after (at start, or a snapshot)
        self._base = (self.seq, self.epoch)
        self.promised = self.epoch  # no Apply of an older epoch is taken after a takeover
        self.term = self.epoch      # leader: the epoch of the ops it orders
        self.tail: collections.deque[tuple[int, int, bytes]] = collections.deque()
        self._tail_bytes = 0
        self.results: collections.OrderedDict[tuple[int, str], tuple[int, dict[str, Any]]] = \
            collections.OrderedDict()
        self.leading = False
        self.lease_until = 0.0
        self.applied = trio.Event()
        self.diverged = False
        self.resync = False  # this node's log may hold ops the job's does not
        self._ids = itertools.count(1)
        self._boot = f"{time.time_ns():x}"
        self._queue: list[_Pending] = []
        self._kick = trio.Event()
        self._pos: dict[int, int] = {}          # leader: member -> last seq it acknowledged
        self._out: set[int] = set()            # leader: members not in the broadcast
        self._granted: dict[int, float] = {}   # leader: member -> when its lease was granted
        self._heard: dict[int, float] = {}     # leader: member -> when it last followed us
        self._held: dict[int, int] = {}        # leader: member -> last seq it said it holds
        self._ping = False                     # leader: broadcast even with no new op
        self._broadcasting = False             # leader: a batch is being sent
        self._no_quorum_since: float | None = None  # logged once per episode
        self._unavailable_since: float | None = None  # since when no read may be served
        self._renew_lock = trio.Lock()
        self._deposed_at = -1e9
        self._sequencing = False
        self._nursery: Any = None
        self.counters = collections.Counter[str]()

    # ------------------------------------------------------------------ the core's side

    async def submit(self, op: dict[str, Any]) -> dict[str, Any]:
        """Have ``op`` ordered and applied job-wide; its result once applied here.

        Raises:
            FsError: the errno that refused it, or EIO when no leader answered within
                SUBMIT_DEADLINE_S.
        """
        op = dict(op, rank=self.rank, id=f"{self._boot}.{next(self._ids)}")
        body = json.dumps(op, separators=(",", ":")).encode()
        deadline = time.monotonic() + SUBMIT_DEADLINE_S
        delay = 0.05
        while True:
            leader = self.tier.coordinator
            reply = None
            if leader == self.rank:
                if self.leading:
                    reply = await self._sequence(op)
            elif leader is not None and leader >= 0:
                try:
                    reply = await trio.to_thread.run_sync(self.transport.submit, leader, body,
                                                          abandon_on_cancel=True)
                except Exception as exc:  # unreachable: the membership will move on
                    log.info("namespace op to rank %d: %s", leader, _why(exc))
            if reply is not None and reply[0] != -1:
                err, message, seq, result = reply
                if err:
                    raise FsError(err, message or None)
                await self._wait_applied(seq)
                self.counters["ops_submitted"] += 1
                return result
            if time.monotonic() > deadline:
                raise FsError(errno.EIO, "the job's namespace service did not answer")
            await trio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def fresh(self) -> None:
        """Return once this node's copy may serve a read: a member holds a lease (or renews
        it now), a leader with a quorum has heard from enough members.

        Raises:
            FsError: EIO when that did not happen within SUBMIT_DEADLINE_S.
        """
        if self._may_serve():
            return
        deadline = time.monotonic() + SUBMIT_DEADLINE_S
        while not self._may_serve():
            if self.leading:
                self._want_ping()
            elif await self._renew():
                return
            if time.monotonic() > deadline:
                raise FsError(errno.EIO, "the job's namespace service did not answer")
            await trio.sleep(0.1)

    def _may_serve(self) -> bool:
        now = time.monotonic()
        return now < (self._quorum_until() if self.leading else self.lease_until)

    def _quorum_until(self) -> float:
        """Leader: until when more than enough members followed it (quorum - 1 of them
        within LEASE_S, this node being the last one); infinite without a quorum."""
        if self.quorum <= 1:
            return float("inf")
        heard = sorted((self._heard.get(r, -1e18) for r in self._members()), reverse=True)
        return heard[self.quorum - 2] + LEASE_S

    def _holders(self) -> int:
        """Leader: how many nodes (this one included) said they hold ops up to ``self.seq``."""
        return 1 + sum(1 for r in self._members() if self._held.get(r, -1) >= self.seq)

    def _want_ping(self) -> None:
        self._ping = True
        self._kick.set()

    async def _wait_applied(self, seq: int) -> None:
        deadline = time.monotonic() + SUBMIT_DEADLINE_S
        while self.seq < seq:
            if time.monotonic() > deadline:
                raise FsError(errno.EIO, f"namespace op {seq} never reached this node")
            with trio.move_on_after(0.5):
                await self.applied.wait()
            if self.seq < seq:
                await self._renew()

    # ------------------------------------------------------------------ applying

    def _apply_one(self, seq: int, epoch: int, body: bytes) -> tuple[int, str, dict[str, Any],
                                                                       list[Any]]:
        try:
            op = json.loads(body)
            res, keep = self.fs.ns_apply(op, seq, epoch)
            err, message = 0, ""
        except FsError as exc:
            res, keep, err, message = {}, [], exc.errno, exc.strerror or ""
        except Exception as exc:  # a bug or an I/O error must not stop the namespace
            log.exception("namespace op %d failed", seq)
            res, keep, err, message = {}, [], errno.EIO, f"namespace op failed: {exc}"
        if err == 0:
            self.seq, self.epoch = seq, epoch
            self.tail.append((seq, epoch, body))
            self._tail_bytes += len(body)
            while len(self.tail) > TAIL_OPS or self._tail_bytes > TAIL_BYTES:
                self._tail_bytes -= len(self.tail.popleft()[2])
            self.results[(op["rank"], op["id"])] = (seq, res)
            while len(self.results) > TAIL_OPS:
                self.results.popitem(last=False)
            self.applied.set()
            self.applied = trio.Event()
        return err, message, res, keep

    def _can_feed(self, seq: int) -> bool:
        """Whether the tail holds every op after ``seq`` (a member there can be sent them)."""
        if seq >= self.seq:
            return True
        after = self._after(seq)
        return bool(after) and after[0][0] == seq + 1

    def reset_position(self) -> None:
        """Take (epoch, seq) from the core after its namespace was replaced (a snapshot
        install, a restore from the backup tier): the tail starts after that op."""
        self.epoch, self.seq = self.fs.ns_position()
        self._base = (self.seq, self.epoch)
        self.promised = max(self.promised, self.epoch)
        self.term = self.epoch
        self.tail.clear()
        self._tail_bytes = 0
        self.results.clear()

    def _epoch_at(self, seq: int) -> int | None:
        """The epoch of this node's op ``seq``; None when the tail no longer holds it."""
        if seq == self.seq:
            return self.epoch
        if seq == 0:
            return 0
        if seq == self._base[0]:
            return self._base[1]
        for t in reversed(self.tail):
            if t[0] == seq:
                return t[1]
            if t[0] < seq:
                break
        return None

    async def apply_batch(self, term: int, prev_seq: int, prev_epoch: int,
                          ops: list[tuple[int, int, bytes]]) -> dict[str, Any]:
        """A member applies ops the leader of epoch ``term`` sent, which follow op
        (``prev_seq``, ``prev_epoch``) of the leader's log.

        Returns ``{"seq", "promised", "mismatch", "diverged"}``: ``promised`` above ``term``
        tells a deposed leader to step down; ``mismatch`` that this node's log differs from
        the leader's (it installs a snapshot at its next renewal).
        """
        out = {"seq": self.seq, "promised": self.promised, "mismatch": False,
               "diverged": self.diverged}
        if term < self.promised:
            return out
        if self.leading:
            if term == self.term:  # never two leaders of one epoch: refuse, do not count
                return dict(out, mismatch=True)
            self._step_down(f"a leader of epoch {term} sends ops")
        self.promised = term
        if prev_seq > self.seq:  # a catch-up in flight may fill the gap
            with trio.move_on_after(2.0):
                while prev_seq > self.seq:
                    await self.applied.wait()
            if prev_seq > self.seq:
                return dict(out, seq=self.seq)
        if self._epoch_at(prev_seq) != prev_epoch:
            self.resync = True
            return dict(out, seq=self.seq, mismatch=True)
        keep_all: list[Any] = []
        for seq, op_epoch, body in ops:
            if seq <= self.seq:
                if self._epoch_at(seq) != op_epoch:
                    self.resync = True
                    return dict(out, seq=self.seq, mismatch=True)
                continue
            if seq != self.seq + 1:  # a gap: the ops between are in no tail we were sent
                self.resync = True
                return dict(out, seq=self.seq, mismatch=True)
            err, message, _res, keep = self._apply_one(seq, op_epoch, body)
            if err:
                # Every node holds the same namespace at seq-1, so this cannot happen
                # unless the node diverged: say so loudly and resynchronise.
                self.diverged = self.resync = True
                self.fs._error(f"namespace op {seq} failed here but not on the leader: "
                               f"{message} ({err}); resynchronising from the leader")
                return dict(out, seq=self.seq, diverged=True, mismatch=True)
            keep_all.extend(keep)
        await self._keep(keep_all)
        if not ops or self.seq >= ops[-1][0]:
            self.lease_until = time.monotonic() + LEASE_S
        return dict(out, seq=self.seq, promised=self.promised)

    async def _keep(self, versions: list[Any]) -> None:
        """Copy what this node lacks of files it has open that another node removed or
        replaced (POSIX: an open file keeps its content); bounded, best effort."""
        with trio.move_on_after(KEEP_S):
            for v in versions:
                try:
                    await self.fs.fault_in(v, 0, v.size)
                except FsError as exc:
                    log.warning("cannot keep an open file's content: %s", exc)

    # ------------------------------------------------------------------ leader

    async def _sequence(self, op: dict[str, Any]) -> tuple[int, str, int, dict[str, Any]]:
        p = _Pending(op)
        self._queue.append(p)
        self._kick.set()
        await p.done.wait()
        return p.reply

    async def handle_submit(self, body: bytes) -> tuple[int, str, int, dict[str, Any]]:
        """Submit from another node: (-1, ...) when this node does not lead."""
        if not self.leading:
            return -1, "", 0, {}
        return await self._sequence(json.loads(body))

    async def _sequencer(self) -> None:
        """Group commit: apply all queued ops, send them in one Apply, answer them all."""
        self._sequencing = True
        try:
            while self.leading:
                if not self._queue and not self._ping:
                    await self._kick.wait()
                    self._kick = trio.Event()
                    continue
                await self._commit_batch()
        finally:
            self._sequencing = False

    async def _commit_batch(self) -> None:
        batch, self._queue = self._queue, []
        sent, self._ping = self._ping, False
        term = self.term
        keep: list[Any] = []
        for p in batch:
            done = self.results.get((p.op["rank"], p.op["id"]))
            if done is not None:
                # applied already (a retry): answered once a quorum holds it, like any op
                p.reply = (0, "", done[0], done[1])
                sent = True
                continue
            body = json.dumps(p.op, separators=(",", ":")).encode()
            seq = self.seq + 1
            err, message, res, k = self._apply_one(seq, self.term, body)
            p.reply = (err, message, seq if not err else 0, res)
            if not err:
                sent = True
                keep.extend(k)
        if sent:
            self._broadcasting = True
            try:
                await self._broadcast()
            finally:
                self._broadcasting = False
            held = self._holders()
            if self.leading and self.term == term and held < self.quorum:
                self._no_quorum(held)
                self._step_down(f"{held} of {self.tier.cfg.nodes} nodes hold op {self.seq}, "
                                f"{self.quorum} needed")
        if not self.leading or self.term != term:
            # Deposed while sending (and perhaps leading again since, in a new epoch):
            # these ops may not be in the job's log. Their submitters ask again (the leader
            # answers from its record an op it holds), and a deposed node resynchronises.
            if not self.leading:
                self.resync = True
            for p in batch:
                if p.reply[0] == 0:
                    p.reply = (-1, "", 0, {})
        for p in batch:
            if not p.done.is_set():
                p.done.set()
        if keep:
            self._nursery.start_soon(self._keep, keep)

    def _members(self) -> list[int]:
        return [r for r in range(self.tier.cfg.nodes) if r != self.rank]

    async def _broadcast(self) -> None:
        """Bring every member in the broadcast to ``self.seq``; drop those that fail, and
        wait out the leases of dropped members. A member that knows a newer epoch deposes
        this node."""
        async def one(r: int) -> None:
            start = self._pos.get(r, self.seq - 1)
            prev = self._epoch_at(start)
            if prev is None or not self._can_feed(start):
                self._out.add(r)  # too far behind for the tail: it must catch up itself
                return
            sent = time.monotonic()
            try:
                res = await trio.to_thread.run_sync(
                    self.transport.apply, r, self.term, (start, prev), self._after(start),
                    abandon_on_cancel=True)
            except Exception as exc:
                log.info("namespace: rank %d leaves the broadcast: %s", r, _why(exc))
                self._out.add(r)
                self._pos.pop(r, None)
                return
            if res["promised"] > self.term:
                if self.leading:
                    self._step_down(f"rank {r} knows epoch {res['promised']}")
                return
            self._granted[r] = time.monotonic()
            self._heard[r] = sent
            self._pos[r] = res["seq"]
            if not res["mismatch"]:
                self._held[r] = res["seq"]
            if res["mismatch"] or res["seq"] < self.seq:
                self._out.add(r)
                self._pos.pop(r, None)

        async with trio.open_nursery() as n:
            for r in self._members():
                if r not in self._out and r in self.tier.addresses:
                    n.start_soon(one, r)
        # A member out of the broadcast may still serve reads until its lease ends.
        now = time.monotonic()
        wait = max([self._granted.get(r, 0.0) + LEASE_S - now
                    for r in self._members() if r in self._out or r not in self.tier.addresses]
                   + [0.0])
        if wait > 0:
            self.counters["lease_waits"] += 1
            await trio.sleep(wait)

    async def handle_state(self, rank: int, applied_seq: int, last_epoch: int,
                           claim: int) -> dict[str, Any]:
        """A member's lease renewal (or a new leader's poll): our position, whether the
        asker's log agrees with ours at ``applied_seq`` (its op there has ``last_epoch``),
        and the ops after it when we have them all."""
        if claim > self.promised:
            # A new leader is taking over: take no Apply of an older epoch from now on, and
            # if this node led, stop (the new leader has our ops in this answer).
            self.promised = claim
            if self.leading:
                self._step_down(f"rank {rank} takes over with epoch {claim}")
        # The asker's log disagrees with ours where it has our op ``applied_seq`` with another
        # epoch — or where it is longer but ends in an older epoch than ours: its ops past
        # our end were ordered by a leader that a newer one replaced, so they are not the
        # job's (a leader that crashed, or was cut off, after applying ops it never sent).
        mismatch = (self._epoch_at(applied_seq) != last_epoch if applied_seq <= self.seq
                    else last_epoch < self.epoch)
        tail = [] if mismatch else self._after(applied_seq)
        complete = not mismatch and applied_seq <= self.seq and (
            applied_seq == self.seq or (bool(tail) and tail[0][0] == applied_seq + 1)) and \
            sum(len(t[2]) for t in tail) <= TAIL_BYTES
        if self.leading:
            self._granted[rank] = time.monotonic()
            if claim <= self.term:  # it follows no newer leader: it counts for our quorum
                self._heard[rank] = self._granted[rank]
            if not mismatch and applied_seq <= self.seq:
                self._held[rank] = applied_seq
            if complete:
                self._out.discard(rank)
                self._pos[rank] = self.seq
        return {"is_coordinator": self.leading, "seq": self.seq,
                "epoch": max(self.epoch, self.promised), "last_epoch": self.epoch,
                "tail": tail if complete else [], "complete": complete, "mismatch": mismatch}

    def _after(self, seq: int) -> list[tuple[int, int, bytes]]:
        """The ops of the tail after ``seq``, oldest first (walked from the newest end: a
        member is rarely more than a batch behind)."""
        out = []
        for t in reversed(self.tail):
            if t[0] <= seq:
                break
            out.append(t)
        out.reverse()
        return out

    def _step_down(self, why: str) -> None:
        log.info("rank %d no longer leads the job namespace: %s", self.rank, why)
        self.leading = False
        self._deposed_at = time.monotonic()
        for p in self._queue:  # their submitters ask the new leader
            p.reply = (-1, "", 0, {})
            p.done.set()
        self._queue = []
        self._kick.set()

    def _position(self) -> tuple[int, int]:
        return self.seq, self.epoch

    async def _state(self, rank: int, claim: int = 0) -> dict[str, Any]:
        return await trio.to_thread.run_sync(self.transport.state, rank, self._position(),
                                             claim, abandon_on_cancel=True)

    async def _catch_up(self, rank: int, st: dict[str, Any]) -> None:
        """Take what ``rank`` has beyond us: its tail when our logs agree, else (or when it
        no longer holds the tail) its snapshot."""
        if (st["last_epoch"], st["seq"]) <= (self.epoch, self.seq) and not st["mismatch"] \
                and not self.resync:
            return
        if st["complete"] and not self.resync:
            await self.apply_batch(max(st["epoch"], self.promised), self.seq, self.epoch,
                                   st["tail"])
        if st["mismatch"] or self.resync or self.seq < st["seq"]:
            await self._install_from(rank)

    async def _renew(self) -> bool:
        """Ask the leader for its position and catch up; True when the lease is renewed."""
        async with self._renew_lock:
            if self.leading or time.monotonic() < self.lease_until - LEASE_S / 2:
                return True
            leader = self.tier.coordinator
            if leader is None or leader < 0 or leader == self.rank:
                return False
            sent = time.monotonic()
            try:
                # Our promise goes with the renewal: a leader deposed by a newer epoch (which
                # it may not know yet, being cut off from the new leader) steps down.
                st = await self._state(leader, self.promised)
                if not st["is_coordinator"]:
                    return False
                await self._catch_up(leader, st)
            except Exception as exc:
                log.info("namespace lease from rank %d: %s", leader, _why(exc))
                return False
            if self.seq < st["seq"]:
                return False
            self.lease_until = sent + LEASE_S
            self._no_quorum_since = None
            return True

    async def _poll(self, claim: int) -> list[tuple[int, dict[str, Any]]]:
        """Every reachable member's position (``claim``: the epoch this node takes over
        with, or 0)."""
        out = []
        for r in self._members():
            if r not in self.tier.addresses:
                continue
            try:
                out.append((r, await self._state(r, claim)))
            except Exception as exc:  # down: it catches up when it joins
                log.info("namespace: rank %d does not answer: %s", r, _why(exc))
        return out

    async def _adopt_best_log(self, claim: int) -> list[tuple[int, dict[str, Any]]] | None:
        """Catch up with the most up-to-date log among live members — the newest last
        epoch, then the longest (Raft's rule). Returns the members' positions, or None when
        the catch-up failed."""
        polled = await self._poll(claim)
        best = max([(st["last_epoch"], st["seq"], r) for r, st in polled], default=None)
        if best is not None and (best[0], best[1]) > (self.epoch, self.seq):
            r = best[2]
            try:
                await self._catch_up(r, dict(polled)[r])
            except Exception as exc:
                log.warning("namespace: cannot catch up with rank %d: %s", r, _why(exc))
                return None
        return polled

    async def _take_over(self) -> None:
        """Become the leader: claim an epoch above any member's (a leader still running
        steps down when it sees the claim), adopt the most up-to-date log, then order."""
        first = await self._poll(0)
        if len(first) + 1 < self.quorum:
            self._no_quorum(len(first) + 1)
            return  # a minority must not lead: run() tries again
        top = max([self.epoch, self.promised] + [st["epoch"] for _r, st in first])
        # An epoch only this rank claims (one of ``nodes`` residues): two nodes that both
        # believe they coordinate never lead the same epoch.
        claimed = top + 1 + (self.rank - top - 1) % self.tier.cfg.nodes
        self.term = self.promised = claimed
        async with self._renew_lock:  # no renewal installs an older snapshot meanwhile
            await self._lead_with(claimed)

    async def _lead_with(self, claimed: int) -> None:
        """The rest of a takeover, epoch ``claimed`` promised (under the renewal lock)."""
        polled = await self._adopt_best_log(claimed)
        if polled is None:
            return  # not leading: run() tries again
        if self.promised > claimed:
            return  # a rival claimed a newer epoch meanwhile: it leads, or run() tries again
        self.term = claimed  # (a snapshot install took the other node's epoch)
        if len(polled) + 1 < self.quorum:
            self._no_quorum(len(polled) + 1)
            return
        self.resync = False
        self._pos.clear()
        self._out.clear()
        self._held.clear()
        for r, st in polled:  # members whose log agrees with ours stay in the broadcast
            if st["seq"] <= self.seq and self._epoch_at(st["seq"]) == st["last_epoch"] and \
                    self._can_feed(st["seq"]):
                self._pos[r] = self._held[r] = st["seq"]
        now = time.monotonic()
        for r in self._members():  # leases the old leader granted may still run
            self._granted[r] = now
            if r not in self._pos:
                self._out.add(r)
        # the members that answered the claim follow this node from now on
        self._heard = {r: now for r, _st in polled}
        self._no_quorum_since = None
        if self.quorum > 1:
            # Raft's commitment rule: ops of older epochs this node adopted count as
            # acknowledged once an op of its own epoch, ordered after them, reached a quorum.
            self._queue.insert(0, _Pending({"op": "noop", "rank": self.rank,
                                            "id": f"{self._boot}.{next(self._ids)}"}))
        self.leading = True
        self.counters["takeovers"] += 1
        log.info("rank %d leads the job namespace from seq %d (epoch %d)", self.rank,
                 self.seq, self.term)
        if not self._sequencing:
            self._nursery.start_soon(self._sequencer)

    def _no_quorum(self, reached: int) -> None:
        """Log once per episode that this node cannot lead for want of a quorum."""
        if self._no_quorum_since is None:
            self._no_quorum_since = time.monotonic()
            log.warning("namespace: %d of %d nodes reachable, %d needed (ns_quorum=majority):"
                        " calls on this node wait until more come back", reached,
                        self.tier.cfg.nodes, self.quorum)

    # ------------------------------------------------------------------ start and run

    async def join(self, timeout: float = 60.0) -> None:
        """At mount, before FUSE serves: catch up with the job — from the leader, or, when
        this node is to lead, from the most up-to-date member (``_take_over`` does that)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            await self.tier.heartbeat_once()
            leader = self.tier.coordinator
            if leader == self.rank:
                # about to lead: first take the job's log from the most up-to-date member
                await self._adopt_best_log(0)
                return
            if leader is None or leader < 0:
                await trio.sleep(0.2)
                continue
            try:
                st = await self._state(leader)
                if st["is_coordinator"]:
                    await self._catch_up(leader, st)
                    return
            except Exception as exc:
                log.info("joining the job namespace through rank %d: %s", leader, _why(exc))
            await trio.sleep(0.5)  # the leader is not up yet, or is taking over
        log.warning("no leader of the job namespace answered; serving this node's copy")

    async def _install_from(self, rank: int) -> None:
        """Replace this node's namespace with ``rank``'s snapshot (a node that diverged or
        fell too far behind; open files keep reading what they opened)."""
        snap = await trio.to_thread.run_sync(self.transport.snapshot, rank,
                                             abandon_on_cancel=True)
        if self.leading:  # took over meanwhile (a read's renewal raced the takeover)
            return
        self.fs.ns_install(snap)
        self.reset_position()
        self.resync = self.diverged = False
        self.counters["snapshots_installed"] += 1

    async def run(self) -> None:
        """Lead when this node is the coordinator; otherwise keep the lease fresh."""
        async with trio.open_nursery() as n:
            self._nursery = n
            while True:
                coord = self.tier.coordinator
                if coord == self.rank and not self.leading:
                    # Not again while the node that deposed us may still lead (until the
                    # membership agrees who the coordinator is).
                    if time.monotonic() - self._deposed_at > 1.5 * LEASE_S:
                        await self._take_over()
                elif coord != self.rank and self.leading:
                    self._step_down(f"rank {coord} coordinates the job")
                elif self.leading and self.quorum > 1:
                    left = self._quorum_until() - time.monotonic()
                    # (while a batch is out, its answers decide: Applies in flight count)
                    if left < -LEASE_S and not self._broadcasting:
                        self._no_quorum(1 + sum(
                            1 for r in self._members()
                            if self._heard.get(r, -1e18) > time.monotonic() - LEASE_S))
                        self._step_down("no quorum of nodes followed it for "
                                        f"{LEASE_S - left:.0f} s")
                    elif left < LEASE_S / 2:
                        self._want_ping()  # an idle leader keeps its quorum's attention
                elif not self.leading:
                    await self._renew()
                if self._may_serve():
                    self._unavailable_since = None
                elif self._unavailable_since is None:
                    self._unavailable_since = time.monotonic()
                await trio.sleep(LEASE_S / 4)

    def _unavailable_s(self) -> float | None:
        """Seconds this node has not been able to serve the namespace (no lease, or leading
        without a quorum), once that lasted a lease; else None."""
        if self._unavailable_since is None or self._may_serve():
            return None
        out = time.monotonic() - self._unavailable_since
        return round(out, 1) if out >= LEASE_S else None

    def status(self) -> dict[str, Any]:
        """The namespace's part of ``mtcfs status``: leader, position, lease, counters."""
        lease = max(0.0, self.lease_until - time.monotonic())
        return {"leader": self.tier.coordinator, "leading": self.leading, "seq": self.seq,
                "quorum": self.quorum, "nodes": self.tier.cfg.nodes,
                "unavailable_s": self._unavailable_s(),
                "epoch": self.term if self.leading else self.epoch, "lease_s": round(lease, 2),
                "out_of_broadcast": sorted(self._out), "diverged": self.diverged,
                **dict(self.counters)}
