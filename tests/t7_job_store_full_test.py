"""scope=job: one node's store filesystem fills up while the job goes on changing the
namespace (another process filled the tmpfs under the store: on a training host /dev/shm is
shared with data loaders and NCCL).

The promise (README): nothing is lost, a fault is a clear error. The full node cannot write
the rows of the ops other nodes commit, so it must not skip them: it waits at the first one,
says so (``mtcfs status``), gives its writers ENOSPC before their op is committed job-wide,
and once there is room again it applies the ops it waited for and is the same namespace as
every other node, also after a restart.

Before the fix (2026-11-25): the full node's apply of another node's mkdir failed at its
SQLite commit (SQLITE_FULL), the node marked itself "diverged" and moved past the op for
good: the directory never appeared there, not even after room came back or a restart; a
writer on the full node had its op committed job-wide and got EIO.
"""

from __future__ import annotations

import errno
import os

import pytest

from support.fullstore import MiB, fill, job_with_small_store, seed_then_fill


def test_a_full_node_waits_for_room_and_then_has_every_op(make_cluster):
    with job_with_small_store(make_cluster) as (c, store1):
        n0, n1 = c.node(0), c.node(1)
        filler = seed_then_fill(c, store1, {"a": b"first"})
        # A change made on the full node is refused before etcd has it: nothing committed
        # job-wide that this node could not apply.
        with pytest.raises(OSError) as e:
            n1.path("step_from_1").mkdir()
        assert e.value.errno == errno.ENOSPC, e.value
        # The job goes on: rank 0's changes do not wait for rank 1.
        n0.path("step_2").mkdir()
        n0.path("step_2", "b").write_bytes(b"small")
        big = os.urandom(3 * MiB + 5)
        n0.path("step_2", "c").write_bytes(big)
        assert "step_from_1" not in os.listdir(n0.mnt)

        ns = n1.wait_for(lambda: (c.status(1)["namespace"].get("waiting_for_room")
                                  and c.status(1)["namespace"]), 30,
                         "rank 1 to report that it waits for room")
        assert "room" in ns["waiting_for_room"], ns
        assert not ns["diverged"], ns
        # A read that needs the ops it waits for is a clear error at the deadline, not a
        # hang and not a stale answer.
        with pytest.raises(OSError) as e:
            os.listdir(n1.mnt)
        assert e.value.errno == errno.EIO, e.value

        filler.unlink()  # room again: rank 1 applies what it waited for
        n1.wait_for(lambda: not c.status(1)["namespace"].get("waiting_for_room"), 30,
                    "rank 1 to apply the ops it waited for")
        for r in (1, 0):
            n = c.node(r)
            assert sorted(os.listdir(n.path("step_2"))) == ["b", "c"]
            assert n.path("step_2", "b").read_bytes() == b"small"
            assert n.path("step_2", "c").read_bytes() == big
            assert n.path("step_1", "a").read_bytes() == b"first"
        assert not c.status(1)["namespace"]["diverged"]
        n1.path("step_from_1").mkdir()  # room again: a change made there goes through
        n0.wait_for(lambda: os.path.isdir(n0.path("step_from_1")), 30, "rank 1's mkdir")

        c.restart(1)  # what it applied is in its rows
        n1 = c.node(1)
        assert sorted(os.listdir(n1.path("step_2"))) == ["b", "c"]
        assert n1.path("step_2", "c").read_bytes() == big


def test_a_file_closed_on_a_full_node_is_published_once_there_is_room(make_cluster):
    """The writer on the full node: its close(2) says ENOSPC (not EIO: the cause), and the
    bytes it wrote are not lost: they are published job-wide once there is room, so every
    node reads them (before: the publish was refused for good, and the other node kept the
    empty file)."""
    with job_with_small_store(make_cluster) as (c, store1):
        n0, n1 = c.node(0), c.node(1)
        n1.path("step_1").mkdir()
        fd = os.open(n1.path("step_1", "w.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
        filler = store1 / "filler.bin"
        fill(filler, leave=MiB)  # room for the bytes, not for the reserve
        os.write(fd, b"payload" * 100)
        with pytest.raises(OSError) as e:
            os.close(fd)
        assert e.value.errno == errno.ENOSPC, e.value
        filler.unlink()
        n0.wait_for(lambda: n0.path("step_1", "w.bin").read_bytes() == b"payload" * 100, 30,
                    "the bytes closed on rank 1 to be published")
        assert n1.path("step_1", "w.bin").read_bytes() == b"payload" * 100
