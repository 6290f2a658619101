"""scope=job: a whole-job restart with every RAM tier lost comes back from the backup tier.

The bucket holds, for each step, one manifest per rank listing the files that rank wrote
(``steps/<step>/rank-<r>/``). Their union is the step's directory as the job saw it. The
node about to lead the namespace, finding no member with any state, turns the newest step
complete for every rank into a namespace snapshot and installs it; the other nodes join from
it as from any leader. File bytes are faulted in from the backup tier (and each node's
prefetcher brings back the files its rank wrote, so its replicas and backups resume).
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Any

from mtcfs.base.manifest import SPECIAL_MODES, StepManifest
from mtcfs.core.ports import ROOT_INO

log = logging.getLogger(__name__)


def snapshot_from_manifests(manifests: list[StepManifest]) -> dict[str, Any]:
    """A namespace snapshot (the format of ``Filesystem.ns_snapshot``) holding one step: the
    union of every rank's manifest of it, each file owned by the rank that listed it.

    Args:
        manifests: the manifests of one step, one per rank (``m.rank`` set).

    Raises:
        ValueError: if the manifests name different steps, or two ranks list one path as
            different kinds.
    """
    if len({m.step for m in manifests}) != 1:
        raise ValueError("manifests of different steps")
    m0 = manifests[0]
    entries: list[dict[str, Any]] = []
    inos: dict[str, int] = {"": ROOT_INO}
    kinds: dict[str, str] = {}
    uid, gid = os.getuid(), os.getgid()

    def add(path: str, kind: str, mode: int, mtime_ns: int, **extra: Any) -> None:
        if path in kinds:
            if kinds[path] != kind:
                raise ValueError(f"{path} is a {kinds[path]} in one rank's manifest and a"
                                 f" {kind} in another's")
            return
        parent, _, name = path.rpartition("/")
        if parent not in inos:
            add(parent, "dir", 0o755, mtime_ns)
        inos[path] = len(inos) + 1
        kinds[path] = kind
        fmt = {"dir": stat.S_IFDIR, "file": stat.S_IFREG, "symlink": stat.S_IFLNK}.get(kind)
        if kind == "special":  # a FIFO, socket or device node: metadata only
            fmt = SPECIAL_MODES[extra["node"]]
        if fmt is None:
            raise ValueError(f"{path} is of an unknown kind {kind!r}")
        entries.append({"ino": inos[path], "parent": inos[parent], "name": name, "kind": kind,
                        "mode": fmt | mode, "uid": uid, "gid": gid, "mtime_ns": mtime_ns,
                        "target": extra.get("target", ""), **(
                            {"version": extra["version"]} if "version" in extra else {}), **(
                            {"rdev": extra["rdev"]} if extra.get("rdev") else {})})

    add(m0.step, "dir", 0o755, m0.created_ns)
    for m in sorted(manifests, key=lambda m: m.rank or 0):
        for e in m.entries:
            if e.kind == "file":
                add(e.path, "file", e.mode, e.mtime_ns, version={
                    "size": e.size, "chunk_size": e.chunk_size, "chunks": list(e.chunks),
                    "blake3": e.blake3, "rank": m.rank or 0, "sealed": True})
            else:
                add(e.path, e.kind, e.mode, e.mtime_ns, target=e.target or "", node=e.node,
                    rdev=e.rdev)
    return {"epoch": 1, "seq": 1, "next_ino": len(inos) + 1, "entries": entries,
            "steps": [{"name": m0.step, "number": m0.step_number, "ino": inos[m0.step],
                       "source": "restore", "committed_ns": m0.created_ns}]}


def latest_job_step(backup_store: Any, nodes: int) -> list[StepManifest] | None:
    """The manifests of every rank of the newest step complete in the bucket for the job
    that wrote it (blocking), or None when there is none.

    ``nodes`` (this job's node count) does not choose the step or its ranks: a step written
    by 4 ranks is complete when all 4 completed it and comes back with all 4 ranks' files,
    on 2 nodes or on 8 (``BackupStore.job_complete_steps``).
    """
    full = [(num, step, ranks) for step, (num, ranks)
            in backup_store.job_complete_steps().items()]
    if not full:
        return None
    _num, step, ranks = max(full)
    return [backup_store.get_step(step, rank=r) for r in sorted(ranks)]
