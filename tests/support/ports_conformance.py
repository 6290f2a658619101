"""Checked by mypy (tests/t1_typecheck_test.py), never run: the core's tier API satisfies
every port that the composition root (mtcfs/daemon.py) hands it to the tiers as, and the
facade and components satisfy the hosts of the components checked here."""

from __future__ import annotations

from mtcfs.core import ports
from mtcfs.core.core import Filesystem
from mtcfs.core.capacity import Host as ReclaimHost
from mtcfs.core.eviction import Actions as EvictionActions
from mtcfs.core.fetcher import Host as FetcherHost
from mtcfs.core.jobns import Host as JobNamespaceHost
from mtcfs.core.verifier import Host as VerifierHost


def conforms(fs: Filesystem) -> None:
    """Each assignment fails type checking when the core stops providing a port."""
    api = fs.tier_api
    backup: ports.BackupPort = api
    peer: ports.PeerPort = api
    restore: ports.RestorePort = api
    mtc: ports.MtcPort = api
    namespace: ports.NamespacePort = api
    origins: ports.ChunkOriginPort = api
    mount_restore: ports.MountRestorePort = api
    # the core's own components' hosts (those checked here)
    jobns_host: JobNamespaceHost = fs
    reclaim_host: ReclaimHost = fs
    fetcher_host: FetcherHost = fs.chunks
    verifier_host: VerifierHost = fs.chunks
    eviction_actions: EvictionActions = fs.reclaim
    del backup, peer, restore, mtc, namespace, origins, mount_restore, jobns_host
    del reclaim_host, fetcher_host, verifier_host, eviction_actions
