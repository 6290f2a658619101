"""Small waits and probes shared by the tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


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


def err(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """The errno ``fn(*args)`` fails with, 0 if it succeeds."""
    try:
        fn(*args, **kwargs)
    except OSError as exc:
        return exc.errno or 0
    return 0
