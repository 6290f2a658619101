"""The one retry policy of the backup tier, and a backend wrapper that applies it.

Only :class:`TransientError` is retried; every other error surfaces at once. Waits follow
"full jitter" exponential backoff (Marc Brooker, "Exponential Backoff And Jitter", AWS
Architecture Blog, 2015): before retry ``n`` (1-based) sleep a uniformly random time in
``[0, min(max_delay, base_delay * 2**(n-1))]``. Randomising the whole interval spreads out
the retries of a thousand nodes that all saw the same 503 at the same moment, which fixed or
"equal" jitter does much less well.

The GCS client library's own retries are switched off (``retry=None``) so that this is the
only policy: one place to tune, one set of counters, no multiplied waits.

Retrying blindly is safe because every backend operation is idempotent: puts write
content-addressed chunks or write-once markers, deletes of missing keys succeed.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from mtcfs.tiers.backup.backend import Backend
from mtcfs.base.counters import Counters
from mtcfs.tiers.backup.errors import TransientError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Retries up to this number are logged at DEBUG, later ones at WARNING.
QUIET_RETRIES = 3


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep retrying a transient failure.

    Attributes:
        max_attempts: total attempts including the first; ``None`` for no limit.
        base_delay: seconds; the cap of the first backoff interval.
        max_delay: seconds; no single wait is longer.
        deadline: seconds since the first attempt after which no further attempt starts;
            ``None`` for no limit. The last wait is shortened to end at the deadline.

    Raises:
        ValueError: on a negative delay, ``max_delay < base_delay``, ``max_attempts < 1`` or
            ``deadline <= 0``.
    """

    max_attempts: int | None = None
    base_delay: float = 0.2
    max_delay: float = 30.0
    deadline: float | None = None

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

    def call(self, fn: Callable[[], T], *, what: str = "operation",
             sleep: Callable[[float], None] | None = None,
             stop: threading.Event | None = None,
             rng: random.Random | None = None,
             clock: Callable[[], float] = time.monotonic,
             on_retry: Callable[[int, float, TransientError], None] | None = None) -> T:
        """Call ``fn()`` until it returns, retrying :class:`TransientError` per this policy.

        Args:
            fn: the operation; called once per attempt.
            what: what is being done, for log lines ("put chunks/ab/ab12.zst").
            sleep: waits the given seconds; default ``stop.wait`` if ``stop`` is given, else
                :func:`time.sleep`. Tests inject a fake.
            stop: when set, waiting ends early and the last error is raised.
            rng: random source for the jitter (default: the module's).
            clock: monotonic seconds, for the deadline.
            on_retry: called as ``on_retry(retry_number, delay_s, error)`` before each wait.

        Returns:
            What ``fn`` returned.

        Raises:
            TransientError: the last one, when attempts, the deadline or ``stop`` ran out
                (a note on it says how many attempts were made).
            Exception: anything else ``fn`` raised, at once.
        """
        start = clock()
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except TransientError as exc:
                delay = self.backoff(attempt, rng)
                why = ""
                if self.max_attempts is not None and attempt >= self.max_attempts:
                    why = f"{attempt} attempts made"
                elif self.deadline is not None:
                    remaining = self.deadline - (clock() - start)
                    if remaining <= 0:
                        why = f"deadline of {self.deadline:g} s passed after {attempt} attempts"
                    delay = min(delay, max(remaining, 0.0))
                if not why and stop is not None and stop.is_set():
                    why = f"stopped after {attempt} attempts"
                if why:
                    exc.add_note(f"retry gave up: {why}")
                    log.warning("giving up on %s: %s (%s)", what, exc, why)
                    raise
                level = logging.DEBUG if attempt <= QUIET_RETRIES else logging.WARNING
                log.log(level, "retrying %s (retry %d) in %.2f s after transient error: %s",
                        what, attempt, delay, exc)
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
                    raise


class RetryingBackend(Backend):
    """A :class:`Backend` that retries every call of the backend it wraps.

    ``list`` is retried as a whole: the listing is read completely inside the retried call
    and then yielded, so a failure on page 7 restarts the listing instead of leaving the
    caller with half of it. That buffers the key names (about 100 bytes each).

    Args:
        backend: the backend to call.
        policy: the retry policy; default ``RetryPolicy()`` (retry forever, 0.2 s .. 30 s).
        sleep: injectable wait function (seconds), for tests.
        stop: when set (daemon shutdown), retries stop and the last error is raised.
        rng: random source for the jitter, for reproducible tests.
    """

    def __init__(self, backend: Backend, policy: RetryPolicy | None = None, *,
                 sleep: Callable[[float], None] | None = None,
                 stop: threading.Event | None = None,
                 rng: random.Random | None = None) -> None:
        self._inner = backend
        self._policy = policy or RetryPolicy()
        self._sleep = sleep
        self._stop = stop
        self._rng = rng
        self._counters = Counters(("retries", "retry_wait_ms", "gave_up"))

    @property
    def inner(self) -> Backend:
        """The wrapped backend."""
        return self._inner

    @property
    def policy(self) -> RetryPolicy:
        return self._policy

    def stats(self) -> dict[str, int]:
        """Return counters: ``retries`` (waits done), ``retry_wait_ms`` (total jittered wait
        chosen, in ms), ``gave_up`` (calls that failed with a transient error in the end)."""
        return self._counters.snapshot()

    def _on_retry(self, retry: int, delay: float, exc: TransientError) -> None:
        self._counters.add("retries")
        self._counters.add("retry_wait_ms", int(delay * 1000))

    def _call(self, fn: Callable[[], T], what: str) -> T:
        try:
            return self._policy.call(fn, what=f"{what} on {self._inner.describe()}",
                                     sleep=self._sleep, stop=self._stop, rng=self._rng,
                                     on_retry=self._on_retry)
        except TransientError:
            self._counters.add("gave_up")
            raise

    def put(self, key: str, data: bytes) -> None:
        self._call(lambda: self._inner.put(key, data), f"put {key}")

    def get(self, key: str) -> bytes:
        return self._call(lambda: self._inner.get(key), f"get {key}")

    def exists(self, key: str) -> bool:
        return self._call(lambda: self._inner.exists(key), f"stat {key}")

    def list(self, prefix: str) -> Iterator[str]:
        keys = self._call(lambda: list(self._inner.list(prefix)), f"list {prefix!r}")
        return iter(keys)

    def delete(self, key: str) -> None:
        self._call(lambda: self._inner.delete(key), f"delete {key}")

    def describe(self) -> str:
        return self._inner.describe()
