"""Membership of the peer tier, kept in etcd: who is in the job, where, and which steps
each rank completed.

A part of :class:`mtcfs.tiers.peer.tier.PeerTier` (mixed in). Nothing here decides alone or
talks to other nodes about membership:

* **Registration**: the node holds an etcd lease and a record under the job's prefix
  (:class:`mtcfs.tiers.coord.membership.Membership`: rank, Peer address, topology labels).
  A node is alive while its lease is; a daemon that dies stops renewing and every other
  node's watch sees its record go one TTL (``liveness_s``) later; a daemon that stops
  cleanly revokes it at once. Addresses learned there fill in what ``peers=`` did not say
  (a configured address is never replaced).
* **Step records** (:class:`mtcfs.tiers.coord.steps.StepRecords`): each rank records the
  steps it completed (the newest 16; a record outlives its daemon, so a replacement starts
  from its previous life's). The record is written from the membership loop when it
  changed, never from a checkpoint write, so no write waits on etcd.
* **The newest step complete on all ranks** is read from the records, every
  :data:`COMPLETE_EVERY_S` seconds (scaled with the job's size), and at a restore.

The rules are in docs/coordination.md ("Membership and step records").
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import trio

from mtcfs.core.ports import PeerPort
from mtcfs.tiers.coord.etcd import EtcdError, EtcdPermissionDenied
from mtcfs.tiers.coord.membership import Membership, MemberRecord, RankTaken
from mtcfs.tiers.coord.steps import StepRecords
from mtcfs.tiers.peer.records import MemberInfo, StepRef

if TYPE_CHECKING:
    from mtcfs.tiers.backup import BackupStore
    from mtcfs.tiers.coord.etcd import Etcd
    from mtcfs.tiers.peer.service import PeerServer
    from mtcfs.tiers.peer.tier import TierConfig

log = logging.getLogger("mtcfs.tiers.peer.tier")

#: Seconds between reads of every rank's step record (the newest step complete on all
#: ranks), for jobs up to :data:`COMPLETE_SCALE_NODES` nodes; larger jobs read less often
#: (``nodes / COMPLETE_SCALE_NODES`` times this), so etcd serves the same number of these
#: ranges per second at any size (50 /s above 500 nodes), each of ``nodes`` records: the
#: records it returns grow with the job (docs/benchmarks.md, "Coordination at scale").
COMPLETE_EVERY_S = 10.0
COMPLETE_SCALE_NODES = 500
#: Steps a record keeps.
RECORD_KEEP = 16


class MembershipRounds:
    """Registration, the member view and the step records of one node."""

    # Provided by PeerTier (mtcfs/tiers/peer/tier.py), into which this class is mixed.
    fs: PeerPort
    cfg: TierConfig
    rank: int
    backup_store: BackupStore | None
    addresses: dict[int, str]
    configured: set[int]
    advertise: str
    members: dict[int, MemberInfo]
    restorable: dict[str, int]
    latest_complete: StepRef | None
    server: PeerServer | None

    def _setup_membership(self, etcd: Etcd, prefix: str) -> None:
        self.etcd = etcd
        self.coord_prefix = prefix
        self.member: Membership | None = None
        self._joined = False
        self._record_lock = trio.Lock()
        self.step_records = StepRecords(etcd, prefix, self.rank, keep=RECORD_KEEP)
        self._names: dict[int, str] = {}        # step number -> name, as this node saw it
        self._recorded: set[int] | None = None  # what etcd holds for this rank
        self.membership_error = ""

    # ------------------------------------------------------------------ joining

    async def join_job(self, at_mount: bool = False) -> None:
        """Register this node, start the member view and load this rank's record. When etcd
        does not answer (within the client's deadline), log it and go on: the mount comes
        up, ``peers=`` addresses still work, and every membership round tries again. When
        etcd's auth refuses this node's keys, the same later on (logged once, in
        ``mtcfs status``: a role may be granted meanwhile), but at mount it is an error.

        Raises:
            RankTaken: another live daemon holds this rank (one line): never mount twice.
            EtcdPermissionDenied: ``at_mount`` and etcd's auth refuses this node's keys
                (one line naming the job's prefix).
        """
        if self.member is None:
            ttl = max(2, int(round(self.cfg.liveness_s)))
            self.member = Membership(self.etcd, self.coord_prefix, self.rank, self.advertise,
                                     dict(self.cfg.labels), ttl_s=ttl, progress_s=30.0,
                                     boot_id=self._member_id(),
                                     address_is_mine=self.server is not None,
                                     expect=self.cfg.nodes)
        if self._joined:
            return
        try:
            await self.member.ajoin()
            self._recorded = await trio.to_thread.run_sync(self.step_records.load,
                                                           abandon_on_cancel=True)
        except RankTaken:
            raise
        except EtcdPermissionDenied as exc:
            why = (f"etcd denies rank {self.rank} the job's keys under {self.coord_prefix}: "
                   f"{exc}")
            if at_mount:
                raise EtcdPermissionDenied(why, exc.keys) from None
            if not self.membership_error.startswith("not registered in etcd: etcd denies"):
                log.error("%s (retrying)", why)
            self.membership_error = f"not registered in etcd: {why}"
            return
        except EtcdError as exc:
            if not self.membership_error:
                log.error("rank %d cannot register in etcd (retrying): %s", self.rank, exc)
            self.membership_error = f"not registered in etcd: {exc}"
            return
        self._joined = True
        self.membership_error = ""
        log.info("rank %d registered in etcd at %smembers/", self.rank, self.coord_prefix)
        self._learn_members()

    def _member_id(self) -> str:
        """This store's member id (kept in its metadata): a daemon restarted on the same
        store takes its rank back at once from its previous life's record, while any other
        daemon waits for that record's lease to expire (mtcfs/tiers/coord/membership.py).
        Only one daemon opens a store at a time (its lock), so the id names one life line."""
        got = self.fs.db.get_kv("etcd_member_id")
        if not got:
            got = uuid.uuid4().hex[:16]
            self.fs.db.set_kv("etcd_member_id", got)
        return str(got)

    async def leave_job(self) -> None:
        """Revoke the lease (the others see this node gone at once); best effort."""
        await trio.to_thread.run_sync(self.leave_job_sync, abandon_on_cancel=True)

    def leave_job_sync(self) -> None:
        """:meth:`leave_job`, blocking (at shutdown, after the trio loop)."""
        member, self.member = self.member, None
        if member is not None and self._joined:
            self._joined = False
            member.leave()

    # ------------------------------------------------------------------ the loop

    def _complete_every_s(self) -> float:
        return COMPLETE_EVERY_S * max(1.0, self.cfg.nodes / COMPLETE_SCALE_NODES)

    async def _membership_loop(self) -> None:
        last_complete = -1e9
        while True:
            try:
                if not self._joined:
                    await self.join_job()
                self._learn_members()
                await self._record_steps()
                if time.monotonic() - last_complete >= self._complete_every_s():
                    last_complete = time.monotonic()
                    await self.refresh_latest_complete()
            except Exception:  # membership must never die
                log.exception("membership round failed")
            await trio.sleep(self.cfg.heartbeat_s)

    def _learn_members(self) -> None:
        if self.member is None or self.member.members_view is None or not self._joined:
            return
        view: dict[int, MemberRecord] = self.member.view()
        now = time.time()
        members: dict[int, MemberInfo] = {}
        for r, m in self.members.items():  # known before: keep, as dead
            if r not in view:
                members[r] = MemberInfo(rank=r, address=m.address, labels=m.labels,
                                        alive=False, age_s=m.age_s)
        for r, rec in view.items():
            if not 0 <= r < self.cfg.nodes:
                continue
            members[r] = MemberInfo(rank=r, address=rec.address, labels=dict(rec.labels),
                                    alive=True, age_s=max(0.0, now - rec.since))
            if r != self.rank and rec.address and r not in self.configured:
                self.addresses[r] = rec.address
        self.members = members
        self.membership_error = self.member.error

    def _steps_now(self) -> set[int]:
        for name, rec in self.fs.steps.items():
            self._names[rec.number] = name
        for name, num in self.restorable.items():
            self._names[num] = name
        return {rec.number for rec in self.fs.steps.values()}

    async def _record_steps(self) -> None:
        """Write this rank's record when it gained a step (a step once completed stays
        recorded: a rank that evicted it from RAM still completed it). Called every
        membership round and before a step is replicated (so a step that a peer holds is
        in this rank's record, unless etcd did not answer); one write at a time."""
        async with self._record_lock:
            await self._record_steps_locked()

    async def _record_steps_locked(self) -> None:
        if self._recorded is None:
            return
        want = set(sorted(self._recorded | self._steps_now())[-RECORD_KEEP:])
        if want == self._recorded:
            return
        try:
            await trio.to_thread.run_sync(self.step_records.record, want,
                                          abandon_on_cancel=True)
            self._recorded = want
        except EtcdError as exc:
            log.warning("cannot record this rank's steps in etcd (next round retries): %s", exc)

    async def refresh_latest_complete(self) -> StepRef | None:
        """Read the newest step complete on all ranks from etcd's step records; keep the
        newest ever seen (a step complete on all ranks stays so)."""
        try:
            num = await trio.to_thread.run_sync(self.step_records.newest_complete_everywhere,
                                                self.cfg.nodes, abandon_on_cancel=True)
        except EtcdError as exc:
            log.warning("cannot read the step records from etcd: %s", exc)
            num = None
        if num is not None:
            self._offer_complete(StepRef(self._names.get(num, str(num)), num))
        return self.latest_complete

    def _offer_complete(self, cand: StepRef | None) -> None:
        if cand is not None and (self.latest_complete is None or
                                 cand.step_number > self.latest_complete.step_number):
            self.latest_complete = cand

    async def decide_restore(self) -> dict[str, Any]:
        """The job's restore decision for a restoring node (etcd's ``restore/current``,
        see :meth:`mtcfs.tiers.coord.steps.StepRecords.decide_current`).

        Raises:
            EtcdError: etcd did not answer in time.
        """
        return await trio.to_thread.run_sync(self.step_records.decide_current, self.cfg.nodes,
                                             abandon_on_cancel=True)

    def recorded_steps(self) -> set[int]:
        """The steps etcd's record of this rank names (its previous lives' included)."""
        return set(self._recorded or ())

    async def wait_for_members(self, ranks: list[int], timeout: float) -> list[int]:
        """Wait (up to ``timeout`` s) until every rank of ``ranks`` has a known address;
        returns those that still have none."""
        deadline = time.monotonic() + timeout
        while True:
            self._learn_members()
            missing = [r for r in ranks if r not in self.addresses]
            if not missing or time.monotonic() >= deadline:
                return missing
            if self.member is not None:  # a view still gathering reads them at once
                self.member.want(missing)
            await trio.sleep(0.1)

    def backup_latest(self) -> StepRef | None:
        """The newest step the backup tier holds complete for every rank of the job that
        wrote it (thread; ``BackupStore.job_complete_steps``)."""
        if self.backup_store is None:
            return None
        try:
            by_step = self.backup_store.job_complete_steps()
        except Exception as exc:
            log.warning("cannot read the backup tier's steps: %s", exc)
            return None
        full = [(num, step) for step, (num, _ranks) in by_step.items()]
        if not full:
            return None
        num, step = max(full)
        return StepRef(step, num)
