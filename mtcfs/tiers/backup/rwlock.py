"""A shared/exclusive lock: many uploads at once, or one retention sweep alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class SharedExclusiveLock:
    """Readers-writer lock that prefers the writer.

    Any number of holders may share it; an exclusive holder waits until they are gone and
    keeps new shared holders out while it waits, so a sweep is not starved by a stream of
    uploads. Not reentrant.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0
        self._exclusive = False
        self._writers_waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the lock shared for the ``with`` block (blocks while a sweep runs or waits)."""
        with self._cond:
            while self._exclusive or self._writers_waiting:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if self._shared == 0:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the lock alone for the ``with`` block (blocks until shared holders leave)."""
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()

    @property
    def shared_holders(self) -> int:
        """How many shared holders there are right now (for tests and status)."""
        with self._cond:
            return self._shared
