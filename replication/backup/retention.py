"""Backup retention: keep the newest K complete steps, then mark-and-sweep the chunks.

Procedure (:func:`run_retention`):

1. List ``steps/``; read the COMPLETE markers; keep the ``keep`` complete steps with the
   highest step numbers; delete the older ones, marker first (a step is never listed without
   its manifest), then manifest.
2. Incomplete steps (a manifest, no marker: an upload in progress, or one that died) are
   deleted only if their step number is below every kept step's *and* their manifest was
   taken more than ``grace`` ago.
3. Mark: the chunk set of every ``manifest.json`` that remains, complete or not.
4. List ``steps/`` again and mark manifests that appeared meanwhile.
5. Sweep: list ``chunks/`` and delete every chunk not marked.

If any remaining manifest is unreadable (or a kept step has none), its chunks cannot be known
and the sweep is skipped (``swept=False``); steps are still rotated.

The concurrent-uploader race
----------------------------
The danger is an uploader that skips chunk X because X already exists (dedup) while a sweep
that did not see the uploader's manifest deletes X: the uploader then writes ``COMPLETE``
for a step that cannot be restored. Defences, strongest first:

1. **Ordering (required across nodes).** Run retention on one node only (the coordinator),
   and only while no upload of the job is in flight; the coordinator knows both. Within one
   process it is enforced: :class:`~replication.backup.chunk_store.BackupStore` uploads hold
   a shared lock and retention the exclusive one, so a sweep never overlaps that store's
   uploads.
2. **Intent manifest first.** An uploader writes ``manifest.json`` *before* it decides which
   chunks to skip, so a sweep that lists manifests after that moment keeps X. Step 4 lists
   them again right before the sweep, leaving only an uploader that writes its manifest
   after that second listing *and* sees X before the delete reaches it.
3. **Grace period.** An incomplete step survives, pinning its chunks, while it is newer than
   the oldest kept step or younger than ``grace``. Choose ``grace`` above the longest backup
   you expect, so that a slow upload of an old step number (a rollback, then a re-save) is
   not mistaken for an abandoned one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from mtcfs.manifest import StepManifest
from replication.backup.backend import Backend
from replication.backup.errors import NotFound
from replication.backup.layout import CHUNKS_PREFIX, COMPLETE, MANIFEST, parse_chunk_key
from replication.backup.records import RetentionStats
from replication.backup.steps import BadManifest, StepCatalog

log = logging.getLogger(__name__)


def run_retention(catalog: StepCatalog, backend: Backend, *, keep: int, grace_ns: int,
                  now_ns: int, forget: Callable[[bytes], None],
                  workers: int) -> RetentionStats:
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

    Returns:
        The outcome; ``seconds`` is left 0.

    Raises:
        ValueError: if ``keep < 1``.
        BackupError: if the backend fails; what was deleted stays deleted, the rest is
            intact, and running it again finishes the job.
    """
    if keep < 1:
        raise ValueError(f"retention must keep at least 1 complete step, got {keep}")
    steps = catalog.scan()
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
    for step, objs in sorted(catalog.scan().items()):
        if step not in steps and step not in deleted and MANIFEST in objs:
            m = load(step)
            if m is not None:
                mark(m)

    stats = RetentionStats(steps_kept=[i.step for i in kept],
                           steps_deleted=[i.step for i in old],
                           incomplete_deleted=incomplete_deleted, swept=sweepable)
    if not sweepable:
        return stats
    garbage: list[tuple[str, bytes]] = []
    chunks_kept = 0
    for key in backend.list(CHUNKS_PREFIX):
        h = parse_chunk_key(key)
        if h is None:
            continue  # not ours: leave it
        digest = bytes.fromhex(h)
        if digest in live:
            chunks_kept += 1
        else:
            garbage.append((key, digest))

    def drop(item: tuple[str, bytes]) -> None:
        backend.delete(item[0])
        forget(item[1])

    if garbage:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(garbage))),
                                thread_name_prefix="mtcfs-backup") as pool:
            for _ in pool.map(drop, garbage):
                pass
    return RetentionStats(steps_kept=stats.steps_kept, steps_deleted=stats.steps_deleted,
                          incomplete_deleted=incomplete_deleted, chunks_kept=chunks_kept,
                          chunks_deleted=len(garbage), swept=True)
