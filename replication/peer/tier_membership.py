"""Membership rounds of the peer tier: report to the coordinator, take over when it dies,
learn the newest step complete on all ranks.

A part of :class:`replication.peer.tier.PeerTier` (mixed in); the rules are in
docs/peer-protocol.md ("Membership" and "How the daemon runs the peer tier").
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import trio

from replication.peer.errors import PeerError
from replication.peer.records import HeartbeatResult, StepRef

log = logging.getLogger("replication.peer.tier")

#: Seconds a coordinator candidate that did not answer is skipped before it is asked again:
#: short, so that a restarted lower rank (its store empty, waiting for the job to name the
#: step to restore) becomes coordinator again within a few rounds.
SUSPECT_S = 2.0


class MembershipRounds:
    """Heartbeats to the coordinator and what they teach this node."""

    fs: Any
    cfg: Any
    rank: int
    backup_store: Any

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

    async def ask_all_latest(self) -> list[StepRef | None]:
        """Every other known node's newest step complete on all ranks (one short heartbeat
        each, in a worker thread; nodes that do not answer are left out)."""
        s = self.fs.statfs()          # read on the loop, which owns the core
        steps = self._steps_report()
        return await trio.to_thread.run_sync(self._ask_all, steps, s, abandon_on_cancel=True)

    def _ask_all(self, steps: list[StepRef], s: Mapping[str, int]) -> list[StepRef | None]:
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
