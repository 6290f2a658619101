"""The RAM tier's capacity: ENOSPC past size=, eviction of old checkpoints first, never of
the newest complete one, and a daemon that stays healthy."""

import errno
import os

import pytest

MiB = 1024 * 1024


def write_file(path, nbytes, seed=1):
    data = os.urandom(nbytes)
    with open(path, "wb") as f:
        for off in range(0, nbytes, 4 * MiB):
            f.write(data[off:off + 4 * MiB])
    return data


def commit_step(m, name, nbytes):
    os.mkdir(m.path(name))
    data = write_file(m.path(name, "shard.bin"), nbytes)
    m.path(name, ".metadata").write_bytes(b"meta")
    m.wait_state(name, "local")
    return data


def test_enospc_past_size_daemon_stays_up(make_mount):
    m = make_mount(size="32M")
    with pytest.raises(OSError) as ei:
        write_file(m.path("too-big.bin"), 40 * MiB)
    assert ei.value.errno == errno.ENOSPC
    st = m.status()
    assert st["ram"]["used"] <= 32 * MiB
    if st["fuse"]["passthrough"]:
        # the kernel refused it (the data directory's own tmpfs is full): status shows it
        tmpfs = st["store_fs"]["data_tmpfs"]
        assert tmpfs["size"] <= 32 * MiB and tmpfs["used"] >= tmpfs["size"] - 4 * MiB
    else:
        assert st["counters"]["enospc"] >= 1  # the daemon refused it, and counted it
    # Healthy: a small file still works, and deleting the partial one frees its space.
    os.unlink(m.path("too-big.bin"))
    small = write_file(m.path("small.bin"), 1 * MiB)
    assert m.path("small.bin").read_bytes() == small
    m.wait_for(lambda: m.status()["ram"]["used"] <= 2 * MiB, 10, "space to be freed")


def test_old_checkpoint_evicted_before_enospc(make_mount):
    m = make_mount(size="64M", keep=1)
    commit_step(m, "step_1", 20 * MiB)
    s2 = commit_step(m, "step_2", 20 * MiB)
    os.mkdir(m.path("step_3"))
    s3 = write_file(m.path("step_3", "shard.bin"), 30 * MiB)
    assert not m.path("step_1").exists()          # the oldest was evicted (not backed up)
    assert m.path("step_2", "shard.bin").read_bytes() == s2
    assert m.path("step_3", "shard.bin").read_bytes() == s3
    assert [c["step"] for c in m.checkpoints()] == ["step_2"]


def test_newest_complete_checkpoint_never_evicted(make_mount):
    m = make_mount(size="48M", keep=1)
    s1 = commit_step(m, "step_1", 20 * MiB)
    os.mkdir(m.path("step_2"))
    with pytest.raises(OSError) as ei:
        write_file(m.path("step_2", "shard.bin"), 40 * MiB)
    assert ei.value.errno == errno.ENOSPC
    assert m.path("step_1", "shard.bin").read_bytes() == s1
    assert m.state("step_1") == "local"
