"""mtcfs/base/ahead.py: work a few items ahead of its consumer, in a thread of its own."""

from __future__ import annotations

import threading

import pytest

from mtcfs.base.ahead import ahead


def test_results_come_in_order_computed_at_most_depth_ahead():
    done: list[int] = []
    gate = threading.Event()

    def fn(i: int) -> int:
        done.append(i)
        return i * 10

    it = ahead(range(10), fn, depth=2, name="t-ahead")
    assert next(it) == 0
    gate.wait(0.2)  # time for the thread to run ahead as far as it may
    assert len(done) <= 1 + 2 + 1  # the one yielded, two queued, one waiting to be queued
    assert list(it) == [i * 10 for i in range(1, 10)]


def test_an_exception_is_raised_in_the_consumer_at_its_place():
    def fn(i: int) -> int:
        if i == 3:
            raise OSError(5, "boom")
        return i

    got = []
    with pytest.raises(OSError, match="boom"):
        for x in ahead(range(10), fn, depth=2, name="t-ahead"):
            got.append(x)
    assert got == [0, 1, 2]


def test_results_not_yielded_are_discarded_when_the_consumer_stops():
    discarded: list[int] = []
    it = ahead(range(10), lambda i: i, depth=3, name="t-ahead", discard=discarded.append)
    assert next(it) == 0
    threading.Event().wait(0.2)
    it.close()
    # every item computed was either yielded (0) or discarded, none twice
    assert discarded and sorted(discarded) == list(range(1, len(discarded) + 1))
