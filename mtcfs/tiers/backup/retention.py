"""Backup retention: keep the newest K complete steps, then mark-and-sweep the chunks.

Single-node stores (:func:`run_retention`)
-----------------------------------------
1. List ``steps/``; read the COMPLETE markers; keep the ``keep`` complete steps with the
   highest step numbers; delete the older ones, marker first (a step is never listed without
   its manifest), then manifest.
2. Incomplete steps (a manifest, no marker: an upload in progress, or one that died) are
   deleted only if their step number is below every kept step's *and* their manifest was
   taken more than ``grace`` ago.
3. Mark: the chunk set of every ``manifest.json`` that remains, complete or not, and of
   every rank manifest (``steps/<step>/rank-<r>/``) should the bucket hold any.
4. List ``steps/`` again and mark manifests that appeared meanwhile.
5. Sweep: list ``chunks/`` and delete every chunk not marked.

If any remaining manifest is unreadable (or a kept step has none), its chunks cannot be known
and the sweep is skipped (``swept=False``); steps are still rotated.

Multi-node stores (:func:`run_job_retention`)
---------------------------------------------
``keep`` counts step numbers job-wide, and only steps complete on every rank count, so the
newest restorable checkpoint of the whole job is never retired:

1. List ``steps/`` once; read one COMPLETE marker per step (its step number and the world
   size of the job that wrote it); a step needs ranks ``0..W-1``, W that recorded world
   size, or, in markers from before it was recorded, ``world_size`` (without it, every
   rank that has a manifest or marker anywhere in the bucket) or one above the highest
   rank with an object of the step, whichever is more (:func:`~mtcfs.tiers.backup.steps.job_complete`).
2. Keep the ``keep`` newest steps complete on all their ranks, and every step newer than
   the oldest of them (in progress, or complete on some ranks only).
3. Older steps: delete every rank's complete manifest (marker first); an incomplete one only
   once its manifest was taken more than ``grace`` ago (a slow re-upload after a rollback).
4. Sweep, only if this call deleted a manifest (or ``sweep=True``), holding the job's sweep
   gate exclusive (:mod:`mtcfs.tiers.backup.gate`): read every manifest of every rank (and
   of the single-node layout), list ``chunks/``, and if anything is unreferenced, bump the
   sweep generation, then delete it, checking the hold before each delete. A manifest that
   cannot be read, or a complete one that vanished, skips the sweep; so does a gate that
   cannot be taken in time (etcd unreachable, uploads that do not end) and a store without a
   gate.

Any rank may run it, and several at once: each keeps every chunk that any manifest it reads
references, and a manifest deleted under it by another sweeper makes it skip its own sweep.
Sweeping only after a deletion keeps the cost to about one full sweep per retired step in
the job, not one per rank. Chunks orphaned by failed uploads go with the next sweep.

The concurrent-uploader race
----------------------------
The danger is an uploader that skips chunk X because X already exists (dedup) while a sweep
that did not see the uploader's manifest deletes X: the uploader then writes ``COMPLETE``
for a step that cannot be restored. The grace period above protects only *manifests*
(incomplete steps), not unreferenced chunks, so it does not help here. Defences:

1. **Sweep gate (multi-node stores).** Uploads hold the job's gate shared, from before their
   intent manifest until COMPLETE, and sweeps hold it exclusive; a sweep bumps the sweep
   generation before it deletes, and an uploader whose index is older than the generation
   lists ``chunks/`` again. This closes the race, and also keeps an uploader's chunk index
   true when another node's sweep deleted a chunk it uploaded long ago. See
   :mod:`mtcfs.tiers.backup.gate`.
2. **Ordering (single-node stores).** Within one process it is enforced:
   :class:`~mtcfs.tiers.backup.chunk_store.BackupStore` uploads hold a shared lock and
   retention the exclusive one, so a sweep never overlaps that store's uploads. A bucket
   shared by several single-node stores must have retention run on one of them, while no
   other uploads.
3. **Intent manifest first.** An uploader writes ``manifest.json`` *before* it decides which
   chunks to skip, so a sweep that lists manifests after that moment keeps X. Step 4 of the
   single-node procedure lists them again right before the sweep.
4. **Grace period.** An incomplete step survives, pinning its chunks, while it is newer than
   the oldest kept step or younger than ``grace``. Choose ``grace`` above the longest backup
   you expect, so that a slow upload of an old step number (a rollback, then a re-save) is
   not mistaken for an abandoned one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Literal, TypeVar

from mtcfs.base import pools
from mtcfs.base.manifest import StepManifest
from mtcfs.tiers.backup.backend import Backend
from mtcfs.tiers.backup.errors import GateError, NotFound
from mtcfs.tiers.backup.gate import SweepGate
from mtcfs.tiers.backup.layout import CHUNKS_PREFIX, COMPLETE, MANIFEST, parse_chunk_key
from mtcfs.tiers.backup.records import RetentionStats
from mtcfs.tiers.backup.steps import (BadManifest, StepCatalog, complete_ranks, job_complete,
                                     scan_layouts)

T = TypeVar("T")
R = TypeVar("R")

log = logging.getLogger(__name__)


def run_retention(catalog: StepCatalog, backend: Backend, *, keep: int, grace_ns: int,
                  now_ns: int, forget: Callable[[bytes], None],
                  workers: int, sweep: bool = True) -> RetentionStats:
    """Rotate steps and sweep unreferenced chunks; see the module notes.

    The caller must hold whatever excludes its own uploads.

    Args:
        catalog: the steps of the backup.
        backend: the same backend (for chunk listing and deletes).
        keep: complete steps to keep, >= 1.
        grace_ns: minimum age in ns of an incomplete step's manifest before it is deleted.
        now_ns: the current time, ns since the epoch.
        forget: called with the 32-byte digest of each deleted chunk (to update an index).
        workers: threads for deleting chunks (>= 1).
        sweep: False to rotate steps only (then ``swept`` is False).

    Returns:
        The outcome; ``seconds`` is left 0.

    Raises:
        ValueError: if ``keep < 1``.
        BackupError: if the backend fails; what was deleted stays deleted, the rest is
            intact, and running it again finishes the job.
    """
    if keep < 1:
        raise ValueError(f"retention must keep at least 1 complete step, got {keep}")
    steps, ranked = scan_layouts(backend)
    complete = catalog.complete_steps(steps)
    kept, old = complete[-keep:], complete[:-keep]
    kept_names = {i.step for i in kept}
    for info in old:
        catalog.delete_step(info.step, steps.get(info.step, ()))
    deleted = {i.step for i in old}
    oldest_kept = kept[0].step_number if kept else None
    live: set[bytes] = set()
    sweepable = True

    def load(step: str) -> StepManifest | None:
        nonlocal sweepable
        try:
            return catalog.read_manifest(step)
        except NotFound:
            if step in kept_names:
                log.error("not sweeping chunks: complete step %s in %s has no manifest",
                          step, backend.describe())
                sweepable = False
            return None
        except BadManifest as exc:
            log.error("not sweeping chunks: %s", exc)
            sweepable = False
            return None

    def mark(m: StepManifest) -> None:
        live.update(bytes.fromhex(h) for h in m.chunk_set())

    incomplete_deleted: list[str] = []
    for step in sorted(steps):
        objs = steps[step]
        if step in deleted or MANIFEST not in objs:
            continue  # rotated out above, or a stray object without a manifest
        m = load(step)
        if m is None:
            continue
        if (COMPLETE not in objs and oldest_kept is not None
                and m.step_number < oldest_kept and now_ns - m.created_ns > grace_ns):
            catalog.delete_step(step, objs)  # an abandoned upload, older than all kept
            incomplete_deleted.append(step)
            deleted.add(step)
            continue
        mark(m)

    # Manifests that appeared while we were marking pin their chunks too.
    again, ranked_again = scan_layouts(backend)
    for step, objs in sorted(again.items()):
        if step not in steps and step not in deleted and MANIFEST in objs:
            m = load(step)
            if m is not None:
                mark(m)
    # Rank manifests (a multi-node job writing to the same bucket) are never rotated here,
    # but their chunks are kept.
    for step, ranks in sorted(_merge(ranked, ranked_again).items()):
        for r, objs in sorted(ranks.items()):
            got = _read_for_marking(backend, step, r, objs)
            if got is False:
                sweepable = False
            elif got is not None:
                mark(got)

    stats = RetentionStats(steps_kept=[i.step for i in kept],
                           steps_deleted=[i.step for i in old],
                           incomplete_deleted=incomplete_deleted, swept=sweepable and sweep)
    if not (sweepable and sweep):
        return stats
    chunks_kept, garbage = _unreferenced_chunks(backend, live)

    def drop(item: tuple[str, bytes]) -> None:
        backend.delete(item[0])
        forget(item[1])

    if garbage:
        pools.run_map("backup-io", drop, garbage, workers)
    return RetentionStats(steps_kept=stats.steps_kept, steps_deleted=stats.steps_deleted,
                          incomplete_deleted=incomplete_deleted, chunks_kept=chunks_kept,
                          chunks_deleted=len(garbage), swept=True)


def _merge(a: dict[str, dict[int, set[str]]], b: dict[str, dict[int, set[str]]]
           ) -> dict[str, dict[int, set[str]]]:
    out: dict[str, dict[int, set[str]]] = {}
    for src in (a, b):
        for step, ranks in src.items():
            for r, objs in ranks.items():
                out.setdefault(step, {}).setdefault(r, set()).update(objs)
    return out


def _read_for_marking(backend: Backend, step: str, rank: int | None, objs: set[str]
                        ) -> StepManifest | None | Literal[False]:
    """Read a manifest for marking: the manifest, None if there is none to mark (absent,
    or gone while not complete), False if the sweep must not run (unreadable, or a complete
    one is gone)."""
    if MANIFEST not in objs and COMPLETE not in objs:
        return None
    where = "" if rank is None else f" rank {rank}"
    try:
        return StepCatalog(backend, 1, rank).read_manifest(step)
    except NotFound:
        if COMPLETE in objs:
            log.error("not sweeping chunks: complete step %s%s in %s has no manifest",
                      step, where, backend.describe())
            return False
        return None
    except BadManifest as exc:
        log.error("not sweeping chunks: %s", exc)
        return False


def _parallel(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    items = list(items)
    if len(items) <= 1 or workers <= 1:
        return [fn(i) for i in items]
    return pools.run_map("backup-io", fn, items, workers)


def run_job_retention(backend: Backend, gate: SweepGate | None, *, keep: int,
                      grace_ns: int, clock_ns: Callable[[], int], world_size: int | None,
                      sweep: bool | None, forget: Callable[[bytes], None],
                      bumped: Callable[[int, int], None], workers: int) -> RetentionStats:
    """Rotate the steps of a multi-node job and sweep unreferenced chunks; see the module
    notes.

    The caller must hold whatever excludes its own uploads.

    Args:
        backend: the bucket.
        gate: the job's sweep gate; None: chunks are not swept (steps are still rotated).
        keep: steps complete on every rank to keep, >= 1.
        grace_ns: minimum age in ns of an incomplete manifest before it is deleted.
        clock_ns: wall clock, ns since the epoch (only for ``grace_ns``, against the
            manifests' creation times).
        world_size: ranks in the job (0..world_size-1); None: every rank seen in the bucket.
        sweep: True: always sweep; False: never; None: only if this call deleted a manifest.
        forget: called with the 32-byte digest of each chunk before it is deleted (to update
            an index).
        bumped: called with (generation before, after) when the sweep bumped the sweep
            generation, before its first delete.
        workers: threads for reads and deletes (>= 1).

    Returns:
        The outcome; ``seconds`` is left 0.

    Raises:
        ValueError: if ``keep < 1`` or ``world_size < 1``.
        BackupError: if the backend fails; what was deleted stays deleted, the rest is
            intact, and running it again finishes the job. A gate that fails only skips (or
            stops) the sweep, logged.
    """
    if keep < 1:
        raise ValueError(f"retention must keep at least 1 complete step, got {keep}")
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    now_ns = clock_ns()
    _, ranked = scan_layouts(backend)
    done = complete_ranks(backend, ranked, workers)
    if world_size is None:  # every rank seen in the bucket
        world_size = max((r + 1 for ranks in ranked.values() for r in ranks), default=1)
    # Complete for the job that wrote each step (its world size, recorded in its markers):
    # after a restore on more nodes, the older steps of fewer ranks are still complete.
    full = job_complete(backend, ranked, workers, default_world=world_size)
    complete = sorted((num, step) for step, (num, _rs) in full.items())
    kept = complete[-keep:]
    kept_names = {step for _, step in kept}
    deleted_complete: set[str] = set()
    deleted_incomplete: set[str] = set()
    if kept:
        oldest = kept[0]

        def first_manifest(step: str) -> StepManifest | None:
            for r, objs in sorted(ranked[step].items()):
                if MANIFEST in objs:
                    got = _read_for_marking(backend, step, r, objs)
                    if isinstance(got, StepManifest):
                        return got
            return None

        unknown = sorted(s for s in ranked if s not in done and s not in kept_names)
        numbers = {s: n for s, (n, _) in done.items()}
        for step, m in zip(unknown, _parallel(first_manifest, unknown, workers)):
            if m is not None:
                numbers[step] = m.step_number
        old = [s for s in ranked if s not in kept_names and s in numbers
               and (numbers[s], s) < oldest]

        def retire(item: tuple[str, int, set[str]]) -> str | None:
            step, r, objs = item
            cat = StepCatalog(backend, 1, r)
            if COMPLETE in objs:
                cat.delete_step(step, objs)
                return "complete"
            if MANIFEST not in objs:
                return None  # stray objects without a manifest: not ours to judge
            got = _read_for_marking(backend, step, r, objs)
            if isinstance(got, StepManifest) and now_ns - got.created_ns > grace_ns:
                cat.delete_step(step, objs)  # an abandoned upload, older than all kept
                return "incomplete"
            return None

        items = [(s, r, objs) for s in sorted(old) for r, objs in sorted(ranked[s].items())]
        for (step, _, _), what in zip(items, _parallel(retire, items, workers)):
            if what == "complete":
                deleted_complete.add(step)
            elif what == "incomplete":
                deleted_incomplete.add(step)
    stats = RetentionStats(steps_kept=[s for _, s in kept],
                           steps_deleted=sorted(deleted_complete),
                           incomplete_deleted=sorted(deleted_incomplete), swept=False)
    if sweep is False or (sweep is None and not (deleted_complete or deleted_incomplete)):
        return stats
    if gate is None:
        log.warning("not sweeping chunks of %s: a multi-node store sweeps only through the "
                    "job's sweep gate (coord=etcd://...)", backend.describe())
        return stats
    swept, chunks_kept, gone = _gated_sweep(backend, gate, forget=forget, bumped=bumped,
                                            workers=workers)
    return RetentionStats(steps_kept=stats.steps_kept, steps_deleted=stats.steps_deleted,
                          incomplete_deleted=stats.incomplete_deleted, chunks_kept=chunks_kept,
                          chunks_deleted=gone, swept=swept)


def _unreferenced_chunks(backend: Backend,
                         live: set[bytes]) -> tuple[int, list[tuple[str, bytes]]]:
    """List the bucket's chunk objects: (how many ``live`` holds, the others as (key,
    digest)). Keys not of our chunk layout are left out (never ours to delete)."""
    kept = 0
    garbage: list[tuple[str, bytes]] = []
    for key in backend.list(CHUNKS_PREFIX):
        h = parse_chunk_key(key)
        if h is None:
            continue  # not ours: leave it
        digest = bytes.fromhex(h)
        if digest in live:
            kept += 1
        else:
            garbage.append((key, digest))
    return kept, garbage


def _gated_sweep(backend: Backend, gate: SweepGate, *, forget: Callable[[bytes], None],
                 bumped: Callable[[int, int], None], workers: int) -> tuple[bool, int, int]:
    """Holding the gate exclusive: mark every manifest in the bucket, bump the generation if
    anything is garbage, and delete the chunks none references, each after checking the
    hold. Returns (swept, chunks kept, chunks deleted); a gate failure is logged and makes
    ``swept`` False."""
    deleted = 0
    chunks_kept = 0
    try:
        with gate.exclusive() as hold:
            single, ranked = scan_layouts(backend)
            entries: list[tuple[str, int | None, set[str]]] = [
                (step, None, objs) for step, objs in single.items()]
            entries += [(step, r, objs) for step, ranks in ranked.items()
                        for r, objs in ranks.items()]
            got = _parallel(lambda e: _read_for_marking(backend, *e), entries, workers)
            if any(g is False for g in got):
                return False, 0, 0
            live: set[bytes] = set()
            for m in got:
                if isinstance(m, StepManifest):
                    live.update(bytes.fromhex(h) for h in m.chunk_set())
            chunks_kept, garbage = _unreferenced_chunks(backend, live)
            if not garbage:
                return True, chunks_kept, 0
            # Before the first delete: an uploader that takes the gate after us (also after
            # we died half way) sees a new generation and lists chunks/ again.
            bumped(*gate.bump(hold))
            gone: list[int] = []

            def drop(item: tuple[str, bytes]) -> None:
                hold.check()  # never delete once the hold may have ended
                forget(item[1])  # before the request: a failed delete may still happen
                backend.delete(item[0])
                gone.append(1)

            try:
                _parallel(drop, garbage, workers)
            finally:
                deleted = len(gone)
    except GateError as exc:
        log.warning("chunk sweep of %s skipped or stopped after %d deletes: %s",
                    backend.describe(), deleted, exc)
        return False, chunks_kept, deleted
    return True, chunks_kept, deleted
