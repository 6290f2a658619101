"""Backends for tests that are our own implementations of the interface, not mocks.

:class:`FlakyBackend` wraps any :class:`~mtcfs.tiers.backup.backend.Backend` and fails a
seeded fraction of calls with :class:`~mtcfs.tiers.backup.errors.TransientError`, at one of
three moments:

* ``before``: the call fails without reaching the wrapped backend (a refused connection);
* ``after``: the wrapped backend did the work, then the reply is "lost" (a reset after the
  request went through): a put or delete happened although the caller saw an error;
* ``midway`` (listings only): some keys are yielded, then the iteration fails.

Only a retry layer above it (:class:`~mtcfs.tiers.backup.retry.RetryingBackend`) makes it
behave like a backend again, which is what the conformance suite checks: retries of
operations that did happen must be harmless (the interface promises idempotence).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from mtcfs.tiers.backup.backend import Backend
from mtcfs.tiers.backup.errors import TransientError

T = TypeVar("T")

__all__ = ["FlakyBackend"]


class FlakyBackend(Backend):
    """Wraps ``inner`` and fails calls with :class:`TransientError` at random.

    Args:
        inner: the backend that does the work.
        rate: fraction of calls (0..1) that fail.
        seed: seed of the random choices, so a run can be repeated.

    Raises:
        ValueError: if ``rate`` is outside [0, 1].
    """

    def __init__(self, inner: Backend, rate: float = 0.3, seed: int = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be within [0, 1], got {rate}")
        self.inner = inner
        self.rate = rate
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        #: faults injected so far, by moment ("before", "after", "midway")
        self.faults: dict[str, int] = {"before": 0, "after": 0, "midway": 0}

    def _fault(self, moments: tuple[str, ...]) -> str:
        """The moment at which this call fails, or "" for a call that succeeds."""
        with self._lock:
            if self._rng.random() >= self.rate:
                return ""
            moment = self._rng.choice(moments)
            self.faults[moment] += 1
            return moment

    def _do(self, what: str, fn: Callable[[], T]) -> T:
        moment = self._fault(("before", "after"))
        if moment == "before":
            raise TransientError(f"{what}: injected fault before the call")
        result = fn()
        if moment == "after":
            raise TransientError(f"{what}: injected fault after the call (reply lost)")
        return result

    def put(self, key: str, data: bytes) -> None:
        self._do(f"put {key}", lambda: self.inner.put(key, data))

    def get(self, key: str) -> bytes:
        return self._do(f"get {key}", lambda: self.inner.get(key))

    def exists(self, key: str) -> bool:
        return self._do(f"stat {key}", lambda: self.inner.exists(key))

    def list(self, prefix: str) -> Iterator[str]:
        moment = self._fault(("before", "midway"))
        if moment == "before":
            raise TransientError(f"list {prefix!r}: injected fault before the call")
        keys = self.inner.list(prefix)
        if moment == "midway":
            return self._fail_midway(prefix, keys)
        return keys

    @staticmethod
    def _fail_midway(prefix: str, keys: Iterator[str]) -> Iterator[str]:
        for i, key in enumerate(keys):
            if i == 1:
                raise TransientError(f"list {prefix!r}: injected fault while iterating")
            yield key
        raise TransientError(f"list {prefix!r}: injected fault at the end of the listing")

    def delete(self, key: str) -> None:
        self._do(f"delete {key}", lambda: self.inner.delete(key))

    def describe(self) -> str:
        return f"flaky({self.rate:g}) {self.inner.describe()}"
