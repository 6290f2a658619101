"""Bringing a replacement node back: which step, whose manifest, from which tier.

A node that mounts with an empty store asks the job rather than deciding alone:

1. It lists what the other nodes hold of its rank (``ListManifests(of_rank=me)``): the
   placement's holders first, every other known node if none of them answers. Steps whose
   replica is complete on some holder, and steps the backup tier holds complete for this
   rank, are *restorable*; they go into this node's heartbeat reports.
2. It waits (a few heartbeat rounds) until the coordinator names the newest step complete
   on ALL ranks. Every node of a restarting job therefore restores the same step, never a
   mix. If the job cannot name one in time, the newest restorable step is used, and the
   reason is logged.
3. The manifest comes from a holder whose replica is complete, else from the backup tier.
   The core imports it (files appear at once); the chunks follow through the peer chunk
   source — spread over every holder of the step — and the backup tier after it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio

from mtcfs.manifest import StepManifest
from replication.peer.errors import PeerError
from replication.peer.records import StepRef

log = logging.getLogger(__name__)


async def choose_and_fetch(tier: Any, want: int | None, *,
                           wait_s: float = 20.0) -> tuple[StepManifest, str, bool] | None:
    """Pick the step to restore for ``tier.rank`` and fetch its manifest.

    Args:
        tier: the node's :class:`~replication.peer.tier.PeerTier` (server started).
        want: a step number asked for (``restore=N``), or None for the job's newest.
        wait_s: seconds to wait for the coordinator to name the job's newest step.

    Returns:
        (manifest, source, backed_up) — source is ``"peer rank R"`` or ``"backup"``;
        backed_up tells whether the backup tier holds the step complete — or None when
        there is nothing to restore.

    Raises:
        PeerError, BackupError: the chosen manifest cannot be read from any tier.
    """
    t0 = time.monotonic()
    peer_steps = await trio.to_thread.run_sync(_list_holders, tier)
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
    if target.step in backup_steps:
        m = await trio.to_thread.run_sync(tier.backup_store.get_step, target.step)
        tier.restore_info = {"step": target.step, "manifest_from": "backup", "holders": [],
                             "decided_s": round(time.monotonic() - t0, 3)}
        return m, "backup", True
    log.warning("step %s was chosen but no tier holds this rank's manifest of it", target.step)
    return None


def _list_holders(tier: Any) -> dict[str, tuple[int, list[int]]]:
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


def _fetch_manifest(tier: Any, rank: int, step: str) -> StepManifest | None:
    for info in tier.client(rank).list_manifests(tier.rank, step=step):
        if info.step == step and info.chunks_missing == 0:
            m = StepManifest.from_bytes(info.manifest)
            if m.rank == tier.rank and m.job == tier.cfg.job and m.step == step:
                return m
    return None


async def _job_latest(tier: Any, restorable: dict[str, int], wait_s: float) -> StepRef | None:
    """The job's newest step complete on all ranks, as the coordinator sees it."""
    deadline = time.monotonic() + wait_s
    newest, newest_name = max((n, s) for s, n in restorable.items())
    from_backup = None  # the newest step the backup tier holds complete for every rank
    if tier.backup_store is not None:
        from_backup = await trio.to_thread.run_sync(tier.backup_latest)
    while True:
        await tier.heartbeat_once()
        # The coordinator may have just restarted (this very node, when it is rank 0) and
        # not heard from everyone yet; any live node can say what it was told.
        told = [s for s in (tier.latest_complete, from_backup, *await tier.ask_all_latest())
                if s is not None]
        if told:
            tier.latest_complete = max(told, key=lambda s: s.step_number)
        known = [s for s in told if s.step in restorable]
        best = max(known, key=lambda s: s.step_number) if known else None
        # Take it at once unless this rank could restore something newer that nobody has
        # confirmed yet (the nodes that would confirm it may still be starting: wait for
        # them rather than restore an older step than the rest of the job).
        if best is not None and best.step_number >= newest:
            return best
        if time.monotonic() > deadline:
            if best is not None:
                return best
            break
        await trio.sleep(tier.cfg.heartbeat_s / 2)
    num, name = newest, newest_name
    log.warning("the job named no step complete on all ranks within %.0f s (coordinator: %s,"
                " its answer: %s); restoring this rank's newest restorable step %s", wait_s,
                tier.coordinator, tier.latest_complete, name)
    return StepRef(name, num)
