"""Review of the scope=job store-full wait (commit bc35589): what a node whose store
filesystem filled up meets beyond tests/t7_job_store_full_test.py.

Each test: two daemons, a real etcd, rank 1's store on a 24 MiB tmpfs that another process
fills (on a training host /dev/shm is shared with data loaders and NCCL)."""

from __future__ import annotations

import errno
import os
import time

import pytest

from mtcfs.tiers.coord.etcd import Etcd
from support.etcd import shared_etcd
from support.fullstore import MiB
from support.fullstore import fill as _fill
from support.fullstore import job_with_small_store as _job_with_small_store
from support.fullstore import seed_then_fill


def _ns(c, rank: int) -> dict:
    return c.status(rank)["namespace"]


def test_an_unlink_on_a_store_full_to_the_last_byte_waits_and_stays_done(make_cluster):
    """Rank 1's store filesystem full to its last byte (the filler does not stop at the
    reserve), rank 0 removes a file (a checkpoint rotation does). Unlink may use the
    reserve, so it was applied on rank 1 without the room check: its commit failed
    (SQLITE_FULL) with the file already gone from rank 1's namespace in memory but not from
    its rows; rank 1 set ``diverged``, etcd was reported unreachable, and after a restart
    the removed file was back on rank 1 alone, ``diverged`` forgotten. It must wait for
    room like any other op, then apply it for good."""
    with _job_with_small_store(make_cluster) as (c, store1):
        n0, n1 = c.node(0), c.node(1)
        filler = seed_then_fill(c, store1, {"a": b"first", "b": b"second"})
        n0.path("step_1", "a").unlink()
        ns = n1.wait_for(lambda: (_ns(c, 1).get("waiting_for_room") or _ns(c, 1)["diverged"])
                         and _ns(c, 1), 30, "rank 1 to wait for room")
        assert not ns["diverged"], ns
        assert ns["waiting_for_room"], ns
        assert not ns["unavailable_s"], ns  # etcd answers: the wait is this node's
        filler.unlink()
        n1.wait_for(lambda: not _ns(c, 1).get("waiting_for_room"), 30, "rank 1 to go on")
        assert os.listdir(n1.path("step_1")) == ["b"]
        assert not _ns(c, 1)["diverged"]
        c.restart(1)
        n1 = c.node(1)
        assert os.listdir(n1.path("step_1")) == ["b"] == os.listdir(n0.path("step_1"))


@pytest.mark.xfail(strict=True, reason="a node that waits applies no op after the one it "
                   "waits at, not even the unlink that would free its room")
def test_removing_the_full_nodes_own_files_gives_it_room(make_cluster):
    """Rank 1's store holds a 3 MiB file of its own (replicas=1: the only copy); another
    process then takes the rest of the filesystem. rank 0 makes a directory (rank 1 waits
    at it), then the job removes rank 1's old file to make room (a checkpoint rotation).
    The unlink is committed after the op rank 1 waits at, so rank 1 never applies it and
    never frees the 3 MiB: it waits for ever although the job freed room for it."""
    with _job_with_small_store(make_cluster) as (c, store1):
        n0, n1 = c.node(0), c.node(1)
        filler = store1 / "filler.bin"
        _fill(filler, leave=7 * MiB)
        n1.path("step_1").mkdir()
        n1.path("step_1", "big").write_bytes(os.urandom(3 * MiB))
        n0.wait_for(lambda: os.path.exists(n0.path("step_1", "big")), 30, "big on rank 0")
        _fill(filler)  # the other process grows
        n0.path("step_2").mkdir()
        n1.wait_for(lambda: _ns(c, 1).get("waiting_for_room"), 30, "rank 1 to wait")
        n0.path("step_1", "big").unlink()
        n1.wait_for(lambda: not _ns(c, 1).get("waiting_for_room"), 30,
                    "rank 1 to free its removed file's room and go on")
        assert os.listdir(n1.mnt) == os.listdir(n0.mnt)


def test_a_waiting_node_serves_its_open_files_without_a_second_per_call(make_cluster):
    """While rank 1 waits for room, the kernel's getattr before each read(2) of a file open
    there (attributes are never cached in scope=job), and of the root before `mtcfs
    status`, waited ROOT_FRESH_S (1 s) for a fresh namespace that cannot come before
    answering from this node's copy: a reader of an open checkpoint shard got one read(2)
    a second. As with etcd unreachable, those answer at once while the node waits."""
    with _job_with_small_store(make_cluster) as (c, store1):
        n0, n1 = c.node(0), c.node(1)
        n1.path("step_1").mkdir()
        data = os.urandom(MiB)
        n1.path("step_1", "shard").write_bytes(data)
        fd = os.open(n1.path("step_1", "shard"), os.O_RDONLY)
        try:
            _fill(store1 / "filler.bin")
            n0.path("step_2").mkdir()
            n1.wait_for(lambda: _ns(c, 1).get("waiting_for_room"), 30, "rank 1 to wait")
            t = time.monotonic()
            got = b"".join(os.pread(fd, 64 << 10, off) for off in range(0, MiB, 64 << 10))
            took = time.monotonic() - t
            assert got == data
            assert took < 2.0, f"16 reads of an open file took {took:.1f} s"
            t = time.monotonic()
            n1.cli("status", str(n1.mnt))
            assert time.monotonic() - t < 1.0
        finally:
            os.close(fd)


def test_a_change_on_a_waiting_node_is_refused_before_etcd_has_it(make_cluster):
    """Rank 1 waits at rank 0's mkdir; another process frees a little room (1 MiB: under
    the reserve, above what a setattr needs). A chmod through a descriptor open on rank 1
    (no lookup first, so no read that would fail) passed the room check, as a setattr may
    use the reserve: it was committed job-wide behind the op rank 1 waits at, and the
    caller got EIO at coord_timeout for a change every node then made. A node that waits
    can apply nothing it submits: ENOSPC at once, nothing committed."""
    with _job_with_small_store(make_cluster) as (c, store1):
        n0, n1 = c.node(0), c.node(1)
        n1.path("f").write_bytes(b"f")
        os.chmod(n1.path("f"), 0o644)
        fd = os.open(n1.path("f"), os.O_RDONLY)
        try:
            filler = store1 / "filler.bin"
            _fill(filler)
            n0.path("step_2").mkdir()
            n1.wait_for(lambda: _ns(c, 1).get("waiting_for_room"), 30, "rank 1 to wait")
            os.truncate(filler, os.path.getsize(filler) - MiB)
            t = time.monotonic()
            with pytest.raises(OSError) as e:
                os.fchmod(fd, 0o600)
            assert e.value.errno == errno.ENOSPC, e.value
            assert time.monotonic() - t < 2.0
            text = n1.cli("status", str(n1.mnt)).stdout
            assert "WAITING" in text and "changes get ENOSPC" in text, text
        finally:
            os.close(fd)
        time.sleep(1)
        assert os.stat(n0.path("f")).st_mode & 0o777 == 0o644
        filler.unlink()
        n1.wait_for(lambda: not _ns(c, 1).get("waiting_for_room"), 30, "rank 1 to go on")
        assert os.stat(n1.path("f")).st_mode & 0o777 == 0o644


def test_a_node_that_waited_through_two_folds_installs_the_base(make_cluster, monkeypatch):
    """While rank 1 waits for room, rank 0 folds the log (at least twice) and deletes the
    ops rank 1 waits at, and etcd compacts its history. Once there is room rank 1 installs
    the base (it checks room too) and applies what came after it: the same namespace as
    rank 0, also after a restart.
    (Passes on bc35589: a check of docs/reliability.md's claim.)"""
    monkeypatch.setenv("MTCFS_NS_TRIM_OPS", "4")
    with _job_with_small_store(make_cluster) as (c, store1):
        n0, n1 = c.node(0), c.node(1)
        filler = seed_then_fill(c, store1, {"a": b"first"})
        # Rank 1 may apply some ops after the fill (its database's write-ahead log reuses
        # pages it already holds): ops until it waits, so that it waits before every fold
        # (it applied the ops past the last fold under load, and installed nothing: 1 > 1)
        deadline = time.monotonic() + 60
        for k in range(1000):
            if _ns(c, 1).get("waiting_for_room"):
                break
            assert time.monotonic() < deadline, "rank 1 never waited for room"
            n0.path(f"pre_{k}").mkdir()
        installed = _ns(c, 1).get("snapshots_installed", 0)
        # Fold until the ops rank 1 waits at are deleted: a fold deletes the ops its
        # previous base held, so two folds past rank 1's position. Under load (CI, stop
        # 55) rank 1 still applied a few ops between folds, reaching the last base and
        # installing nothing: the filler takes back what rank 1's database freed after
        # each fold, and the folds go on until rank 1 is behind the deleted ops.
        bases: list[int] = [_ns(c, 0)["base_rev"]]
        steps = 0
        while not (len(bases) >= 2 and bases[-2] > _ns(c, 1)["seq"]):
            assert steps < 40, (bases, _ns(c, 1))
            trims = _ns(c, 0).get("log_trims", 0)
            for i in range(2 + steps, 6 + steps):
                n0.path(f"step_{i}").mkdir()
                n0.path(f"step_{i}", "x").write_bytes(b"x%d" % i)
            steps += 4
            n0.wait_for(lambda t=trims: _ns(c, 0).get("log_trims", 0) > t, 30, "a fold")
            bases.append(_ns(c, 0)["base_rev"])
            _fill(filler)
        n0.path("step_1", "a").write_bytes(b"second")
        # A watch from rank 1's position replays the deleted ops from etcd's history (a
        # right way on, seen under load: no base installed). Compacted, as etcd does by
        # itself in time, the history is gone and the base is the only way on.
        etcd = Etcd(shared_etcd().endpoints)
        try:
            etcd.compact(etcd.get(b"/")[1])
        finally:
            etcd.close()
        n1.wait_for(lambda: "compacted" in n1.log(), 30, "rank 1's watch to meet the compaction")
        assert _ns(c, 1)["waiting_for_room"]
        filler.unlink()
        n1.wait_for(lambda: not _ns(c, 1).get("waiting_for_room"), 30, "rank 1 to go on")
        assert _ns(c, 1)["snapshots_installed"] > installed
        assert sorted(os.listdir(n1.mnt)) == sorted(os.listdir(n0.mnt))
        for i in range(2, 2 + steps):
            assert n1.path(f"step_{i}", "x").read_bytes() == b"x%d" % i
        assert n1.path("step_1", "a").read_bytes() == b"second"
        c.restart(1)
        n1 = c.node(1)
        assert sorted(os.listdir(n1.mnt)) == sorted(os.listdir(n0.mnt))
        assert n1.path("step_1", "a").read_bytes() == b"second"


def test_a_read_on_a_node_does_not_take_its_metadata_reserve(make_cluster):
    """Another process leaves rank 1's store filesystem 5 MiB (above the 2 MiB reserve)
    and changes nothing after. A read on rank 1 of a 4 MiB file rank 0 wrote faults its
    chunks into rank 1's store and leaves 1 MiB: rank 1 then waits at rank 0's next
    mkdir, and since removing that file on rank 0 is an op after it, for ever. The read
    itself took the room the namespace needs; it must leave the reserve. Now the fault-in
    of a chunk that would take it is refused (``check_data_room``): the read gets ENOSPC,
    rank 1 goes on with the job's ops, and once there is room the read returns the file.
    As root the file data is on a tmpfs of its own (issue 40, store/datafs.py), not on the
    metadata's filesystem: the read then takes none of its room and returns the file."""
    with _job_with_small_store(make_cluster) as (c, store1):
        n0, n1 = c.node(0), c.node(1)
        data = os.urandom(4 * MiB)
        filler = seed_then_fill(c, store1, {"r": data}, leave=5 * MiB)
        if os.path.ismount(store1 / "data"):
            assert n1.path("step_1", "r").read_bytes() == data
        else:
            with pytest.raises(OSError) as e:
                n1.path("step_1", "r").read_bytes()
            assert e.value.errno == errno.ENOSPC, e.value
        st = os.statvfs(store1)
        assert st.f_bavail * st.f_frsize >= 2 * MiB, "the read took the metadata's reserve"
        n0.path("step_2").mkdir()
        n1.wait_for(lambda: os.path.isdir(n1.path("step_2")), 15, "step_2 on rank 1")
        filler.unlink()
        assert n1.path("step_1", "r").read_bytes() == data


def test_a_file_closed_on_a_full_node_is_the_same_everywhere_once_there_is_room(make_cluster):
    """A writer on rank 1 closes its file while rank 1's store is full to the last byte:
    the kernel writes the dirty pages back at close, the store's pwrite fails (ENOSPC:
    nothing reached the data file, which stays empty), close(2) gets ENOSPC, and the seal
    (retried until its rows fit) records and publishes the empty file. Once room comes
    back both nodes read what the store holds. Before (dac0c09 too), rank 1's kernel kept
    serving the 100,000 bytes from its page cache, and the size, also to new opens, while
    the store, `user.mtcfs.state` "local" and rank 0 had the empty file: the
    writeback-cache leftover of docs/reliability.md, across opens. Now the failed write
    gives the file a new kernel inode number (``OpenFiles._forget_kernel_copy``)."""
    with _job_with_small_store(make_cluster) as (c, store1):
        n0, n1 = c.node(0), c.node(1)
        n1.path("step_1").mkdir()
        fd = os.open(n1.path("step_1", "w"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"A" * 100000)
        filler = store1 / "filler.bin"
        _fill(filler)
        with pytest.raises(OSError) as e:
            os.close(fd)
        assert e.value.errno == errno.ENOSPC
        time.sleep(2)
        filler.unlink()
        n0.wait_for(lambda: n0.path("step_1", "w").read_bytes()
                    == n1.path("step_1", "w").read_bytes(), 30,
                    "both nodes to serve the same bytes")
