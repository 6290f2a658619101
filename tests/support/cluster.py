"""Several mtcfs mounts on one machine, one per rank of a job, peering over loopback TCP.

Each rank gets its own directory ``root/n<rank>`` (``store/``, ``mnt/``), its own Peer port on
127.0.0.1, and the options ``rank=R,nodes=N,peers=<every rank's address>,listen=<its own>``
and ``coord=`` (the process's shared etcd, tests/support/etcd.py) with a prefix of its own,
on top of the shared ``options`` and its ``per_rank_options``. A rank can be crashed
(``kill9``), lose its RAM tier (``wipe``) and come back (``restart``, or ``restart_many``
for several at once) on the same address.

Tests get one from the ``make_cluster(nodes, **Cluster kwargs)`` fixture in
``tests/conftest.py``, which cleans every cluster up::

    def test_replica_survives_a_crash(make_cluster):
        c = make_cluster(2, options={"replicas": 1})
        d = c.node(0).path("step_10")
        d.mkdir()
        (d / "w.bin").write_bytes(b"x" * 100_000)
        (d / "commit_success.txt").write_bytes(b"ok")      # commits step_10
        c.wait_replicated(0, "step_10")                     # "replicated 1/1"
        c.kill9(0)
        c.restart(0, wipe=True)                             # restores from rank 1

or without a fixture: ``c = Cluster(tmp, 2); try: c.start(); ... finally: c.cleanup()``.

Ports come from :func:`support.ports.free_ports`: a block of ports below the kernel's
ephemeral range that this test process alone hands out, so a parallel test (another
pytest-xdist worker) cannot take a port between its pick and the daemon's bind, nor while
a killed rank is down.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Self

from mtcfs import control
from mtcfs.tiers.peer.tls import TlsFiles

from .fabric import Fabric
from .mount import Mount, force_unmount, unmount_below
from .pki import Issued, TestCa
from .ports import free_ports  # noqa: F401 (re-exported: tests import it from here)

#: the Peer port of every rank of a cluster on a :class:`Fabric` (each has its own address)
FABRIC_PORT = 7400
_REPLICATED = re.compile(r"^replicated (\d+)/(\d+)$")


def _opt(v: object) -> str | None:
    """Option values as Mount takes them: True -> a bare flag, anything else -> str."""
    return None if v is True else str(v)


class Cluster:
    """``nodes`` mtcfs mounts of one job, ranks 0..nodes-1, each a :class:`Mount`.

    Args:
        root: a per-test directory (on tmpfs: the stores live below it).
        nodes: number of ranks.
        job: job name, the same for every rank.
        options: ``-o`` options for every rank (``replicas``, ``placement``, ``backup``, ...).
        per_rank_options: rank -> options that override ``options`` for that rank
            (``topology``, a different ``size``, ...).
        coord_for_rank: rank -> that rank's ``coord=`` URL (each node reaches etcd through
            its own address: ``EtcdCluster(netns_clients=...).client_url``); the cluster's
            ``coord_prefix`` goes with it. None: ``options``' ``coord``, or for scope=job
            the process's shared etcd.
        tls: (nodes > 1) the peers speak mutual TLS with certificates of a CA made for this
            cluster (``tls_ca=``, ``tls_cert=``, ``tls_key=``); False: option ``insecure``.
        test_faults: mount every rank with the ``test_faults`` option, which lets
            :meth:`partition` cut the network through the daemon's ``fault`` control hook
            (a test option: production units never set it, docs/security-local.md).
        own_prefix: give ``coord_prefix=`` a prefix of this cluster's own (a shared etcd);
            False: none unless ``options`` says, so the daemons use their default,
            ``/mtcfs/<job>/`` (an etcd of the test's own, as a user's job would).
        fabric: run rank r in network namespace r of this :class:`Fabric` (its own
            address, :data:`FABRIC_PORT`); ``coord=`` must then name an etcd the fabric's
            nodes reach (on :attr:`Fabric.gateway`).

    Nothing runs until :meth:`start`. Always call :meth:`cleanup` (it never raises).
    """

    def __init__(self, root: Path, nodes: int, job: str = "testjob",
                 options: dict | None = None,
                 per_rank_options: dict[int, dict] | None = None,
                 learn_addresses: bool = False,
                 coord_for_rank: Callable[[int], str] | None = None,
                 tls: bool = True, test_faults: bool = True,
                 own_prefix: bool = True, fabric: Fabric | None = None) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        self.root = Path(root)
        self.nodes = nodes
        self.job = job
        self.fabric = fabric
        if fabric is None:
            self.host = "127.0.0.1"
            self.ports = free_ports(nodes, self.host)
            self.addresses = [f"{self.host}:{p}" for p in self.ports]
        else:  # each rank in a network of its own: every port is free there
            if fabric.nodes < nodes:
                raise ValueError(f"the fabric has {fabric.nodes} nodes, not {nodes}")
            self.host = fabric.gateway
            self.ports = [FABRIC_PORT] * nodes
            self.addresses = [f"{fabric.addr(r)}:{FABRIC_PORT}" for r in range(nodes)]
        self._options = {k: _opt(v) for k, v in (options or {}).items()}
        self._per_rank = {r: {k: _opt(v) for k, v in o.items()}
                          for r, o in (per_rank_options or {}).items()}
        #: no ``peers=``: the addresses are learned from etcd at run time, as a new user's
        #: job does
        self.learn_addresses = learn_addresses
        self.coord_for_rank = coord_for_rank
        self.test_faults = test_faults
        #: this cluster's keys in a shared etcd (coord=): no other cluster sees them
        self.coord_prefix = f"/mtcfs-test/{os.urandom(6).hex()}"
        #: the job CA of this cluster (tls=True), which signed every rank's certificate
        self.ca: TestCa | None = None
        if nodes > 1 and tls:
            self.ca = TestCa(self.root / "pki", job)
        self.own_prefix = own_prefix
        self._mounts = [self._new_mount(r) for r in range(nodes)]
        self._retired: list[Mount] = []  # replaced by restart(); cleaned up too

    # -- set-up -----------------------------------------------------------------------------

    def options(self, rank: int) -> dict[str, str | None]:
        """The full ``-o`` options of ``rank`` (``store`` and ``size`` come from Mount)."""
        extra = {}
        if self.nodes > 1 and "coord" not in self._options and self.coord_for_rank is None:
            # the nodes of a job agree through etcd: the process's shared one
            from .etcd import shared_etcd
            extra = {"coord": shared_etcd().url, "coord_prefix": self.coord_prefix}
        where = {} if self.learn_addresses else {"peers": ",".join(self.addresses)}
        if "coord" in self._options and "coord_prefix" not in self._options \
                and self.own_prefix:
            extra = {"coord_prefix": self.coord_prefix, **extra}
        if self.coord_for_rank is not None:
            extra = {**extra, "coord": self.coord_for_rank(rank),
                     "coord_prefix": self._options.get("coord_prefix") or self.coord_prefix}
        if self.nodes > 1:
            extra = {**self._security(rank), **extra}
        faults = {"test_faults": None} if self.test_faults else {}
        return {**self._options, **faults,
                "rank": str(rank), "nodes": str(self.nodes),
                **where, "listen": self.addresses[rank],
                **self._per_rank.get(rank, {}), **extra}

    def issued(self, rank: int) -> Issued:
        """Rank ``rank``'s certificate and key (made on first use), signed by :attr:`ca`."""
        assert self.ca is not None, "a cluster made with tls=False has no certificates"
        stem = f"rank-{rank}"
        if not (self.ca.dir / f"{stem}.pem").exists():
            return self.ca.issue_rank(self.job, rank)
        return Issued(cert=self.ca.dir / f"{stem}.pem", key=self.ca.dir / f"{stem}.key",
                      ca=self.ca.ca)

    def tls_files(self, rank: int) -> TlsFiles:
        """What a client calling as ``rank`` presents (PeerClient(tls=...))."""
        i = self.issued(rank)
        return TlsFiles(str(i.ca), str(i.cert), str(i.key))

    def _security(self, rank: int) -> dict[str, str | None]:
        """TLS files for the peers; ``insecure`` where something stays plaintext (no CA,
        or an etcd without ``coord_ca=``, as the shared test etcd on loopback is)."""
        if self.ca is None or "insecure" in self._options:
            return {"insecure": None}
        i = self.issued(rank)
        plain_etcd = {} if "coord_ca" in self._options else {"insecure": None}
        return {"tls_ca": str(i.ca), "tls_cert": str(i.cert), "tls_key": str(i.key),
                **plain_etcd}

    def set_rank_options(self, rank: int, options: dict) -> None:
        """Replace ``rank``'s ``per_rank_options`` from its next (re)start on: a replacement
        node that differs from the one it replaces (its ``topology`` labels, ...)."""
        self._per_rank[self._ranks([rank])[0]] = {k: _opt(v) for k, v in options.items()}

    def _new_mount(self, rank: int) -> Mount:
        return Mount(self.root / f"n{rank}", job=self.job, options=self.options(rank),
                     prefix=None if self.fabric is None else self.fabric.prefix(rank))

    def _ranks(self, ranks: Iterable[int] | None) -> list[int]:
        out = list(range(self.nodes)) if ranks is None else list(ranks)
        for r in out:
            if not 0 <= r < self.nodes:
                raise ValueError(f"rank {r} is outside 0..{self.nodes - 1}")
        return out

    def node(self, rank: int) -> Mount:
        """The current :class:`Mount` of ``rank``."""
        return self._mounts[self._ranks([rank])[0]]

    def __getitem__(self, rank: int) -> Mount:
        return self.node(rank)

    def __len__(self) -> int:
        return self.nodes

    # -- life cycle -------------------------------------------------------------------------

    def start(self, ranks: Iterable[int] | None = None, timeout: float = 60.0) -> Cluster:
        """Mount every rank (or ``ranks``) at once, one thread each; return when all are up.

        Raises:
            RuntimeError: naming every rank that failed to mount, with its log tail.
        """
        todo = self._ranks(ranks)
        errors: dict[int, BaseException] = {}

        def one(r: int) -> None:
            try:
                self._mounts[r].start(timeout=timeout)
            except BaseException as exc:  # noqa: BLE001 (reported below, per rank)
                errors[r] = exc

        threads = [threading.Thread(target=one, args=(r,), name=f"mount-n{r}") for r in todo]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError("; ".join(
                f"rank {r}: {exc}\n--- log of rank {r} ---\n{self._mounts[r].log()[-3000:]}"
                for r, exc in sorted(errors.items())))
        return self

    def kill9(self, rank: int) -> None:
        """SIGKILL the daemon of ``rank`` (a node crash) and clear its dead mount."""
        self.node(rank).kill9()

    def stop(self, rank: int, timeout: float = 60.0) -> None:
        """Unmount ``rank`` cleanly (the daemon exits)."""
        self.node(rank).stop(timeout=timeout)

    def wipe(self, rank: int) -> None:
        """Delete everything in the store directory of ``rank`` (its RAM tier is lost). The
        rank must be down (:meth:`kill9` or :meth:`stop` first). The log of the run is kept
        beside the store as ``mtcfs.log.<n>``."""
        m = self.node(rank)
        if m.pid is not None:
            raise RuntimeError(f"rank {rank} is still running (pid {m.pid}); kill9 it first")
        log = m.store / "mtcfs.log"
        if log.exists():
            n = sum(1 for _ in m.root.glob("mtcfs.log.*"))
            shutil.copyfile(log, m.root / f"mtcfs.log.{n}")
        if m.store.is_dir():
            unmount_below(m.store)  # its data tmpfs (it outlives the daemon)
            for p in m.store.iterdir():
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()

    def restart(self, rank: int, wipe: bool = False, timeout: float = 60.0) -> Mount:
        """Start a fresh Mount for ``rank`` with the same directories, address and options.

        A rank still running is unmounted cleanly first; ``wipe=True`` empties its store
        before the start (a replacement node). Returns the new mount.
        """
        return self.restart_many([rank], wipe=wipe, timeout=timeout)[0]

    def restart_many(self, ranks: Iterable[int], wipe: bool = False,
                     timeout: float = 60.0) -> list[Mount]:
        """:meth:`restart` for several ranks, started at once (as a scheduler restarting a
        failed slice, or the whole job, would). Returns the new mounts, in ``ranks`` order.

        Raises:
            RuntimeError: as :meth:`start`.
        """
        todo = self._ranks(ranks)
        for r in todo:
            old = self.node(r)
            if old.pid is not None:
                old.stop(timeout=timeout)
            if wipe:
                self.wipe(r)
            self._retired.append(old)
            self._mounts[r] = self._new_mount(r)
        self.start(todo, timeout=timeout)
        return [self._mounts[r] for r in todo]

    def cleanup(self) -> None:
        """Unmount every rank, whatever state it is in, all at once (never raises)."""
        def one(m: Mount) -> None:
            try:
                m.cleanup()
            except BaseException:  # noqa: BLE001 (cleanup of one must not stop the rest)
                try:
                    force_unmount(str(m.mnt))
                except BaseException:  # noqa: BLE001, S110
                    pass
            try:
                unmount_below(m.store)  # its data tmpfs (it outlives the daemon)
            except BaseException:  # noqa: BLE001, S110
                pass

        threads = [threading.Thread(target=one, args=(m,))
                   for m in [*self._mounts, *self._retired]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def partition(self, *groups: Iterable[int]) -> None:
        """Cut the network between ``groups`` of ranks, as a failed switch would: each rank
        of a group refuses calls from, and makes none to, the ranks of the other groups (the
        daemon's ``fault`` control hook; needs ``test_faults``, the default).
        ``partition()`` heals every cut."""
        sets = [set(self._ranks(g)) for g in groups]
        cut: dict[int, list[int]] = {}
        for g in sets:
            for r in g:
                cut[r] = sorted(set().union(*(h for h in sets if h is not g)))
        if not sets:  # heal every running rank
            cut = {r: [] for r in range(self.nodes) if self.node(r).pid is not None}
        for r, others in sorted(cut.items()):
            sock = str(self.node(r).store / "control.sock")
            got = control.call(sock, "fault", timeout=10, partition=others)
            if got != {"partitioned": others}:
                raise RuntimeError(f"rank {r} did not take the partition: {got}")

    # -- observing --------------------------------------------------------------------------

    def status(self, rank: int) -> dict:
        """``mtcfs status --json`` of ``rank`` (the peer tier is under ``"peers"``)."""
        return self.node(rank).status()

    def state(self, rank: int, rel_path: str) -> str:
        """``user.mtcfs.state`` of ``rel_path`` in the mount of ``rank``."""
        return self.node(rank).state(rel_path)

    def wait_replicated(self, rank: int, rel_path: str, k: int | None = None,
                        timeout: float = 60.0) -> str:
        """Wait until ``rel_path`` on ``rank`` reads ``replicated k/R`` (at least ``k``
        replicas; ``k=None``: all R of them). Returns the state.

        Raises:
            TimeoutError: with the last state seen and the log tail of ``rank``.
        """
        m = self.node(rank)
        last = [""]

        def done() -> str | None:
            try:
                last[0] = s = m.state(rel_path)
            except OSError as exc:
                last[0] = f"<{exc}>"
                return None
            hit = _REPLICATED.match(s)
            if hit and int(hit.group(1)) >= (int(hit.group(2)) if k is None else k):
                return s
            return None

        deadline = time.monotonic() + timeout
        while True:
            s = done()
            if s:
                return s
            if time.monotonic() > deadline:
                want = "replicated R/R" if k is None else f"replicated >={k}/R"
                raise TimeoutError(f"rank {rank}: {rel_path} is {last[0]!r} after {timeout:.0f}s, "
                                   f"waiting for {want}\n{m.log()[-4000:]}")
            time.sleep(0.02)
