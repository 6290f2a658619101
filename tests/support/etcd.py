"""Real etcd servers for tests and benchmarks: Debian's ``etcd`` binary on loopback.

* :class:`EtcdCluster` starts 1 or 3 members on free loopback ports with their data on
  tmpfs, waits until the cluster serves a linearizable read, and can kill, pause and
  restart a member (the fault tests: kill the etcd leader during a save).
* ``EtcdCluster(..., netns_clients=N)`` runs the members in a network namespace of their
  own (tests/support/netns.py) instead: client node ``rank`` (0..N-1) reaches every member
  through its own address (:meth:`EtcdCluster.client_url`), and
  :meth:`EtcdCluster.partition` cuts it off (a blackhole: its calls hit their deadlines),
  :meth:`EtcdCluster.heal` joins it again. The partition tests.
* ``EtcdCluster(..., tls=EtcdServerTls(...))`` serves its clients over TLS only, asks
  them for a certificate its CA signed (``--client-cert-auth``: the certificate's CN is
  the etcd user), and :meth:`EtcdCluster.enable_auth` turns on etcd's users and roles
  with ``etcdctl`` (the commands docs/security-etcd.md gives): one role per job prefix.
  The default stays plaintext without auth.
* ``etcd_server`` is a session-scoped pytest fixture (one member) shared by the tests;
  each test uses its own key prefix (``etcd_prefix``), so they never see each other's keys.

Nothing here reaches beyond 127.0.0.1 and the namespaces it creates.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from .cluster import free_ports
from .netns import NetNs
from .pki import Issued

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
ETCDCTL = shutil.which("etcdctl") or "/usr/bin/etcdctl"


@dataclass(frozen=True)
class EtcdServerTls:
    """TLS on an :class:`EtcdCluster`'s client port.

    Attributes:
        server: etcd's certificate and key (its SAN must hold the endpoints' host, IP
            127.0.0.1); its ``ca`` is also the CA etcd trusts for client certificates.
        admin: a client certificate of that CA with CN ``root`` (etcd's root user once
            auth is on), used by the cluster's own helpers (readiness, ``etcdctl``).
    """

    server: Issued
    admin: Issued


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that started it ends (Linux
    PR_SET_PDEATHSIG), so no etcd outlives a test process however it ends."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_spawn_requests: queue.Queue = queue.Queue()
_spawner: threading.Thread | None = None
_spawner_lock = threading.Lock()


def _spawn_loop() -> None:
    while True:
        args, kwargs, answer = _spawn_requests.get()
        try:
            answer.put(subprocess.Popen(args, preexec_fn=_die_with_parent, **kwargs))
        except BaseException as exc:  # noqa: BLE001 (handed to the caller)
            answer.put(exc)


def _spawn(args: list[str], **kwargs) -> subprocess.Popen:
    """Popen from one thread that lives as long as the process (the parent death signal
    follows the thread that forked, and callers may be short-lived threads)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = threading.Thread(target=_spawn_loop, daemon=True, name="etcd-spawner")
            _spawner.start()
    answer: queue.Queue = queue.Queue()
    _spawn_requests.put((args, kwargs, answer))
    got = answer.get()
    if isinstance(got, BaseException):
        raise got
    return got


class EtcdCluster:
    """``members`` etcd processes forming one cluster on loopback.

    Args:
        root: a directory for the members' data and logs (on tmpfs).
        members: 1 or 3 (or more).
        extra_args: more etcd flags, for every member.
        netns_clients: run the members in a network namespace of their own, reachable by
            that many client nodes, each through its own address (see the module's
            docstring); None: on the root namespace's loopback.
        tls: serve clients over TLS only, each with a certificate of ``tls.server.ca``
            (``--client-cert-auth``); None: plaintext (members talk to each other in
            plaintext either way).
        host: the address the client ports listen on (without ``netns_clients``): a
            :class:`~support.fabric.Fabric`'s gateway for a cluster of namespaces.

    Attributes:
        endpoints: client ``host:port`` of each member, in member order (in a namespace:
            through its own address, which no partition cuts).
        url: ``etcd://h:p,h:p,...`` (the form of the ``coord=`` mount option).
        netns: the :class:`NetNs`, or None.
    """

    def __init__(self, root: Path, members: int = 1, extra_args: list[str] | None = None,
                 netns_clients: int | None = None, tls: EtcdServerTls | None = None,
                 host: str = "127.0.0.1") -> None:
        self.root = Path(root)
        self.tls = tls
        self.extra_args = list(extra_args or [])
        self.members = members
        self.names = [f"m{i}" for i in range(members)]
        self.procs: list[subprocess.Popen | None] = [None] * members
        self.netns: NetNs | None = None
        if netns_clients is None:
            ports = free_ports(2 * members, host)
            self.client_ports = ports[:members]
            self.peer_ports = ports[members:]
            peer_host = "127.0.0.1"
        else:  # a namespace of their own: every port is free there
            self.client_ports = [23790 + i for i in range(members)]
            self.peer_ports = [23800 + i for i in range(members)]
            self.netns = NetNs(netns_clients).create()
            host, peer_host = self.netns.service, "127.0.0.1"
        self.endpoints = [f"{host}:{p}" for p in self.client_ports]
        self.url = "etcd://" + ",".join(self.endpoints)
        self._peer_host = peer_host
        self._initial = ",".join(f"{n}=http://{peer_host}:{p}"
                                 for n, p in zip(self.names, self.peer_ports))
        self.token = f"mtcfs-test-{uuid.uuid4().hex[:8]}"

    def client_url(self, rank: int) -> str:
        """The ``coord=`` URL of client node ``rank``: every member, through that node's
        own address in the namespace (``netns_clients`` only)."""
        assert self.netns is not None, "only for an EtcdCluster in a network namespace"
        a = self.netns.client_addr(rank)
        return "etcd://" + ",".join(f"{a}:{p}" for p in self.client_ports)

    def partition(self, rank: int) -> None:
        """Cut client node ``rank`` off every member (``netns_clients`` only)."""
        assert self.netns is not None, "only for an EtcdCluster in a network namespace"
        self.netns.partition(rank)

    def heal(self, rank: int) -> None:
        """Undo :meth:`partition`."""
        assert self.netns is not None, "only for an EtcdCluster in a network namespace"
        self.netns.heal(rank)

    def _cmd(self, i: int) -> list[str]:
        peer = f"http://{self._peer_host}:{self.peer_ports[i]}"
        scheme = "http" if self.tls is None else "https"
        client = f"{scheme}://{self.endpoints[i]}"
        listen = client if self.netns is None else f"{scheme}://0.0.0.0:{self.client_ports[i]}"
        tls = [] if self.tls is None else [
            "--cert-file", str(self.tls.server.cert), "--key-file", str(self.tls.server.key),
            "--client-cert-auth", "--trusted-ca-file", str(self.tls.server.ca)]
        return [*(self.netns.exec_prefix() if self.netns is not None else []),
                ETCD, "--name", self.names[i], "--data-dir", str(self.root / self.names[i]),
                "--listen-client-urls", listen, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", self._initial, "--initial-cluster-token", self.token,
                "--initial-cluster-state", "new",
                # fast elections on loopback (the fault tests kill the leader)
                "--heartbeat-interval", "50", "--election-timeout", "500",
                "--logger", "zap", "--log-level", "error",
                "--auto-compaction-mode", "revision", "--auto-compaction-retention", "100000",
                *tls, *self.extra_args]

    def start(self, timeout: float = 30.0) -> "EtcdCluster":
        self.root.mkdir(parents=True, exist_ok=True)
        for i in range(self.members):
            self.start_member(i)
        self.wait_ready(timeout)
        return self

    def start_member(self, i: int) -> None:
        log = open(self.root / f"{self.names[i]}.log", "ab")
        self.procs[i] = _spawn(self._cmd(i), stdout=log, stderr=log,
                               stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until a linearizable read succeeds (the cluster has a leader)."""
        from mtcfs.tiers.coord.etcd import Etcd, EtcdError
        c = Etcd([e for i, e in enumerate(self.endpoints) if self.procs[i] is not None],
                 timeout_s=2.0, tls=self.admin_tls())
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    c.revision()
                    return
                except EtcdError as exc:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"etcd did not come up: {exc}\n{self.logs()}")
                    for i, p in enumerate(self.procs):
                        if p is not None and p.poll() is not None:
                            raise RuntimeError(f"etcd member {i} exited {p.returncode}\n"
                                               f"{self.logs()}")
                    time.sleep(0.1)
        finally:
            c.close()

    def leader(self) -> int:
        """Index of the member that leads now."""
        from mtcfs.tiers.coord.etcd import Etcd
        c = Etcd(self.endpoints, timeout_s=2.0, tls=self.admin_tls())
        try:
            for i, e in enumerate(self.endpoints):
                if self.procs[i] is None:
                    continue
                try:
                    st = c.status(e)
                except Exception:  # noqa: BLE001 (a member that is down)
                    continue
                if st.leader == st.header.member_id:
                    return i
        finally:
            c.close()
        raise RuntimeError("no etcd member leads")

    def admin_tls(self):
        """The :class:`mtcfs.tiers.coord.etcd.EtcdTls` of the admin (root) certificate, or
        None for a plaintext cluster."""
        from mtcfs.tiers.coord.etcd import EtcdTls
        if self.tls is None:
            return None
        a = self.tls.admin
        return EtcdTls(str(a.ca), str(a.cert), str(a.key))

    def etcdctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run ``etcdctl`` (v3 API) against every member, as the admin when TLS is on.

        Raises:
            RuntimeError: ``check`` and etcdctl failed (its output in the message).
        """
        cmd = [ETCDCTL, "--endpoints",
               ",".join(f"{'https' if self.tls else 'http'}://{e}" for e in self.endpoints)]
        if self.tls is not None:
            a = self.tls.admin
            cmd += ["--cacert", str(a.ca), "--cert", str(a.cert), "--key", str(a.key)]
        r = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=30, check=False,
                           env={**os.environ, "ETCDCTL_API": "3"})
        if check and r.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed ({r.returncode}): "
                               f"{r.stdout.strip()} {r.stderr.strip()}")
        return r

    def enable_auth(self, roles: dict[str, str]) -> None:
        """Turn on etcd's authentication with a root user (the admin certificate's CN) and,
        for each ``user -> key prefix`` of ``roles``, a user and a role of that name with
        readwrite on exactly that prefix: the commands of docs/security-etcd.md."""
        self.etcdctl("user", "add", "root", "--no-password")
        self.etcdctl("role", "add", "root")
        self.etcdctl("user", "grant-role", "root", "root")
        for user, prefix in roles.items():
            self.add_job_user(user, prefix)
        self.etcdctl("auth", "enable")

    def add_job_user(self, user: str, prefix: str | None) -> None:
        """A user ``user`` (a client certificate's CN) with a role of the same name granting
        readwrite on ``prefix`` and nothing else (None: a role that grants nothing)."""
        self.etcdctl("user", "add", user, "--no-password")
        self.etcdctl("role", "add", user)
        if prefix is not None:
            self.etcdctl("role", "grant-permission", user, "--prefix=true", "readwrite",
                         prefix)
        self.etcdctl("user", "grant-role", user, user)

    def wipe_member(self, i: int) -> None:
        """Delete a (stopped) member's data: it starts again as a new, empty cluster."""
        assert self.procs[i] is None, "stop the member first"
        shutil.rmtree(self.root / self.names[i], ignore_errors=True)
        self.token = f"mtcfs-test-{uuid.uuid4().hex[:8]}"

    def kill_member(self, i: int) -> None:
        p = self.procs[i]
        if p is not None:
            p.kill()
            p.wait(10)
            self.procs[i] = None

    def pause_member(self, i: int) -> None:
        p = self.procs[i]
        assert p is not None
        os.kill(p.pid, signal.SIGSTOP)

    def resume_member(self, i: int) -> None:
        p = self.procs[i]
        assert p is not None
        os.kill(p.pid, signal.SIGCONT)

    def logs(self) -> str:
        out = []
        for n in self.names:
            f = self.root / f"{n}.log"
            if f.exists():
                out.append(f"--- {n}\n" + f.read_text(errors="replace")[-2000:])
        return "\n".join(out)

    def stop(self) -> None:
        for i, p in enumerate(self.procs):
            if p is None:
                continue
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.kill()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
            self.procs[i] = None
        if self.netns is not None:
            self.netns.destroy()
        shutil.rmtree(self.root, ignore_errors=True)


_shared: EtcdCluster | None = None
_shared_lock = threading.Lock()


def shared_etcd() -> EtcdCluster:
    """The process's one etcd member on loopback, started on first use and stopped when
    the process exits (scope=job clusters of tests, examples and benchmarks use it, each
    under its own key prefix)."""
    global _shared
    with _shared_lock:
        if _shared is None or any(p is None or p.poll() is not None for p in _shared.procs):
            root = Path(tempfile.mkdtemp(prefix="mtcfs-etcd-", dir="/dev/shm"))
            _shared = EtcdCluster(root, 1).start()
            atexit.register(_shared.stop)
        return _shared


def stop_shared() -> None:
    """Stop the process's shared etcd now (for a process that leaves with os._exit)."""
    global _shared
    with _shared_lock:
        if _shared is not None:
            _shared.stop()
            _shared = None


@pytest.fixture(scope="session")
def etcd_server():
    """One etcd member on loopback for the whole session (data on /dev/shm)."""
    return shared_etcd()


@pytest.fixture
def etcd_prefix():
    """A key prefix no other test uses."""
    return f"/mtcfs-test/{uuid.uuid4().hex[:12]}/"


@pytest.fixture(name="client")
def etcd_client(etcd_server):
    """A client of the session's etcd (5 s deadline per call), closed after the test."""
    from mtcfs.tiers.coord.etcd import Etcd
    c = Etcd(etcd_server.endpoints, timeout_s=5.0)
    yield c
    c.close()
