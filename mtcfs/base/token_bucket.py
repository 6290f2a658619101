"""A byte-rate budget for a tier's background transfers (``replicate_rate=``,
``backup_rate=``): a token bucket that blocks the sending thread.

A classic token bucket (tokens are bytes, refilled at ``rate`` per second up to ``burst``)
where a take larger than what is there goes into debt: the taker pays now and sleeps until
the bucket is back at zero. So one chunk is never cut (the sender sends whole chunks) and
the long-run rate holds whatever the chunk size; the longest single wait is
``chunk / rate``. Thread-safe: the senders of one tier share one bucket, and each waits in
turn (the lock is not held while sleeping).

Only background transfers take from it: a restore, a fault-in, a peer's read of this node's
replicas never wait here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

#: The longest a single chunk may wait for its tokens, seconds: option parsing refuses a
#: rate under ``chunk_size / this``. Below the chunk stream's IO_TIMEOUT_S (30 s), the
#: silence after which a peer ends a stream (tiers/peer/chunk_stream.py).
MAX_CHUNK_WAIT_S = 10.0
#: The burst, in seconds of the rate: a transfer that was idle may send this much at once.
BURST_S = 0.25


class TokenBucket:
    """Bytes per second for one tier's background transfers.

    Args:
        rate: bytes per second; 0: unbounded (:meth:`take` counts, never waits).
        clock, sleep: for tests (seconds).

    Raises:
        ValueError: ``rate`` negative.
    """

    def __init__(self, rate: int, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if rate < 0:
            raise ValueError(f"a rate is bytes per second, at least 0; got {rate}")
        self.rate = rate
        self._burst = rate * BURST_S
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._tokens = self._burst
        self._at = clock()
        #: Bytes taken so far.
        self.bytes = 0
        #: Seconds takers slept for tokens so far (all threads together).
        self.waited_s = 0.0

    def take(self, n: int) -> float:
        """Take ``n`` bytes' worth, sleeping first if the bucket is in debt after it.
        Returns the seconds slept."""
        with self._lock:
            self.bytes += n
            if not self.rate:
                return 0.0
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
            self.waited_s += wait
        if wait:
            self._sleep(wait)
        return wait

    def figures(self) -> dict[str, Any]:
        """``rate`` (bytes/s, 0: unbounded), ``bytes`` taken, ``waited_s``: what status
        shows per tier under ``budget``."""
        with self._lock:
            return {"rate": self.rate, "bytes": self.bytes,
                    "waited_s": round(self.waited_s, 3)}
