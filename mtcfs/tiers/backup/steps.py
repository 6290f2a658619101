"""The ``steps/`` half of the backup layout: manifests and COMPLETE markers.

A step directory (``steps/<step>/`` of a single-node store, ``steps/<step>/rank-<r>/`` of
rank ``r``; see :mod:`mtcfs.tiers.backup.layout`) holds ``manifest.json``
(``StepManifest.to_bytes()``) and, once every chunk it references is stored, ``COMPLETE``: a
small JSON summary (format, job, step, step_number, rank, created_ns, completed_ns,
total_bytes, chunks) that lets a listing show steps without reading their manifests. In the
rank layout the marker's ``rank`` is the directory's rank, and a marker naming another rank
is ignored as unreadable.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

from mtcfs.base import pools
from mtcfs.base.manifest import ManifestError, StepManifest
from mtcfs.tiers.backup.backend import Backend
from mtcfs.tiers.backup.errors import BackupError, NotFound
from mtcfs.tiers.backup.layout import (
    COMPLETE, MANIFEST, STEPS_PREFIX, check_rank, complete_key, manifest_key,
    parse_rank_step_key, parse_step_key, step_dir,
)
from mtcfs.tiers.backup.records import StepInfo

log = logging.getLogger(__name__)

#: Format of the COMPLETE marker's JSON.
MARKER_FORMAT = 1


class BadManifest(BackupError):
    """A stored manifest does not parse, or names another step than its directory."""


def scan_layouts(backend: Backend) -> tuple[dict[str, set[str]], dict[str, dict[int, set[str]]]]:
    """One listing of ``steps/``, split by layout.

    Returns:
        ``(single, ranked)``: ``single`` maps each step of the single-node layout to the
        object names in its directory; ``ranked`` maps each step to ``{rank: object names in
        steps/<step>/rank-<rank>/}``. Keys of neither layout are left out.

    Raises:
        BackupError: if the listing fails.
    """
    single: dict[str, set[str]] = {}
    ranked: dict[str, dict[int, set[str]]] = {}
    for key in backend.list(STEPS_PREFIX):
        parsed = parse_step_key(key)
        if parsed is not None:
            single.setdefault(parsed[0], set()).add(parsed[1])
            continue
        pr = parse_rank_step_key(key)
        if pr is not None:
            ranked.setdefault(pr[0], {}).setdefault(pr[1], set()).add(pr[2])
    return single, ranked


def _first_markers(backend: Backend, ranked: dict[str, dict[int, set[str]]], workers: int
                   ) -> dict[str, tuple[StepInfo, list[int]]]:
    """For each step of the rank layout some rank completed: the lowest readable COMPLETE
    marker of it (one read per step; ``workers`` threads) and the ranks whose marker the
    listing shows. A step none of whose markers is readable is left out."""
    done = {step: sorted(r for r, objs in ranks.items() if COMPLETE in objs)
            for step, ranks in ranked.items()}
    done = {step: rs for step, rs in done.items() if rs}

    def first(step: str) -> StepInfo | None:
        for r in done[step]:
            info = StepCatalog(backend, 1, r).read_marker(step)
            if info is not None:
                return info
        return None

    names = sorted(done)
    if len(names) <= 1 or workers <= 1:
        infos = [first(s) for s in names]
    else:
        infos = pools.run_map("backup-io", first, names, workers)
    return {s: (i, done[s]) for s, i in zip(names, infos) if i is not None}


def job_complete(backend: Backend, ranked: dict[str, dict[int, set[str]]], workers: int,
                 default_world: int | None = None) -> dict[str, tuple[int, set[int]]]:
    """The steps of the rank layout complete for the whole job that wrote them.

    A step needs every rank ``0..world_size-1`` of the job that wrote it, whatever the job
    that restores it has now (fewer or more nodes): the ``world_size`` its lowest readable
    COMPLETE marker records, or, in a marker written before it was recorded, one above the
    highest rank with any object of the step (an upload that died after its intent
    manifest counts; one that died before it cannot be seen), and at least
    ``default_world`` (retention passes the job's world size, as it did before).

    Returns:
        ``{step: (step_number, ranks)}`` for those steps: ``ranks`` is ``0..world_size-1``.

    Raises:
        BackupError: if the backend fails.
    """
    out = {}
    for s, (info, done) in _first_markers(backend, ranked, workers).items():
        world = info.world_size or max(default_world or 0, max(ranked[s]) + 1)
        if set(done) >= set(range(world)):
            out[s] = (info.step_number, set(range(world)))
    return out


def complete_ranks(backend: Backend, ranked: dict[str, dict[int, set[str]]], workers: int
                   ) -> dict[str, tuple[int, set[int]]]:
    """Which ranks completed each step of the rank layout.

    Args:
        backend: where the objects are.
        ranked: the second half of :func:`scan_layouts`.
        workers: threads for reading markers (>= 1).

    Returns:
        ``{step: (step_number, ranks)}`` for every step at least one rank completed.
        ``ranks`` are the ranks whose ``COMPLETE`` object the listing shows; the step number
        comes from the lowest such rank's marker that is readable (one read per step). A
        step none of whose markers is readable is left out.

    Raises:
        BackupError: if the backend fails.
    """
    return {s: (info.step_number, set(done))
            for s, (info, done) in _first_markers(backend, ranked, workers).items()}


class StepCatalog:
    """Reads and writes step manifests and markers of one rank (or of a single-node store)
    in a backend.

    Args:
        backend: where the objects are.
        workers: threads for reading many markers at once (>= 1).
        rank: whose steps: None for the single-node layout ``steps/<step>/``, else the rank
            layout ``steps/<step>/rank-<rank>/``.

    Raises:
        ValueError: on a bad rank.
    """

    def __init__(self, backend: Backend, workers: int, rank: int | None = None) -> None:
        self._backend = backend
        self._workers = max(1, workers)
        self._rank = check_rank(rank)

    @property
    def rank(self) -> int | None:
        """The rank whose steps this catalog reads and writes (None: single-node layout)."""
        return self._rank

    def scan(self) -> dict[str, set[str]]:
        """Map each of this rank's step directories to the object names in it (one listing
        of ``steps/``).

        Raises:
            BackupError: if the listing fails.
        """
        steps: dict[str, set[str]] = {}
        for key in self._backend.list(STEPS_PREFIX):
            if self._rank is None:
                parsed = parse_step_key(key)
                if parsed is not None:
                    steps.setdefault(parsed[0], set()).add(parsed[1])
            else:
                pr = parse_rank_step_key(key)
                if pr is not None and pr[1] == self._rank:
                    steps.setdefault(pr[0], set()).add(pr[2])
        return steps

    def read_marker(self, step: str) -> StepInfo | None:
        """Read a COMPLETE marker; None if it is gone or unreadable (logged as a warning).

        Raises:
            BackupError: if the backend fails.
        """
        try:
            raw = self._backend.get(complete_key(step, self._rank))
        except NotFound:
            return None
        try:
            d = json.loads(raw)
            if d.get("format") != MARKER_FORMAT or d.get("step") != step:
                raise ValueError(f"format {d.get('format')!r}, step {d.get('step')!r}")
            if self._rank is not None and d.get("rank") != self._rank:
                raise ValueError(f"marker of rank {d.get('rank')!r} in rank {self._rank}'s "
                                 "directory")
            return StepInfo(step=step, step_number=int(d["step_number"]),
                            created_ns=int(d["created_ns"]),
                            completed_ns=int(d.get("completed_ns", 0)),
                            total_bytes=int(d["total_bytes"]), chunks=int(d["chunks"]),
                            world_size=int(d["world_size"]) if "world_size" in d else None)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("ignoring unreadable COMPLETE marker of step %s%s in %s: %s", step,
                        "" if self._rank is None else f" rank {self._rank}",
                        self._backend.describe(), exc)
            return None

    def complete_steps(self, scan: dict[str, set[str]]) -> list[StepInfo]:
        """The complete steps of a :meth:`scan`, sorted by step number (then creation time).

        Raises:
            BackupError: if the backend fails.
        """
        names = sorted(s for s, objs in scan.items() if COMPLETE in objs)
        if len(names) <= 1 or self._workers == 1:
            infos = [self.read_marker(s) for s in names]
        else:
            infos = pools.run_map("backup-io", self.read_marker, names, self._workers)
        found = [i for i in infos if i is not None]
        found.sort(key=lambda i: (i.step_number, i.created_ns, i.step))
        return found

    def is_complete(self, step: str) -> bool:
        """Whether the step's COMPLETE marker exists. Raises BackupError on failure."""
        return self._backend.exists(complete_key(step, self._rank))

    def read_manifest(self, step: str) -> StepManifest:
        """Read and parse a step's manifest, complete or not.

        Raises:
            NotFound: if there is none.
            BadManifest: if it does not parse or is for another step.
            BackupError: if the backend fails.
        """
        raw = self._backend.get(manifest_key(step, self._rank))
        where = self._backend.describe()
        if self._rank is not None:
            where = f"{where} (rank {self._rank})"
        try:
            m = StepManifest.from_bytes(raw)
        except ManifestError as exc:
            raise BadManifest(f"manifest of step {step!r} in {where} is unreadable: "
                              f"{exc}") from exc
        if m.step != step:
            raise BadManifest(f"manifest under step {step!r} in {where} is for step "
                              f"{m.step!r}")
        return m

    def write_intent(self, manifest: StepManifest) -> int:
        """Store a step's manifest before its chunks; return bytes sent (0 if unchanged).

        If the step is already complete with the same manifest, nothing is written and it
        stays restorable. If it is complete with a different one, its marker is deleted
        first, so the step is never complete with a manifest that was not committed.

        Raises:
            ValueError: on a bad step name.
            BackupError: if the backend fails.
        """
        raw = manifest.to_bytes()
        mkey = manifest_key(manifest.step, self._rank)
        ckey = complete_key(manifest.step, self._rank)
        if self._backend.exists(ckey):
            try:
                if self._backend.get(mkey) == raw:
                    return 0
            except NotFound:
                pass
            log.warning("replacing complete step %s in %s with a new manifest",
                        manifest.step, self._backend.describe())
            self._backend.delete(ckey)
        self._backend.put(mkey, raw)
        return len(raw)

    def write_marker(self, manifest: StepManifest, chunks: int, completed_ns: int,
                     world_size: int | None = None) -> int:
        """Store the COMPLETE marker; return its size in bytes.

        Args:
            manifest: the step.
            chunks: number of unique chunks it references.
            completed_ns: now, ns since the epoch.
            world_size: ranks of the job that wrote it (multi-node; recorded so that a
                restore knows which ranks the step needs: :func:`job_complete`).

        Raises:
            BackupError: if the backend fails.
        """
        marker = json.dumps({
            "format": MARKER_FORMAT, "job": manifest.job, "step": manifest.step,
            "step_number": manifest.step_number,
            "rank": manifest.rank if self._rank is None else self._rank,
            "created_ns": manifest.created_ns, "completed_ns": completed_ns,
            "total_bytes": manifest.total_bytes, "chunks": chunks,
            **({"world_size": world_size} if world_size is not None else {}),
        }, separators=(",", ":")).encode()
        self._backend.put(complete_key(manifest.step, self._rank), marker)
        return len(marker)

    def delete_step(self, step: str, objs: Iterable[str] = ()) -> None:
        """Delete a step (this rank's part of it): its marker first (it stops being
        restorable), then its manifest, then the other ``objs`` named in its directory.

        Raises:
            BackupError: if the backend fails (the step is then at worst incomplete).
        """
        self._backend.delete(complete_key(step, self._rank))
        self._backend.delete(manifest_key(step, self._rank))
        for name in sorted(set(objs) - {COMPLETE, MANIFEST}):
            self._backend.delete(step_dir(step, self._rank) + name)
