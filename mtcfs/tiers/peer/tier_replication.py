"""Replication of committed steps to this node's peers, audits of what they hold, and gc
of the replicas this node holds for others.

A part of :class:`mtcfs.tiers.peer.tier.PeerTier` (mixed in); the rules are in
docs/peer-protocol.md ("How the daemon runs the peer tier").
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass, field
from functools import partial
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from mtcfs.base import pools
from mtcfs.base.manifest import StepManifest
from mtcfs.base.token_bucket import TokenBucket
from mtcfs.core.ports import PeerPort, StepRecord, oldest_first
from mtcfs.tiers.peer.errors import PeerError, PeerUnavailable
from mtcfs.tiers.peer.records import ManifestInfo, StepRef

if TYPE_CHECKING:
    from mtcfs.tiers.peer.client import PeerClient
    from mtcfs.tiers.peer.replica_store import ReplicaStore
    from mtcfs.tiers.peer.tier import TierConfig

log = logging.getLogger("mtcfs.tiers.peer.tier")

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
    #: step -> the content the peer confirmed (see :func:`content_of`)
    confirmed: dict[str, tuple[int, int]] = field(default_factory=dict)
    audited: float = 0.0                  # monotonic time of the last audit


def content_of(rec: StepRecord) -> tuple[int, int]:
    """Names a step's content: a re-commit changes ``committed_ns``; a file changed after
    the commit (``mtcfs seal`` steps are not committed again) bumps ``generation``."""
    return rec.committed_ns, rec.generation


class TwinNotReady(Exception):
    """A data-parallel twin does not hold (all of) the step's chunks yet."""


class Replication:
    """One replication task per peer, audits, replica gc."""

    # Provided by PeerTier (mtcfs/tiers/peer/tier.py), into which this class is mixed.
    fs: PeerPort
    cfg: TierConfig
    rank: int
    links: dict[int, PeerLink]
    send_budget: TokenBucket
    latest_complete: StepRef | None
    replica_store: ReplicaStore
    _wake: dict[int, trio.Event]
    _replicating: set[int]
    _bulk: trio.CapacityLimiter

    if TYPE_CHECKING:
        def peer_ranks(self) -> list[int]: ...
        def twins(self) -> set[int]: ...
        def client(self, rank: int) -> PeerClient: ...
        async def _record_steps(self) -> None: ...

    def _on_event(self, event: str, obj: Any) -> None:
        if event in ("committed", "sealed", "closed", "step_changed"):
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

    def _recent(self) -> list[StepRecord]:
        """The steps replicated: the ``keep`` newest, newest first."""
        return oldest_first(self.fs.steps.values())[::-1][:max(1, self.cfg.keep)]

    def _wanted(self, link: PeerLink) -> list[StepRecord]:
        """Steps still to replicate to ``link.peer``, newest first (the ``keep`` newest)."""
        return [r for r in self._recent() if link.confirmed.get(r.name) != content_of(r)]

    def lag(self, link: PeerLink) -> tuple[int, int]:
        """(steps, bytes) not yet confirmed by the peer."""
        steps = self._wanted(link)
        total = sum(v.size for rec in steps for v in self.fs.step_versions(rec))
        return len(steps), total

    def lag_seconds(self, link: PeerLink) -> float:
        """Seconds since the oldest step the peer has not confirmed was committed (0: it
        holds every step it should)."""
        steps = self._wanted(link)
        if not steps:
            return 0.0
        return max(0.0, time.time() - min(r.committed_ns for r in steps) / 1e9)

    def _ready(self, rec: StepRecord) -> bool:
        """Sealed, and all of it in RAM (a step still being restored waits)."""
        return self.fs.step_sealed(rec) and self.fs.step_in_ram(rec)

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

    async def _replicate_step(self, link: PeerLink, rec: StepRecord) -> None:
        fs = self.fs
        await self._record_steps()  # etcd's record of this rank names the step first
        committed = rec.committed_ns
        content = content_of(rec)
        manifest, pinned = fs.snapshot_step(rec.name)
        try:
            manifest = dataclasses.replace(manifest, rank=self.rank)
            # No re-hash here: the peer verifies every chunk before it keeps it.
            reader = self._yielding(fs.chunk_reader(pinned, verify=False))
            twin = link.peer in self.twins()
            hashes_only = twin and time.time_ns() - committed < self.cfg.twin_wait_s * 1e9
            async with self._bulk:  # background work (base/background.py)
                stats = await pools.run_background(
                    self._push, link.peer, manifest, reader, hashes_only,
                    abandon_on_cancel=True)
        finally:
            fs.unpin(pinned)
        link.bytes_sent += stats["bytes_sent"]
        link.chunks_sent += stats["chunks_sent"]
        link.chunks_skipped += stats["chunks_skipped"]
        if fs.steps.get(rec.name) is not rec or content_of(rec) != content:
            return  # changed meanwhile: the next round replicates the new content
        link.confirmed[rec.name] = content
        link.last_replicated = rec.name
        link.steps_replicated += 1
        self._count(rec)
        log.info("%s replicated to rank %d (%d/%d; %d payload bytes)", rec.name, link.peer,
                 rec.replicated, rec.replicas, stats["bytes_sent"])

    def _count(self, rec: StepRecord) -> None:
        """Set the step's ``replicated k/R`` from the links' confirmations."""
        rec.replicas = len(self.peer_ranks())
        rec.replicated = sum(1 for lk in self.links.values()
                             if lk.peer in self.peer_ranks()
                             and lk.confirmed.get(rec.name) == content_of(rec))

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

    def _list_held(self, peer: int) -> list[ManifestInfo]:
        return self.client(peer).list_manifests(self.rank, with_manifest=False)

    def _yielding(self, read: Callable[[str], bytes]) -> Callable[[str], bytes]:
        """Wrap a chunk reader so that sending pauses while the application writes, and
        keeps to ``replicate_rate=`` (:attr:`send_budget`: each chunk read takes its size).

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
            data = read(digest)
            self.send_budget.take(len(data))
            return data
        return read_chunk

    def _push(self, peer: int, manifest: StepManifest, reader: Callable[[str], bytes],
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
                stats = await pools.run_background(
                    partial(self.replica_store.gc, self.cfg.keep + _REPLICA_SLACK,
                            protect_steps=protect, orphan_grace_s=600.0))
                if stats.manifests_deleted or stats.chunks_deleted:
                    log.info("replica gc: %d manifests, %d chunks (%d bytes) freed",
                             len(stats.manifests_deleted), stats.chunks_deleted,
                             stats.bytes_freed)
            except Exception:
                log.exception("replica gc failed")
