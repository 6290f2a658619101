"""What the fuzz tests share (hypothesis): the settings of a fuzz test's short form in the
suite and its long form, and the checks of a parser's refusal."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings

from mtcfs.base.untrusted import BadRecord


def fuzz(short: int) -> settings:
    """``short`` examples in the suite (derandomized), MTCFS_FUZZ_EXAMPLES in the long form
    (random; ``--hypothesis-seed=N`` repeats a run)."""
    long = os.environ.get("MTCFS_FUZZ_EXAMPLES")
    return settings(max_examples=int(long) if long else short, deadline=None, database=None,
                    derandomize=not long, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def one_line(message: str) -> None:
    """Assert that ``message`` is one non-empty line (what a user is shown)."""
    assert message.strip() and len(message.splitlines()) == 1, repr(message)


def decoded_or_bad(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or None when it raised :class:`BadRecord` with a one-line message
    (any other exception fails the test)."""
    try:
        return fn(*args)
    except BadRecord as exc:
        one_line(str(exc))
        return None
