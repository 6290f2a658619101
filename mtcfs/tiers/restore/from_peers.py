"""Bringing a replacement node back: which step, whose manifest, from which tier.

A node that mounts with an empty store asks the job rather than deciding alone:

1. When etcd's record of its rank names a step, it waits (up to ``wait_s``) until the
   placement's holders of its rank are registered in etcd; then it lists what the other
   nodes hold of its rank (``ListManifests(of_rank=me)``): the holders first, every other
   known node if none of them answers. Steps whose replica
   is complete on some holder, and steps the backup tier holds complete for this rank, are
   *restorable*.
2. It reads the job's restore decision from etcd (``restore/current``, see
   :meth:`mtcfs.tiers.coord.steps.StepRecords.decide_current`): the newest step in every
   rank's step record. Every node of a restarting job therefore restores the same step,
   never a mix. When the decision names no step this rank can restore (etcd lost the
   records, or every copy of that step of this rank is gone), the newest step the backup
   tier holds for every rank is used, else this rank's newest restorable step; the reason
   is logged.
3. The manifest comes from a holder whose replica is complete, else from the backup tier.
   The core imports it (files appear at once); the chunks follow through the peer chunk
   source — spread over every holder of the step — and the backup tier after it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import trio

from mtcfs.base.manifest import StepManifest
from mtcfs.tiers.coord.etcd import EtcdError
from mtcfs.tiers.peer.errors import PeerError
from mtcfs.tiers.peer.records import StepRef

if TYPE_CHECKING:
    from mtcfs.tiers.peer.tier import PeerTier

log = logging.getLogger(__name__)


async def choose_and_fetch(tier: PeerTier, want: int | None, *,
                           wait_s: float = 20.0) -> tuple[StepManifest, str, bool] | None:
    """Pick the step to restore for ``tier.rank`` and fetch its manifest.

    Args:
        tier: the node's :class:`~mtcfs.tiers.peer.tier.PeerTier` (server started).
        want: a step number asked for (``restore=N``), or None for the job's newest.
        wait_s: seconds to wait for the holders to register, and for etcd's decision.

    Returns:
        (manifest, source, backed_up) — source is ``"peer rank R"`` or ``"backup"``;
        backed_up tells whether the backup tier holds the step complete — or None when
        there is nothing to restore.

    Raises:
        PeerError, BackupError: the chosen manifest cannot be read from any tier.
    """
    t0 = time.monotonic()
    # Holders can only hold a step of this rank that its record names (it is recorded
    # before it is replicated): a rank that never recorded one does not wait for them.
    holders = [r for r in tier.peer_ranks() if r != tier.rank]
    missing = await tier.wait_for_members(holders, wait_s if tier.recorded_steps() else 0)
    if missing:
        log.info("restore: no address known for holder rank(s) %s after %g s", missing, wait_s)
    peer_steps = await trio.to_thread.run_sync(list_holders, tier)
    backup_steps: dict[str, int] = {}
    if tier.backup_store is not None:
        try:
            infos = await trio.to_thread.run_sync(tier.backup_store.list_steps)
            backup_steps = {i.step: i.step_number for i in infos}
        except Exception as exc:
            log.warning("cannot list the backup tier: %s", exc)
    restorable = {name: num for name, (num, _) in peer_steps.items()}
    restorable.update(backup_steps)
    tier.restorable = restorable
    if not restorable:
        return None
    target: StepRef | None = None
    if want is not None:
        match = [(n, s) for s, n in restorable.items() if n == want]
        if match:
            target = StepRef(max(match)[1], want)
    else:
        target = await _job_latest(tier, restorable, wait_s)
    if target is None:
        return None
    holders = peer_steps.get(target.step, (0, []))[1]
    tier.restore_holders = holders or tier.peer_ranks()
    for rank in holders:
        try:
            m = await trio.to_thread.run_sync(_fetch_manifest, tier, rank, target.step)
        except PeerError as exc:
            log.warning("manifest of %s from rank %d: %s", target.step, rank, exc)
            continue
        if m is not None:
            tier.restore_info = {"step": target.step, "manifest_from": f"peer rank {rank}",
                                 "holders": holders, "decided_s": round(time.monotonic() - t0, 3)}
            return m, f"peer rank {rank}", target.step in backup_steps
    if target.step in backup_steps and tier.backup_store is not None:
        bm = await trio.to_thread.run_sync(tier.backup_store.get_step, target.step)
        tier.restore_info = {"step": target.step, "manifest_from": "backup", "holders": [],
                             "decided_s": round(time.monotonic() - t0, 3)}
        return bm, "backup", True
    log.warning("step %s was chosen but no tier holds this rank's manifest of it", target.step)
    return None


def list_holders(tier: PeerTier) -> dict[str, tuple[int, list[int]]]:
    """step -> (number, ranks holding a complete replica of this rank's data)."""
    found: dict[str, tuple[int, list[int]]] = {}
    first = [r for r in tier.peer_ranks() if r != tier.rank]
    rest = [r for r in range(tier.cfg.nodes) if r != tier.rank and r not in first]
    for group in (first, rest):
        for rank in group:
            try:
                infos = tier.client(rank).list_manifests(tier.rank, with_manifest=False)
            except PeerError as exc:
                log.info("rank %d cannot list my replicas: %s", rank, exc)
                continue
            for info in infos:
                if info.chunks_missing == 0:
                    num, ranks = found.setdefault(info.step, (info.step_number, []))
                    ranks.append(rank)
        if found:
            break
    return found


def _fetch_manifest(tier: PeerTier, rank: int, step: str) -> StepManifest | None:
    for info in tier.client(rank).list_manifests(tier.rank, step=step):
        if info.step == step and info.chunks_missing == 0:
            m = StepManifest.from_bytes(info.manifest)
            if m.rank == tier.rank and m.job == tier.cfg.job and m.step == step:
                return m
    return None


async def _job_latest(tier: PeerTier, restorable: dict[str, int], wait_s: float) -> StepRef | None:
    """The step to restore: the job's decision in etcd when this rank can restore it."""
    by_number = {n: name for name, n in restorable.items()}
    decided: int | None = None
    try:
        with trio.fail_after(wait_s):
            decision = await tier.decide_restore()
        decided = decision.get("step")
        tier.restore_decision = decision
    except (EtcdError, trio.TooSlowError) as exc:
        log.warning("no restore decision from etcd: %s", exc or f"none within {wait_s:g} s")
    from_backup = None  # the newest step the backup tier holds complete for every rank
    if tier.backup_store is not None:
        from_backup = await trio.to_thread.run_sync(tier.backup_latest)
    if from_backup is not None and from_backup.step in restorable and \
            (decided is None or from_backup.step_number > decided):
        return from_backup  # complete for every rank; newer than any record (etcd lost them)
    if decided is not None:
        if decided in by_number:
            return StepRef(by_number[decided], decided)
        log.warning("the job's restore decision is step %d, which no tier holds for rank %d",
                    decided, tier.rank)
    num = max(by_number)
    log.warning("restoring this rank's newest restorable step %s (the job named none it can "
                "restore)", by_number[num])
    return StepRef(by_number[num], num)
