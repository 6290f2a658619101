"""Failpoints: named places in the daemon where a test can make it pause, or die.

A test sets ``MTCFS_FAILPOINTS`` in the daemon's environment, e.g.
``MTCFS_FAILPOINTS="backup.put_chunk=sleep(0.5)"`` (several separated by ``;``); every pass
through :func:`failpoint` with that name then sleeps that many seconds. It makes a window a
test needs (a kill during an upload) certain instead of a matter of timing. ``NAME=kill``
instead makes the first pass through that failpoint SIGKILL the daemon itself, at exactly
that point (a crash between two steps that must be ordered: no window to aim at). Unset, a
failpoint costs one dictionary lookup. The idea is etcd's gofail and FreeBSD's fail(9).

The actions are ``sleep(SECONDS)`` and ``kill``; the name of each failpoint is where it is
called.
"""

from __future__ import annotations

import os
import re
import signal
import time

ENV = "MTCFS_FAILPOINTS"
#: The action of ``NAME=kill`` in :func:`parse`'s result (a sleep's is its seconds).
KILL = "kill"
_SPEC = re.compile(r"^\s*([\w.]+)\s*=\s*(?:sleep\(\s*([0-9.]+)\s*\)|(kill))\s*$")


def parse(text: str) -> dict[str, float | str]:
    """``"a.b=sleep(0.5);c=sleep(1);d=kill"`` -> ``{"a.b": 0.5, "c": 1.0, "d": "kill"}``.

    Raises:
        ValueError: a part that is not ``NAME=sleep(SECONDS)`` or ``NAME=kill``.
    """
    out: dict[str, float | str] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        m = _SPEC.match(part)
        if m is None:
            raise ValueError(f"{ENV}: expected NAME=sleep(SECONDS) or NAME=kill, got {part!r}")
        out[m.group(1)] = KILL if m.group(3) else float(m.group(2))
    return out


_ACTIVE = parse(os.environ.get(ENV, ""))


def failpoint(name: str) -> None:
    """Pause here if the environment asks for it (blocking: call it in a worker thread), or
    SIGKILL this process here (``NAME=kill``: never returns)."""
    if _ACTIVE:
        action = _ACTIVE.get(name)
        if action == KILL:
            os.kill(os.getpid(), signal.SIGKILL)
            os._exit(128 + signal.SIGKILL)  # (not reached: the kill ends every thread)
        elif action:
            time.sleep(float(action))
