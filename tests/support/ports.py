"""TCP ports for test servers that no other test process on this machine is handed.

The daemons of a test bind their ports themselves (a peer's ``listen=``, etcd's client and
peer URLs, the GCS emulator), and a rank that is killed and restarted binds the same port
again. Asking the kernel (bind to port 0, close, pass the number on) is racy as soon as
tests run in parallel (pytest-xdist's workers, or another engineer's run on the same
machine): the kernel hands numbers from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), where another process's bind(0) and every
outgoing connection's source port are taken from too, so a port can be taken between the
moment it is picked and the moment the daemon binds it, or while a killed rank is down.

So each test process claims a *block* of ports below the ephemeral range, which nothing
else hands out: block ``k`` is ports ``BASE + k*BLOCK .. BASE + (k+1)*BLOCK - 1``, claimed
by an exclusive ``flock`` of ``<lock dir>/block-<k>.lock`` held for the life of the
process (the kernel drops it when the process ends, however it ends). Within its block a
process hands ports out in turn, round robin, skipping a port it cannot bind at that
moment (a server of this process still listening on it, a connection in TIME_WAIT, a
program outside the tests). A port is handed out again only after the ``BLOCK - 1`` ports
after it were, which is many tests later.

When no block is free (or the ephemeral range starts too low to leave room below it), the
ports come from the kernel as before (bind to port 0).
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
import threading

#: ports in one block; a process hands a port out again after this many others
BLOCK = 500
#: the lowest port of block 0
BASE = 10_000
LOCK_DIR = os.path.join(tempfile.gettempdir(), "mtcfs-test-ports")

_lock = threading.Lock()
_block: tuple[int, int] | None = None   # (first port, port count) of this process's block
_block_fd: int | None = None
_block_pid: int | None = None           # the process that holds the flock (forks do not)
_next = 0


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _claim_block() -> tuple[int, int] | None:
    """Flock the first free block below the ephemeral range; None when there is none."""
    global _block_fd, _block_pid
    blocks = (_ephemeral_low() - BASE) // BLOCK
    if blocks < 1:
        return None
    os.makedirs(LOCK_DIR, exist_ok=True)
    try:
        os.chmod(LOCK_DIR, 0o1777)   # shared by every user's test runs
    except OSError:
        pass
    for k in range(blocks):
        path = os.path.join(LOCK_DIR, f"block-{k}.lock")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        _block_fd, _block_pid = fd, os.getpid()
        return BASE + k * BLOCK, BLOCK
    return None


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_ports(n: int, host: str) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports of this process's block that can be bound on ``host`` now
    and that no other process claiming ports here is handed (see the module docstring).

    Raises:
        OSError: fewer than ``n`` ports of the block can be bound now.
    """
    global _block, _next
    with _lock:
        if _block is None or _block_pid != os.getpid():
            _block = _claim_block()
            _next = 0
        if _block is None:
            return _kernel_ports(n, host)
        first, count = _block
        out: list[int] = []
        for _ in range(count):
            port = first + _next
            _next = (_next + 1) % count
            if port not in out and _bindable(port, host):
                out.append(port)
                if len(out) == n:
                    return out
        raise OSError(f"only {len(out)} of {n} ports of {first}..{first + count - 1} "
                      f"can be bound on {host}")


def free_port(host: str = "127.0.0.1") -> int:
    """One port of :func:`free_ports`."""
    return free_ports(1, host)[0]
