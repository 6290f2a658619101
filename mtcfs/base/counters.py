"""Thread-safe monotonically increasing counters and histograms, for ``stats()`` and
metrics export."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence
from typing import Any


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


#: Upper bounds (seconds) of latency histograms: 1 ms to 10 min, about 2.5x apart (a small
#: file hashes in ms, a shard of many GB in tens of seconds on a busy host).
LATENCY_BOUNDS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                       0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 150.0, 600.0)


class Histogram:
    """Counts of observed values by bucket, for a Prometheus histogram; many threads add.

    Args:
        bounds: the buckets' inclusive upper bounds, increasing (e.g. seconds); values above
            the last go to an overflow bucket (Prometheus's ``le="+Inf"``).

    Raises:
        ValueError: ``bounds`` is empty or not strictly increasing.
    """

    def __init__(self, bounds: Sequence[float]) -> None:
        if not bounds or any(b >= a for a, b in zip(bounds[1:], bounds)):
            raise ValueError(f"histogram bounds must increase strictly: {list(bounds)}")
        self._lock = threading.Lock()
        self.bounds: tuple[float, ...] = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation of ``value`` (in the unit of ``bounds``)."""
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy, JSON-ready: ``{"bounds": [b, ...], "counts": [n, ...],
        "sum": s, "count": n}``; ``counts`` has one entry per bound (values <= it and above
        the bound before, not cumulative) and a last one for values above every bound."""
        with self._lock:
            counts = list(self._counts)
            total = self._sum
        return {"bounds": list(self.bounds), "counts": counts, "sum": total,
                "count": sum(counts)}
