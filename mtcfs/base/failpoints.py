"""Failpoints: named places in the daemon where a test can make it pause.

A test sets ``MTCFS_FAILPOINTS`` in the daemon's environment, e.g.
``MTCFS_FAILPOINTS="backup.put_chunk=sleep(0.5)"`` (several separated by ``;``); every pass
through :func:`failpoint` with that name then sleeps that many seconds. It makes a window a
test needs (a kill during an upload) certain instead of a matter of timing. Unset, a
failpoint costs one dictionary lookup. The idea is etcd's gofail and FreeBSD's fail(9).

Only ``sleep(SECONDS)`` exists so far; the name of each failpoint is where it is called.
"""

from __future__ import annotations

import os
import re
import time

ENV = "MTCFS_FAILPOINTS"
_SPEC = re.compile(r"^\s*([\w.]+)\s*=\s*sleep\(\s*([0-9.]+)\s*\)\s*$")


def parse(text: str) -> dict[str, float]:
    """``"a.b=sleep(0.5);c=sleep(1)"`` -> ``{"a.b": 0.5, "c": 1.0}``.

    Raises:
        ValueError: a part that is not ``NAME=sleep(SECONDS)``.
    """
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        m = _SPEC.match(part)
        if m is None:
            raise ValueError(f"{ENV}: expected NAME=sleep(SECONDS), got {part!r}")
        out[m.group(1)] = float(m.group(2))
    return out


_ACTIVE = parse(os.environ.get(ENV, ""))


def failpoint(name: str) -> None:
    """Pause here if the environment asks for it (blocking: call it in a worker thread)."""
    if _ACTIVE:
        delay = _ACTIVE.get(name)
        if delay:
            time.sleep(delay)
