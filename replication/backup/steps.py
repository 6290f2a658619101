"""The ``steps/`` half of the backup layout: manifests and COMPLETE markers.

A step directory holds ``manifest.json`` (``StepManifest.to_bytes()``) and, once every chunk
it references is stored, ``COMPLETE``: a small JSON summary (format, job, step, step_number,
rank, created_ns, completed_ns, total_bytes, chunks) that lets a listing show steps without
reading their manifests.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from mtcfs.manifest import ManifestError, StepManifest
from replication.backup.backend import Backend
from replication.backup.errors import BackupError, NotFound
from replication.backup.layout import (
    COMPLETE, MANIFEST, STEPS_PREFIX, complete_key, manifest_key, parse_step_key,
)
from replication.backup.records import StepInfo

log = logging.getLogger(__name__)

#: Format of the COMPLETE marker's JSON.
MARKER_FORMAT = 1


class BadManifest(BackupError):
    """A stored manifest does not parse, or names another step than its directory."""


class StepCatalog:
    """Reads and writes step manifests and markers in a backend.

    Args:
        backend: where the objects are.
        workers: threads for reading many markers at once (>= 1).
    """

    def __init__(self, backend: Backend, workers: int) -> None:
        self._backend = backend
        self._workers = max(1, workers)

    def scan(self) -> dict[str, set[str]]:
        """Map each step directory to the object names in it (one listing of ``steps/``).

        Raises:
            BackupError: if the listing fails.
        """
        steps: dict[str, set[str]] = {}
        for key in self._backend.list(STEPS_PREFIX):
            parsed = parse_step_key(key)
            if parsed is not None:
                steps.setdefault(parsed[0], set()).add(parsed[1])
        return steps

    def read_marker(self, step: str) -> StepInfo | None:
        """Read a COMPLETE marker; None if it is gone or unreadable (logged as a warning).

        Raises:
            BackupError: if the backend fails.
        """
        try:
            raw = self._backend.get(complete_key(step))
        except NotFound:
            return None
        try:
            d = json.loads(raw)
            if d.get("format") != MARKER_FORMAT or d.get("step") != step:
                raise ValueError(f"format {d.get('format')!r}, step {d.get('step')!r}")
            return StepInfo(step=step, step_number=int(d["step_number"]),
                            created_ns=int(d["created_ns"]),
                            completed_ns=int(d.get("completed_ns", 0)),
                            total_bytes=int(d["total_bytes"]), chunks=int(d["chunks"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("ignoring unreadable COMPLETE marker of step %s in %s: %s",
                        step, self._backend.describe(), exc)
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
            with ThreadPoolExecutor(max_workers=min(self._workers, len(names)),
                                    thread_name_prefix="mtcfs-backup") as pool:
                infos = list(pool.map(self.read_marker, names))
        found = [i for i in infos if i is not None]
        found.sort(key=lambda i: (i.step_number, i.created_ns, i.step))
        return found

    def is_complete(self, step: str) -> bool:
        """Whether the step's COMPLETE marker exists. Raises BackupError on failure."""
        return self._backend.exists(complete_key(step))

    def read_manifest(self, step: str) -> StepManifest:
        """Read and parse a step's manifest, complete or not.

        Raises:
            NotFound: if there is none.
            BadManifest: if it does not parse or is for another step.
            BackupError: if the backend fails.
        """
        raw = self._backend.get(manifest_key(step))
        where = self._backend.describe()
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
        mkey, ckey = manifest_key(manifest.step), complete_key(manifest.step)
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

    def write_marker(self, manifest: StepManifest, chunks: int, completed_ns: int) -> int:
        """Store the COMPLETE marker; return its size in bytes.

        Args:
            manifest: the step.
            chunks: number of unique chunks it references.
            completed_ns: now, ns since the epoch.

        Raises:
            BackupError: if the backend fails.
        """
        marker = json.dumps({
            "format": MARKER_FORMAT, "job": manifest.job, "step": manifest.step,
            "step_number": manifest.step_number, "rank": manifest.rank,
            "created_ns": manifest.created_ns, "completed_ns": completed_ns,
            "total_bytes": manifest.total_bytes, "chunks": chunks,
        }, separators=(",", ":")).encode()
        self._backend.put(complete_key(manifest.step), marker)
        return len(marker)

    def delete_step(self, step: str, objs: Iterable[str] = ()) -> None:
        """Delete a step: its marker first (it stops being restorable), then its manifest,
        then the other ``objs`` named in its directory.

        Raises:
            BackupError: if the backend fails (the step is then at worst incomplete).
        """
        self._backend.delete(complete_key(step))
        self._backend.delete(manifest_key(step))
        for name in sorted(set(objs) - {COMPLETE, MANIFEST}):
            self._backend.delete(f"{STEPS_PREFIX}{step}/{name}")
