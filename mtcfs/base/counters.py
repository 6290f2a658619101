"""Thread-safe monotonically increasing counters, for ``stats()`` and metrics export."""

from __future__ import annotations

import threading
from collections.abc import Iterable


class Counters:
    """A set of named integer counters that many threads add to.

    Args:
        names: counters that exist (at 0) from the start, so a snapshot always has them.
    """

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {n: 0 for n in names}

    def add(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` (default 1) to counter ``name``, creating it at 0 if new."""
        with self._lock:
            self._values[name] = self._values.get(name, 0) + amount

    def get(self, name: str) -> int:
        """Return the current value of ``name`` (0 if it was never added to)."""
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        """Return a consistent copy of all counters."""
        with self._lock:
            return dict(self._values)
