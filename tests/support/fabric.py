"""A switched network of many "hosts" on one machine: one network namespace per node.

:class:`Fabric` makes a Linux bridge in the root namespace with ``10.X.Y.1/24`` and, for each
node ``r`` (0..nodes-1), a network namespace of its own joined to the bridge by a veth pair,
holding ``10.X.Y.(10+r)/24`` (X.Y random, retried while the /24 overlaps anything of the
root namespace). Every node reaches every other node and the root side's address (where
the scale run's etcd listens) through the bridge, as hosts on one switch do; nothing is
routed beyond the /24.

A process is put into node ``r``'s network with :meth:`Fabric.prefix` (``nsenter --net=``:
only the network namespace changes, not the mount namespace, so a FUSE mount the process
makes is seen by every other process of the machine, as ``ip netns exec`` would not allow:
it unshares the mount namespace).

Nothing here reaches beyond the bridge and the namespaces it creates. :meth:`destroy`
removes them all (deleting a namespace deletes its veth); it runs at exit too, and what a
killed process left behind (the names carry its pid) is removed by the next one.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN for nsenter), iproute2 and util-linux's nsenter.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import random
import re
from typing import Self

from .netns import _ip, _pid_alive, _taken_networks

PREFIX = "mtcfs-fab"  # namespace names: mtcfs-fab<pid>-<tag>-<rank>
_NAME = re.compile(rf"^{PREFIX}(\d+)-([0-9a-f]+)-(\d+)$")
_BRIDGE = re.compile(r"^mtfb([0-9a-f]{6})$")
MAX_NODES = 240


def sweep_stale() -> None:
    """Delete the namespaces and bridges of fabrics whose creating process is gone."""
    owners: dict[str, int] = {}
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m:
            owners[m.group(2)] = int(m.group(1))
            if not _pid_alive(int(m.group(1))):
                _ip("netns", "del", name, check=False)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        words = line.split(":")
        dev = words[1].strip() if len(words) > 1 else ""
        m = _BRIDGE.match(dev)
        if m and (m.group(1) not in owners or not _pid_alive(owners[m.group(1)])):
            _ip("link", "del", dev, check=False)


class Fabric:
    """``nodes`` network namespaces on one bridge.

    Args:
        nodes: 1..240 namespaces.

    Attributes:
        gateway: the bridge's (root namespace's) address: services every node reaches.
    """

    def __init__(self, nodes: int) -> None:
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes must be 1..{MAX_NODES}, got {nodes}")
        self.nodes = nodes
        self.tag = os.urandom(3).hex()
        self.bridge = f"mtfb{self.tag}"
        self.net: ipaddress.IPv4Network | None = None
        self._made: list[str] = []
        self._bridge_made = False

    def name(self, rank: int) -> str:
        return f"{PREFIX}{os.getpid()}-{self.tag}-{rank}"

    def _host(self, n: int) -> str:
        assert self.net is not None, "create() first"
        return str(self.net.network_address + n)

    @property
    def gateway(self) -> str:
        return self._host(1)

    def addr(self, rank: int) -> str:
        """Node ``rank``'s address."""
        if not 0 <= rank < self.nodes:
            raise ValueError(f"rank {rank} is outside 0..{self.nodes - 1}")
        return self._host(10 + rank)

    def prefix(self, rank: int) -> list[str]:
        """Prepend to a command to run it in node ``rank``'s network (only)."""
        return ["nsenter", f"--net=/run/netns/{self.name(rank)}"]

    def create(self) -> Self:
        """Make the bridge, every namespace and veth (all undone when a step fails).

        Raises:
            RuntimeError: a step failed, or no free 10.X.Y.0/24 was found.
        """
        sweep_stale()
        atexit.register(self.destroy)
        try:
            self._set_up()
        except BaseException:
            self.destroy()
            raise
        return self

    def _set_up(self) -> None:
        # the namespaces first: their names carry this process's pid, so another process's
        # sweep_stale keeps the bridge made next (a bridge with no live owner is swept)
        for r in range(self.nodes):
            _ip("netns", "add", self.name(r))
            self._made.append(self.name(r))
        _ip("link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        for _ in range(20):
            net = ipaddress.ip_network(f"10.{random.randrange(64, 255)}."
                                       f"{random.randrange(0, 256)}.0/24")
            if not any(net.overlaps(t) for t in _taken_networks()):
                self.net = net
                break
        else:
            raise RuntimeError("no free 10.X.Y.0/24 for the fabric")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for r in range(self.nodes):
            ns = self.name(r)
            outer, inner = f"mf{self.tag}{r}a", f"mf{self.tag}{r}b"  # <= 15 characters
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            run = ["netns", "exec", ns, "ip"]
            _ip(*run, "link", "set", "lo", "up")
            _ip(*run, "addr", "add", f"{self.addr(r)}/24", "dev", inner)
            _ip(*run, "link", "set", inner, "up")

    def destroy(self) -> None:
        """Remove every namespace and the bridge (processes inside must be ended first)."""
        for ns in self._made:
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        if self._bridge_made:
            _ip("link", "del", self.bridge, check=False)
            self._bridge_made = False
