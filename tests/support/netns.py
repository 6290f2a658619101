"""A network namespace for tests that cut a node off a service (the etcd partition tests).

:class:`NetNs` creates a network namespace and a veth pair into it from the root namespace:

* root side ``10.X.Y.1/24`` (X.Y random per namespace, retried while the /24 overlaps
  any address or route of the root namespace);
* namespace side ``10.X.Y.2/24`` (the "service" address: never taken away) and, per client
  node, one extra address ``10.X.Y.(10+rank)/32``.

A service started in the namespace (``ip netns exec <name> ...``, :meth:`exec_prefix`) and
listening on 0.0.0.0 is reached by each client node through its own address.
:meth:`partition` deletes that address in the namespace: packets to it are then silently
dropped (the namespace does not forward, so it sends no ICMP error; the root side has a
permanent neighbour entry, so the sender gets no "no route to host" either) and the
service's packets from it cannot leave. A client's calls hit their own deadlines: a
blackhole, as a failed switch or a cut cable makes, not a refusal. :meth:`heal` adds the
address back.

Nothing here reaches beyond the namespace and the veth it creates. :meth:`destroy` removes
both (processes still inside must be ended first; services started with the etcd spawner
die with the test process anyway); it runs at exit too, and a namespace left behind by a
killed test process (its name carries that process's pid) is removed by the next one.

Needs root (CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import random
import re
import subprocess
import threading
from typing import Self

PREFIX = "mtcfs-pt"  # namespace names: mtcfs-pt<pid>-<hex>
_NAME = re.compile(rf"^{PREFIX}(\d+)-([0-9a-f]+)$")
_live: set[NetNs] = set()
_live_lock = threading.Lock()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def available() -> str | None:
    """None when namespaces can be made here, else why not (for a skip)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    try:
        r = _ip("netns", "list", check=False)
    except FileNotFoundError:
        return "iproute2 (ip) is missing"
    return None if r.returncode == 0 else f"ip netns does not work: {r.stderr.strip()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> None:
    """Delete the namespaces of this module whose creating process is gone (a test process
    that was killed before its clean-up ran). Deleting a namespace deletes its veth."""
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)


def _taken_networks(but_dev: str = "") -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the root namespace has an address or a route in (those on
    device ``but_dev`` aside)."""
    out: list[ipaddress.IPv4Network] = []
    for line in _ip("-4", "-o", "addr", "show").stdout.splitlines():
        words = line.split()
        m = re.search(r"\binet (\S+)", line)
        if m and len(words) > 1 and words[1] != but_dev:
            out.append(ipaddress.ip_interface(m.group(1)).network)
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        words = line.split()
        if not words:
            continue
        if but_dev and f" dev {but_dev}" in f" {line} ":
            continue
        word = words[1] if words[0] in ("local", "broadcast", "unreachable", "prohibit",
                                       "blackhole", "multicast") and len(words) > 1 \
            else words[0]
        if word == "default":
            continue
        try:
            out.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            continue
    return out


class NetNs:
    """A network namespace with a veth from the root namespace and one address per client.

    Args:
        clients: how many client addresses (ranks 0..clients-1) the namespace side gets.

    Attributes:
        name: the namespace's name (``ip netns exec <name> ...``).
        service: the namespace side's own address (never partitioned).
        root_addr: the root side's address.
    """

    def __init__(self, clients: int) -> None:
        if not 1 <= clients <= 200:
            raise ValueError(f"clients must be 1..200, got {clients}")
        self.clients = clients
        tag = os.urandom(3).hex()
        self.name = f"{PREFIX}{os.getpid()}-{tag}"
        self.veth_root = f"mtpt{tag}r"      # <= 15 characters (IFNAMSIZ)
        self.veth_ns = f"mtpt{tag}n"
        self.net: ipaddress.IPv4Network | None = None
        self.partitioned: set[int] = set()
        self._created = False

    # -- addresses ---------------------------------------------------------------------------

    def _host(self, n: int) -> str:
        assert self.net is not None
        return str(self.net.network_address + n)

    @property
    def root_addr(self) -> str:
        return self._host(1)

    @property
    def service(self) -> str:
        return self._host(2)

    def client_addr(self, rank: int) -> str:
        """The address client node ``rank`` reaches the namespace's services at."""
        if not 0 <= rank < self.clients:
            raise ValueError(f"rank {rank} is outside 0..{self.clients - 1}")
        return self._host(10 + rank)

    def exec_prefix(self) -> list[str]:
        """Prepend to a command to run it in the namespace."""
        return ["ip", "netns", "exec", self.name]

    def ns_ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _ip("netns", "exec", self.name, "ip", *args, check=check)

    # -- life cycle --------------------------------------------------------------------------

    def create(self, tries: int = 20) -> Self:
        """Make the namespace, the veth and the addresses (all undone when one step fails).

        Raises:
            RuntimeError: a step failed, or no free 10.X.Y.0/24 was found.
        """
        sweep_stale()
        _ip("netns", "add", self.name)
        with _live_lock:
            _live.add(self)
        self._created = True
        try:
            self._set_up(tries)
        except BaseException:
            self.destroy()
            raise
        return self

    def _set_up(self, tries: int) -> None:
        _ip("link", "add", self.veth_root, "type", "veth", "peer", "name", self.veth_ns)
        _ip("link", "set", self.veth_ns, "netns", self.name)
        self.ns_ip("link", "set", "lo", "up")
        self.ns_ip("link", "set", self.veth_ns, "up")
        _ip("link", "set", self.veth_root, "up")
        mac = subprocess.run([*self.exec_prefix(), "cat",
                              f"/sys/class/net/{self.veth_ns}/address"],
                             capture_output=True, text=True, check=True, timeout=30).stdout.strip()
        for _ in range(tries):
            taken = _taken_networks()
            net = ipaddress.ip_network(f"10.{random.randrange(64, 255)}."
                                       f"{random.randrange(0, 256)}.0/24")
            if any(net.overlaps(t) for t in taken):
                continue
            self.net = net
            _ip("addr", "add", f"{self.root_addr}/24", "dev", self.veth_root)
            # another process may have picked the same /24 at the same moment: check again
            # (our own device aside) and pick another one if so
            if any(net.overlaps(t) for t in _taken_networks(but_dev=self.veth_root)):
                _ip("addr", "del", f"{self.root_addr}/24", "dev", self.veth_root, check=False)
                self.net = None
                continue
            break
        else:
            raise RuntimeError("no free 10.X.Y.0/24 for a test network namespace")
        self.ns_ip("addr", "add", f"{self.service}/24", "dev", self.veth_ns)
        for r in range(self.clients):
            self.ns_ip("addr", "add", f"{self.client_addr(r)}/32", "dev", self.veth_ns)
        # permanent neighbour entries: a partitioned address is then a blackhole (packets go
        # out and vanish) instead of a failed ARP ("no route to host" after 3 s)
        for a in [self.service, *(self.client_addr(r) for r in range(self.clients))]:
            _ip("neigh", "replace", a, "lladdr", mac, "dev", self.veth_root, "nud", "permanent")

    def partition(self, rank: int) -> None:
        """Cut client ``rank`` off the namespace's services (a blackhole both ways)."""
        self.ns_ip("addr", "del", f"{self.client_addr(rank)}/32", "dev", self.veth_ns)
        self.partitioned.add(rank)

    def heal(self, rank: int) -> None:
        """Undo :meth:`partition`."""
        self.ns_ip("addr", "add", f"{self.client_addr(rank)}/32", "dev", self.veth_ns)
        self.partitioned.discard(rank)

    def destroy(self) -> None:
        """Delete the veth and the namespace (never raises; safe to call twice)."""
        if not self._created:
            return
        _ip("link", "del", self.veth_root, check=False)
        _ip("netns", "del", self.name, check=False)
        self._created = False
        with _live_lock:
            _live.discard(self)

    def __enter__(self) -> Self:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


@atexit.register
def _destroy_all() -> None:
    with _live_lock:
        live = list(_live)
    for ns in live:
        ns.destroy()
