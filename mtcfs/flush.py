"""The flush at a stop: before the daemon exits on SIGTERM, the newest committed checkpoint
goes to the tiers that outlive this node.

A SIGTERM is what a node gets before it goes away: a preemption notice (a spot or
preemptible VM), a node drain, the DaemonSet pod's preStop and grace period, ``systemctl
stop``. The RAM tier dies with the node, so a step committed a moment before is lost unless
a peer or the bucket holds it. On SIGTERM the daemon therefore keeps serving the mount (the
trainer may still be writing its last step) and waits, at most ``stop_flush=`` seconds
(default :data:`DEFAULT_FLUSH_S`, inside Kubernetes' default grace period of 30 s), until
the newest committed step is replicated to every peer that should hold it (``replicated
R/R``) and, with a backup tier, backed up (an upload of it is asked for at once, whatever
``backup_interval=`` says). Then it unmounts and exits. What it could not flush in time is
logged as one warning line (``flush at stop: ... NOT ...``) and written to the store's
``last-stop.json``, which ``mtcfs status`` of the next daemon on this store shows as
``last_stop``. A second signal ends the wait at once. docs/reliability.md, "Stopping".

The idea is Orbax's and GKE's "save at preemption" (a checkpoint on SIGTERM), turned
around: the checkpoint is already here, only its copies are missing.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from collections.abc import Callable
from typing import Any, Protocol

import trio

from mtcfs.core.records import StepRecord, oldest_first

log = logging.getLogger(__name__)

#: Seconds the daemon waits at SIGTERM for the newest step to reach the other tiers.
DEFAULT_FLUSH_S = 25.0
#: Seconds between looks at the step's replication state.
POLL_S = 0.05


class Steps(Protocol):
    """The committed steps of the core (``Filesystem.steps``)."""

    @property
    def steps(self) -> dict[str, StepRecord]: ...


class Backup(Protocol):
    """The backup scheduler (tiers/backup/scheduler.py)."""

    async def request(self, step: str | None = None) -> None: ...


@dataclass
class FlushReport:
    """What the flush at a stop did.

    Attributes:
        step: the newest committed step ("" when there was none).
        seconds: how long the flush took.
        replicated: ``"k/R"`` peers holding the step when the flush ended ("" without a
            peer tier).
        backed_up: whether the backup tier holds it (None without a backup tier).
        complete: every tier the node has holds the step.
        missing: one line per tier that does not.
    """

    step: str = ""
    seconds: float = 0.0
    replicated: str = ""
    backed_up: bool | None = None
    complete: bool = True
    missing: list[str] = field(default_factory=list)
    at: float = field(default_factory=time.time)

    def line(self) -> str:
        if not self.step:
            return "flush at stop: no committed step to flush"
        where = ", ".join(x for x in (
            f"replicated {self.replicated}" if self.replicated else "",
            {True: "backed up", False: "NOT backed up", None: ""}[self.backed_up]) if x)
        if self.complete:
            return f"flush at stop: {self.step} {where} ({self.seconds:.2f} s)"
        return (f"flush at stop: {self.step} NOT flushed within {self.seconds:.1f} s: "
                f"{'; '.join(self.missing)}; it is lost if this node's RAM is")


async def flush(fs: Steps, *, replicas: Callable[[], int] | None, backup: Backup | None,
                deadline_s: float) -> FlushReport:
    """Wait, at most ``deadline_s`` seconds, until the newest committed step is held by
    every peer that should hold it and (with ``backup``) by the backup tier.

    Args:
        fs: the core's committed steps (each record's ``replicated`` counts the peers that
            confirmed it as it is now).
        replicas: how many peers should hold this node's steps now (the peer tier's
            placement); None without a peer tier.
        backup: the backup scheduler, asked to back the step up now; None without one.
        deadline_s: the most seconds to wait.

    Returns:
        The report (never raises: a failed backup upload is a ``missing`` line).
    """
    t0 = time.monotonic()
    recs = oldest_first(fs.steps.values())
    report = FlushReport()
    has_peers = replicas is not None
    if not recs or (replicas is None and backup is None):
        return report
    rec = recs[-1]
    report.step = rec.name
    errors: list[str] = []

    def want() -> int:
        return replicas() if replicas is not None else 0

    def peers_done() -> bool:
        return rec.replicated >= want()

    async def to_peers() -> None:
        while not peers_done():
            await trio.sleep(POLL_S)

    async def to_backup() -> None:
        if backup is None or rec.backed_up_ns is not None:
            return
        try:
            await backup.request(rec.name)
        except Exception as exc:  # noqa: BLE001 (reported, the stop goes on)
            errors.append(f"backup: {exc}")

    with trio.move_on_after(deadline_s):
        async with trio.open_nursery() as n:
            n.start_soon(to_peers)
            n.start_soon(to_backup)
    report.seconds = round(time.monotonic() - t0, 3)
    if has_peers:
        report.replicated = f"{rec.replicated}/{want()}"
        if not peers_done():
            report.missing.append(f"replicated {report.replicated}")
    if backup is not None:
        report.backed_up = rec.backed_up_ns is not None
        if not report.backed_up:
            report.missing.append("not backed up" + (f" ({errors[0]})" if errors else ""))
    report.complete = not report.missing
    return report


def save_report(store_dir: str, report: FlushReport) -> None:
    """Write ``report`` to ``STORE/last-stop.json`` (atomically; errors are logged)."""
    path = os.path.join(store_dir, "last-stop.json")
    try:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(report), f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot record the stop's flush in %s: %s", path, exc)


def load_report(store_dir: str) -> dict[str, Any] | None:
    """The last stop's report, as written by :func:`save_report`, taken out of the store
    (it is about the stop right before this start, not an older one); None if none or
    unreadable (a damaged file is not trusted: it is only shown, and only if it parses)."""
    path = os.path.join(store_dir, "last-stop.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    if not isinstance(data, dict) or not isinstance(data.get("step"), str):
        return None
    return {k: data.get(k) for k in ("step", "seconds", "replicated", "backed_up",
                                     "complete", "missing", "at")}
