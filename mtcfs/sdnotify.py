"""systemd's service notification protocol: tell the service manager the mount is ready.

A unit of ``Type=notify`` (systemd/mtcfs@.service) counts as started only once the daemon
sends ``READY=1``; ``STATUS=`` lines show in ``systemctl status``; ``STOPPING=1`` says the
stop began. The protocol (sd_notify(3), "Service notification protocol" in systemd's
docs): one datagram of newline-separated ``KEY=VALUE`` lines to the AF_UNIX socket named in
``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace).

It is our own 30 lines rather than a library: ``systemd-python`` compiles against
libsystemd-dev, and ``sdnotify`` on PyPI (unmaintained since 2017) is the same dozen lines;
the protocol itself is a stable, documented interface (docs/operations.md, "systemd").

Without ``$NOTIFY_SOCKET`` (not started by systemd, or not ``Type=notify``) every call does
nothing. A send that fails is logged once and never raised: the service manager's
bookkeeping must not stop a mount.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


class Notifier:
    """Sends notifications to ``$NOTIFY_SOCKET`` (read once, at construction).

    Args:
        address: the socket (default: ``$NOTIFY_SOCKET``); ``""`` or unset: disabled.
    """

    def __init__(self, address: str | None = None) -> None:
        addr = os.environ.get("NOTIFY_SOCKET", "") if address is None else address
        self.address = "\0" + addr[1:] if addr.startswith("@") else addr
        self._warned = False

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=VALUE`` lines (e.g. ``READY=1``, ``STATUS="serving"``); True if sent."""
        if not self.address:
            return False
        msg = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(msg, self.address)
            return True
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("cannot notify the service manager at %s: %s",
                            self.address.replace("\0", "@"), exc)
            return False

    def ready(self, status: str) -> bool:
        """The mount is served: ``READY=1`` with a status line and this process's pid."""
        return self.send(READY=1, STATUS=status, MAINPID=os.getpid())

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def stopping(self, status: str = "unmounting") -> bool:
        return self.send(STOPPING=1, STATUS=status)
