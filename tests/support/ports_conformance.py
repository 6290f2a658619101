"""Checked by mypy (tests/t1_typecheck_test.py), never run: the core satisfies every port
that the composition root (mtcfs/daemon.py) hands it to the tiers as."""

from __future__ import annotations

from mtcfs.core import ports
from mtcfs.core.core import Filesystem
from mtcfs.core.capacity import Host as ReclaimHost
from mtcfs.core.checkpoints import Host as CheckpointsHost
from mtcfs.core.eviction import Actions as EvictionActions
from mtcfs.core.jobns import Host as JobNamespaceHost


def conforms(fs: Filesystem) -> None:
    """Each assignment fails type checking when Filesystem stops providing a port."""
    backup: ports.BackupPort = fs
    peer: ports.PeerPort = fs
    restore: ports.RestorePort = fs
    mtc: ports.MtcPort = fs
    namespace: ports.NamespacePort = fs
    origins: ports.ChunkOriginPort = fs
    mount_restore: ports.MountRestorePort = fs
    # the core's own components' hosts (those checked here)
    jobns_host: JobNamespaceHost = fs
    checkpoints_host: CheckpointsHost = fs
    reclaim_host: ReclaimHost = fs
    eviction_actions: EvictionActions = fs.reclaim
    del backup, peer, restore, mtc, namespace, origins, mount_restore, jobns_host
    del checkpoints_host, reclaim_host, eviction_actions
