"""The composition root of one mount: build everything, run it, tear it down.

Everything is built here and nowhere else: the store, the filesystem core, the backup tier
and its policy, restore, the control socket and the pyfuse3 session. One trio run holds
them all in one nursery; SIGTERM/SIGINT or an unmount ends it.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

import pyfuse3
import trio

from mtcfs.base import background, pools, untrusted
from mtcfs import control
from mtcfs.base.errors import FsError
from mtcfs.core.core import Filesystem
from mtcfs.core.passthrough import Passthrough, why_unavailable
from mtcfs.core.step_registry import backup_lag
from mtcfs.flush import FlushReport, load_report, save_report
from mtcfs.flush import flush as flush_at_stop
from mtcfs.fuse_ops import Operations, libfuse_version
from mtcfs.base.mountinfo import device_of
from mtcfs.base.token_bucket import TokenBucket
from mtcfs.options import MountOptions, plaintext_parts
from mtcfs.sdnotify import Notifier
from mtcfs.core.store import Store, check_size, datafs, filesystem_warning
from mtcfs.tiers.restore.restorer import Restorer

log = logging.getLogger(__name__)

#: Read-ahead for the mount's backing device info, in KiB: lets the kernel send 1 MiB read
#: requests instead of 128 KiB ones (library-fs-ops.md: cold reads ~35% faster).
READ_AHEAD_KB = 4096
#: Seconds a metrics scrape waits for the trio loop to read the status (then mtcfs_up 0).
METRICS_STATUS_S = 5.0


def default_capacity(store_path: str) -> int:
    """Half of the filesystem the store lives on (tmpfs under /dev/shm by default; the store
    directory's, not its data tmpfs's: the store may not exist yet, then its nearest parent
    that does)."""
    p = os.path.abspath(store_path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    st = os.statvfs(p)
    return st.f_blocks * st.f_frsize // 2


def etcd_client(o: MountOptions) -> Any:
    """The job's etcd client from the mount options: ``coord=`` endpoints, a deadline of
    at most ``coord_timeout`` per call, TLS when ``coord_ca=`` is given (with the client
    certificate of ``coord_cert=``/``coord_key=``).

    Raises:
        OSError: a TLS file cannot be read (it was readable when the options were parsed).
    """
    from mtcfs.tiers.coord.etcd import CALL_TIMEOUT_S, Etcd, EtcdTls
    assert o.coord, "the options checked that coord= is given"
    tls = EtcdTls(o.coord_ca, o.coord_cert, o.coord_key) if o.coord_ca else None
    return Etcd(o.coord, timeout_s=min(CALL_TIMEOUT_S, o.coord_timeout), tls=tls)


class Daemon:
    """One mount: ``mtcfs SOURCE MOUNTPOINT -o ...``.

    Args:
        opts: validated mount options.
    """

    def __init__(self, opts: MountOptions) -> None:
        self.opts = opts
        self.store: Store | None = None
        self.fs: Filesystem | None = None
        #: The FUSE adapter, once the mount is being served (its direct writes are in status).
        self.ops: Operations | None = None
        #: FUSE passthrough: which opens the kernel serves itself (built with the core).
        self.passthrough = Passthrough(False)
        self.backup_store: Any = None
        self.backup: Any = None
        #: ``daemon_nice=``: the daemon's autogroup as status shows it.
        self.group_nice = ""
        #: ``backup_rate=``: the bytes per second of the backup tier's uploads.
        self.backup_budget = TokenBucket(0)
        self.prefetcher: Any = None
        self.peer: Any = None
        self.restorer: Restorer | None = None
        #: The flush at a SIGTERM (mtcfs/flush.py): None until one starts.
        self.flush_state: dict[str, Any] | None = None
        #: The previous daemon's flush at its stop, from the store (None: none recorded).
        self.last_stop: dict[str, Any] | None = None
        #: The stop signal the daemon got (SIGTERM, SIGINT, SIGHUP), if any: it unmounts.
        self._stop_signal: int | None = None
        self._nursery: trio.Nursery | None = None
        self.started = time.time()
        self.ns: Any = None  # scope=job: the job's namespace log
        self.etcd: Any = None  # coord=etcd: the job's etcd client
        self.mtc: Any = None  # option mtc: Orbax's replicator protocol on the root
        #: The store's filesystem: {"type", "mount", "warning"} (warning None on tmpfs).
        self.store_fs: dict[str, Any] = {}
        #: systemd's notification socket (sdnotify.py): READY=1 once served, STOPPING=1.
        self.notifier = Notifier()
        #: metrics=: prometheus-client's HTTP server (metrics.py), or None.
        self.metrics_server: Any = None
        #: The trio loop's token while it serves (threads hand it work: the metrics scrape).
        self._trio_token: trio.lowlevel.TrioToken | None = None

    # ------------------------------------------------------------------ building

    def build(self) -> None:
        """Open the store and build the core and backup tier (no mount yet).

        Raises:
            StoreError, ValueError: the store or backup URL cannot be used.
        """
        o = self.opts
        # Before any background thread starts (base/background.py).
        background.configure(o.cpu_policy)
        self.group_nice = background.set_group_nice(o.daemon_nice)
        rates = "".join(f", {what} at most {rate} B/s" for what, rate in (
            ("replication", o.replicate_rate), ("backup", o.backup_rate if o.backup else 0))
            if rate)
        log.info("background work: %s, %d hashing thread(s)%s; the daemon: %s",
                 o.cpu_policy.describe(), o.hash_threads, rates, self.group_nice)
        self.backup_budget = TokenBucket(o.backup_rate)
        check_size(o.store, o.size)  # also checked by the CLI, with the option as given
        # Before the store: its data directory's own tmpfs is sized from it (datafs.py).
        capacity = o.size or default_capacity(o.store)
        self.store = Store(o.store, o.job, o.chunk_size, mountpoint=o.mountpoint,
                           data_size=datafs.tmpfs_size(capacity, o.chunk_size))
        self.store_fs = filesystem_warning(self.store.path)
        self.last_stop = load_report(self.store.path)
        if self.last_stop is not None and not self.last_stop.get("complete"):
            log.warning("the last stop did not flush %s to the other tiers: %s",
                        self.last_stop.get("step"), "; ".join(
                            str(m) for m in self.last_stop.get("missing") or []))
        if self.store_fs["warning"]:
            log.warning("%s", self.store_fs["warning"])
        self.passthrough = Passthrough(o.passthrough)
        self.passthrough.refuse(why_unavailable(self.store.data_dir,
                                                hasattr(pyfuse3, "session_fileno")))
        if self.store.data_limit is None:
            # The kernel writes a passed-through file without asking the daemon: size= must
            # then be the data directory's own limit (docs/passthrough.md, "Capacity").
            self.passthrough.refuse("the store's data directory has no size limit of its own "
                                    "(not on tmpfs, or its tmpfs could not be mounted): "
                                    "size= is kept by the daemon")
        self.fs = Filesystem(self.store, capacity=capacity, keep=o.keep,
                             chunk_size=o.chunk_size, job=o.job, rank=o.rank,
                             passthrough=self.passthrough)
        self.fs.fetcher.fetch_deadline_s = o.read_timeout
        self.fs.verifier.interval_s, self.fs.verifier.rate = o.scrub_interval, o.scrub_rate
        self.fs.open_files.hash_threads = self.fs.verifier.threads = o.hash_threads
        # docs/usage.md, Capacity: with a backup tier, a checkpoint awaiting its backup is
        # never deleted to make room (the write gets ENOSPC) unless evict_unsaved=yes.
        self.fs.eviction.evict_unsaved = o.evict_unsaved if o.evict_unsaved is not None \
            else not o.backup
        sources: list[tuple[str, Any]] = []
        if o.multi_node:
            sources.append(("peers", self._build_peer()))
        if o.backup:
            backup = self._build_backup()
            if self.peer is not None and self.peer.twins():
                from mtcfs.tiers.peer.sources import TwinWait
                sources.append(("twins", TwinWait(self.peer.lower_live_twins,
                                                  self.peer.fetch_client)))
            sources.append(("backup", backup))
        if sources:
            from mtcfs.tiers.peer.sources import TieredChunkSource
            from mtcfs.tiers.restore.from_backup import Prefetcher
            self.fs.fetcher.chunk_source = sources[0][1] if len(sources) == 1 and not o.multi_node \
                else TieredChunkSource(sources)
            self.prefetcher = Prefetcher(self.fs.tier_api)
        served = getattr(self.fs.fetcher.chunk_source, "served", None)

        def peer_chunk() -> None:  # counted as the chunk sources count (status)
            if served is not None:
                served["peers"] = served.get("peers", 0) + 1
        self.restorer = Restorer(self.fs.tier_api, rank=o.rank, nodes=o.nodes, restore=o.restore,
                                 backup_url=o.backup, backup_store=self.backup_store,
                                 peer=self.peer, prefetcher=self.prefetcher, ns=self.ns,
                                 mtc=o.mtc, on_peer_chunk=peer_chunk)
        if o.mtc:
            self._build_mtc()
        if o.metrics:
            self._serve_metrics(o.metrics)

    def _serve_metrics(self, address: str) -> None:
        """``metrics=HOST:PORT``: prometheus-client's HTTP server on its own thread; each
        scrape reads :meth:`status` on the trio loop (the only thread that may read the
        core), waiting at most METRICS_STATUS_S for it (else ``mtcfs_up 0``).

        Raises:
            ValueError: the address cannot be bound (one line: the option and why).
        """
        from mtcfs.metrics import serve

        def fetch() -> dict[str, Any]:
            token = self._trio_token
            if token is None:
                raise RuntimeError("the mount is not served yet")
            done = threading.Event()
            box: list[Any] = []

            def read() -> None:
                try:
                    box.append(self.status())
                except Exception as exc:  # noqa: BLE001 (handed to the scrape)
                    box.append(exc)
                done.set()
            token.run_sync_soon(read)
            if not done.wait(METRICS_STATUS_S):
                raise TimeoutError(f"the daemon's loop did not answer within "
                                   f"{METRICS_STATUS_S:g} s")
            if isinstance(box[0], Exception):
                raise box[0]
            return dict(box[0])
        try:
            self.metrics_server, _ = serve(address, fetch)
        except OSError as exc:
            raise ValueError(f"bad option metrics={address}: cannot listen there: "
                             f"{exc.strerror or exc}") from None
        log.info("Prometheus metrics at http://%s/metrics", address)

    def _build_mtc(self) -> None:
        """Option ``mtc``: this mount is the node's replicator for Orbax."""
        from mtcfs.tiers.mtc.replicator import MtcReplicator
        o = self.opts
        rounds = None
        if self.peer is not None:
            from mtcfs.tiers.coord.rounds import RestoreRounds
            rounds = RestoreRounds(self.etcd, self._coord_prefix(), o.rank, o.nodes)
        self.mtc = MtcReplicator(
            self.fs.tier_api, rank=o.rank, nodes=o.nodes, job=o.job,
            jax_coordinator=o.jax_coordinator or self._jax_coordinator(o.peer_address(0)),
            peer=self.peer, backup_store=self.backup_store, backup_service=self.backup,
            fetch_step=self._mtc_fetch, kick_prefetch=self.restorer.kick_prefetch,
            rounds=rounds)

    @staticmethod
    def _jax_coordinator(rank0: str | None) -> str:
        """The JAX coordinator written to jax-init-info.txt: rank 0's host, port 8476."""
        host = rank0.rsplit(":", 1)[0] if rank0 else "127.0.0.1"
        return f"{'127.0.0.1' if host in ('0.0.0.0', '[::]', '') else host}:8476"

    async def _learn_jax_coordinator(self) -> None:
        """Option mtc without jax_coordinator= or peers=: rank 0's host from its record in
        etcd (waits up to ``coord_timeout`` for rank 0 to register; else 127.0.0.1)."""
        o = self.opts
        if self.mtc is None or self.peer is None or o.jax_coordinator or o.peers:
            return
        if await self.peer.wait_for_members([0], o.coord_timeout):
            log.warning("rank 0 did not register within %g s: jax-init-info.txt names %s",
                        o.coord_timeout, self.mtc.jax_coordinator)
            return
        self.mtc.jax_coordinator = self._jax_coordinator(self.peer.addresses.get(0))

    def _coord_prefix(self) -> str:
        return self.opts.coord_prefix or f"/mtcfs/{self.opts.job}/"

    async def _mtc_fetch(self, number: int) -> dict[str, Any]:
        """Import this rank's step ``number`` from the peers or the backup tier."""
        assert self.restorer is not None
        return await self.restorer.restore(number, check_space=True)

    async def _seed_job_namespace(self) -> None:
        """scope=job's seed hook (the job's etcd keyspace is empty): restore the namespace
        from the backup tier (Restorer.job_namespace_from_backup)."""
        assert self.restorer is not None
        await self.restorer.job_namespace_from_backup()

    def _peer_tls(self) -> Any:
        """The peer tier's TLS files (checked for this rank), or None with ``insecure``, which
        is logged as a warning at every start.

        Raises:
            TlsError (a ValueError): the files do not make this rank's identity.
        """
        from mtcfs.tiers.peer.tls import TlsFiles
        o = self.opts
        plain = plaintext_parts(o)
        if plain:
            log.warning("option insecure: %s is PLAINTEXT and unauthenticated: anyone who "
                        "reaches it can read and change this job's checkpoints "
                        "(docs/security.md)", " and ".join(plain))
        if not o.tls_ca:
            return None
        assert o.tls_cert and o.tls_key
        tls = TlsFiles(o.tls_ca, o.tls_cert, o.tls_key)
        tls.check_for(o.job, o.rank)
        return tls

    def _build_peer(self) -> Any:
        """The peer tier (``nodes`` > 1); returns its chunk source."""
        from mtcfs.tiers.peer.sources import PeerChunkSource
        from mtcfs.tiers.peer.tier import PeerTier, TierConfig
        o = self.opts
        assert self.fs is not None and self.store is not None
        assert o.coord, "nodes > 1 needs coord= (checked by the options)"
        addresses = dict(enumerate(o.peers or []))
        self.etcd = etcd_client(o)
        cfg = TierConfig(job=o.job, rank=o.rank, nodes=o.nodes, listen=o.listen or "",
                         addresses=addresses, replicas=o.replicas, placement=o.placement,
                         labels=dict(o.topology), data_parallelism=o.assume_data_parallelism or 1,
                         huge_model=o.huge_model, keep=o.keep, tls=self._peer_tls(),
                         replica_quota=o.replica_quota, stream_port=o.stream_port,
                         replicate_rate=o.replicate_rate)
        peer = self.peer = PeerTier(self.fs.tier_api, cfg, self.store.path, etcd=self.etcd,
                                    prefix=self._coord_prefix())
        # The replicas share the RAM budget with this node's own files, and they count on
        # this node's copies of chunks it holds for others.
        replicas = peer.replica_store
        self.fs.budget.shared_used = lambda: replicas.used_estimate
        self.fs.vstore.chunk_keeper = replicas
        if o.scope == "job":
            from mtcfs.tiers.namespace.etcd_log import EtcdNamespace
            from mtcfs.tiers.namespace.sources import JobChunkSource
            self.ns = self.fs.ns_log = EtcdNamespace(
                self.fs.tier_api, self.etcd, self._coord_prefix(), o.rank,
                seed=self._seed_job_namespace,
                timeout_s=o.coord_timeout, nodes=o.nodes)
            return JobChunkSource(self.fs.tier_api, peer)
        return PeerChunkSource(lambda: peer.restore_holders or peer.peer_ranks(),
                               peer.fetch_client, peer.report_bad, others=peer.other_ranks)

    def _build_backup(self) -> Any:
        """The backup tier and its policy (``backup=``); returns its chunk source."""
        from mtcfs.tiers.backup import BackupStore, RetryingBackend, RetryPolicy, open_backend
        from mtcfs.tiers.restore.from_backup import BackupChunkSource
        from mtcfs.tiers.backup.scheduler import BackupService
        o = self.opts
        # The deadline bounds every backend call, retries included: a sweep's delete stuck in
        # retries is the one window the sweep gate of a multi-node bucket leaves (backup/gate.py).
        backend = RetryingBackend(open_backend(o.backup),
                                  RetryPolicy(max_attempts=8, base_delay=0.2, max_delay=20.0,
                                              deadline=120.0))
        if o.multi_node:
            # uploads and chunk sweeps of the job's nodes agree through etcd
            from mtcfs.tiers.coord.backup_gate import EtcdSweepGate
            assert self.etcd is not None, "built with the peer tier (nodes > 1 needs coord=)"
            gate = EtcdSweepGate(self.etcd, self._coord_prefix() + "backup/",
                                 owner=f"rank {o.rank}")
            self.backup_store = BackupStore(backend, rank=o.rank, world_size=o.nodes,
                                            gate=gate, workers=o.backup_threads,
                                            budget=self.backup_budget)
        else:
            self.backup_store = BackupStore(backend, workers=o.backup_threads,
                                            budget=self.backup_budget)
        source = BackupChunkSource(self.backup_store)
        share, twins = None, None
        if self.peer is not None:
            self.peer.backup_store = self.backup_store
            share = self.peer.upload_share()
            twins = self.peer.twins

        iv = o.backup_interval
        self.backup = BackupService(self.fs.tier_api, self.backup_store, interval_s=iv.seconds,
                                    every_ckpts=iv.checkpoints, keep_backups=o.backup_keep,
                                    url=o.backup, interval_text=str(iv), share=share,
                                    twins=twins, budget=self.backup_budget)
        return source

    # ------------------------------------------------------------------ running

    def fuse_options(self) -> set[str]:
        """The options of the FUSE mount (a set of ``name`` or ``name=value`` strings).

        ``default_permissions`` always (pyfuse3's default, kept explicitly): the kernel
        checks every access against the modes and owners mtcfs reports, so with
        ``allow_other`` another user gets what the file modes allow and no more
        (docs/security-local.md).
        """
        o = self.opts
        opts = set(pyfuse3.default_options)
        opts.add("default_permissions")
        opts.add(f"fsname={o.job}")
        opts.add("subtype=mtcfs")
        if o.allow_other:
            opts.add("allow_other")
        if o.read_only:
            opts.add("ro")
        return opts

    async def run(self, ready: Callable[[], None]) -> None:
        """Mount, call ``ready()``, and serve until unmounted or signalled."""
        assert self.fs is not None and self.store is not None
        self.notifier.status(f"mounting {self.opts.mountpoint}")
        self._trio_token = trio.lowlevel.current_trio_token()
        if self.peer is not None:
            token = trio.lowlevel.current_trio_token()
            self.peer.start_server(token)
        try:
            await self._run(ready)
        finally:
            if self.peer is not None:
                self.peer.stop()
                self.peer.leave_job_sync()  # the others see this node gone at once
            self._trio_token = None
            if self.metrics_server is not None:
                self.metrics_server.shutdown()
                self.metrics_server.server_close()
            if self.etcd is not None:
                self.etcd.close()
            pools.shutdown(block=False)  # idle pool threads end; queued work is dropped

    async def _run(self, ready: Callable[[], None]) -> None:
        assert self.fs is not None and self.store is not None and self.restorer is not None
        if self.peer is not None:
            # registered in etcd (retried later if etcd is down; refused by etcd's auth:
            # the mount fails, with the job's prefix in the one-line error)
            await self.peer.join_job(at_mount=True)
            await self._learn_jax_coordinator()
        if self.ns is not None:
            await self.ns.join()  # the job's namespace, before the kernel sees any of it
        else:
            await self.restorer.at_mount()
        # Signals are caught from the moment the mount exists: a SIGTERM before the serving
        # loop ran (systemctl stop at once) killed the daemon by default and left a dead
        # mount (ENOTCONN) behind. Those that arrive meanwhile wait in the receiver.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            ops = Operations(self.fs, self.opts.mountpoint, self.opts.direct_writes,
                             self.passthrough)
            self.ops = ops
            pyfuse3.init(ops, self.opts.mountpoint, self.fuse_options())
            mounted = True
            closed = False
            try:
                async with trio.open_nursery() as n:
                    self._nursery = n
                    self.restorer.start_soon = n.start_soon
                    n.start_soon(self._tune_readahead, ops)
                    self.fs.start(n)
                    if self.mtc is not None:
                        # Before the kernel's first request is served (they queue until
                        # pyfuse3.main runs), so the trainer never sees the root without it.
                        await self.mtc.write_init_info()
                    if self.opts.test_faults:
                        log.warning("test_faults: the control socket accepts fault injection "
                                    "(a test option; never use it in production)")
                    await n.start(control.serve, self.store.control_socket, self.handle)
                    n.start_soon(self._signals, sigs)
                    n.start_soon(self.fs.verifier.loop)
                    if self.backup is not None:
                        n.start_soon(self.backup.run)
                    if self.prefetcher is not None:
                        n.start_soon(self.prefetcher.run)
                    if self.peer is not None:
                        n.start_soon(self.peer.run)
                    if self.ns is not None:
                        n.start_soon(self.ns.run)
                    if self.restorer.bulk_pending:
                        n.start_soon(self.restorer.bulk_from_peers)
                    if self.mtc is not None:
                        n.start_soon(self.mtc.run)
                    ready()
                    o = self.opts
                    self.notifier.ready(f"serving job {o.job} rank {o.rank} at {o.mountpoint}")
                    await pyfuse3.main()
                    self.notifier.stopping()
                    mounted = False
                    if self._stop_signal is not None:
                        # Unmount now, not after the nursery ends: a seal hashing a large file
                        # in a thread may hold it for minutes, the mount unserved meanwhile.
                        pyfuse3.close(unmount=True)
                        closed = True
                    n.cancel_scope.cancel()
            finally:
                # Unmounted by the kernel (umount): nothing left to do; stopped by a signal
                # (pyfuse3.terminate) or an error: unmount, never leave a dead connection behind.
                if not closed:
                    pyfuse3.close(unmount=mounted or self._stop_signal is not None)
                self._nursery = None
                self.restorer.start_soon = None
                if self.peer is not None:  # no gRPC thread may touch the core once it is closed
                    self.peer.stop()
                # Clean only once pyfuse3.main returned (unmounted, or a stop signal): an
                # exception out of the serving loop is recorded as a crash.
                self.fs.close(clean=not mounted)
                self.store.close()

    async def _signals(self, sigs: AsyncIterator[int]) -> None:
        flushing: trio.CancelScope | None = None
        async for sig in sigs:
            if sig == signal.SIGTERM and flushing is None and self.opts.stop_flush > 0 \
                    and self._nursery is not None:
                # The node is going away: first the newest step to the tiers that outlive
                # it (mtcfs/flush.py), the mount still served; then the unmount.
                flushing = trio.CancelScope()
                self._nursery.start_soon(self._flush_then_stop, sig, flushing)
                continue
            if flushing is not None:
                log.info("signal %d during the flush at stop: unmounting now", sig)
                flushing.cancel()
            self._stop(sig)

    def _stop(self, sig: int) -> None:
        log.info("signal %d: unmounting", sig)
        self.notifier.stopping(f"signal {sig}: unmounting")
        self._stop_signal = sig
        pyfuse3.terminate()  # (after init: before main, main returns at once)

    async def _flush_then_stop(self, sig: int, scope: trio.CancelScope) -> None:
        log.info("signal %d: flushing the newest step to the other tiers (at most %g s)",
                 sig, self.opts.stop_flush)
        self.notifier.stopping(f"signal {sig}: flushing the newest step, then unmounting")
        with scope:
            await self.flush(self.opts.stop_flush)
        if scope.cancelled_caught:  # cut short by a second signal
            self._end_flush(FlushReport(step="?", complete=False,
                                        missing=["cut short by a second signal"]))
        if self._stop_signal is None:
            self._stop(sig)

    async def flush(self, deadline_s: float) -> FlushReport:
        """The flush at a stop (mtcfs/flush.py), at most ``deadline_s`` seconds: logged,
        recorded in the store for the next start, shown by status meanwhile."""
        assert self.fs is not None
        self.flush_state = {"running": True, "deadline_s": deadline_s}
        peer = self.peer
        report = await flush_at_stop(
            self.fs, replicas=None if peer is None else lambda: len(peer.peer_ranks()),
            backup=self.backup, deadline_s=deadline_s)
        self._end_flush(report)
        return report

    def _end_flush(self, report: FlushReport) -> None:
        assert self.store is not None
        (log.info if report.complete else log.warning)("%s", report.line())
        save_report(self.store.path, report)
        self.flush_state = {"running": False, **asdict(report)}

    async def _tune_readahead(self, ops: Operations) -> None:
        # The kernel sets the mount's read-ahead when it processes the INIT reply (capped
        # at the value then in force), so raise it only after INIT. Not via
        # os.stat(mountpoint), which would send a request to this very daemon:
        # /proc/self/mountinfo has the device number.
        while not ops.initialized:
            await trio.sleep(0.01)
        await trio.sleep(0.05)
        try:
            dev = device_of(self.opts.mountpoint)
            if dev is None:
                return
            path = f"/sys/class/bdi/{dev}/read_ahead_kb"
            with open(path, "w") as f:
                f.write(str(READ_AHEAD_KB))
        except OSError as exc:  # not root, or no sysfs: keep the kernel default
            log.debug("cannot raise read-ahead: %s", exc)

    # ------------------------------------------------------------------ control requests

    async def handle(self, req: dict[str, Any], progress: control.Progress) -> Any:
        cmd = req["cmd"]
        fs = self.fs
        assert fs is not None
        if cmd == "status":
            return self.status()
        if cmd == "checkpoints":
            return await self.checkpoints()
        if cmd == "seal":
            rec = fs.step_registry.seal(str(req.get("path", "")))
            return {"step": rec.name, "number": rec.number}
        if cmd == "gc":
            evicted = fs.evict()
            swept = None
            if self.backup_store is not None:
                stats = await trio.to_thread.run_sync(self.backup_store.retain,
                                                      self.opts.backup_keep)
                kept = await trio.to_thread.run_sync(self.backup_store.list_steps)
                evicted += fs.step_registry.retired({s.step for s in kept})
                swept = getattr(stats, "__dict__", stats)
            return {"evicted": evicted, "backup_retention": swept}
        if cmd == "verify":
            tp = trio.lowlevel.current_trio_token()

            def prog(done: int, total: int) -> None:
                trio.from_thread.run_sync(progress, done, total, trio_token=tp)
            bad = await fs.checkpoints.verify(prog)
            for msg in bad:
                fs.report_error(f"verify: {msg}")
            return {"mismatches": bad}
        if cmd == "restore":
            step = req.get("step")
            number = int(step) if step is not None else None
            res = await self.restorer.restore(number)
            if req.get("wait", True):
                await self.restorer.wait_restored(progress)
            return res
        if cmd == "fault":
            # Test hook: cut this node off from the given ranks, both ways, as a network
            # partition would (``partition=[]`` heals it). Only with the test_faults option.
            if not self.opts.test_faults:
                raise FsError(errno.EPERM, "the fault command is a test hook: this daemon "
                              "was not started with the test_faults option")
            if self.peer is None:
                raise FsError(errno.EINVAL, "not a multi-node mount")
            self.peer.partitioned.clear()
            self.peer.partitioned.update(int(r) for r in req.get("partition", []))
            return {"partitioned": sorted(self.peer.partitioned)}
        if cmd == "flush":  # mtcfs umount --flush: what a SIGTERM does before its unmount
            deadline = float(req.get("deadline_s", self.opts.stop_flush))
            return asdict(await self.flush(max(0.0, min(deadline, 3600.0))))
        if cmd == "backup":
            if self.backup is None:
                raise FsError(errno.EINVAL, "no backup= tier configured")
            await self.backup.request(req.get("step"))
            return self.backup.status.to_json()
        raise FsError(errno.EINVAL, f"unknown command {cmd!r}")

    def status(self) -> dict[str, Any]:
        fs = self.fs
        assert fs is not None
        o = self.opts
        s = fs.statfs()
        out: dict[str, Any] = {
            "job": o.job, "node": socket.gethostname(),
            "mountpoint": os.path.abspath(o.mountpoint), "store": o.store,
            "pid": os.getpid(), "uptime_s": round(time.time() - self.started, 1),
            "chunk_size": o.chunk_size, "hash_threads": o.hash_threads, "keep": o.keep,
            "fuse": {"libfuse": libfuse_version(), "killpriv_v2": fs.kills_suidgid,
                     **(self.ops.direct.status() if self.ops else {"direct_writes": False}),
                     **self.passthrough.status()},
            "ram": {"capacity": s["capacity"], "used": s["used"], "free": s["free"],
                    "files": s["files"], "checkpoints": len(fs.steps),
                    "evict_unsaved": fs.eviction.evict_unsaved,
                    "deleted_unsaved": list(fs.eviction.unsaved_deleted)},
            "counters": {k: v for k, v in vars(fs.counters).items() if isinstance(v, int)},
            "histograms": {"seal_seconds": fs.counters.seal_seconds.snapshot()},
            "fds": {"open": len(fs.fds), "limit": fs.fds.limit, "opens": fs.fds.opens,
                    "evictions": fs.fds.evictions},  # data file descriptors (fdcache.py)
            "errors": list(fs.errors),
            "rejected_records": untrusted.REJECTED.snapshot(),
            "restarted_loops": untrusted.RESTARTS.snapshot(),
            "reads": {"deadline_s": fs.fetcher.fetch_deadline_s, "failed": fs.counters.fault_errors,
                      "last_failure": fs.fetcher.last_fault_error,
                      "suspect_peers": list(getattr(self._peer_source(), "suspects",
                                                    list)())},
            "backup": None, "restore": None,
            "store_fs": {**self.store_fs, "data_tmpfs": self._data_tmpfs()},
            "scrub": {**fs.verifier.state, "interval_s": fs.verifier.interval_s,
                      "rate": fs.verifier.rate, "corrupt_chunks": fs.counters.corrupt_chunks,
                      "unverified_chunks": fs.verifier.unverified_chunks()},
            "budget": self._budget(),
        }
        if self.backup is not None:
            b = self.backup.status.to_json()
            b["store"] = self.backup_store.stats()
            b["lag_steps"], b["lag_seconds"] = backup_lag(fs.steps.values(), time.time_ns())
            out["backup"] = b
        if self.prefetcher is not None:
            chunks, nbytes = self.prefetcher.pending()
            info = self.restorer.info if self.restorer is not None else {}
            out["restore"] = {**info, "pending_chunks": chunks,
                              "pending_bytes": nbytes,
                              "pending_files": len({v.vid for v, _ in fs.chunks.pending()}),
                              "files": self._files_of_step(info.get("step")),
                              "corrupt_chunks": getattr(fs.fetcher.chunk_source, "corrupt", 0),
                              "chunks_from": dict(getattr(fs.fetcher.chunk_source, "served", {}))}
        out["peers"] = self.peer.status() if self.peer is not None else None
        out["stop_flush"] = {"deadline_s": o.stop_flush, "now": self.flush_state,
                             "last_stop": self.last_stop}
        out["scope"] = self.opts.scope
        if self.ns is not None:
            out["namespace"] = self.ns.status()
        if self.mtc is not None:
            out["mtc"] = self.mtc.status()
        return out

    def _budget(self) -> dict[str, Any]:
        """What the background budget is and what it held back (docs/usage.md,
        "Background work"): ``cpu`` (base/background.py ``stats``), ``hash_threads``,
        ``backup_threads``, and per tier (``peers``, ``backup``; None without the tier)
        ``rate`` (bytes/s, 0: unbounded), ``bytes`` sent under it, ``waited_s``."""
        o = self.opts
        return {"cpu": background.stats(), "daemon_group": self.group_nice,
                "hash_threads": o.hash_threads,
                "backup_threads": o.backup_threads if o.backup else None,
                "peers": self.peer.send_budget.figures() if self.peer is not None else None,
                "backup": self.backup_budget.figures() if o.backup else None}

    def _data_tmpfs(self) -> dict[str, Any] | None:
        """The data directory's own tmpfs: {"path", "size", "used"} (bytes, statfs), or
        None when the store has none (datafs.py)."""
        st = self.store
        usage = st.data_usage() if st is not None else None
        if st is None or usage is None:
            return None
        return {"path": st.data_dir, "size": usage[0], "used": usage[1]}

    def _files_of_step(self, step: object) -> int | None:
        """Files in committed step ``step`` on this node (None: no such step here)."""
        fs = self.fs
        rec = fs.steps.get(step) if fs is not None and isinstance(step, str) else None
        if fs is None or rec is None or rec.ino not in fs.inodes:
            return None
        return sum(1 for _p, ino in fs.tree.walk(fs.inodes[rec.ino]) if ino.is_file)

    def _peer_source(self) -> Any:
        """The chunk source that asks peers (for its suspects), or None."""
        src = self.fs.fetcher.chunk_source if self.fs is not None else None
        for _name, s in getattr(src, "sources", [("", src)]):
            if hasattr(s, "suspects"):
                return s
        return None

    async def checkpoints(self) -> list[dict[str, Any]]:
        fs = self.fs
        assert fs is not None
        rows: dict[str, dict[str, Any]] = {}
        for rec in fs.steps.values():
            files = size = local = 0
            for _p, ino in fs.tree.walk(fs.inodes[rec.ino]):
                if ino.is_file:
                    v = fs.versions[ino.vid]
                    files += 1
                    size += v.size
                    local += v.local_bytes()
            ram = "complete" if local == size else ("evicted" if local == 0 else "partial")
            backup = "complete" if rec.backed_up_ns is not None else (
                "uploading" if rec.backing_up else ("-" if self.backup is None else "pending"))
            peers = f"{rec.replicated}/{rec.replicas or len(self.peer.peer_ranks())}" \
                if self.peer is not None else "-"
            rows[rec.name] = {"step": rec.name, "number": rec.number, "files": files,
                              "bytes": size, "ram": ram, "peers": peers, "backup": backup,
                              "committed_by": rec.source,
                              "committed": rec.committed_ns / 1e9}
        if self.backup_store is not None:
            try:
                remote = await trio.to_thread.run_sync(self.backup_store.list_steps)
            except Exception as exc:
                log.warning("cannot list the backup tier: %s", exc)
                remote = []
            for info in remote:
                row = rows.get(info.step)
                if row is None:
                    rows[info.step] = {"step": info.step, "number": info.step_number,
                                       "files": None, "bytes": info.total_bytes, "ram": "-",
                                       "peers": "-",
                                       "backup": "complete", "committed_by": "backup",
                                       "committed": info.created_ns / 1e9}
                else:
                    row["backup"] = "complete"
        return sorted(rows.values(), key=lambda r: (r["number"], r["step"]))
