"""The named pools (mtcfs.base.pools): one bounded executor per name and process, a per-call
width, inline nesting, the first error raised after the running items ended."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from mtcfs.base import pools


def test_specs_are_bounded_and_described() -> None:
    for name, spec in pools.POOLS.items():
        assert spec.name == name and spec.size >= 1 and spec.purpose
    assert pools.limiter("cpu").total_tokens == 2
    assert pools.limiter("peer-calls", 3).total_tokens == 3
    with pytest.raises(KeyError):
        pools.limiter("backup-io")  # an executor, not a limiter
    with pytest.raises(KeyError):
        pools.pool("nope")
    ex = pools.new_executor("peer-server", 2)
    assert ex.submit(lambda: threading.current_thread().name).result().startswith(
        "mtcfs-peer-server")
    ex.shutdown()


def test_width_order_names_and_nesting() -> None:
    lock = threading.Lock()
    now = [0, 0]  # in flight, most seen
    names: set[str] = set()

    def work(i: int) -> int:
        with lock:
            now[0] += 1
            now[1] = max(now[1], now[0])
            names.add(threading.current_thread().name)
        time.sleep(0.01)
        with lock:
            now[0] -= 1
        return i * i

    assert pools.run_map("backup-io", work, range(20), 3) == [i * i for i in range(20)]
    assert now[1] == 3
    assert all(n.startswith("mtcfs-backup-io") for n in names)
    assert pools.pool("backup-io") is pools.pool("backup-io")
    # an item asking the same pool runs its items inline instead of waiting for a thread
    outer = pools.run_map("backup-io", lambda i: sum(pools.run_map(
        "backup-io", lambda j: j, range(i), 4)), range(40), 16)
    assert outer == [sum(range(i)) for i in range(40)]
    assert pools.stats()["backup-io"]["threads"] <= pools.POOLS["backup-io"].size


def test_first_error_raised_after_running_items_end() -> None:
    started: list[int] = []
    ended: list[int] = []

    def work(i: int) -> int:
        started.append(i)
        if i == 2:
            raise OSError("disk")
        time.sleep(0.05)
        ended.append(i)
        return i

    with pytest.raises(OSError):
        list(pools.run_unordered("backup-io", work, range(50), 4))
    assert len(started) < 50  # the rest never started
    assert sorted(ended) == sorted(i for i in started if i != 2)  # nothing runs on after


def test_shutdown_then_fresh_pool_and_limiter_in_trio() -> None:
    first = pools.pool("backup-io")
    pools.shutdown()
    assert pools.pool("backup-io") is not first

    async def main() -> int:
        lim = pools.limiter("backup-fetch")
        got = await trio.to_thread.run_sync(lambda: 7, limiter=lim)
        return got + lim.borrowed_tokens

    assert trio.run(main) == 7
