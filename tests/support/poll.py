"""Small waits and probes shared by the tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def alive(pid: int) -> bool:
    """True while process ``pid`` exists and has not exited (a zombie, state Z or X in
    /proc/PID/stat, is not alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait_for(pred: Callable[[], T], timeout: float, what: str,
             interval: float = 0.05) -> T:
    """Call ``pred`` until it returns something true and return that.

    Raises:
        TimeoutError: not within ``timeout`` seconds; names ``what`` and the last value.
    """
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what} "
                               f"(last: {got!r})")
        time.sleep(interval)


def wait_with_logs(pred: Callable[[], T], timeout: float, what: str, cluster: Any = None,
                   ranks: tuple[int, ...] | list[int] = ()) -> T:
    """Call ``pred`` every 0.1 s until it returns something true and return that; an
    OSError or RuntimeError it raises (a status call during a restart) counts as not yet.

    Raises:
        TimeoutError: not within ``timeout`` seconds; names ``what``, the last value and,
            for each of ``ranks`` of ``cluster``, the end of that rank's daemon log.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = pred()
        except (OSError, RuntimeError) as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            logs = "".join(f"\n--- log of rank {r} ---\n{cluster.node(r).log()[-3000:]}"
                           for r in ranks) if cluster is not None else ""
            raise TimeoutError(f"{what}: not within {timeout:.0f}s (last: {last!r}){logs}")
        time.sleep(0.1)


def err(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """The errno ``fn(*args)`` fails with, 0 if it succeeds."""
    try:
        fn(*args, **kwargs)
    except OSError as exc:
        return exc.errno or 0
    return 0
