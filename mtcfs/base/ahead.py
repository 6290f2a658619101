"""Work done a few items ahead of its consumer, in a thread of its own.

A sender that reads (and hashes) a chunk and then sends it leaves the connection idle while
it reads; with :func:`ahead` the next items are read while the current one is sent. Used by
the peer tier's streams (tiers/peer/get_stream.py, tiers/peer/chunk_stream.py);
docs/architecture.md lists the threads.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_END = object()
#: Seconds between the consumer's looks at whether the producing thread still runs.
_POLL_S = 1.0


def ahead(items: Iterable[T], fn: Callable[[T], R], *, depth: int, name: str,
          discard: Callable[[R], None] | None = None) -> Iterator[R]:
    """Yield ``fn(item)`` for each of ``items``, in order, computed in a thread named
    ``name`` up to ``depth`` items ahead of the consumer.

    An exception ``fn`` raises is raised here, in the consumer, at that item's place (the
    thread stops there). When the consumer stops early (closes the generator, or raises),
    the thread stops after the item it is on, and every result computed but not yielded is
    given to ``discard`` (to close what it holds open).
    """
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        for item in items:
            try:
                out: Any = (True, fn(item))
            except BaseException as exc:  # noqa: BLE001 (re-raised in the consumer)
                put((False, exc))
                return
            if not put(out):
                if discard is not None:
                    discard(out[1])
                return
        put(_END)

    worker = threading.Thread(target=produce, name=name, daemon=True)
    worker.start()
    try:
        while True:
            try:
                got = q.get(timeout=_POLL_S)
            except queue.Empty:
                if worker.is_alive():
                    continue
                try:
                    got = q.get_nowait()
                except queue.Empty:
                    raise RuntimeError(f"{name}: the producing thread ended early") from None
            if got is _END:
                return
            ok, value = got
            if not ok:
                raise value
            yield value
    finally:
        stop.set()
        worker.join(timeout=5)
        while True:  # what was computed ahead and not yielded
            try:
                got = q.get_nowait()
            except queue.Empty:
                break
            if got is not _END and got[0] and discard is not None:
                discard(got[1])
