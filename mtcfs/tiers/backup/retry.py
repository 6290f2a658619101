"""The backup tier's retry policy, and a backend wrapper that applies it.

The policy is :class:`mtcfs.base.retry.RetryPolicy` (full-jitter exponential backoff,
attempts, deadline, stop), with :class:`TransientError` as the only kind of error retried;
every other error surfaces at once.

The GCS client library's own retries are switched off (``retry=None``) so that this is the
only policy: one place to tune, one set of counters, no multiplied waits.

Retrying blindly is safe because every backend operation is idempotent: puts write
content-addressed chunks or write-once markers, deletes of missing keys succeed.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from mtcfs.base import retry as base_retry
from mtcfs.base.retry import QUIET_RETRIES, Retryable
from mtcfs.tiers.backup.backend import Backend
from mtcfs.base.counters import Counters
from mtcfs.tiers.backup.errors import TransientError

__all__ = ["QUIET_RETRIES", "RetryPolicy", "RetryingBackend"]

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy(base_retry.RetryPolicy):
    """:class:`mtcfs.base.retry.RetryPolicy` retrying :class:`TransientError` by default.

    Attributes:
        max_attempts: total attempts including the first; ``None`` for no limit.
        base_delay: seconds; the cap of the first backoff interval.
        max_delay: seconds; no single wait is longer.
        deadline: seconds since the first attempt after which no further attempt starts;
            ``None`` for no limit.
        retryable: the errors retried (default ``(TransientError,)``).

    Raises:
        ValueError: as the base policy.
    """

    retryable: Retryable = (TransientError,)


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

    def _on_retry(self, retry: int, delay: float, exc: BaseException) -> None:
        self._counters.add("retries")
        self._counters.add("retry_wait_ms", int(delay * 1000))

    def _call(self, fn: Callable[[], T], what: str) -> T:
        try:
            return self._policy.call(fn, retryable=(TransientError,),
                                     what=f"{what} on {self._inner.describe()}",
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
