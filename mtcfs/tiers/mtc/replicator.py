"""The node's replicator for Orbax's multi-tier checkpointing (mount option ``mtc``).

Orbax's ``ReplicatorCheckpointManager`` (MaxText ``enable_multi_tier_checkpointing``) talks
to the replicator of its node only through files in its local checkpoint directory — here,
the root of this mount (../shared/reference/orbax-mtc-protocol.md, docs/orbax-mtc.md):

- ``jax-init-info.txt`` (this node's rank, the JAX coordinator's ``ip:port``), written at
  mount, before the kernel sees the mount;
- ``replicator.yaml``, which the trainer writes at start-up: read, checked
  (:mod:`mtcfs.tiers.mtc.config`), adopted (peer ranks, backup interval), then deleted — the
  acknowledgement Orbax waits for; handled again each time it appears;
- the restore marker ``<job>-s<step>-n<rank>-w0.restore``: the step every rank restores,
  agreed through etcd (:mod:`mtcfs.tiers.coord.rounds`), brought into RAM (peers, backup tier,
  every chunk verified), presented by renaming its directory to the marker (Orbax renames it
  back); an empty ``...-s0-...`` file when no step exists anywhere;
- ``replicator.failed`` (fatal: Orbax raises RuntimeError with its text) and
  ``replicator.errors`` (logged by Orbax) for what the trainer must know.

Saving needs nothing here: Orbax's commit rename commits the step, and the peer and backup
tiers replicate and back it up as for any checkpoint.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from mtcfs.base.errors import FsError
from mtcfs.base import steps as stepnames
from mtcfs.core.ports import MtcPort
from mtcfs.tiers.mtc.config import ReplicatorConfig, ReplicatorConfigError, parse_replicator_yaml
from mtcfs.tiers.peer.records import StepRef

if TYPE_CHECKING:
    from mtcfs.tiers.backup import BackupStore
    from mtcfs.tiers.backup.scheduler import BackupService
    from mtcfs.tiers.coord.rounds import RestoreRounds
    from mtcfs.tiers.peer.tier import PeerTier

log = logging.getLogger(__name__)

INIT_INFO = b"jax-init-info.txt"
YAML = b"replicator.yaml"
ERRORS = b"replicator.errors"
FAILED = b"replicator.failed"
#: Names of the protocol itself: never cleaned away by a restore.
PROTOCOL_FILES = {INIT_INFO, YAML, ERRORS, FAILED, YAML + b".tmp"}

#: Seconds between two looks for replicator.yaml and for new errors to report.
POLL_S = 0.2
#: Seconds a restore may take before replicator.failed says why: well inside the 300 s
#: Orbax waits for the marker.
RESTORE_BUDGET_S = 240.0
#: Seconds a step is offered to a data-parallel peer as hashes only before its missing
#: chunks are sent (twins from replicator.yaml; the mount option's twins wait 60 s).
YAML_TWIN_WAIT_S = 5.0
#: Largest replicator.errors / replicator.failed kept, bytes (Orbax reads them only at
#: start-up, MaxText before each save; between, the oldest lines go).
MAX_REPORT_BYTES = 64 * 1024
#: Times the agreed step is asked of the peers and the backup tier before the restore fails
#: (one second apart).
FETCH_TRIES = 10
#: Seconds a restore round waits for every rank to ask (within RESTORE_BUDGET_S).
ROUND_WAIT_S = 180.0


def orbax_peers(rank: int, nodes: int, slices: int) -> list[int]:
    """Orbax's peer ranks of ``rank``: the processes at its position in every other slice.

    >>> orbax_peers(1, 4, 2), orbax_peers(0, 6, 3)
    ([3], [2, 4])
    """
    per = nodes // slices
    return [k * per + rank % per for k in range(slices) if k * per + rank % per != rank]


def orbax_slices(rank: int, nodes: int, peers: tuple[int, ...] | list[int]) -> int | None:
    """The slice count for which Orbax's rule gives ``rank`` exactly ``peers``, or None."""
    for slices in range(2, nodes + 1):
        if nodes % slices == 0 and sorted(orbax_peers(rank, nodes, slices)) == sorted(peers):
            return slices
    return None


class RestoreFailed(Exception):
    """The restore cannot complete; the message goes to ``replicator.failed``."""


class MtcReplicator:
    """Speaks Orbax's replicator protocol on the root of one mount.

    Args:
        fs: the filesystem core.
        rank: this node's rank (the JAX process id written to ``jax-init-info.txt``).
        nodes: ranks in the job.
        job: the mount's job name (the marker's prefix when the yaml names none).
        jax_coordinator: ``host:port`` of the JAX coordinator, for ``jax-init-info.txt``.
        peer: the node's peer tier, or None (one node).
        backup_store: the backup tier (:class:`mtcfs.tiers.backup.BackupStore`), or None.
        backup_service: its policy (:class:`mtcfs.tiers.backup.scheduler.BackupService`), or None.
        fetch_step: ``await fetch_step(number)`` imports this rank's step ``number`` from the
            peers or the backup tier (the daemon's ``restore_from_job``/``restore_step``).
        kick_prefetch: asks the prefetcher to fetch missing chunks now.
        rounds: the job's restore rounds in etcd (:class:`mtcfs.tiers.coord.rounds.
            RestoreRounds`), or None (one node: this rank decides alone).
    """

    def __init__(self, fs: MtcPort, *, rank: int, nodes: int, job: str, jax_coordinator: str,
                 peer: PeerTier | None = None, backup_store: BackupStore | None = None,
                 backup_service: BackupService | None = None,
                 fetch_step: Callable[[int], Awaitable[dict[str, Any] | None]] | None = None,
                 kick_prefetch: Callable[[], None] | None = None,
                 rounds: RestoreRounds | None = None) -> None:
        self.fs = fs
        self.rank = rank
        self.nodes = nodes
        self.job = job
        self.jax_coordinator = jax_coordinator
        self.peer = peer
        self.backup_store = backup_store
        self.backup_service = backup_service
        self.fetch_step = fetch_step
        self.kick_prefetch = kick_prefetch or (lambda: None)
        self.config: ReplicatorConfig | None = None
        self.state = "waiting for replicator.yaml"
        self.yamls = 0
        self.last_restore: dict[str, Any] | None = None
        self.last_error: str | None = None
        self._errors_seen = 0
        self.rounds = rounds

    # ------------------------------------------------------------------ files

    async def write_init_info(self) -> None:
        """Write ``jax-init-info.txt``: the process id, then the coordinator address."""
        await self.fs.write_own_file(INIT_INFO,
                                     f"{self.rank}\n{self.jax_coordinator}\n".encode())
        log.info("wrote %s: process %d, JAX coordinator %s", INIT_INFO.decode(), self.rank,
                 self.jax_coordinator)

    async def _append(self, name: bytes, lines: list[str]) -> None:
        old = b""
        try:
            old = await self.fs.read_own_file(name)
        except FsError:
            pass
        data = old + "".join(f"{line}\n" for line in lines).encode()
        if len(data) > MAX_REPORT_BYTES:  # nobody reads it: keep the newest lines
            data = data[-MAX_REPORT_BYTES:]
            data = data[data.find(b"\n") + 1:]
        await self.fs.write_own_file(name, data)

    async def report_failure(self, message: str) -> None:
        """Write ``message`` to ``replicator.failed`` (Orbax raises RuntimeError with it)."""
        self.last_error = message
        log.error("replicator failed: %s", message)
        try:
            await self._append(FAILED, [message])
        except FsError as exc:
            log.warning("cannot write %s: %s", FAILED.decode(), exc)

    # ------------------------------------------------------------------ running

    async def run(self) -> None:
        """Watch for ``replicator.yaml`` and for errors the trainer must hear of."""
        while True:
            if YAML in self.fs.root_entries():
                try:
                    await self.handle_yaml()
                except Exception as exc:  # never let the protocol die with the mount up
                    log.exception("handling replicator.yaml failed")
                    await self.report_failure(f"mtcfs: handling replicator.yaml failed: {exc}")
                    await self._ack()
                    self.state = "failed"
            await self._report_new_errors()
            await trio.sleep(POLL_S)

    async def _report_new_errors(self) -> None:
        total = self.fs.errors_total
        if total == self._errors_seen:
            return
        new = self.fs.errors[-min(total - self._errors_seen, len(self.fs.errors)):]
        self._errors_seen = total
        await self.report_errors([f"mtcfs rank {self.rank}: {e}" for e in new])

    async def report_errors(self, lines: list[str]) -> None:
        """Append ``lines`` to ``replicator.errors`` (Orbax logs them and carries on)."""
        try:
            await self._append(ERRORS, lines)
        except FsError as exc:
            log.warning("cannot write %s: %s", ERRORS.decode(), exc)

    async def _ack(self) -> None:
        try:
            await self.fs.remove_own(YAML)
        except FsError as exc:
            log.warning("cannot delete %s: %s", YAML.decode(), exc)

    async def handle_yaml(self) -> None:
        """Read, check and adopt ``replicator.yaml``, acknowledge it, then restore."""
        t0 = time.monotonic()
        self.yamls += 1
        self.state = "reading replicator.yaml"
        await self.fs.remove_own(FAILED)  # a previous run's verdict is not this one's
        text = (await self.fs.read_own_file(YAML)).decode(errors="replace")
        try:
            cfg = parse_replicator_yaml(text, nodes=self.nodes, rank=self.rank)
        except ReplicatorConfigError as exc:
            # The verdict first: Orbax reads replicator.failed once the yaml is gone.
            await self.report_failure(str(exc))
            await self._ack()
            self.state = "failed"
            return
        if cfg.warnings:
            await self.report_errors(list(cfg.warnings))
        self.adopt(cfg)
        # Markers of an earlier round that no trainer took are withdrawn before the
        # acknowledgement (Orbax looks for markers only once the yaml is gone): the new
        # trainer must see only this round's decision.
        await self._withdraw_markers()
        await self._ack()
        log.info("replicator.yaml of %r adopted (rank %d of %d, peers %s, backup every %s)",
                 cfg.job_name, cfg.node_rank, cfg.nodes, list(cfg.peer_ranks),
                 f"{cfg.backup_interval_steps} steps" if cfg.backup_interval_steps
                 else f"{cfg.backup_interval_minutes} min")
        self.state = "restoring"
        try:
            with trio.fail_after(RESTORE_BUDGET_S):
                info = await self.restore(cfg)
        except trio.TooSlowError:
            await self.report_failure(
                f"mtcfs rank {self.rank}: restore did not finish within {RESTORE_BUDGET_S:.0f}"
                f" s ({self.state})")
            self.state = "failed"
            return
        except (RestoreFailed, FsError) as exc:
            await self.report_failure(f"mtcfs rank {self.rank}: restore failed: {exc}")
            self.state = "failed"
            return
        info["seconds"] = round(time.monotonic() - t0, 3)
        info["finished"] = time.time()
        self.last_restore = info
        self.state = "restored"
        log.info("restore marker %s is in place, %.2f s after replicator.yaml (%s)",
                 info["marker"], info["seconds"], info.get("source"))

    def adopt(self, cfg: ReplicatorConfig) -> None:
        """Take the job's peer ranks and backup interval (the yaml overrides the mount's)."""
        self.config = cfg
        if self.peer is not None:
            override = {}
            slices = orbax_slices(self.rank, cfg.nodes, cfg.peer_ranks)
            if slices:
                # Orbax's rule for every rank: the processes at the same position in every
                # other slice hold its data; the yaml gives only this rank's peers.
                for r in range(cfg.nodes):
                    override[r] = orbax_peers(r, cfg.nodes, slices)
            override[self.rank] = list(cfg.peer_ranks)
            self.peer.peer_override = override
            if self.peer.cfg.data_parallelism < 2:  # the mount option, if given, rules
                # Data-parallel replicas save the same arrays at the same moment: the peer
                # is first offered hashes only, for a few seconds, so that identical
                # chunks it is writing itself never cross (Orbax's per-process files
                # differ in part, so the wait is short, then the bytes go).
                self.peer.twin_override = set(cfg.peer_ranks) \
                    if (cfg.assume_data_parallelism or 1) > 1 else None
                self.peer.cfg.twin_wait_s = YAML_TWIN_WAIT_S
        b = self.backup_service
        if b is not None:
            if cfg.backup_interval_steps is not None:
                # Training steps, as MaxText means them (it requires the interval to be at
                # least local_checkpoint_period): the step numbers tell, not a count.
                b.every_steps, b.every_ckpts, b.interval_s = cfg.backup_interval_steps, None, None
                b.status.interval = f"{cfg.backup_interval_steps} steps (replicator.yaml)"
            else:
                b.every_steps = b.every_ckpts = None
                b.interval_s = 60.0 * (cfg.backup_interval_minutes or 30)
                b.status.interval = f"{cfg.backup_interval_minutes}m (replicator.yaml)"
            b._wake.set()

    # ------------------------------------------------------------------ restore

    async def restore(self, cfg: ReplicatorConfig) -> dict[str, Any]:
        """Agree on the step, clean the directory, bring the step into RAM, place the marker.

        Raises:
            RestoreFailed: no tier can give this rank the agreed step.
        """
        job = cfg.job_name or self.job
        self.state = "listing restorable steps"
        restorable, where = await self._restorable()
        self.state = "waiting for the job's decision"
        t_decide = time.monotonic()
        step = await self._agree(restorable)
        decide_s = time.monotonic() - t_decide
        self.state = "cleaning the local directory"
        # Complete local steps stay until the chosen step is here: a restore that fails
        # (its manifest unreadable, its data out of reach) must not have deleted the
        # node's last good checkpoint first.
        await self._clean(step, keep_complete=step is not None)
        info: dict[str, Any] = {"step": step.step if step else None,
                                "decision_seconds": round(decide_s, 3)}
        if step is None:
            marker = f"{job}-s0-n{self.rank}-w0.restore".encode()
            await self.fs.write_own_file(marker, b"")
            info.update(marker=marker.decode(), source="nothing to restore")
            return info
        self.state = f"bringing step {step.step} into RAM"
        t_data = time.monotonic()
        info["source"] = await self._bring_back(step, where.get(step.step_number, "local"))
        info["data_seconds"] = round(time.monotonic() - t_data, 3)
        await self._clean(step)  # now the other complete steps
        rec = self.fs.steps[step.step]
        info["bytes"] = sum(v.size for v in self.fs.step_versions(rec))
        marker = f"{job}-s{step.step_number}-n{self.rank}-w0.restore".encode()
        await self.fs.remove_own(marker)
        await self.fs.rename_own(step.step.encode(errors="surrogateescape"), marker)
        info["marker"] = marker.decode()
        return info

    async def _restorable(self) -> tuple[dict[int, str], dict[int, str]]:
        """This rank's restorable steps (number -> name) and where each is (number ->
        "local", "peer", "backup")."""
        names: dict[int, str] = {}
        where: dict[int, str] = {}
        if self.backup_store is not None:
            try:
                for s in await trio.to_thread.run_sync(self.backup_store.list_steps):
                    names[s.step_number], where[s.step_number] = s.step, "backup"
            except Exception as exc:
                log.warning("cannot list the backup tier: %s", exc)
        if self.peer is not None:
            from mtcfs.tiers.restore.from_peers import list_holders
            # This rank's newest recorded step, when it is not here: asked of every rank
            # if the placement's holders lack it (placement may have moved since).
            newest = max(self.peer.recorded_steps(), default=None)
            if newest in {rec.number for rec in self.fs.steps.values()}:
                newest = None
            held = await trio.to_thread.run_sync(list_holders, self.peer, newest)
            for name, (num, _ranks) in held.items():
                names[num], where[num] = name, "peer"
            self.peer.restorable = {name: num for num, name in names.items()}
        for rec in self.fs.steps.values():
            if stepnames.step_number(rec.name) is not None:
                names[rec.number], where[rec.number] = rec.name, "local"
        return names, where

    async def _agree(self, restorable: dict[int, str]) -> StepRef | None:
        """The step every rank restores (None: nothing): the newest step every rank can
        restore, decided once per restart of the job through etcd (a restore round)."""
        steps = [StepRef(name, num) for num, name in sorted(restorable.items())]
        if self.rounds is None or self.nodes < 2:
            return steps[-1] if steps else None
        rounds = self.rounds
        got: dict[str, Any] = {}

        async def decide(cancel: trio.CancelScope) -> None:
            try:
                got["step"] = await rounds.agree(restorable, wait_s=ROUND_WAIT_S)
            except Exception as exc:  # RoundTimeout, EtcdError: one line for the trainer
                got["error"] = exc
            cancel.cancel()
        async with trio.open_nursery() as n:
            n.start_soon(decide, n.cancel_scope)
            n.start_soon(self._say_waiting, rounds)
        if "error" in got:
            raise RestoreFailed(f"no restore decision: {got['error']}")
        number = got.get("step")
        if number is None:
            return None
        if number not in restorable:
            raise RestoreFailed(f"the job chose step {number}, which this rank can no longer"
                                " restore")
        return StepRef(restorable[number], number)

    async def _say_waiting(self, rounds: RestoreRounds) -> None:
        said: list[int] | None = None
        while True:
            await trio.sleep(1.0)
            waiting = list(rounds.waiting_for)
            if waiting and waiting != said:
                said = waiting
                log.info("restore round: waiting for rank(s) %s", waiting[:10])
                self.state = f"waiting for rank(s) {waiting[:10]} to ask for a restore"

    async def _withdraw_markers(self) -> None:
        root = self.fs.root_entries()
        for name in list(root):
            n = stepnames.restore_marker_step(name)
            if n is None:
                continue
            back = str(n).encode()
            if self.fs.is_directory(root[name]) and n > 0 and back not in root:
                await self.fs.rename_own(name, back)  # the step's own name again
                log.info("withdrew marker %s (no trainer took it)", name.decode(errors="replace"))
            else:
                await self.fs.remove_own(name)

    async def _clean(self, keep: StepRef | None, keep_complete: bool = False) -> None:
        """Remove from the local directory everything Orbax would list or trip over but the
        step to restore: other steps, uncommitted ``*.orbax-checkpoint-tmp*`` directories,
        markers of earlier restores. Files that are neither are left alone.
        ``keep_complete``: leave every committed step too (before the chosen step is here)."""
        for name in list(self.fs.root_entries()):
            if name in PROTOCOL_FILES:
                continue
            num = stepnames.step_number(name)
            marker_num = stepnames.restore_marker_step(name)
            committed = name.decode(errors="surrogateescape") in self.fs.steps
            if committed and (keep_complete or (keep is not None and
                                                num == keep.step_number)):
                continue
            if num is not None or marker_num is not None or stepnames.is_orbax_tmp(name):
                await self.fs.remove_own(name)
                log.info("restore: removed %s from the local directory",
                         name.decode(errors="replace"))

    async def _bring_back(self, step: StepRef, where: str) -> str:
        """Make every byte of ``step`` local; returns where its data came from."""
        source = where
        if step.step not in self.fs.steps:
            if self.fetch_step is None:
                raise RestoreFailed(f"step {step.step} is not here and no tier can give it")
            tries = 0
            cleaned = False
            while True:
                try:
                    got = await self.fetch_step(step.step_number)
                    break
                except FsError as exc:
                    why = exc.strerror or str(exc)
                    if exc.errno == errno.ENOSPC and not cleaned:
                        # Its manifest was read: the other complete steps make room now.
                        await self._clean(step)
                        cleaned = True
                        continue
                    tries += 1
                    # The step was restorable when this rank joined the round: a holder
                    # that does not answer now, or is busy with its own restore, is asked
                    # again.
                    if exc.errno != errno.ENOENT or tries >= FETCH_TRIES:
                        raise RestoreFailed(why if why.startswith("step ") else
                                            f"step {step.step}: {why}") from None
                    log.info("restore of %s: %s; asking again", step.step, why)
                    await trio.sleep(1.0)
            source = str((got or {}).get("source") or where)
            if step.step not in self.fs.steps:
                raise RestoreFailed(f"step {step.step} could not be imported")
        rec = self.fs.steps[step.step]
        versions = self.fs.step_versions(rec)
        need = sum(v.size - v.local_bytes() for v in versions)
        free = self.fs.statfs()["free"]
        if need > free:
            await self._clean(step)  # the other complete steps make room
            free = self.fs.statfs()["free"]
        if need > free:
            raise RestoreFailed(f"step {step.step} needs {need} more bytes in RAM but the RAM"
                                f" tier has {free} free (size={self.fs.capacity}); mount with"
                                " a larger size=")
        kicked = False
        while not self.fs.step_in_ram(rec):
            if not kicked:
                self.kick_prefetch()
                kicked = True
            await trio.sleep(0.05)
            if self.fs.steps.get(step.step) is not rec:
                raise RestoreFailed(f"step {step.step} was removed while it was restored")
        return source

    def status(self) -> dict[str, Any]:
        c = self.config
        return {"state": self.state, "jax_coordinator": self.jax_coordinator,
                "yamls_handled": self.yamls, "last_restore": self.last_restore,
                "last_error": self.last_error,
                "config": None if c is None else {
                    "job_name": c.job_name, "node_rank": c.node_rank, "nodes": c.nodes,
                    "peer_ranks": list(c.peer_ranks),
                    "assume_data_parallelism": c.assume_data_parallelism,
                    "backup_interval_minutes": c.backup_interval_minutes,
                    "backup_interval_steps": c.backup_interval_steps}}
