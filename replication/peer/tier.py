"""The peer tier of one node: membership, replication of committed steps, replica gc.

One :class:`PeerTier` per mount with ``nodes > 1``. It owns the node's Peer gRPC server
(threads), its replica store (``<store>/replicas``, in the same RAM budget as the node's own
files), one client per peer, and three kinds of trio tasks:

* **heartbeats** (every ``heartbeat_s``): report this rank — address, labels, steps complete,
  capacity — to the coordinator, the lowest rank that answers; learn members and the newest
  step complete on all ranks. When the coordinator does not answer it is suspected for
  ``liveness_s`` and the next rank is asked, so the lowest live rank takes over with no
  decision and rebuilds the soft state from the reports it now receives (and from the
  backup tier, see :meth:`PeerTier.backup_latest`).
* **replication**, one task per peer (placement.py decides which): every committed, sealed
  step goes to the peer — the chunks it lacks, then the manifest — and once the peer's
  ``PublishManifest`` reply lists nothing missing the step counts as replicated there; its
  ``user.mtcfs.state`` becomes ``replicated k/R``. A data-parallel twin holds the same bytes
  itself, so only hashes travel (the twin's answer "missing nothing" is the verification);
  if it still lacks chunks after ``twin_wait_s``, the bytes are sent after all. Failures
  back off (jittered exponential, capped) and show as lag in status; the application never
  waits for any of it.
* **replica gc** (every 10 s): drop replicas of steps older than the ``keep`` newest of each
  rank, never the step complete in the job.

The core is used through duck-typed methods only (``steps``, ``step_sealed``,
``snapshot_step``, ``chunk_reader``, ``unpin``, ``subscribe``, ``statfs``); imports point
down.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from mtcfs.manifest import StepManifest
from replication.peer import placement
from replication.peer.client import PeerClient
from replication.peer.errors import PeerError, PeerUnavailable
from replication.peer.membership import Membership
from replication.peer.records import HeartbeatResult, MemberInfo, StepRef
from replication.peer.replica_store import ReplicaStore
from replication.peer.service import PeerServer, serve
from replication.peer.sources import FsLocalChunks
from replication.backup.retry import RetryPolicy

log = logging.getLogger(__name__)

#: Seconds a coordinator candidate that did not answer is skipped before it is asked again:
#: short, so that a restarted lower rank (its store empty, waiting for the job to name the
#: step to restore) becomes coordinator again within a few rounds.
SUSPECT_S = 2.0

#: Replication sends a chunk only after this many seconds without an application write...
QUIET_S = 0.05
#: ... waiting at most this long in total per step pushed to a peer.
YIELD_BUDGET_S = 30.0

#: Steps per rank a node keeps as replicas beyond ``keep`` (a step being replicated while
#: the previous ones are still the newest complete).
_REPLICA_SLACK = 1
#: Seconds between checks that an idle peer still holds the steps it confirmed.
_AUDIT_S = 5.0


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
    heartbeat_s: float = 1.0
    liveness_s: float = 5.0
    twin_wait_s: float = 60.0
    keep: int = 2


@dataclass
class PeerLink:
    """Replication towards one peer, as ``mtcfs status`` shows it."""

    peer: int
    state: str = "starting"          # ok | lagging | unreachable | starting
    last_replicated: str | None = None
    last_error: str | None = None
    failures: int = 0
    bytes_sent: int = 0
    chunks_sent: int = 0
    chunks_skipped: int = 0
    steps_replicated: int = 0
    confirmed: dict[str, int] = field(default_factory=dict)  # step -> committed_ns confirmed
    audited: float = 0.0                  # monotonic time of the last audit


class TwinNotReady(Exception):
    """A data-parallel twin does not hold (all of) the step's chunks yet."""


class PeerTier:
    """The peer tier of one node.

    Args:
        fs: the filesystem core.
        cfg: the job's configuration.
        store_dir: the node's store directory; replicas go to ``<store_dir>/replicas``.
        backup_store: the backup tier (a per-rank ``BackupStore``) or None.

    Raises:
        OSError: the listen address cannot be bound.
    """

    def __init__(self, fs: Any, cfg: TierConfig, store_dir: str,
                 backup_store: Any = None) -> None:
        self.fs = fs
        self.cfg = cfg
        self.rank = cfg.rank
        self.backup_store = backup_store
        self.addresses: dict[int, str] = dict(cfg.addresses)
        self.advertise = self._advertised(cfg.listen)
        self.addresses[self.rank] = self.advertise
        self.membership = Membership(cfg.nodes, self_rank=cfg.rank, self_address=self.advertise,
                                     self_labels=cfg.labels, liveness_s=cfg.liveness_s)
        self.replica_store = ReplicaStore(f"{store_dir}/replicas",
                                          capacity=lambda: fs.capacity - fs.used)
        fs.shared_used = lambda: self.replica_store.used
        self.server: PeerServer | None = None
        self.clients: dict[str, PeerClient] = {}
        self.links: dict[int, PeerLink] = {}
        self.members: dict[int, MemberInfo] = {}
        self.coordinator: int | None = None
        self.latest_complete: StepRef | None = None
        self._backup_latest: StepRef | None = None
        self.suspect: dict[int, float] = {}
        self.partitioned: set[int] = set()
        self.bad_peers: dict[int, int] = {}
        self.restorable: dict[str, int] = {}     # steps this rank can restore: name -> number
        self.restore_holders: list[int] = []
        self.restore_info: dict[str, Any] | None = None
        self._known_version = 0
        self._stop = threading.Event()
        self._wake: dict[int, trio.Event] = {}
        self._replicating: set[int] = set()   # peers with a running replication task
        self._bulk = trio.CapacityLimiter(4)
        fs.subscribe(self._on_event)

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
                            membership=self.membership, workers=32)
        self.server.service.partitioned = self.partitioned
        if self.cfg.listen.endswith(":0"):  # tests: the port was picked by the kernel
            self.advertise = self._advertised(self.server.address)
            self.addresses[self.rank] = self.advertise

    def stop(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.stop(grace=1.0)
        for c in self.clients.values():
            c.close()

    async def run(self) -> None:
        """Heartbeats, replication and gc until cancelled."""
        async with trio.open_nursery() as n:
            n.start_soon(self._heartbeat_loop)
            n.start_soon(self._links_loop, n)
            n.start_soon(self._gc_loop)

    # ------------------------------------------------------------------ clients

    def client(self, rank: int, *, quick: bool = False) -> PeerClient:
        """The client for ``rank``'s Peer service.

        Args:
            quick: for heartbeats: a 2 s deadline and no retry, so that a peer behind a
                partition (packets dropped, no refusal) costs one short wait per round.

        Raises:
            PeerUnavailable: no address is known for it, or it is cut off (injected fault).
        """
        addr = self.addresses.get(rank)
        if addr is None:
            raise PeerUnavailable(f"rank {rank}", "no address known yet")
        if rank in self.partitioned:
            raise PeerUnavailable(addr, f"rank {rank} is cut off from this node (injected fault)")
        key = f"{addr}#quick" if quick else addr
        c = self.clients.get(key)
        if c is None:
            if quick:
                c = PeerClient(addr, self.cfg.job, self.rank, timeout=2.0, stop=self._stop,
                               retry=RetryPolicy(max_attempts=1, base_delay=0.1, max_delay=0.1))
            else:
                c = PeerClient(addr, self.cfg.job, self.rank, timeout=10.0, stop=self._stop,
                               retry=RetryPolicy(max_attempts=3, base_delay=0.1, max_delay=1.0))
            self.clients[key] = c
        return c

    def report_bad(self, rank: int, message: str) -> None:
        self.bad_peers[rank] = self.bad_peers.get(rank, 0) + 1
        self.fs._error(f"peer rank {rank} served bad data: {message}")

    # ------------------------------------------------------------------ placement

    def peer_ranks(self) -> list[int]:
        """The ranks that hold this rank's data (empty until topology labels are known)."""
        return self.peers_of(self.rank)

    def peers_of(self, rank: int) -> list[int]:
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
        if c.data_parallelism < 2:
            return set()
        stride = c.nodes // c.data_parallelism
        return {(self.rank + k * stride) % c.nodes for k in range(1, c.data_parallelism)}

    def lower_live_twins(self) -> list[int]:
        """Twins with a lower rank that the coordinator sees alive, lowest first."""
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

    # ------------------------------------------------------------------ membership

    def _steps_report(self) -> list[StepRef]:
        out = {name: rec.number for name, rec in self.fs.steps.items()}
        out.update(self.restorable)
        return [StepRef(name, num) for name, num in sorted(out.items(), key=lambda x: x[1])][-16:]

    def _candidates(self) -> list[int]:
        now = time.monotonic()
        return [r for r in range(self.cfg.nodes)
                if r == self.rank or (r in self.addresses and self.suspect.get(r, 0) <= now)]

    async def heartbeat_once(self) -> None:
        """One round: report to the coordinator (the lowest rank that answers)."""
        s = self.fs.statfs()
        steps = self._steps_report()
        self.membership.report(self.rank, address=self.advertise, labels=self.cfg.labels,
                               steps_complete=steps, capacity_bytes=s["capacity"],
                               used_bytes=s["used"], job_complete=self.latest_complete)
        for cand in self._candidates():
            if cand == self.rank:
                if self.coordinator != self.rank:
                    log.info("rank %d coordinates the job now", self.rank)
                self.coordinator = self.rank
                self._learn(self.membership.view(0), own=True)
                return
            try:
                res = await trio.to_thread.run_sync(
                    partial(self._heartbeat_call, cand, steps, s), abandon_on_cancel=True)
            except PeerError as exc:
                if self.suspect.get(cand, 0) <= time.monotonic():
                    log.warning("coordinator candidate rank %d does not answer: %s", cand, exc)
                self.suspect[cand] = time.monotonic() + min(self.cfg.liveness_s, SUSPECT_S)
                continue
            if self.coordinator != cand:
                log.info("rank %d coordinates the job", cand)
                self._known_version = 0  # another table: its versions are not comparable
            self.coordinator = cand
            self._learn(res, own=False)
            return

    def ask_all_latest(self) -> list[StepRef | None]:
        """Worker thread: every other known node's newest step complete on all ranks (one
        short heartbeat each; nodes that do not answer are left out)."""
        s = self.fs.statfs()
        steps = self._steps_report()
        out: list[StepRef | None] = []
        for rank in sorted(self.addresses):
            if rank == self.rank:
                continue
            try:
                out.append(self._heartbeat_call(rank, steps, s).latest_complete)
            except PeerError:
                continue
        return out

    def _heartbeat_call(self, rank: int, steps: list[StepRef],
                        s: Mapping[str, int]) -> HeartbeatResult:
        return self.client(rank, quick=True).heartbeat(
            address=self.advertise, labels=self.cfg.labels, steps_complete=steps,
            capacity_bytes=s["capacity"], used_bytes=s["used"],
            known_version=self._known_version, job_complete=self.latest_complete)

    def _learn(self, res: HeartbeatResult, *, own: bool) -> None:
        if res.members is not None:
            members = {m.rank: m for m in res.members}
            # A new coordinator's table lacks the ranks that never reported to it (the old
            # coordinator above all): keep what was learned of them, as dead, so status
            # lists them and topology placement still knows their labels.
            for r, m in self.members.items():
                if r not in members:
                    members[r] = dataclasses.replace(m, alive=False)
            self.members = members
            for m in res.members:
                if m.rank != self.rank and m.address:
                    self.addresses[m.rank] = m.address
            if not own:
                self._known_version = res.membership_version
        # A step complete on all ranks stays so: keep the newest this node has been told,
        # whichever coordinator (or the backup tier) told it.
        for cand in (res.latest_complete, self._backup_latest if own else None):
            if cand is not None and (self.latest_complete is None or
                                     cand.step_number > self.latest_complete.step_number):
                self.latest_complete = cand

    async def _heartbeat_loop(self) -> None:
        last_backup_check = -1e9
        while True:
            try:
                await self.heartbeat_once()
                if self.coordinator == self.rank and self.backup_store is not None and \
                        time.monotonic() - last_backup_check > 30:
                    last_backup_check = time.monotonic()
                    self._backup_latest = await trio.to_thread.run_sync(self.backup_latest)
            except Exception:  # never let membership die
                log.exception("heartbeat round failed")
            await trio.sleep(self.cfg.heartbeat_s)

    def backup_latest(self) -> StepRef | None:
        """The newest step the backup tier holds complete for every rank (thread)."""
        try:
            by_step = self.backup_store.complete_ranks()
        except Exception as exc:
            log.warning("cannot read the backup tier's steps: %s", exc)
            return None
        full = [(num, step) for step, (num, ranks) in by_step.items()
                if len(ranks) >= self.cfg.nodes]
        if not full:
            return None
        num, step = max(full)
        return StepRef(step, num)

    # ------------------------------------------------------------------ replication

    def _on_event(self, event: str, obj: Any) -> None:
        if event in ("committed", "sealed"):
            for ev in self._wake.values():
                ev.set()
        elif event == "step_removed":
            for link in self.links.values():
                link.confirmed.pop(obj, None)

    async def _links_loop(self, nursery: trio.Nursery) -> None:
        """Start a replication task for each peer placement names (topology may change)."""
        while True:
            for p in self.peer_ranks():
                if p not in self._replicating:  # new, or its task ended (placement changed)
                    self.links.setdefault(p, PeerLink(p))
                    self._wake[p] = trio.Event()
                    self._replicating.add(p)
                    nursery.start_soon(self._replicate_to, p)
            await trio.sleep(self.cfg.heartbeat_s)

    def _recent(self) -> list[Any]:
        """The steps replicated: the ``keep`` newest, newest first."""
        return sorted(self.fs.steps.values(), key=lambda r: (r.number, r.committed_ns),
                      reverse=True)[:max(1, self.cfg.keep)]

    def _wanted(self, link: PeerLink) -> list[Any]:
        """Steps still to replicate to ``link.peer``, newest first (the ``keep`` newest)."""
        return [r for r in self._recent() if link.confirmed.get(r.name) != r.committed_ns]

    def lag(self, link: PeerLink) -> tuple[int, int]:
        """(steps, bytes) not yet confirmed by the peer."""
        steps = self._wanted(link)
        total = 0
        for rec in steps:
            for _p, ino in self.fs.walk(self.fs.inodes[rec.ino]):
                if ino.is_file and ino.vid is not None:
                    total += self.fs.versions[ino.vid].size
        return len(steps), total

    def _ready(self, rec: Any) -> bool:
        fs = self.fs
        if not fs.step_sealed(rec):
            return False
        return all(not fs.versions[i.vid].missing for _p, i in fs.walk(fs.inodes[rec.ino])
                   if i.is_file and i.vid is not None)

    async def _replicate_to(self, peer: int) -> None:
        try:
            await self._replicate_loop(peer)
        finally:
            self._replicating.discard(peer)

    async def _replicate_loop(self, peer: int) -> None:
        link = self.links[peer]
        rng = random.Random()
        while peer in self.peer_ranks():
            todo = [r for r in self._wanted(link) if self._ready(r)]
            if not todo:
                if not self._wanted(link):
                    link.state = "ok"
                    if time.monotonic() - link.audited >= _AUDIT_S and await self._audit(link):
                        continue  # the peer lost steps (it restarted empty): send them again
                with trio.move_on_after(2.0):
                    await self._wake[peer].wait()
                self._wake[peer] = trio.Event()
                continue
            try:
                await self._replicate_step(link, todo[0])
                link.failures = 0
                link.last_error = None
                link.state = "ok" if len(todo) == 1 else "lagging"
            except (PeerError, TwinNotReady, OSError) as exc:
                link.failures += 1
                link.last_error = str(exc)
                link.state = "unreachable" if isinstance(exc, PeerUnavailable) else "lagging"
                if link.failures in (1, 5) or link.failures % 50 == 0:
                    log.warning("replication of %s to rank %d: %s", todo[0].name, peer, exc)
                delay = min(10.0, 0.25 * 2 ** min(link.failures, 6))
                with trio.move_on_after(rng.uniform(delay / 2, delay)):
                    await self._wake[peer].wait()
                self._wake[peer] = trio.Event()

    async def _replicate_step(self, link: PeerLink, rec: Any) -> None:
        fs = self.fs
        committed = rec.committed_ns
        manifest, pinned = fs.snapshot_step(rec.name)
        try:
            manifest = dataclasses.replace(manifest, rank=self.rank)
            reader = self._yielding(fs.chunk_reader(pinned))
            twin = link.peer in self.twins()
            hashes_only = twin and time.time_ns() - committed < self.cfg.twin_wait_s * 1e9
            async with self._bulk:
                stats = await trio.to_thread.run_sync(
                    self._push, link.peer, manifest, reader, hashes_only,
                    abandon_on_cancel=True)
        finally:
            fs.unpin(pinned)
        link.bytes_sent += stats["bytes_sent"]
        link.chunks_sent += stats["chunks_sent"]
        link.chunks_skipped += stats["chunks_skipped"]
        if fs.steps.get(rec.name) is not rec or rec.committed_ns != committed:
            return  # changed meanwhile: the next round replicates the new content
        link.confirmed[rec.name] = committed
        link.last_replicated = rec.name
        link.steps_replicated += 1
        self._count(rec)
        log.info("%s replicated to rank %d (%d/%d; %d payload bytes)", rec.name, link.peer,
                 rec.replicated, rec.replicas, stats["bytes_sent"])

    def _count(self, rec: Any) -> None:
        """Set the step's ``replicated k/R`` from the links' confirmations."""
        rec.replicas = len(self.peer_ranks())
        rec.replicated = sum(1 for lk in self.links.values()
                             if lk.peer in self.peer_ranks()
                             and lk.confirmed.get(rec.name) == rec.committed_ns)

    async def _audit(self, link: PeerLink) -> bool:
        """Ask the peer which of this rank's steps it holds complete; drop confirmations of
        steps it no longer holds (it restarted with an empty store, or lost them), so they
        count again as not replicated and are sent again. Returns True if any was dropped.
        An unreachable peer changes nothing (the next audit asks again)."""
        link.audited = time.monotonic()
        window = {r.name: r for r in self._recent()}
        before = {name: ns for name, ns in link.confirmed.items() if name in window}
        if not before:
            return False
        try:
            infos = await trio.to_thread.run_sync(
                partial(self._list_held, link.peer), abandon_on_cancel=True)
        except (PeerError, OSError) as exc:
            log.debug("audit of rank %d: %s", link.peer, exc)
            return False
        held = {i.step for i in infos if i.chunks_missing == 0}
        lost = [name for name, ns in before.items()
                if name not in held and link.confirmed.get(name) == ns]
        for name in lost:
            del link.confirmed[name]
            self._count(window[name])
        if lost:
            log.warning("rank %d no longer holds %s of this rank (restarted?): replicating "
                        "again", link.peer, ", ".join(sorted(lost)))
        return bool(lost)

    def _list_held(self, peer: int) -> list[Any]:
        return self.client(peer).list_manifests(self.rank, with_manifest=False)

    def _yielding(self, read: Any) -> Any:
        """Wrap a chunk reader so that sending pauses while the application writes.

        On a node the replication's reads and sends compete with the application's writes
        for CPU and memory bandwidth; checkpoint writes are the training job's critical
        path, so before each chunk the sender waits until no write() came for
        :data:`QUIET_S`. The pauses of one push add up to :data:`YIELD_BUDGET_S` at most,
        so a job that never stops writing still gets its steps replicated.
        """
        budget = [YIELD_BUDGET_S]

        def read_chunk(digest: str) -> bytes:
            while budget[0] > 0 and time.monotonic() - self.fs.last_write < QUIET_S:
                time.sleep(0.02)
                budget[0] -= 0.02
            return read(digest)
        return read_chunk

    def _push(self, peer: int, manifest: StepManifest, reader: Any,
              hashes_only: bool) -> dict[str, int]:
        """Worker thread: put what the peer lacks, publish the manifest, confirm."""
        client = self.client(peer)
        out = {"bytes_sent": 0, "chunks_sent": 0, "chunks_skipped": 0}
        digests = sorted(manifest.chunk_set())
        if hashes_only:
            # A data-parallel twin wrote the same bytes: publishing the manifest is the
            # check (its reply lists the chunks it does not hold, from its own files or
            # its replicas); no chunk payload moves.
            res = client.publish_manifest(manifest)
            if res.missing:
                raise TwinNotReady(f"data-parallel twin rank {peer} does not hold "
                                   f"{len(res.missing)} of {res.chunks_total} chunks yet")
            out["chunks_skipped"] = len(digests)
            return out
        todo = digests
        for _attempt in range(3):
            put = client.put_chunks((h, partial(reader, h)) for h in todo)
            out["bytes_sent"] += put.bytes_sent
            out["chunks_sent"] += put.chunks_sent
            out["chunks_skipped"] += len(put.skipped)
            if put.rejected:
                h, why = next(iter(put.rejected.items()))
                raise PeerError(client.address, f"refused {len(put.rejected)} chunks "
                                                f"(e.g. {h[:16]}: {why})")
            res = client.publish_manifest(manifest)
            if not res.missing:
                return out
            todo = list(res.missing)  # dropped by its gc meanwhile: send again
        raise PeerError(client.address, f"still lacks {len(todo)} chunks of {manifest.step}")

    # ------------------------------------------------------------------ replica gc

    async def _gc_loop(self) -> None:
        while True:
            await trio.sleep(10.0)
            protect = [self.latest_complete.step_number] if self.latest_complete else []
            try:
                stats = await trio.to_thread.run_sync(
                    partial(self.replica_store.gc, self.cfg.keep + _REPLICA_SLACK,
                            protect_steps=protect, orphan_grace_s=600.0))
                if stats.manifests_deleted or stats.chunks_deleted:
                    log.info("replica gc: %d manifests, %d chunks (%d bytes) freed",
                             len(stats.manifests_deleted), stats.chunks_deleted,
                             stats.bytes_freed)
            except Exception:
                log.exception("replica gc failed")

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        now_members = []
        view = self.membership.view(0) if self.coordinator == self.rank else None
        source = dict(self.members)
        if view and view.members:
            source.update({m.rank: m for m in view.members})
        for r in sorted(source):
            m = source[r]
            now_members.append({"rank": m.rank, "address": m.address, "alive": m.alive,
                                "age_s": round(m.age_s, 2), "labels": m.labels,
                                "capacity_bytes": m.capacity_bytes, "used_bytes": m.used_bytes})
        links = []
        for p in self.peer_ranks():
            link = self.links.get(p) or PeerLink(p)
            lag_steps, lag_bytes = self.lag(link)
            links.append({"peer": p, "address": self.addresses.get(p), "state": link.state,
                          "lag_steps": lag_steps, "lag_bytes": lag_bytes,
                          "last_replicated": link.last_replicated,
                          "last_error": link.last_error, "bytes_sent": link.bytes_sent,
                          "chunks_sent": link.chunks_sent,
                          "chunks_skipped": link.chunks_skipped,
                          "steps_replicated": link.steps_replicated,
                          "data_parallel_twin": p in self.twins()})
        lc = self.latest_complete
        return {
            "rank": self.rank, "nodes": self.cfg.nodes, "listen": self.advertise,
            "coordinator": self.coordinator,
            "coordinator_address": self.addresses.get(self.coordinator)
            if self.coordinator is not None else None,
            "replicas": self.cfg.replicas, "placement": self._placement_name(),
            "peers": self.peer_ranks(),
            "holds_for": [r for r in range(self.cfg.nodes)
                          if r != self.rank and self.rank in self._safe_peers_of(r)],
            "latest_complete": {"step": lc.step, "number": lc.step_number} if lc else None,
            "members": now_members, "replication": links,
            "replica_store": self.replica_store.stats(),
            "server": self.server.service.stats() if self.server else None,
            "bad_peers": {str(k): v for k, v in self.bad_peers.items()},
            "partitioned": sorted(self.partitioned),
            "restore": self.restore_info,
        }

    def _safe_peers_of(self, rank: int) -> list[int]:
        try:
            return self.peers_of(rank)
        except Exception:
            return []

    def _placement_name(self) -> str:
        c = self.cfg
        if c.data_parallelism > 1:
            return f"data-parallel D={c.data_parallelism}" + (" huge-model" if c.huge_model else "")
        if c.labels:
            return "topology"
        return c.placement
