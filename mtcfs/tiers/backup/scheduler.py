"""The backup policy: when to back up which checkpoint, in the background.

Every ``backup_interval`` (a duration, or a count of committed checkpoints) the newest
committed checkpoint that is not yet in the backup tier is uploaded: its files' chunks that
the bucket lacks, then its manifest, then its completion marker. The application never
waits for any of it: uploads run in worker threads, read from pinned versions in the store,
and a failing bucket only delays the next attempt (jittered backoff).

This module knows the filesystem core only through :class:`mtcfs.core.ports.BackupPort`
(``steps``, ``step_sealed``, ``snapshot_step``, ``chunk_reader``, ``mark_backed_up``,
``backup_pending``, ``set_backup_pending``, ``unpin``, ``evict``, ``subscribe``), which the
daemon hands it; of the core it imports only the ports (imports point down).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import trio

from mtcfs.base import pools
from mtcfs.base.token_bucket import TokenBucket
from mtcfs.core.ports import BackupPort, StepRecord, oldest_first
from mtcfs.tiers.backup import BackupError, BackupStore
from mtcfs.tiers.backup.chunk_store import DEFAULT_SHARE_WAIT_S

log = logging.getLogger(__name__)

#: Seconds between checks whether a step restored from a peer has all its chunks in RAM.
NOT_READY_POLL_S = 1.0


@dataclass
class BackupStatus:
    """What ``mtcfs status`` shows of the backup tier."""

    url: str
    interval: str
    uploading: str | None = None
    last_step: str | None = None
    last_finished: float | None = None
    last_seconds: float | None = None
    last_bytes_logical: int = 0
    last_bytes_uploaded: int = 0
    last_chunks_by_others: int = 0
    total_bytes_uploaded: int = 0
    backups: int = 0
    failures: int = 0
    last_error: str | None = None
    pending: list[str] = field(default_factory=list)
    #: Seconds the last backup's uploads waited for ``backup_rate=`` (the budget).
    last_budget_wait_s: float = 0.0
    #: Why backups fall behind their interval (the last one took longer than the
    #: interval, or the next was due before it ended), or None: they keep up.
    behind: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class BackupService:
    """Runs the backup policy for one mount.

    Args:
        fs: the filesystem core, as the backup tier sees it.
        store: the backup tier.
        interval_s: back up at most every this many seconds (None: count-based).
        every_ckpts: back up every this many committed checkpoints (None: time-based).
        keep_backups: complete checkpoints kept in the backup tier (``backup_keep``).
        url: for status only.
        share: ``share(digest) -> bool``: which missing chunks this node uploads itself
            (data-parallel twins split the upload); None: all of them. Passed to
            :meth:`BackupStore.put_step`.
        share_wait_s: seconds to wait for the other nodes' shares before uploading them
            here (>= 0).
        budget: ``backup_rate=``'s bucket, the one the store's uploads take from (for
            status: how long each backup waited for it), or None.
        twins: with ``share``, ``twins() -> ranks`` of this node's data-parallel twins (the
            nodes whose shares it waits for). Twins converge on common steps: a step a twin
            has begun in the bucket (intent or complete), that this node holds committed and
            not backed up and that is newer than its last backup, is backed up at once,
            whether or not the interval is due, and before this node's own newest; and a
            share wait ends early once the twins are on newer steps (see
            :meth:`BackupStore.put_step`). None: neither.
    """

    def __init__(self, fs: BackupPort, store: BackupStore, *, interval_s: float | None,
                 every_ckpts: int | None, keep_backups: int, url: str, interval_text: str,
                 share: Callable[[str], bool] | None = None,
                 share_wait_s: float = DEFAULT_SHARE_WAIT_S,
                 twins: Callable[[], Collection[int]] | None = None,
                 budget: TokenBucket | None = None) -> None:
        if not share_wait_s >= 0:
            raise ValueError(f"share_wait_s must be >= 0, got {share_wait_s}")
        self.fs = fs
        self.store = store
        self.share = share
        self.share_wait_s = share_wait_s
        self.twins = twins if share is not None else None
        self.budget = budget
        self.interval_s = interval_s
        self.every_ckpts = every_ckpts
        #: Back up when the newest step's number is at least this far past the last one
        #: backed up (training steps, as Orbax's ``backup-interval-steps``); set by the
        #: replicator protocol (mtcfs/tiers/mtc/), overriding the other two.
        self.every_steps: int | None = None
        self._last_number: int | None = max(
            (s.number for s in fs.steps.values() if s.backed_up_ns is not None), default=None)
        self.keep_backups = keep_backups
        self.status = BackupStatus(url=url, interval=interval_text)
        self._commits_since = 0
        self._last_start = -math.inf
        self._wake = trio.Event()
        self._done = trio.Event()
        self._force: str | None = None
        self._force_failed = False
        self._request_lock = trio.Lock()  # one explicit request at a time
        fs.subscribe(self._on_event)
        done = [s for s in fs.steps.values() if s.backed_up_ns is not None]
        if done:
            # What mtcfs status shows as the last backup survives a restart (a SIGKILL).
            last = max(done, key=lambda s: s.backed_up_ns or 0)
            self.status.last_step = last.name
            self.status.last_finished = (last.backed_up_ns or 0) / 1e9
        #: A backup a crash interrupted (recorded in the store when it started): resumed
        #: first, whatever the interval says; the chunks it had uploaded are not sent again.
        self._resume: str | None = None
        pending = fs.backup_pending()
        rec = fs.steps.get(pending) if pending else None
        if rec is not None and rec.backed_up_ns is None:
            self._resume = pending
            log.info("resuming the backup of %s that a crash interrupted", pending)
        if self.candidate() is not None:
            # A step committed before this daemon started (restart, crash, backup= added
            # later) and never backed up: it is due now, whatever the count says.
            self._commits_since = every_ckpts or 1

    def _on_event(self, event: str, obj: Any) -> None:
        if event == "committed":
            if getattr(obj, "source", None) == "orbax-restore":
                # The job went back to this step: count the interval in steps from here.
                self._last_number = obj.number if obj.backed_up_ns is not None else None
            self._commits_since += 1
            self._wake.set()

    def candidate(self) -> Any | None:
        """The newest committed step, if it is not yet backed up."""
        if not self.fs.steps:
            return None
        newest = oldest_first(self.fs.steps.values())[-1]
        return None if newest.backed_up_ns is not None else newest

    def _due(self) -> bool:
        if self._force is not None:
            return True
        if self.every_steps is not None:
            cand = self.candidate()
            # (A step number not past the last backed up: the job went back to an older
            # step and trains again; its new steps are backed up.)
            return cand is not None and (self._last_number is None or
                                         cand.number <= self._last_number or
                                         cand.number - self._last_number >= self.every_steps)
        if self.every_ckpts is not None:
            return self._commits_since >= self.every_ckpts
        return time.monotonic() - self._last_start >= (self.interval_s or 0)

    async def request(self, step: str | None = None) -> None:
        """Back up ``step`` (default: the newest committed) now and wait until it is done.

        Raises:
            BackupError: the upload failed.
        """
        async with self._request_lock:
            self._force = step or "__newest__"
            self._done = trio.Event()
            self._wake.set()
            await self._done.wait()
            if self.status.last_error and self._force_failed:
                raise BackupError(self.status.last_error)

    async def run(self) -> None:
        failures = 0
        #: After an attempt at the interrupted backup that did not complete, a due newer
        #: step goes next (then the interrupted one again): a step that cannot be backed up
        #: now never holds back the backup of the newest.
        resume_waits = False
        while True:
            rec, counted = None, self._commits_since
            if self._resume is not None:
                r = self.fs.steps.get(self._resume)
                if r is None or r.backed_up_ns is not None:
                    # Deleted, no longer a committed step, or backed up meanwhile.
                    self._resume, resume_waits = None, False
                    self.fs.set_backup_pending(None)
            if self._force not in (None, "__newest__"):
                rec = self.fs.steps.get(self._force)
            elif self._resume is not None and not (resume_waits and self._due()):
                rec, counted = self.fs.steps.get(self._resume), 0
            elif self._due():
                # An explicit request is for the newest step; otherwise a twin's step first.
                rec = (self.candidate() if self._force is not None
                       else await self._joinable() or self.candidate())
            else:
                rec, counted = await self._joinable(), 0
            resume_waits = False
            if rec is None:
                if self._force is not None:
                    self._force = None
                    self._done.set()
                self.status.pending = [s.name for s in [self.candidate()] if s is not None]
                with trio.move_on_after(self._sleep_time()):
                    await self._wake.wait()
                self._wake = trio.Event()
                continue
            # Commits counted so far are answered by this backup; any that land while it
            # waits for its step to seal are not (they are newer steps, due next).
            ok = await self._backup(rec, counted)
            if self._resume == rec.name:
                if ok:  # done (or the step is gone): the interrupted backup is over
                    self._resume = None
                    if self.fs.backup_pending() == rec.name:
                        self.fs.set_backup_pending(None)
                else:  # kept, and tried again after the wait or backoff below
                    resume_waits = True
            if ok is None:  # chunks still being restored: not an error, try again soon
                if self._force is not None:
                    self.status.last_error = (f"backup of {rec.name}: some of its chunks are "
                                              "not in RAM yet (restore in progress)")
                    self._force_failed = True
                    self._force = None
                    self._done.set()
                with trio.move_on_after(NOT_READY_POLL_S):
                    await self._wake.wait()
                self._wake = trio.Event()
                continue
            if ok:
                failures = 0
                self._force_failed = False
            else:
                failures += 1
                self._force_failed = True
                delay = min(300.0, random.uniform(0, 2.0 * 2 ** min(failures, 8)))
                log.warning("backup of %s failed (%d in a row); next try in %.1fs",
                            rec.name, failures, delay)
                if self._force is not None:
                    self._force = None
                    self._done.set()
                await trio.sleep(delay)
                continue
            if self._force is not None:
                self._force = None
                self._done.set()

    def _keeping_up(self, name: str) -> None:
        """After the backup of ``name``: set or clear :attr:`BackupStatus.behind` (logged
        when it is set): a time interval shorter than the backup took, or as many
        checkpoints committed during it as the interval counts."""
        st = self.status
        took = st.last_seconds or 0.0
        why = None
        if self.every_ckpts is None and self.every_steps is None and self.interval_s \
                and took > self.interval_s:
            why = f"the backup of {name} took {took:.1f} s, longer than the interval"
        elif self.every_ckpts is not None and self._commits_since >= self.every_ckpts:
            why = (f"{self._commits_since} checkpoint(s) were committed during the "
                   f"{took:.1f} s backup of {name}")
        if why is not None:
            if st.last_budget_wait_s:
                why += f" ({st.last_budget_wait_s:.1f} s of it waiting for backup_rate=)"
            if st.behind is None:
                log.warning("backups fall behind backup_interval=%s: %s", st.interval, why)
        st.behind = why

    async def _joinable(self) -> StepRecord | None:
        """The step to join: the newest one a twin has begun in the bucket that this node
        holds committed, not backed up (nor being backed up) and numbered above its last
        backup; None if there is none, without twins, or if the bucket cannot be listed
        (logged; the interval still applies)."""
        if self.twins is None:
            return None
        ranks = set(self.twins())
        if not ranks:
            return None
        try:
            begun = await trio.to_thread.run_sync(self.store.steps_begun, ranks,
                                                  abandon_on_cancel=True)
        except BackupError as exc:
            log.warning("cannot list the twins' backups: %s", exc)
            return None
        names = set().union(*begun.values())
        found = [r for r in (self.fs.steps.get(n) for n in names)
                 if r is not None and r.backed_up_ns is None and not r.backing_up
                 and (self._last_number is None or r.number > self._last_number)]
        if not found:
            return None
        rec = oldest_first(found)[-1]
        log.info("joining the backup of %s, which a data-parallel twin began", rec.name)
        return rec

    def _sleep_time(self) -> float:
        if self.every_ckpts is None and self.every_steps is None and \
                self.candidate() is not None:
            return max(0.05, self._last_start + (self.interval_s or 0) - time.monotonic())
        return 3600.0

    async def _backup(self, rec: StepRecord, counted: int = 0) -> bool | None:
        """Upload one step. Returns False on failure (already logged), None if some of its
        chunks are not in RAM (a step restored from a peer, still being fetched)."""
        while not self.fs.step_sealed(rec):
            await trio.sleep(0.05)
            if self.fs.steps.get(rec.name) is not rec:
                return True  # deleted meanwhile: nothing to do
        if not self.fs.step_in_ram(rec):
            if self.status.pending != [rec.name]:
                log.info("backup of %s waits until all its chunks are in RAM again", rec.name)
            self.status.pending = [rec.name]
            return None
        manifest, pinned = self.fs.snapshot_step(rec.name)
        # A time-based interval counts from this start; a failed upload gives it back (as
        # ``taken`` below), so the step is due again after the backoff, not an interval later.
        prev_start, self._last_start = self._last_start, time.monotonic()
        taken = min(counted, self._commits_since)  # given back if the upload fails
        self._commits_since -= taken
        rec.backing_up = True
        self.status.uploading = rec.name
        # The backup to resume after a kill: the interrupted one, until it completes.
        self.fs.set_backup_pending(self._resume or rec.name)
        t0 = time.monotonic()
        waited0 = self.budget.waited_s if self.budget is not None else 0.0
        try:
            # On a background thread (base/background.py): zstd and the requests are
            # background work; the threads it fans out to inherit the policy.
            stats = await pools.run_background(
                partial(self.store.put_step, manifest, self.fs.chunk_reader(pinned),
                        share=self.share, share_wait_s=self.share_wait_s,
                        twins=tuple(sorted(self.twins())) if self.twins is not None else ()),
                abandon_on_cancel=True)
        except (BackupError, OSError) as exc:
            self.status.failures += 1
            self.status.last_error = f"backup of {rec.name}: {exc}"
            self.fs.unpin(pinned)
            self._commits_since += taken  # still due: retried after the backoff
            self._last_start = prev_start
            return False
        except Exception as exc:  # a bug in a reader must not take the mount down
            log.exception("backup of %s failed unexpectedly", rec.name)
            self.status.failures += 1
            self.status.last_error = f"backup of {rec.name}: {type(exc).__name__}: {exc}"
            self.fs.unpin(pinned)
            self._commits_since += taken  # still due: retried after the backoff
            self._last_start = prev_start
            return False
        finally:
            rec.backing_up = False
            self.status.uploading = None
        if not self.fs.mark_backed_up(rec.name, pinned):
            # A file of the step changed during the upload: the bucket holds the step as
            # it was at the snapshot. Not backed up; due again at once (as after a failure).
            log.info("checkpoint %s changed while it was uploaded: uploading it again",
                     rec.name)
            self.fs.unpin(pinned)
            self._commits_since += max(taken, 1)
            self._last_start = prev_start
            return True
        self.fs.set_backup_pending(None if self._resume in (None, rec.name) else self._resume)
        self._last_number = rec.number  # the newest step: the interval counts from here
        self.fs.unpin(pinned)
        st = self.status
        st.last_step, st.last_finished = rec.name, time.time()
        st.last_seconds = time.monotonic() - t0
        st.last_bytes_logical = stats.bytes_logical
        st.last_bytes_uploaded = stats.bytes_uploaded
        st.last_chunks_by_others = stats.chunks_by_others
        st.total_bytes_uploaded += stats.bytes_uploaded
        st.backups += 1
        st.last_error = None
        st.last_budget_wait_s = round(
            (self.budget.waited_s if self.budget is not None else 0.0) - waited0, 3)
        self._keeping_up(rec.name)
        log.info("backed up %s: %d bytes, %d uploaded (%d of %d chunks uploaded here, %d by "
                 "other nodes) in %.2fs", rec.name, stats.bytes_logical, stats.bytes_uploaded,
                 stats.chunks_uploaded, stats.chunks_total, stats.chunks_by_others,
                 st.last_seconds)
        try:
            await trio.to_thread.run_sync(self.store.retain, self.keep_backups,
                                          abandon_on_cancel=True)
            kept = await trio.to_thread.run_sync(self.store.list_steps, abandon_on_cancel=True)
            self.fs.backup_retired({s.step for s in kept})
        except BackupError as exc:
            log.warning("backup retention failed: %s", exc)
        self.fs.evict()
        return True
