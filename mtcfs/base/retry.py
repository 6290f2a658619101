"""The one retry policy: full-jitter exponential backoff, attempts, deadline, stop.

Waits follow "full jitter" exponential backoff (Marc Brooker, "Exponential Backoff And
Jitter", AWS Architecture Blog, 2015): before retry ``n`` (1-based) sleep a uniformly random
time in ``[0, min(max_delay, base_delay * 2**(n-1))]``. Randomising the whole interval spreads
out the retries of a thousand nodes that all saw the same 503 at the same moment, which fixed
or "equal" jitter does much less well.

Which errors are retried is the caller's: a tuple of exception types or a predicate
(:data:`Retryable`), given to the policy (its ``retryable`` field) or to one call. The backup
tier retries its ``TransientError`` (:mod:`mtcfs.tiers.backup.retry`), the peer client the
gRPC statuses UNAVAILABLE and DEADLINE_EXCEEDED (:mod:`mtcfs.tiers.peer.client`). Everything
else surfaces at once. The policy only suits idempotent operations.

Synchronous: it sleeps in the calling thread (a worker thread, never the trio loop).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Retries up to this number are logged at DEBUG, later ones at WARNING (unless quiet).
QUIET_RETRIES = 3

#: Which errors are retried: exception types, or a predicate over the exception.
Retryable = tuple[type[BaseException], ...] | Callable[[BaseException], bool]


def is_retryable(exc: BaseException, retryable: Retryable) -> bool:
    """Return whether ``exc`` is retried under ``retryable`` (types or predicate)."""
    if isinstance(retryable, tuple):
        return isinstance(exc, retryable)
    return bool(retryable(exc))


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep retrying a failure the caller calls retryable.

    Attributes:
        max_attempts: total attempts including the first; ``None`` for no limit.
        base_delay: seconds; the cap of the first backoff interval.
        max_delay: seconds; no single wait is longer.
        deadline: seconds since the first attempt after which no further attempt starts;
            ``None`` for no limit. The last wait is shortened to end at the deadline.
        retryable: the errors retried when a call names none (default: none, every error
            surfaces at once).

    Raises:
        ValueError: on a negative delay, ``max_delay < base_delay``, ``max_attempts < 1`` or
            ``deadline <= 0``.
    """

    max_attempts: int | None = None
    base_delay: float = 0.2
    max_delay: float = 30.0
    deadline: float | None = None
    retryable: Retryable = ()

    def __post_init__(self) -> None:
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 or None, got {self.max_attempts}")
        if self.base_delay < 0 or self.max_delay < self.base_delay:
            raise ValueError(f"need 0 <= base_delay <= max_delay, got {self.base_delay}, "
                             f"{self.max_delay}")
        if self.deadline is not None and self.deadline <= 0:
            raise ValueError(f"deadline must be > 0 seconds or None, got {self.deadline}")

    def backoff(self, retry: int, rng: random.Random | None = None) -> float:
        """Return the wait in seconds before retry number ``retry`` (1 for the first)."""
        cap = min(self.max_delay, self.base_delay * 2.0 ** min(max(retry - 1, 0), 64))
        return (rng or random).uniform(0.0, cap)

    def retry_after(self, exc: BaseException, attempt: int, started: float, *,
                    retryable: Retryable | None = None, what: str = "operation",
                    sleep: Callable[[float], None] | None = None,
                    stop: threading.Event | None = None,
                    rng: random.Random | None = None,
                    clock: Callable[[], float] = time.monotonic,
                    on_retry: Callable[[int, float, BaseException], None] | None = None,
                    quiet: bool = False) -> bool:
        """After failed attempt number ``attempt`` (1-based): wait and return True to try
        again, or return False to give up (a note on ``exc`` then says why, for a retryable
        error). For loops that cannot be one :meth:`call` (a stream resumed where it broke);
        the arguments are :meth:`call`'s, plus ``started``, the ``clock()`` of attempt 1."""
        if not is_retryable(exc, self.retryable if retryable is None else retryable):
            return False
        delay = self.backoff(attempt, rng)
        why = ""
        if self.max_attempts is not None and attempt >= self.max_attempts:
            why = f"{attempt} attempts made"
        elif self.deadline is not None:
            remaining = self.deadline - (clock() - started)
            if remaining <= 0:
                why = f"deadline of {self.deadline:g} s passed after {attempt} attempts"
            delay = min(delay, max(remaining, 0.0))
        if not why and stop is not None and stop.is_set():
            why = f"stopped after {attempt} attempts"
        if why:
            exc.add_note(f"retry gave up: {why}")
            log.log(logging.DEBUG if quiet else logging.WARNING,
                    "giving up on %s: %s (%s)", what, exc, why)
            return False
        level = logging.DEBUG if quiet or attempt <= QUIET_RETRIES else logging.WARNING
        log.log(level, "retrying %s (retry %d) in %.2f s after %s", what, attempt, delay,
                _describe(exc))
        if on_retry is not None:
            on_retry(attempt, delay, exc)
        if sleep is not None:
            sleep(delay)
        elif stop is not None:
            stop.wait(delay)
        else:
            time.sleep(delay)
        if stop is not None and stop.is_set():
            exc.add_note(f"retry gave up: stopped after {attempt} attempts")
            return False
        return True

    def call(self, fn: Callable[[], T], *, retryable: Retryable | None = None,
             what: str = "operation",
             sleep: Callable[[float], None] | None = None,
             stop: threading.Event | None = None,
             rng: random.Random | None = None,
             clock: Callable[[], float] = time.monotonic,
             on_retry: Callable[[int, float, BaseException], None] | None = None,
             quiet: bool = False) -> T:
        """Call ``fn()`` until it returns, retrying the errors ``retryable`` names.

        Args:
            fn: the operation; called once per attempt.
            retryable: exception types or a predicate; default the policy's ``retryable``.
            what: what is being done, for log lines ("put chunks/ab/ab12.zst").
            sleep: waits the given seconds; default ``stop.wait`` if ``stop`` is given, else
                :func:`time.sleep`. Tests inject a fake.
            stop: when set, waiting ends early and the last error is raised.
            rng: random source for the jitter (default: the module's).
            clock: monotonic seconds, for the deadline.
            on_retry: called as ``on_retry(retry_number, delay_s, error)`` before each wait.
            quiet: log retries and giving up at DEBUG only (the caller reports failures).

        Returns:
            What ``fn`` returned.

        Raises:
            Exception: the last retryable error when attempts, the deadline or ``stop`` ran
                out (a note on it says how many attempts were made); any other error ``fn``
                raised, at once.
        """
        start = clock()
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as exc:
                if not self.retry_after(exc, attempt, start, retryable=retryable, what=what,
                                        sleep=sleep, stop=stop, rng=rng, clock=clock,
                                        on_retry=on_retry, quiet=quiet):
                    raise


def _describe(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if callable(code):  # a grpc.RpcError: its status is the useful part
        try:
            return f"{code().name}"
        except Exception:  # noqa: BLE001 - a describe must never fail
            pass
    return f"transient error: {exc}"
