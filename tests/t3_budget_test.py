"""The RAM budget (core/budget.py) alone, then through the core in-process (no FUSE).

Every core test ends with the budget's invariant: ``used`` is the sum of the registered
versions' ``alloc``, which is what their data files hold (``du`` of ``<store>/data``), and
nothing is left in flight.
"""

from __future__ import annotations

import errno
import os

import pytest
import trio
from support.corefs import CS, open_fs, run, sealed, write_file

from mtcfs.base.errors import FsError
from mtcfs.core.budget import PAGE, RamBudget
from mtcfs.core.model import ROOT_INO, Version
from mtcfs.core.records import Counters

# ---------------------------------------------------------------------- the budget alone


class Files:
    """Data files for bare Version objects: ``fd_of`` for the budget."""

    def __init__(self, tmp_path) -> None:
        self.dir = tmp_path
        self.fds: dict[int, int] = {}

    def fd_of(self, v: Version) -> int:
        if v.vid not in self.fds:
            self.fds[v.vid] = os.open(self.path(v.vid), os.O_RDWR | os.O_CREAT, 0o600)
        return self.fds[v.vid]

    def path(self, vid: int) -> str:
        return str(self.dir / f"v{vid}")

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def blocks(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_account_counts_what_the_file_holds_and_holes_cost_nothing(tmp_path):
    files = Files(tmp_path)
    b = RamBudget(1 << 20, fd_of=files.fd_of, counters=Counters())
    v = Version(vid=1, ino=2, size=0, chunk_size=CS)
    fd = files.fd_of(v)
    os.pwrite(fd, b"x" * 3 * PAGE, 0)
    b.account(v)
    assert v.alloc == blocks(files.path(1)) >= 3 * PAGE and b.used == v.alloc
    os.ftruncate(fd, 1 << 20)  # a hole: no pages
    v.size = 1 << 20
    b.account(v)
    assert b.used == v.alloc == blocks(files.path(1))
    # a write over data adds nothing, one into the hole adds its pages
    assert b.new_bytes(v, 0, 2 * PAGE) == 0
    assert b.new_bytes(v, 10 * PAGE + 1, 12 * PAGE) == 2 * PAGE  # pages 10 and 11
    w = Version(vid=2, ino=3, size=0, chunk_size=CS)
    os.pwrite(files.fd_of(w), b"y" * PAGE, 0)
    b.account(w)
    b.remove(v)
    assert v.alloc == 0 and b.used == w.alloc
    b.clear()
    assert b.used == 0
    b.add(w)
    assert b.used == w.alloc
    b.measure_all([v, w], files.path)  # start over from the files
    assert b.used == blocks(files.path(1)) + blocks(files.path(2))
    files.close()


def test_figures_count_the_replicas_and_free_is_never_negative(tmp_path):
    files = Files(tmp_path)
    b = RamBudget(10 * PAGE, fd_of=files.fd_of, counters=Counters())
    v = Version(vid=1, ino=2, size=0, chunk_size=CS)
    os.pwrite(files.fd_of(v), b"x" * 4 * PAGE, 0)
    b.account(v)
    b.shared_used = lambda: 3 * PAGE
    assert b.figures(files=7) == {"capacity": 10 * PAGE, "used": v.alloc + 3 * PAGE,
                                  "replicas": 3 * PAGE, "free": 10 * PAGE - v.alloc - 3 * PAGE,
                                  "files": 7}
    b.shared_used = lambda: 100 * PAGE
    assert b.figures(files=0)["free"] == 0 == b.free()
    files.close()


def test_reserve_settles_then_makes_room_then_refuses(tmp_path):
    files = Files(tmp_path)
    counters = Counters()
    calls: list = []
    v = Version(vid=1, ino=2, size=0, chunk_size=CS)

    async def settle() -> None:
        calls.append("settle")

    def make_room(need: int, keep_unsaved: bool) -> None:
        calls.append(("evict", need, keep_unsaved))
        if not keep_unsaved:  # the policy frees this version's data
            os.ftruncate(files.fd_of(v), 0)
            b.account(v)

    b = RamBudget(8 * PAGE, fd_of=files.fd_of, counters=counters, settle=settle,
                  make_room=make_room)
    os.pwrite(files.fd_of(v), b"x" * 6 * PAGE, 0)
    b.account(v)

    async def main() -> None:
        assert await b.reserve(2 * PAGE) and calls == []  # fits: nothing asked
        # a read's reservation: never deletes unsaved steps; short, it says so
        assert not await b.reserve(4 * PAGE, best_effort=True)
        assert calls == ["settle", ("evict", 2 * PAGE, True)] and counters.enospc == 0
        calls.clear()
        assert await b.reserve(4 * PAGE)  # a write's: the policy evicts
        assert calls == ["settle", ("evict", 2 * PAGE, False)] and b.used == 0
        with b.hold(5 * PAGE):  # bytes in flight count against later reservations
            assert b.in_flight == 5 * PAGE and not b.fits(4 * PAGE)
            assert b.fits(4 * PAGE, in_flight=False)
            with pytest.raises(FsError) as e:
                await b.reserve(4 * PAGE)
            assert e.value.errno == errno.ENOSPC and counters.enospc == 1
        assert b.in_flight == 0 and b.fits(8 * PAGE)

    trio.run(main)
    files.close()


# ---------------------------------------------------------------------- through the core


def check_budget(fs) -> None:
    """The budget's invariant (see module docstring)."""
    assert fs.budget.in_flight == 0
    assert fs.used == fs.budget.used == sum(v.alloc for v in fs.versions.values())
    data = fs.store.data_path(0).rsplit("/", 1)[0]
    on_disk = sum(os.stat(os.path.join(data, n)).st_blocks * 512 for n in os.listdir(data))
    assert fs.used == on_disk
    s = fs.statfs()
    assert s["used"] == fs.used + fs.budget.shared_used() and s["files"] == len(fs.inodes)


def test_writes_rewrites_and_unlinks_keep_the_budget_exact(tmp_path):
    async def body(fs) -> None:
        a = await write_file(fs, ROOT_INO, b"a", os.urandom(3 * CS))
        await sealed(fs, a)
        check_budget(fs)
        fh, _ = await fs.open(a, os.O_WRONLY)  # copy-on-write of a sealed file
        await fs.write(fh, 10 * CS, b"z")      # past the end: a hole, then one page
        await fs.release(fh)
        await sealed(fs, a)
        check_budget(fs)
        await fs.unlink(ROOT_INO, b"a")
        assert fs.used == 0
        check_budget(fs)
        with pytest.raises(AttributeError):
            fs.used = 5  # read-only: only the budget changes it

    run(body, tmp_path, capacity=1 << 30)


def test_a_full_tier_refuses_writes_counting_the_replicas(tmp_path):
    async def body(fs) -> None:
        await write_file(fs, ROOT_INO, b"a", os.urandom(4 * CS))
        fs.budget.shared_used = lambda: 3 * CS  # the peer tier's replicas share the budget
        assert fs.budget.shared_used() == 3 * CS
        with pytest.raises(FsError) as e:
            await write_file(fs, ROOT_INO, b"b", os.urandom(2 * CS))
        assert e.value.errno == errno.ENOSPC and fs.counters.enospc >= 1
        check_budget(fs)
        fs.budget.shared_used = lambda: 0
        await write_file(fs, ROOT_INO, b"c", os.urandom(2 * CS))
        assert fs.statfs()["free"] == fs.capacity - fs.used
        check_budget(fs)

    run(body, tmp_path, capacity=8 * CS)


def test_pressure_evicts_a_backed_up_step_and_the_budget_follows(tmp_path):
    async def body(fs) -> None:
        for n in (1, 2):
            d = await fs.mkdir(ROOT_INO, b"step_%d" % n, 0o755, 0, 0)
            f = await write_file(fs, d.ino, b"x", os.urandom(3 * CS))
            await sealed(fs, f)
            fs.step_registry.seal(f"step_{n}")
        fs.steps["step_1"].backed_up_ns = 1  # the backup tier holds it: its data may go
        check_budget(fs)
        before = fs.used
        d = await fs.mkdir(ROOT_INO, b"step_3", 0o755, 0, 0)
        await write_file(fs, d.ino, b"x", os.urandom(3 * CS))  # needs step_1's room
        assert fs.counters.evicted_steps == 1
        step1 = fs.tree.resolve("step_1/x")
        assert fs.versions[step1.vid].alloc == 0 and fs.versions[step1.vid].missing
        assert fs.used <= before
        check_budget(fs)

    run(body, tmp_path, capacity=7 * CS)


async def _sealed_step(fs, name: bytes) -> None:
    """``name`` with one sealed file of 3 chunks, committed with ``mtcfs seal``."""
    d = await fs.mkdir(ROOT_INO, name, 0o755, 0, 0)
    await sealed(fs, await write_file(fs, d.ino, b"x", os.urandom(3 * CS)))
    fs.step_registry.seal(name.decode())


def test_the_newest_checkpoint_sealed_under_a_name_without_a_number_is_kept(tmp_path):
    """``mtcfs seal /mnt/ckpt/final_model`` after step_1 and step_2: the seal is the newest
    checkpoint. Under pressure the oldest step goes (step_1), and the newest is never
    deleted. Before, a name without a step number counted as step 0, the oldest: the
    seal made a moment ago was deleted first (no other tier held it)."""
    async def body(fs) -> None:
        for name in (b"step_1", b"step_2", b"final_model"):
            await _sealed_step(fs, name)
        d = await fs.mkdir(ROOT_INO, b"step_3", 0o755, 0, 0)
        await write_file(fs, d.ino, b"x", os.urandom(3 * CS))  # needs one step's room
        assert fs.eviction.unsaved_deleted == ["step_1"]
        assert "final_model" in fs.steps

    run(body, tmp_path, capacity=10 * CS)


def test_a_write_that_cannot_fit_whatever_goes_deletes_no_checkpoint(tmp_path):
    """A write larger than all that eviction could free gets ENOSPC, and the steps no
    other tier holds stay: deleting them would not have made it fit. Before, eviction
    deleted them one by one, and the write failed anyway."""
    async def body(fs) -> None:
        for n in (1, 2, 3):
            await _sealed_step(fs, b"step_%d" % n)
        fh, _ = await fs.create(ROOT_INO, b"big", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
        with pytest.raises(FsError) as exc:
            await fs.write(fh, 0, b"z" * (12 * CS))  # past size= whatever is evicted
        await fs.release(fh)
        assert exc.value.errno == errno.ENOSPC
        assert sorted(fs.steps) == ["step_1", "step_2", "step_3"]
        assert fs.eviction.unsaved_deleted == []

    run(body, tmp_path, capacity=10 * CS)


def test_a_reload_measures_the_store_again(tmp_path):
    async def body(fs) -> None:
        await write_file(fs, ROOT_INO, b"a", os.urandom(2 * CS + 5))
        check_budget(fs)

    run(body, tmp_path, capacity=1 << 30)
    fs = open_fs(tmp_path / "store")
    try:
        assert fs.used > 2 * CS
        check_budget(fs)
    finally:
        fs.close()
        fs.store.close()
