"""What a mount restores, from which tier, and when: the one place that decides a restore.

A :class:`Restorer` is built by the composition root (mtcfs/daemon.py) once the tiers
exist, and is asked to restore

- at mount, on an empty store (:meth:`Restorer.at_mount`): the step the job names, from
  the peers then the backup tier (several nodes), or the newest backed-up step (one node);
- on request (``mtcfs restore``, Orbax's replicator): :meth:`Restorer.restore`;
- in scope=job, when the job's namespace log in etcd is empty and about to be seeded
  (:meth:`Restorer.job_namespace_from_backup`): the newest step every rank completed in
  the backup tier.

Each restore imports the namespace of one step first (entries whose chunks are missing),
and leaves the data to the chunk movers: a bulk stream from the peers
(:func:`mtcfs.tiers.restore.bulk.restore_from_peers`) when the manifest came from a peer,
then the prefetcher (:mod:`mtcfs.tiers.restore.from_backup`), which also reads the backup
tier; a read of data not here yet faults it in on its own meanwhile.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from mtcfs.base.errors import FsError
from mtcfs.base.manifest import StepManifest
from mtcfs.core.ports import MountRestorePort

if TYPE_CHECKING:
    from mtcfs.tiers.backup.chunk_store import BackupStore
    from mtcfs.tiers.namespace.etcd_log import EtcdNamespace
    from mtcfs.tiers.peer.tier import PeerTier
    from mtcfs.tiers.restore.from_backup import Prefetcher

log = logging.getLogger(__name__)

#: Seconds a restore before the mount comes up may take (restore=, or scope=job from the
#: backup tier); past it the mount comes up anyway, with the error in status.
RESTORE_AT_MOUNT_S = 120.0


class Restorer:
    """Restores for one mount.

    Args:
        fs: the core.
        rank: this node's rank (0 on one node).
        nodes: the job's node count.
        restore: the ``restore=`` option: ``"latest"``, ``"none"`` or a step number.
        backup_url: the ``backup=`` URL (for logs), or None.
        backup_store: the backup tier's store, or None.
        peer: the peer tier (several nodes), or None.
        prefetcher: the background fetcher of missing chunks, or None (no other tier).
        ns: scope=job: the job's namespace log, or None.
        mtc: True when Orbax's replicator asks for restores (option ``mtc``): nothing is
            restored at mount.
        on_peer_chunk: called for each chunk the bulk restore brings from a peer (the
            chunk sources' ``served`` counts in status).
    """

    def __init__(self, fs: MountRestorePort, *, rank: int, nodes: int, restore: str,
                 backup_url: str | None, backup_store: BackupStore | None,
                 peer: PeerTier | None, prefetcher: Prefetcher | None,
                 ns: EtcdNamespace | None = None, mtc: bool = False,
                 on_peer_chunk: Callable[[], None] | None = None) -> None:
        self.fs = fs
        self.rank = rank
        self.nodes = nodes
        self.restore_option = restore
        self.backup_url = backup_url
        self.backup_store = backup_store
        self.peer = peer
        self.prefetcher = prefetcher
        self.ns = ns
        self.mtc = mtc
        self.on_peer_chunk = on_peer_chunk
        #: What the last restore brought back (status ``restore``).
        self.info: dict[str, Any] = {}
        #: A bulk restore from peers is streaming (or will, once the mount runs); the
        #: prefetcher waits for it.
        self.bulk_pending = False
        #: Starts a task in the mount's nursery; None until the mount runs.
        self.start_soon: Callable[[Callable[[], Awaitable[None]]], None] | None = None

    # ------------------------------------------------------------------ entry points

    async def at_mount(self) -> None:
        """On an empty store, bring back the newest (or the requested) checkpoint; errors
        are recorded in status, never raised (the mount comes up even so)."""
        fs = self.fs
        if (self.backup_store is None and self.peer is None) or self.restore_option == "none" \
                or fs.steps or not fs.namespace_empty() or self.mtc:
            # (With mtc, Orbax asks for a restore through replicator.yaml.)
            return
        want = None if self.restore_option == "latest" else int(self.restore_option)
        try:
            with trio.fail_after(RESTORE_AT_MOUNT_S):
                await self.restore(want)
        except FsError as exc:
            if exc.errno == errno.ENOENT and want is None:
                log.info("nothing to restore: %s", exc.strerror)
            else:
                fs.report_error(f"restore at mount failed: {exc.strerror}")
        except (Exception, trio.TooSlowError) as exc:
            why = str(exc) or f"not done within {RESTORE_AT_MOUNT_S} s"
            fs.report_error(f"restore at mount failed: {why}")

    async def restore(self, number: int | None, *,
                      check_space: bool = False) -> dict[str, Any]:
        """Import step ``number`` (None: the newest) of this rank: the step the job names
        from the peers or the backup tier (several nodes), else from the backup tier.

        Returns:
            ``{"step", "imported", ...}``: ``imported`` False when the step is here already.

        Raises:
            FsError: ENOENT when no tier holds such a step; ENOSPC (``check_space``) when it
                is larger than the RAM tier's free bytes; EINVAL with no other tier.
        """
        if self.peer is not None:
            return await self._from_job(number, check_space=check_space)
        return await self._from_backup(number, check_space=check_space)

    def kick_prefetch(self) -> None:
        """Fetch missing chunks now, unless a bulk restore from peers is streaming them
        (it kicks the prefetcher itself when it ends)."""
        if self.prefetcher is not None and not self.bulk_pending:
            self.prefetcher.kick()

    async def job_namespace_from_backup(self) -> None:
        """scope=job, about to seed the job's empty etcd keyspace with an empty namespace
        (the job's namespace and every RAM tier were lost): install the newest step the
        backup tier holds for every rank, which then seeds it
        (mtcfs/tiers/namespace/etcd_log.py). Errors are recorded in status."""
        from mtcfs.tiers.restore.namespace import latest_job_step, snapshot_from_manifests
        fs, ns = self.fs, self.ns
        assert ns is not None and self.peer is not None
        if self.backup_store is None or self.restore_option == "none" or \
                not fs.namespace_empty():
            return
        t0 = time.monotonic()
        try:
            with trio.fail_after(RESTORE_AT_MOUNT_S):  # the mount comes up even so
                manifests = await trio.to_thread.run_sync(
                    latest_job_step, self.backup_store, self.nodes,
                    abandon_on_cancel=True)
            if manifests is None:
                log.info("nothing to restore: no step is complete for every rank in the backup")
                return
            fs.ns_install(snapshot_from_manifests(manifests))
        except (Exception, trio.TooSlowError) as exc:
            fs.report_error(f"restore of the job namespace from the backup tier failed: "
                            f"{str(exc) or f'no answer within {RESTORE_AT_MOUNT_S} s'}")
            return
        ns.reset_position()
        fs.mark_all_backed_up()
        self.info = {"step": manifests[0].step, "manifest_from": "backup",
                     "bytes": sum(m.total_bytes for m in manifests),
                     "namespace_seconds": time.monotonic() - t0, "started": time.time()}
        log.info("restored the job namespace of %s from the backup tier", manifests[0].step)
        if self.prefetcher is not None:
            self.prefetcher.kick()

    async def bulk_from_peers(self) -> None:
        """Stream the restored step's chunks from the peers, then let the prefetcher (and
        so the backup tier) fetch whatever they did not serve. Errors are recorded."""
        from mtcfs.tiers.restore.bulk import restore_from_peers
        assert self.peer is not None and self.prefetcher is not None
        try:
            stats = await restore_from_peers(self.fs, self.peer, on_chunk=self.on_peer_chunk)
            self.info["bulk_from_peers"] = stats
        except Exception as exc:  # the prefetcher still brings everything back
            log.exception("bulk restore from peers failed")
            self.fs.report_error(f"bulk restore from peers failed: {exc}")
        finally:
            self.bulk_pending = False
            self.prefetcher.kick()

    async def wait_restored(self, progress: Callable[[int, int], None]) -> None:
        """Wait until no chunk of the restored steps is missing, calling
        ``progress(done_bytes, total_bytes)`` every 0.2 s.

        Raises:
            FsError: EIO when a second pass of the prefetcher still fails on some chunks
                (corrupt or missing in every tier).
        """
        assert self.prefetcher is not None
        pf = self.prefetcher
        total = None
        retried = False
        while True:
            chunks, left = pf.pending()
            total = left if total is None else total
            progress(total - left, total)
            if chunks == 0:
                return
            if pf.failed and pf.idle:
                # A pass ended with failures: try once more, then report rather than wait
                # forever on chunks no tier can serve (corrupt or missing everywhere).
                if retried:
                    raise FsError(errno.EIO, f"{chunks} chunks could not be restored (corrupt"
                                  " or missing in every tier); see mtcfs status")
                retried = True
                pf.failed = 0
                pf.kick()
            await trio.sleep(0.2)

    # ------------------------------------------------------------------ one source each

    async def _from_job(self, want: int | None, *, check_space: bool) -> dict[str, Any]:
        """Several nodes: import the step the job names for this rank (peers, then backup)."""
        from mtcfs.tiers.restore.from_peers import choose_and_fetch
        fs = self.fs
        assert self.peer is not None
        t0 = time.monotonic()
        got = await choose_and_fetch(self.peer, want)
        if got is None:
            raise FsError(errno.ENOENT, "no peer and no backup holds a checkpoint of rank "
                          f"{self.rank}")
        manifest, source, backed_up = got
        if manifest.step in fs.steps:
            return {"step": manifest.step, "imported": False, "source": "local"}
        self._check_space(manifest, check_space)
        fs.import_step(manifest, backed_up=backed_up)
        self.info = {"step": manifest.step, "bytes": manifest.total_bytes,
                     "manifest_from": source,
                     "namespace_seconds": time.monotonic() - t0, "started": time.time()}
        log.info("restored namespace of %s (%d bytes) of rank %d; manifest from %s",
                 manifest.step, manifest.total_bytes, self.rank, source)
        if source.startswith("peer") and self.prefetcher is not None:
            # The data follows in long streams from the holders; the prefetcher (which
            # goes chunk by chunk, backup tier included) takes over what they leave.
            self.bulk_pending = True  # the prefetcher waits for it (kick_prefetch)
            if self.start_soon is not None:  # mounted already (mtcfs restore, mtc)
                self.start_soon(self.bulk_from_peers)
            else:  # started with the mount (Daemon._run)
                self.prefetcher.wait_for_kick = True
        elif self.prefetcher is not None:
            self.prefetcher.kick()
        return {"step": manifest.step, "imported": True, "bytes": manifest.total_bytes,
                "source": source}

    async def _from_backup(self, number: int | None, *,
                           check_space: bool) -> dict[str, Any]:
        """Import step ``number`` (None: the newest complete) from the backup tier."""
        fs, bs = self.fs, self.backup_store
        if bs is None:
            raise FsError(errno.EINVAL, "no backup= tier configured")
        t0 = time.monotonic()
        steps = await trio.to_thread.run_sync(bs.list_steps)
        if number is None:
            if not steps:
                raise FsError(errno.ENOENT, "the backup tier holds no complete checkpoint")
            info = steps[-1]
        else:
            match = [s for s in steps if s.step_number == number]
            if not match:
                raise FsError(errno.ENOENT, f"the backup tier has no complete checkpoint {number}")
            info = match[-1]
        if info.step in fs.steps:
            return {"step": info.step, "imported": False}
        manifest = await trio.to_thread.run_sync(bs.get_step, info.step)
        self._check_space(manifest, check_space)
        fs.import_step(manifest)
        self.info = {"step": info.step, "bytes": manifest.total_bytes,
                     "namespace_seconds": time.monotonic() - t0, "started": time.time()}
        log.info("restored namespace of %s (%d bytes) from %s", info.step,
                 manifest.total_bytes, self.backup_url)
        if self.prefetcher is not None:
            self.prefetcher.kick()
        return {"step": info.step, "imported": True, "bytes": manifest.total_bytes,
                "source": "backup"}

    def _check_space(self, manifest: StepManifest, check: bool) -> None:
        free = self.fs.statfs()["free"]
        if check and manifest.total_bytes > free:
            raise FsError(errno.ENOSPC, f"step {manifest.step} holds {manifest.total_bytes} "
                          f"bytes but the RAM tier has {free} free (size="
                          f"{self.fs.capacity}); mount with a larger size=")
