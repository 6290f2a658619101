"""Which step every rank restores: a vote collected by the peer tier's coordinator.

Orbax's multi-tier checkpointing restores each process from ITS node's local directory and
never checks that the processes restored the same step: given different steps, the global
arrays silently mix them (../shared/reference/orbax-mtc-protocol.md). So the decision is
taken once, for the whole job, by one node:

1. Every rank, when its trainer asks for a restore (``replicator.yaml`` appeared), votes with
   the steps it can restore — its RAM tier, its replicas on peers, the backup tier — and
   repeats the vote every 0.1 s until it gets an answer.
2. The coordinator (the lowest live rank, as in the peer tier) waits until every rank
   0..nodes-1 has a fresh vote, then decides the newest step present in ALL of them (or
   nothing: the ``s0`` marker) and latches that decision: every vote that was counted gets
   the same answer when it asks (again), until all of them got it. A new vote from a rank
   whose vote was counted means its trainer restarted: the decision is dropped and a new
   round begins.

Google's replicator does the same through its ZeroMQ coordinator (GoogleCloudPlatform/
checkpoint-replicator); here it is one gRPC method on the peer port (``MtcRestore.Vote`` in
proto/mtcfs_peer.proto).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc

from replication.peer._pb import mtcfs_peer_pb2 as pb
from replication.peer._pb import mtcfs_peer_pb2_grpc as pb_grpc
from replication.peer.records import StepRef

log = logging.getLogger(__name__)

#: Seconds a vote counts without being repeated (voters repeat it every 0.1 s while they
#: wait; a vote not repeated for this long is from a rank that stopped waiting).
VOTE_TTL_S = 10.0
#: Seconds a decision stays latched for the ranks that have not fetched it yet.
LATCH_S = 120.0
#: Seconds for one Vote call.
CALL_TIMEOUT_S = 5.0


@dataclass
class Decision:
    """The coordinator's answer: ``step`` (None: nothing to restore) for every rank."""

    step: StepRef | None
    at: float
    counted: dict[int, str]  # rank -> the vote id that was counted
    delivered: set[int] = field(default_factory=set)


@dataclass
class VoteResult:
    """A voter's view of one round: decided (``step`` None = nothing), or still waiting."""

    decided: bool
    step: StepRef | None = None
    waiting_for: tuple[int, ...] = ()


class Ballot:
    """The coordinator's side of the vote. Thread-safe (called from gRPC threads).

    Args:
        nodes: ranks in the job; a decision needs a vote from each of 0..nodes-1.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, nodes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.nodes = nodes
        self._clock = clock
        self._lock = threading.Lock()
        self._votes: dict[int, tuple[str, dict[int, str], float]] = {}
        self._decision: Decision | None = None
        self._previous: Decision | None = None  # kept for a repeated call of a counted vote
        self.decisions = 0

    def vote(self, rank: int, vote_id: str, restorable: Iterable[StepRef]) -> VoteResult:
        """Record ``rank``'s vote and answer it.

        Raises:
            ValueError: ``rank`` outside 0..nodes-1.
        """
        if not 0 <= rank < self.nodes:
            raise ValueError(f"rank {rank} is outside 0..{self.nodes - 1}")
        now = self._clock()
        with self._lock:
            d = self._decision
            if d is not None and (now - d.at > LATCH_S or len(d.delivered) >= self.nodes):
                self._previous = d
                d = self._decision = None  # every rank has it, or the rest gave up
            p = self._previous
            if d is None and p is not None and p.counted.get(rank) == vote_id:
                return VoteResult(True, p.step)  # a retry whose first answer was lost
            if d is not None:
                if d.counted.get(rank) == vote_id:
                    # The vote that was counted (first fetch, or a repeated call).
                    d.delivered.add(rank)
                    return VoteResult(True, d.step)
                # A new vote from a counted rank: its trainer (and so the job) restarted
                # since; the decision is void and a new round begins. (A rank that already
                # restored from it restarts too: a JAX job does not outlive a process.)
                log.info("restore vote: rank %d voted again; a new round begins", rank)
                d = self._decision = None
            self._votes[rank] = (vote_id, {s.step_number: s.step for s in restorable}, now)
            for r, (_vid, _steps, at) in list(self._votes.items()):
                if now - at > VOTE_TTL_S:
                    del self._votes[r]
            waiting = tuple(r for r in range(self.nodes) if r not in self._votes)
            if waiting:
                return VoteResult(False, waiting_for=waiting)
            common: set[int] | None = None
            for r in range(self.nodes):
                nums = set(self._votes[r][1])
                common = nums if common is None else common & nums
            step = None
            if common:
                best = max(common)
                step = StepRef(self._votes[0][1][best], best)
            self._decision = Decision(step, now, {r: v[0] for r, v in self._votes.items()},
                                      {rank})
            self._votes.clear()
            self.decisions += 1
            log.info("restore vote decided: every rank restores %s",
                     f"step {step.step}" if step else "nothing (no step is held for all ranks)")
            return VoteResult(True, step)


class MtcRestoreService(pb_grpc.MtcRestoreServicer):
    """Serves the :class:`Ballot` when this node coordinates the job.

    Args:
        tier: the node's peer tier (its ``coordinator``, ``rank``, ``cfg.nodes``).
        job: requests of another job are FAILED_PRECONDITION.
    """

    def __init__(self, tier: Any, job: str) -> None:
        self.tier = tier
        self.job = job
        self.ballot = Ballot(tier.cfg.nodes)

    def Vote(self, request: pb.VoteRequest, context: grpc.ServicerContext) -> pb.VoteReply:
        if request.job != self.job:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this node serves job {self.job!r}, not {request.job!r}")
        if request.rank in self.tier.partitioned:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"rank {request.rank} is cut off")
        if self.tier.coordinator != self.tier.rank:
            c = self.tier.coordinator
            return pb.VoteReply(not_coordinator=True, coordinator_rank=-1 if c is None else c)
        try:
            res = self.ballot.vote(request.rank, request.vote_id,
                                   [StepRef(s.step, s.step_number) for s in request.restorable])
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        reply = pb.VoteReply(decided=res.decided, waiting_for=list(res.waiting_for),
                             coordinator_rank=self.tier.rank)
        if res.step is not None:
            reply.step.CopyFrom(pb.StepRef(step=res.step.step, step_number=res.step.step_number))
        return reply


def register(service: MtcRestoreService) -> Callable[[grpc.Server], None]:
    """A registration for :func:`replication.peer.service.serve`'s ``extra``."""
    def add(server: grpc.Server) -> None:
        pb_grpc.add_MtcRestoreServicer_to_server(service, server)
    return add


def call_vote(tier: Any, target: int, vote_id: str,
              restorable: Iterable[StepRef]) -> tuple[VoteResult | None, int | None]:
    """Send this rank's vote to rank ``target`` (a thread; blocking).

    Returns:
        (result, None), or (None, the coordinator ``target`` names) when it does not
        coordinate.

    Raises:
        grpc.RpcError: the call failed (unreachable, timed out).
    """
    if target in tier.partitioned:
        raise ConnectionError(f"rank {target} is cut off (injected fault)")
    stub = pb_grpc.MtcRestoreStub(tier.client(target, quick=True).channel)
    r = stub.Vote(pb.VoteRequest(job=tier.cfg.job, rank=tier.rank, vote_id=vote_id,
                                 restorable=[pb.StepRef(step=s.step, step_number=s.step_number)
                                             for s in restorable]),
                  timeout=CALL_TIMEOUT_S)
    if r.not_coordinator:
        return None, (r.coordinator_rank if r.coordinator_rank >= 0 else None)
    step = StepRef(r.step.step, r.step.step_number) if r.decided and r.step.step else None
    return VoteResult(r.decided, step, tuple(r.waiting_for)), None
