"""Bringing a replacement node back: which step, whose manifest, from which tier.

A node that mounts with an empty store asks the job rather than deciding alone:

1. When etcd's record of its rank names a step, it waits (up to ``wait_s``) until the
   placement's holders of its rank are registered in etcd; then it lists what the other
   nodes hold of its rank (``ListManifests(of_rank=me)``): the holders first, every other
   known node too when none of them holds a complete replica, or none of the step the job
   decided (placement moves: a replacement node in another topology domain, another node
   count, the trainer's peer assignment; an older placement's holder keeps what it got,
   so the current holders may hold only older steps). Steps whose replica
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

from mtcfs.base import pools
from mtcfs.base.manifest import StepManifest
from mtcfs.tiers.coord.etcd import EtcdError
from mtcfs.tiers.peer.errors import PeerError
from mtcfs.tiers.peer.records import ManifestInfo, StepRef

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
    decided: int | None = None
    if want is None:
        decided = await _read_decision(tier, wait_s)
    # The step to look for beyond the placement's holders when they lack it: the one asked
    # for, else the job's decision, else this rank's newest recorded step (etcd's decision
    # unreadable).
    wanted = want if want is not None else decided if decided is not None else \
        max(tier.recorded_steps(), default=None)
    peer_steps = await trio.to_thread.run_sync(list_holders, tier, wanted)
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
        target = await _job_latest(tier, restorable, decided)
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


def list_holders(tier: PeerTier, wanted: int | None = None) -> dict[str, tuple[int, list[int]]]:
    """step -> (number, ranks holding a complete replica of this rank's data).

    The placement's ranks (:meth:`PeerTier.peer_ranks`) are asked first. Every other rank is
    asked too when they hold no complete replica, or none of step number ``wanted`` (the step
    the caller means to restore): placement is not fixed (topology labels of a replacement
    node, the node count, the trainer's peer assignment), and a rank that was a holder under
    an earlier placement keeps what it got, so the newer step may be held only outside the
    current placement while the placement's ranks hold an older one. The ranks of a group
    are asked at once, each call within the client's deadline; holders are listed in
    placement order, then by rank.
    """
    found: dict[str, tuple[int, list[int]]] = {}
    first = [r for r in tier.peer_ranks() if r != tier.rank]
    rest = [r for r in range(tier.cfg.nodes) if r != tier.rank and r not in first]
    for group in (first, rest):
        for rank, infos in _ask_all(tier, group):
            for info in infos:
                if info.chunks_missing == 0:
                    num, ranks = found.setdefault(info.step, (info.step_number, []))
                    ranks.append(rank)
        if found and (wanted is None or any(n == wanted for n, _ in found.values())):
            break
        if found and group is first and rest:
            log.info("the placement's holders %s hold no complete replica of step %s of rank "
                     "%d: asking every other rank", first, wanted, tier.rank)
    return found


#: Ranks asked at once by :func:`list_holders` (each call is a thread of the ``peer-list``
#: pool blocked on gRPC).
LIST_PARALLEL = 16


def _ask_all(tier: PeerTier, ranks: list[int]) -> list[tuple[int, list[ManifestInfo]]]:
    """What each of ``ranks`` holds of this rank (without manifests), in ``ranks`` order;
    a rank that cannot be asked is left out (logged)."""
    def ask(rank: int) -> list[ManifestInfo] | None:
        try:
            return tier.client(rank).list_manifests(tier.rank, with_manifest=False)
        except PeerError as exc:
            log.info("rank %d cannot list my replicas: %s", rank, exc)
            return None

    got = pools.run_map("peer-list", ask, ranks, LIST_PARALLEL)
    return [(rank, infos) for rank, infos in zip(ranks, got, strict=True) if infos is not None]


def _fetch_manifest(tier: PeerTier, rank: int, step: str) -> StepManifest | None:
    for info in tier.client(rank).list_manifests(tier.rank, step=step):
        if info.step == step and info.chunks_missing == 0:
            m = StepManifest.from_bytes(info.manifest)
            if m.rank == tier.rank and m.job == tier.cfg.job and m.step == step:
                return m
    return None


async def _read_decision(tier: PeerTier, wait_s: float) -> int | None:
    """The step number of the job's restore decision in etcd (None: none, or no answer
    within ``wait_s``); the decision is kept in ``tier.restore_decision``."""
    try:
        with trio.fail_after(wait_s):
            decision = await tier.decide_restore()
        tier.restore_decision = decision
        step = decision.get("step")
        return step if isinstance(step, int) else None
    except (EtcdError, trio.TooSlowError) as exc:
        log.warning("no restore decision from etcd: %s", exc or f"none within {wait_s:g} s")
        return None
    except Exception as exc:  # noqa: BLE001 -- never the end of a restore (issue 39)
        log.warning("no restore decision from etcd (%s: %s): restoring without one",
                    type(exc).__name__, exc)
        return None


async def _job_latest(tier: PeerTier, restorable: dict[str, int],
                      decided: int | None) -> StepRef | None:
    """The step to restore: the job's decision in etcd (``decided``) when this rank can
    restore it."""
    by_number = {n: name for name, n in restorable.items()}
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
