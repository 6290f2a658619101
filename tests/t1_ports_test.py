"""Tier-1: test ports (tests/support/ports.py) are never handed to two test processes.

Parallel test processes (pytest-xdist workers) start daemons on ports they picked; a port
handed to two of them would make one daemon fail to bind, or a client reach the wrong
test's daemon.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from support import ports

TESTS = Path(__file__).resolve().parent

HOLDER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from support import ports
    print(" ".join(map(str, ports.free_ports(int(sys.argv[2])))), flush=True)
    sys.stdin.read()          # keep the block claimed until the parent closes stdin
""")


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_two_processes_get_disjoint_ports_outside_the_ephemeral_range():
    # A quarter of a block each: enough that blocks shared would overlap, while a block a
    # finished test process used lately may still have ports in TIME_WAIT (not bindable:
    # asking for the whole block then fails, and did beside another test run).
    n = ports.BLOCK // 4
    procs = [subprocess.Popen([sys.executable, "-c", HOLDER, str(TESTS), str(n)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        got = [set(map(int, p.stdout.readline().split())) for p in procs]
        mine = set(ports.free_ports(10))
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=30)
    assert all(len(g) == n for g in got), [len(g) for g in got]
    assert not got[0] & got[1]
    assert not mine & (got[0] | got[1])
    low = _ephemeral_low()
    assert max(got[0] | got[1] | mine) < low  # never a port the kernel hands out itself


def test_a_port_is_not_handed_out_again_while_it_is_listened_on():
    first = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", first))
        s.listen()
        seen = {p for _ in range(ports.BLOCK // 10) for p in ports.free_ports(10)}
    assert first not in seen
    assert ports._block is not None
    start, count = ports._block
    # the others of this process's block, in turn (but those its servers listen on)
    assert seen <= set(range(start, start + count)) - {first}
    assert len(seen) > count // 2
