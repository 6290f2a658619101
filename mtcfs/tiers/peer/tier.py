"""The peer tier of one node: membership, replication of committed steps, replica gc.

One :class:`PeerTier` per mount with ``nodes > 1``. It owns the node's Peer gRPC server
(threads), its replica store (``<store>/replicas``, in the same RAM budget as the node's own
files), one client per peer, and three kinds of trio tasks:

* **membership** (mtcfs/tiers/peer/tier_membership.py): the node registers in etcd under the
  job's prefix (a leased record: address, labels), follows every member's record with a
  watch, records the steps this rank completed, and reads the newest step complete on all
  ranks from those records. No node coordinates the others.
* **replication**, one task per peer (placement.py decides which): every committed, sealed
  step goes to the peer — the chunks it lacks, then the manifest — and once the peer's
  ``PublishManifest`` reply lists nothing missing the step counts as replicated there; its
  ``user.mtcfs.state`` becomes ``replicated k/R``. A data-parallel twin holds the same bytes
  itself, so only hashes travel (the twin's answer "missing nothing" is the verification);
  if it still lacks chunks after ``twin_wait_s``, the bytes are sent after all. Failures
  back off (jittered exponential, capped) and show as lag in status; the application never
  waits for any of it.
* **replica gc** (every 10 s): drop replicas of steps older than the ``keep`` + 1 newest of
  each rank, never the step complete in the job.
* **audits**: an idle link asks its peer every few seconds which of this rank's steps it
  holds, so a peer that restarted empty gets them again.

Membership lives in :mod:`~mtcfs.tiers.peer.tier_membership` and replication,
audits and gc in :mod:`~mtcfs.tiers.peer.tier_replication`, mixed into :class:`PeerTier`.

The core is seen only through :class:`mtcfs.core.ports.PeerPort` (imports point down); the
tier sets the ``replicated``/``replicas`` counts of a step record. The composition root
(mtcfs/daemon.py) hooks the replica store into the core (``shared_used``, ``vstore.chunk_keeper``).
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from mtcfs.base import pools
from mtcfs.base.retry import RetryPolicy
from mtcfs.base.token_bucket import TokenBucket
from mtcfs.core.ports import PeerPort
from mtcfs.tiers.peer import placement
from mtcfs.tiers.peer.client import PeerClient
from mtcfs.tiers.peer.errors import PeerUnavailable
from mtcfs.tiers.peer.records import MemberInfo, StepRef
from mtcfs.tiers.peer.replica_store import ReplicaStore
from mtcfs.tiers.peer.service import PeerServer, serve
from mtcfs.tiers.peer.sources import ATTEMPT_S, FsLocalChunks
from mtcfs.tiers.peer.tls import TlsFiles
from mtcfs.tiers.peer.tier_membership import MembershipRounds
from mtcfs.tiers.peer.tier_replication import PeerLink, Replication

if TYPE_CHECKING:
    from mtcfs.tiers.backup import BackupStore
    from mtcfs.tiers.coord.etcd import Etcd

log = logging.getLogger(__name__)

#: Seconds one GetChunks call of a bulk restore (16 chunks, 64 MiB at the default chunk
#: size) may take: at least ~1 MB/s, or the holder's share goes to the others.
BULK_CALL_S = 60.0


@dataclass
class TierConfig:
    """What the mount options say about the job (see docs/usage.md)."""

    job: str
    rank: int
    nodes: int
    listen: str
    addresses: dict[int, str]
    replicas: int = 1
    placement: str = "ring"
    labels: dict[str, str] = field(default_factory=dict)
    data_parallelism: int = 1
    huge_model: bool = False
    heartbeat_s: float = 1.0   # seconds between membership rounds (local work, step records)
    liveness_s: float = 5.0    # the etcd lease's TTL: a dead node is gone after this
    twin_wait_s: float = 60.0
    keep: int = 2
    #: the job CA and this rank's certificate (None: plaintext, mount option ``insecure``)
    tls: TlsFiles | None = None
    #: bytes one other rank may hold here (``replica_quota=``); None: a fair share
    replica_quota: int | None = None
    #: the chunk stream's TCP port (``stream_port=``); 0: one the kernel picks
    stream_port: int = 0
    #: bytes per second this node's replication may send (``replicate_rate=``); 0: unbounded
    replicate_rate: int = 0


class PeerTier(MembershipRounds, Replication):
    """The peer tier of one node.

    Args:
        fs: the filesystem core, as the peer tier sees it.
        cfg: the job's configuration.
        store_dir: the node's store directory; replicas go to ``<store_dir>/replicas``.
        backup_store: the backup tier (a per-rank ``BackupStore``) or None.
        etcd: the job's etcd client (mtcfs.tiers.coord.etcd.Etcd); prefix: the job's keys.

    The Peer server starts in :meth:`start_server`, which raises OSError when the listen
    address cannot be bound.
    """

    def __init__(self, fs: PeerPort, cfg: TierConfig, store_dir: str,
                 backup_store: BackupStore | None = None, *, etcd: Etcd, prefix: str) -> None:
        self.fs = fs
        self.cfg = cfg
        self.rank = cfg.rank
        self.backup_store = backup_store
        self.addresses: dict[int, str] = dict(cfg.addresses)
        #: ranks whose address peers= gave: never replaced by what etcd says
        self.configured: set[int] = set(cfg.addresses)
        self.advertise = self._advertised(cfg.listen)
        self.addresses[self.rank] = self.advertise
        self._setup_membership(etcd, prefix)
        self.replica_store = ReplicaStore(f"{store_dir}/replicas",
                                          capacity=lambda: fs.capacity - fs.used,
                                          quota=self.replica_quota)
        #: What this node's replication sends takes from it (``replicate_rate=``); a
        #: restore's reads, served or asked, never do.
        self.send_budget = TokenBucket(cfg.replicate_rate)
        self.server: PeerServer | None = None
        self.clients: dict[str, PeerClient] = {}
        self.links: dict[int, PeerLink] = {}
        self.members: dict[int, MemberInfo] = {}
        self.latest_complete: StepRef | None = None
        self.partitioned: set[int] = set()
        self.bad_peers: dict[int, int] = {}
        self.restorable: dict[str, int] = {}     # steps this rank can restore: name -> number
        self.restore_holders: list[int] = []
        self.restore_info: dict[str, Any] | None = None
        self.restore_decision: dict[str, Any] | None = None  # etcd's, at the last restore
        self._stop = threading.Event()
        self._clients_lock = threading.Lock()
        self._retired: list[PeerClient] = []  # clients of an older certificate
        self._wake: dict[int, trio.Event] = {}
        self._replicating: set[int] = set()   # peers with a running replication task
        self._bulk = pools.limiter("peer-bulk")
        #: registrations of more services on the Peer server (scope=job's namespace)
        self.extra_services: list[Any] = []
        #: rank -> the ranks holding its replicas, where the job said so (Orbax's
        #: replicator.yaml, mtcfs/tiers/mtc/); other ranks follow the placement options.
        self.peer_override: dict[int, list[int]] = {}
        #: The ranks the job says hold the same data as this one (replicator.yaml's
        #: assume-data-parallelism): replication to them first offers hashes only.
        self.twin_override: set[int] | None = None
        fs.subscribe(self._on_event)

    def replica_quota(self) -> int:
        """Bytes one other rank may hold in this node's replica store: a fair share of the
        node's RAM budget, ``size / (1 + replicas)`` — the node's own files and the
        ``replicas`` ranks that place their copies here get one share each — or what
        ``replica_quota=`` says. A peer (even a member gone wrong) that sends more gets
        RESOURCE_EXHAUSTED for the excess, and this node's own writes keep their share
        (docs/security.md)."""
        if self.cfg.replica_quota is not None:
            return min(self.cfg.replica_quota, self.fs.capacity)
        return self.fs.capacity // (1 + max(1, self.cfg.replicas))

    @staticmethod
    def _advertised(listen: str) -> str:
        host, _, port = listen.rpartition(":")
        if host in ("0.0.0.0", "[::]", ""):
            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                host = "127.0.0.1"
        return f"{host}:{port}"

    # ------------------------------------------------------------------ lifecycle

    def start_server(self, token: trio.lowlevel.TrioToken) -> None:
        """Start the Peer service (threads). Call from the trio loop the core runs on."""
        self.replica_store._local = FsLocalChunks(self.fs, token)
        self.server = serve(self.replica_store, self.cfg.listen, self.cfg.job, self.cfg.nodes,
                            workers=32, extra=self.extra_services, tls=self.cfg.tls,
                            stream_port=self.cfg.stream_port)
        self.server.service.partitioned = self.partitioned
        if self.cfg.listen.endswith(":0"):  # tests: the port was picked by the kernel
            self.advertise = self._advertised(self.server.address)
            self.addresses[self.rank] = self.advertise

    def stop(self) -> None:
        """Stop serving and calling peers (idempotent); waits up to 2 s for calls in
        progress, so that no gRPC thread touches the core after the daemon closes it."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self.server is not None:
            self.server.stop(grace=1.0).wait(2.0)
        with self._clients_lock:
            for c in [*self.clients.values(), *self._retired]:
                c.close()

    async def run(self) -> None:
        """Membership, replication and gc until cancelled (after :meth:`join_job`)."""
        async with trio.open_nursery() as n:
            n.start_soon(self._membership_loop)
            n.start_soon(self._links_loop, n)
            n.start_soon(self._gc_loop)

    # ------------------------------------------------------------------ clients

    def client(self, rank: int) -> PeerClient:
        """The client for ``rank``'s Peer service.

        Raises:
            PeerUnavailable: no address is known for it, or it is cut off (injected fault).
        """
        return self._client(rank, "default")

    def fetch_client(self, rank: int) -> PeerClient:
        """The client that fault-in fetches chunks from ``rank`` with: one attempt, every
        call within :data:`~mtcfs.tiers.peer.sources.ATTEMPT_S` seconds (the chunk sources
        ask the next source instead of retrying).

        Raises:
            PeerUnavailable: as :meth:`client`.
        """
        return self._client(rank, "fetch")

    def bulk_client(self, rank: int) -> PeerClient:
        """The client a bulk restore streams chunks from ``rank`` with: one attempt, each
        call of up to :data:`~mtcfs.tiers.peer.client.GET_BATCH` chunks within
        :data:`BULK_CALL_S` seconds (chunks not received go to another holder next round,
        then to fault-in, which tries every source).

        Raises:
            PeerUnavailable: as :meth:`client`.
        """
        return self._client(rank, "bulk")

    def other_ranks(self) -> list[int]:
        """Every other rank with a known address, lowest first."""
        return [r for r in sorted(self.addresses) if r != self.rank]

    def _client(self, rank: int, kind: str) -> PeerClient:
        addr = self.addresses.get(rank)
        if addr is None:
            if self.member is not None:  # a membership view still gathering reads it now
                self.member.want([rank])
            raise PeerUnavailable(f"rank {rank}", "no address known yet")
        if rank in self.partitioned:
            raise PeerUnavailable(addr, f"rank {rank} is cut off from this node (injected fault)")
        key = f"{addr}#{kind}"
        with self._clients_lock:  # called from many worker threads at once
            if self._stop.is_set():
                raise PeerUnavailable(addr, "this node is shutting down")
            c = self.clients.get(key)
            tls = self.cfg.tls
            if c is not None and tls is not None and c.tls_generation != tls.generation:
                # The certificate was renewed on disk: new connections must present it. The
                # old channel may still carry calls; it is closed at stop.
                self._retired.append(c)
                c = None
            if c is None:
                c = self.clients[key] = self._new_client(addr, kind)
        return c

    def _new_client(self, addr: str, kind: str) -> PeerClient:
        job, rank, stop = self.cfg.job, self.rank, self._stop
        tls = self.cfg.tls
        if kind in ("fetch", "bulk"):
            return PeerClient(addr, job, rank, timeout=ATTEMPT_S,
                              stream_timeout=ATTEMPT_S if kind == "fetch" else BULK_CALL_S,
                              stop=stop, tls=tls,
                              retry=RetryPolicy(max_attempts=1, base_delay=0.1, max_delay=0.1))
        return PeerClient(addr, job, rank, timeout=10.0, stop=stop, tls=tls,
                          retry=RetryPolicy(max_attempts=3, base_delay=0.1, max_delay=1.0))

    def report_bad(self, rank: int, message: str) -> None:
        self.bad_peers[rank] = self.bad_peers.get(rank, 0) + 1
        self.fs.report_error(f"peer rank {rank} served bad data: {message}")

    # ------------------------------------------------------------------ placement

    def peer_ranks(self) -> list[int]:
        """The ranks that hold this rank's data (empty until topology labels are known)."""
        return self.peers_of(self.rank)

    def peers_of(self, rank: int) -> list[int]:
        if rank in self.peer_override:  # told by the training job (replicator.yaml)
            return list(self.peer_override[rank])
        c = self.cfg
        n, r = c.nodes, c.replicas
        if n < 2 or r < 1:
            return []
        if c.data_parallelism > 1:
            if c.huge_model:
                r = min(r, c.data_parallelism - 1)
            return placement.data_parallel_peers(rank, n, c.data_parallelism, r)
        if c.labels:
            labels = [self.members[i].labels if i in self.members else None for i in range(n)]
            labels[self.rank] = c.labels
            if any(lab is None for lab in labels):
                return []
            return placement.topology_peers(rank, labels, r)  # type: ignore[arg-type]
        if c.placement == "group":
            return placement.group_peers(rank, n, r + 1)
        return placement.ring_peers(rank, n, r)

    def twins(self) -> set[int]:
        """Data-parallel twins of this rank: ranks that write the same bytes."""
        c = self.cfg
        if self.twin_override is not None:
            return set(self.twin_override)
        if c.data_parallelism < 2:
            return set()
        stride = c.nodes // c.data_parallelism
        return {(self.rank + k * stride) % c.nodes for k in range(1, c.data_parallelism)}

    def lower_live_twins(self) -> list[int]:
        """Twins with a lower rank that etcd says are alive, lowest first."""
        out = []
        for r in sorted(self.twins()):
            m = self.members.get(r)
            if r < self.rank and r not in self.partitioned and (m is None or m.alive):
                out.append(r)
        return out

    def upload_share(self) -> Any:
        """Which chunks of a step this rank uploads to the backup tier, or None for all.

        Data-parallel twins split the upload of their identical chunks by digest, so each
        unique chunk is uploaded by exactly one of them; every node computes the same split.
        """
        c = self.cfg
        if c.data_parallelism < 2:
            return None
        d = c.data_parallelism
        index = self.rank // (c.nodes // d)
        return lambda digest: int(digest[:8], 16) % d == index

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        now_members = []
        for r in sorted(self.members):
            m = self.members[r]
            now_members.append({"rank": m.rank, "address": m.address, "alive": m.alive,
                                "member_for_s": round(m.age_s, 2), "labels": m.labels})
        links = []
        for p in self.peer_ranks():
            link = self.links.get(p) or PeerLink(p)
            lag_steps, lag_bytes = self.lag(link)
            links.append({"peer": p, "address": self.addresses.get(p), "state": link.state,
                          "lag_steps": lag_steps, "lag_bytes": lag_bytes,
                          "lag_seconds": round(self.lag_seconds(link), 3),
                          "last_replicated": link.last_replicated,
                          "last_error": link.last_error, "bytes_sent": link.bytes_sent,
                          "chunks_sent": link.chunks_sent,
                          "chunks_skipped": link.chunks_skipped,
                          "steps_replicated": link.steps_replicated,
                          "data_parallel_twin": p in self.twins()})
        lc = self.latest_complete
        return {
            "rank": self.rank, "nodes": self.cfg.nodes, "listen": self.advertise,
            "stream_port": (self.server.service.chunk_stream.port
                            if self.server is not None
                            and self.server.service.chunk_stream is not None else None),
            "membership": {"etcd": f"{self.coord_prefix}members/",
                           "registered": self.member is not None and not self.membership_error,
                           "error": self.membership_error or None,
                           "lease_ttl_s": self.member.ttl_s if self.member else None,
                           "connected": self.member.connected if self.member else False,
                           "lease_renewed_ago_s": round(self.member.renewed_ago_s(), 3)
                           if self.member else None,
                           "etcd_errors": self.member.counters["etcd_errors"]
                           if self.member else 0,
                           "reregistrations": self.member.counters["reregistrations"]
                           if self.member else 0,
                           "steps_recorded": sorted(self._recorded or ())},
            "replicas": len(self.peer_ranks()) if self.rank in self.peer_override
            else self.cfg.replicas, "placement": self._placement_name(),
            "peers": self.peer_ranks(),
            "holds_for": [r for r in range(self.cfg.nodes)
                          if r != self.rank and self.rank in self._safe_peers_of(r)],
            "latest_complete": {"step": lc.step, "number": lc.step_number} if lc else None,
            "members": now_members, "replication": links,
            "replica_store": {**self.replica_store.stats(),
                              "quota_per_rank_bytes": self.replica_quota(),
                              "held_by_rank": {str(r): n for r, n in
                                               self.replica_store.held_by_rank().items()}},
            "server": self.server.service.stats() if self.server else None,
            "bad_peers": {str(k): v for k, v in self.bad_peers.items()},
            "partitioned": sorted(self.partitioned),
            "restore": None if self.restore_info is None else
            {**self.restore_info, "decision": self.restore_decision},
        }

    def _safe_peers_of(self, rank: int) -> list[int]:
        try:
            return self.peers_of(rank)
        except Exception:
            return []

    def _placement_name(self) -> str:
        c = self.cfg
        if self.rank in self.peer_override:
            return "replicator.yaml"
        if c.data_parallelism > 1:
            return f"data-parallel D={c.data_parallelism}" + (" huge-model" if c.huge_model else "")
        if c.labels:
            return "topology"
        return c.placement
