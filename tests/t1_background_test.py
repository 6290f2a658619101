"""The background budget's parts (issue 45): the CPU policy of background threads
(mtcfs.base.background), the calls sent to them from trio (pools.run_background) and the
byte-rate bucket (mtcfs.base.token_bucket)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import trio

from mtcfs.base import background, pools
from mtcfs.base.background import CpuPolicy, format_cpus, parse_cpus
from mtcfs.base.token_bucket import BURST_S, TokenBucket


@pytest.fixture
def policy() -> Iterator[None]:
    """Pools made during the test get the test's policy; afterwards they are ended, so the
    worker's later tests get fresh threads of the normal class."""
    pools.shutdown()
    yield
    pools.shutdown()
    background.configure(CpuPolicy(sched="normal"))


def _class_of_thread() -> tuple[int, int, frozenset[int], str]:
    tid = threading.get_native_id()
    return (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, tid),
            frozenset(os.sched_getaffinity(0)), threading.current_thread().name)


def test_cpu_lists_parse_as_taskset_takes_them() -> None:
    assert parse_cpus("1") == {1}
    assert parse_cpus("0,2-4, 7") == {0, 2, 3, 4, 7}
    assert format_cpus(parse_cpus("0,2-4,7")) == "0,2-4,7"
    for bad in ("", "a", "1-", "3-1", "-2", "1,,2", "5000"):
        with pytest.raises(ValueError):
            parse_cpus(bad)
    with pytest.raises(ValueError):
        CpuPolicy(sched="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        CpuPolicy(sched="batch", nice=20)


@pytest.mark.usefixtures("policy")
def test_background_calls_run_on_idle_class_threads_and_the_loop_keeps_its_class() -> None:
    cpus = frozenset({max(os.sched_getaffinity(0))})
    background.configure(CpuPolicy(sched="idle", cpus=cpus))
    before = _class_of_thread()

    async def main() -> tuple[object, object, object]:
        lim = trio.CapacityLimiter(1)
        bg = await pools.run_background(_class_of_thread, limiter=lim)
        fg = await trio.to_thread.run_sync(_class_of_thread)
        # A thread a background thread starts inherits its class (the hash pool's helpers
        # are made by pools.pool(), which sets it anyway).
        child = await pools.run_background(
            lambda: pools.pool("hash").submit(_class_of_thread).result())
        return bg, fg, child

    bg, fg, child = trio.run(main)
    assert bg[0] == os.SCHED_IDLE and bg[2] == cpus and bg[3].startswith("mtcfs-background")
    assert child[0] == os.SCHED_IDLE and child[2] == cpus  # type: ignore[index]
    assert fg[0] == before[0] and fg[2] == before[2]  # trio's own workers: untouched
    assert _class_of_thread()[:3] == before[:3]  # the calling thread too
    st = background.stats()
    assert st["sched"] == "idle" and st["cpus"] == format_cpus(cpus) and st["threads"] >= 2
    assert st["error"] is None and st["cpu_s"] >= 0 and st["runqueue_wait_s"] >= 0


@pytest.mark.usefixtures("policy")
def test_batch_and_nice_reach_the_thread() -> None:
    background.configure(CpuPolicy(sched="batch", nice=7))
    got = pools.pool("backup-upload").submit(_class_of_thread).result()
    assert got[0] == os.SCHED_BATCH and got[1] == 7
    fg = pools.pool("backup-io").submit(_class_of_thread).result()  # not a background pool
    assert fg[0] == os.SCHED_OTHER and fg[1] == 0


@pytest.mark.usefixtures("policy")
def test_a_policy_the_kernel_refuses_is_reported_not_raised() -> None:
    # A CPU the process may not use: sched_setaffinity gives EINVAL.
    background.configure(CpuPolicy(sched="normal", cpus=frozenset({4095})))
    got = pools.pool("hash").submit(_class_of_thread).result()
    assert got[2] == frozenset(os.sched_getaffinity(0))  # ran as it was
    assert "not applied" in (background.stats()["error"] or "")


def test_run_background_keeps_the_token_until_the_abandoned_call_ends() -> None:
    release = threading.Event()

    async def main() -> None:
        lim = trio.CapacityLimiter(1)
        with trio.move_on_after(0.05):
            await pools.run_background(release.wait, 5, limiter=lim, abandon_on_cancel=True)
        assert lim.borrowed_tokens == 1  # the call still runs: its token is held
        release.set()
        with trio.fail_after(5):
            while lim.borrowed_tokens:
                await trio.sleep(0.01)
        with pytest.raises(ZeroDivisionError):
            await pools.run_background(lambda: 1 // 0, limiter=lim)
        assert lim.borrowed_tokens == 0
        # Without abandon_on_cancel the call cannot be cancelled: it returns its result.
        with trio.CancelScope() as scope:
            scope.cancel()
            assert await pools.run_background(lambda: time.sleep(0.05) or 42) == 42

    trio.run(main)


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_the_bucket_holds_the_rate_over_whole_chunks() -> None:
    t = FakeTime()
    b = TokenBucket(10 << 20, clock=t.clock, sleep=t.sleep)  # 10 MiB/s
    start = t.now
    for _ in range(25):  # 100 MiB in 4 MiB chunks
        b.take(4 << 20)
    # The burst (0.25 s of the rate) is sent at once; the rest at the rate.
    assert t.now - start == pytest.approx(10 - BURST_S, abs=1e-6)
    assert max(t.slept) == pytest.approx(0.4, abs=1e-6)  # one chunk / rate at most
    fig = b.figures()
    assert fig["bytes"] == 100 << 20 and fig["rate"] == 10 << 20
    assert fig["waited_s"] == pytest.approx(10 - BURST_S, abs=1e-3)
    t.now += 60  # idle: the bucket refills to its burst, not beyond
    t.slept.clear()
    b.take(5 << 19)  # 2.5 MiB: within the burst
    assert not t.slept


def test_an_unbounded_bucket_counts_and_never_waits() -> None:
    t = FakeTime()
    b = TokenBucket(0, clock=t.clock, sleep=t.sleep)
    for _ in range(100):
        assert b.take(1 << 30) == 0
    assert not t.slept and b.figures() == {"rate": 0, "bytes": 100 << 30, "waited_s": 0.0}
    with pytest.raises(ValueError):
        TokenBucket(-1)


def test_threads_sharing_a_bucket_share_its_rate() -> None:
    b = TokenBucket(40 << 20)  # real clock: 8 threads x 1 MiB each = 8 MiB at 40 MiB/s
    t0 = time.monotonic()
    ths = [threading.Thread(target=b.take, args=(1 << 20,)) for _ in range(8)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(10)
    took = time.monotonic() - t0
    assert took >= (8 - 40 * BURST_S) / 40 * 0.95  # (8 MiB - the 10 MiB burst: no wait)
    b.take(8 << 20)  # now in debt: this one waits for its 8 MiB
    assert time.monotonic() - t0 >= (16 - 10) / 40 * 0.95
