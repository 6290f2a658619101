"""The JobNamespace gRPC service (proto/mtcfs_peer.proto) and the client calls to it.

It shares the Peer service's server, port and channels. Calls are served in gRPC threads and
handed to the trio loop that owns the core and the :class:`~replication.jobns.log.JobNamespace`
(``trio.from_thread.run``): every namespace change happens on that one thread.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc
import trio

from replication.peer._pb import mtcfs_peer_pb2 as pb
from replication.peer._pb import mtcfs_peer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

#: Seconds for one call.
CALL_TIMEOUT_S = 10.0
#: Seconds the leader waits for a member's Apply before it leaves the member out of the
#: broadcast (the member's own wait for open files' data is bounded below it).
APPLY_TIMEOUT_S = 5.0


def _ops_out(ops: list[tuple[int, int, bytes]]) -> list[pb.NsOp]:
    return [pb.NsOp(seq=s, epoch=e, body=b) for s, e, b in ops]


def _ops_in(ops: Any) -> list[tuple[int, int, bytes]]:
    return [(o.seq, o.epoch, o.body) for o in ops]


class JobNamespaceService(pb_grpc.JobNamespaceServicer):
    """Serves a node's :class:`~replication.jobns.log.JobNamespace` to the other nodes.

    Args:
        ns: the namespace log.
        job: the job; requests of another job are FAILED_PRECONDITION.
        token: the trio token of the loop ``ns`` runs on.
    """

    def __init__(self, ns: Any, job: str, token: trio.lowlevel.TrioToken) -> None:
        self.ns = ns
        self.job = job
        self.token = token

    def _check(self, request: Any, context: grpc.ServicerContext) -> None:
        if request.job != self.job:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this node serves job {self.job!r}, not {request.job!r}")
        if not 0 <= request.rank < self.ns.tier.cfg.nodes:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rank {request.rank} out of range")
        if request.rank in self.ns.tier.partitioned:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"rank {request.rank} is cut off (injected fault)")

    def _run(self, fn: Any, *args: Any) -> Any:
        return trio.from_thread.run(fn, *args, trio_token=self.token)

    def Submit(self, request: pb.SubmitRequest, context: grpc.ServicerContext) -> pb.SubmitReply:
        self._check(request, context)
        try:
            op = json.loads(request.body)
        except ValueError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "op body is not JSON")
        if not isinstance(op, dict) or op.get("rank") != request.rank or "id" not in op:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "op must name its origin and id")
        err, message, seq, result = self._run(self.ns.handle_submit, request.body)
        if err == -1:
            return pb.SubmitReply(not_coordinator=True,
                                  coordinator_rank=self.ns.tier.coordinator or -1)
        return pb.SubmitReply(errno=err, message=message, seq=seq,
                              result=json.dumps(result).encode())

    def Apply(self, request: pb.ApplyRequest, context: grpc.ServicerContext) -> pb.ApplyReply:
        self._check(request, context)
        r = self._run(self.ns.apply_batch, request.epoch, request.prev_seq, request.prev_epoch,
                      _ops_in(request.ops))
        return pb.ApplyReply(applied_seq=r["seq"], diverged=r["diverged"],
                             promised=r["promised"], mismatch=r["mismatch"])

    def State(self, request: pb.StateRequest, context: grpc.ServicerContext) -> pb.StateReply:
        self._check(request, context)
        st = self._run(self.ns.handle_state, request.rank, request.applied_seq,
                       request.last_epoch, request.epoch)
        return pb.StateReply(is_coordinator=st["is_coordinator"], seq=st["seq"],
                             epoch=st["epoch"], tail=_ops_out(st["tail"]),
                             tail_complete=st["complete"], last_epoch=st["last_epoch"],
                             mismatch=st["mismatch"])

    def Snapshot(self, request: pb.SnapshotRequest,
                 context: grpc.ServicerContext) -> pb.SnapshotReply:
        self._check(request, context)
        snap = trio.from_thread.run_sync(self.ns.fs.ns_snapshot, trio_token=self.token)
        return pb.SnapshotReply(seq=snap["seq"], epoch=snap["epoch"],
                                body=json.dumps(snap).encode())


class Transport:
    """Blocking calls to other nodes' JobNamespace service (run them in worker threads).

    Args:
        tier: the peer tier, for its clients' channels (addresses, injected partitions).

    Every call raises an Exception (grpc.RpcError or PeerError) when the node cannot be
    reached.
    """

    def __init__(self, tier: Any) -> None:
        self.tier = tier

    def _stub(self, rank: int) -> pb_grpc.JobNamespaceStub:
        return pb_grpc.JobNamespaceStub(self.tier.client(rank).channel)

    def _head(self) -> dict[str, Any]:
        return {"job": self.tier.cfg.job, "rank": self.tier.rank}

    def submit(self, rank: int, body: bytes) -> tuple[int, str, int, dict[str, Any]]:
        r = self._stub(rank).Submit(pb.SubmitRequest(body=body, **self._head()),
                                    timeout=CALL_TIMEOUT_S * 3)
        if r.not_coordinator:
            return -1, "", 0, {}
        return r.errno, r.message, r.seq, json.loads(r.result or b"{}")

    def apply(self, rank: int, epoch: int, prev: tuple[int, int],
              ops: list[tuple[int, int, bytes]]) -> dict[str, Any]:
        """Send ``ops`` (following op ``prev`` = (seq, epoch)) to a member."""
        r = self._stub(rank).Apply(pb.ApplyRequest(epoch=epoch, prev_seq=prev[0],
                                                   prev_epoch=prev[1], ops=_ops_out(ops),
                                                   **self._head()), timeout=APPLY_TIMEOUT_S)
        return {"seq": r.applied_seq, "diverged": r.diverged, "promised": r.promised,
                "mismatch": r.mismatch}

    def state(self, rank: int, applied: tuple[int, int], claim: int = 0) -> dict[str, Any]:
        """Ask ``rank`` where its log is, from our ``applied`` = (seq, epoch of that op);
        ``claim``: the epoch this node takes over with (0: none)."""
        r = self._stub(rank).State(pb.StateRequest(applied_seq=applied[0], last_epoch=applied[1],
                                                   epoch=claim, **self._head()), timeout=2.0)
        return {"is_coordinator": r.is_coordinator, "seq": r.seq, "epoch": r.epoch,
                "tail": _ops_in(r.tail), "complete": r.tail_complete,
                "last_epoch": r.last_epoch, "mismatch": r.mismatch}

    def snapshot(self, rank: int) -> dict[str, Any]:
        r = self._stub(rank).Snapshot(pb.SnapshotRequest(**self._head()),
                                      timeout=CALL_TIMEOUT_S * 3)
        return json.loads(r.body)


def register(ns: Any, job: str, token: trio.lowlevel.TrioToken) -> Any:
    """A registration for :func:`replication.peer.service.serve`'s ``extra``."""
    def add(server: grpc.Server) -> None:
        pb_grpc.add_JobNamespaceServicer_to_server(JobNamespaceService(ns, job, token), server)
    return add


