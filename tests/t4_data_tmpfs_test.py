"""The store's data directory on a tmpfs of its own, sized by the daemon (issue 40).

With FUSE passthrough the kernel writes straight into ``<store>/data/<vid>``, unseen by the
daemon, so ``size=`` must hold in the data directory's filesystem itself. What a user
checks: a write past it gets ENOSPC at that write(2) and the files before are intact; the
RAM tier survives a kill -9 and a clean unmount bit for bit; a larger ``size=`` grows it, a
smaller one than it holds is refused (exit 2, one line); a store of an earlier version is
moved into the tmpfs with every byte, even when that start is killed midway; a foreign
mount on ``data/`` is refused; no mount outlives the test directory.

Writes into ``data/`` itself stand for passthrough writes (the kernel's path); the mount
runs without passthrough, so its own writes still take the daemon's path (ENOSPC at size=).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from mtcfs.base import mountinfo
from mtcfs.core.store import datafs
from support.mount import MTCFS, is_mounted, leaked_data_mounts, one_line_error, remove_tree
from support.tree import snapshot

MiB = 1 << 20
CHUNK = 256 << 10
SMALL = {"size": "8M", "chunk_size": "256K"}

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def _data_mount(store: Path) -> mountinfo.MountEntry | None:
    return mountinfo.entry_at(str(store / "data"))


def _assert_ours(store: Path, size_opt: int) -> None:
    e = _data_mount(store)
    assert e is not None and e.fstype == "tmpfs" and e.source == datafs.SOURCE, e
    total, _ = datafs.usage(str(store / "data"))
    assert total == datafs.tmpfs_size(size_opt, CHUNK), total


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def test_a_write_past_the_data_tmpfs_gets_enospc_and_the_files_before_stay(make_mount):
    m = make_mount(**SMALL)
    _assert_ours(m.store, 8 * MiB)
    files = {"a.bin": os.urandom(3 * MiB), "b.bin": os.urandom(2 * MiB + 123)}
    m.path("step_1").mkdir()
    for name, data in files.items():
        _write(m.path("step_1", name), data)
    # The daemon's path: ENOSPC at size= (write or close), as before.
    with pytest.raises(OSError) as ei:
        _write(m.path("big.bin"), os.urandom(5 * MiB))
    assert ei.value.errno == errno.ENOSPC
    os.unlink(m.path("big.bin"))
    # The kernel's path (passthrough writes into data/): ENOSPC at the write(2) that
    # crosses the data tmpfs's size, never more than it holds.
    total, used = datafs.usage(str(m.store / "data"))
    written = 0
    fd = os.open(m.store / "data" / "passthrough-stand-in", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError) as ei:
            while True:
                written += os.write(fd, b"\xab" * MiB)
        assert ei.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
        os.unlink(m.store / "data" / "passthrough-stand-in")
    assert written <= total - used
    assert total == datafs.tmpfs_size(8 * MiB, CHUNK) == 8 * MiB  # size=, no more
    for name, data in files.items():
        assert m.path("step_1", name).read_bytes() == data
    st = m.status()["store_fs"]["data_tmpfs"]
    assert st["size"] == total and st["path"] == str(m.store / "data")
    assert "tmpfs of its own" in m.cli("status", str(m.mnt)).stdout


def test_the_data_tmpfs_survives_kill9_and_a_clean_unmount_bit_for_bit(make_mount):
    m = make_mount(**SMALL)
    files = {"a.bin": os.urandom(MiB + 17), "b.bin": os.urandom(300_000)}
    m.path("step_1").mkdir()
    for name, data in files.items():
        _write(m.path("step_1", name), data)
    dev = _data_mount(m.store).device  # type: ignore[union-attr]
    m.stop()
    assert not is_mounted(str(m.mnt))
    assert _data_mount(m.store).device == dev  # type: ignore[union-attr]  (kept, not remade)
    m.start()
    for name, data in files.items():
        assert m.path("step_1", name).read_bytes() == data
    _write(m.path("step_1", "c.bin"), b"c" * 5000)
    m.kill9()
    assert _data_mount(m.store).device == dev  # type: ignore[union-attr]
    m.start()
    for name, data in {**files, "c.bin": b"c" * 5000}.items():
        assert m.path("step_1", name).read_bytes() == data
    assert _data_mount(m.store).device == dev  # type: ignore[union-attr]


def test_a_larger_size_grows_it_and_one_smaller_than_it_holds_is_refused(make_mount):
    m = make_mount(**SMALL)
    data = os.urandom(6 * MiB)
    _write(m.path("f.bin"), data)
    m.stop()
    m.options["size"] = "16M"
    m.start()
    _assert_ours(m.store, 16 * MiB)
    assert m.status()["ram"]["capacity"] == 16 * MiB
    m.stop()
    before = snapshot(m.store)
    r = subprocess.run(MTCFS + [m.job, str(m.mnt), "-o",
                                f"store={m.store},size=2M,chunk_size=256K"],
                       capture_output=True, text=True, timeout=60)
    assert not is_mounted(str(m.mnt))
    one_line_error(r, 2, "size=", "data tmpfs", "nothing was changed")
    assert snapshot(m.store) == before
    _assert_ours(m.store, 16 * MiB)
    m.start()
    assert m.path("f.bin").read_bytes() == data


def _make_old_store(m) -> None:
    """Turn ``m``'s (stopped) store into one of an earlier version: a plain ``data/``
    directory holding the data files, no tmpfs."""
    data = m.store / "data"
    keep = m.store.parent / "data-copy"
    shutil.copytree(data, keep)
    subprocess.run(["umount", str(data)], check=True)
    assert _data_mount(m.store) is None
    for p in keep.iterdir():
        shutil.copy2(p, data / p.name)
    shutil.rmtree(keep)


@pytest.mark.parametrize("crash", [None, "datafs.copied", "datafs.renamed", "datafs.moved"])
def test_a_store_of_an_earlier_version_is_moved_into_its_tmpfs(make_mount, monkeypatch, crash):
    m = make_mount(**SMALL)
    files = {"a.bin": os.urandom(2 * MiB + 5), "b.bin": os.urandom(70_000)}
    m.path("step_1").mkdir()
    for name, d in files.items():
        _write(m.path("step_1", name), d)
    m.stop()
    _make_old_store(m)
    if crash is not None:  # the daemon dies at that step of the move; the next start is whole
        monkeypatch.setenv("MTCFS_FAILPOINTS", f"{crash}=kill")
        with pytest.raises(RuntimeError):
            m.start()
        m.kill9()
        monkeypatch.delenv("MTCFS_FAILPOINTS")
    m.start()
    if crash in ("datafs.renamed", "datafs.moved"):  # the start after found it half done
        said = "deleted" if crash == "datafs.moved" else "put"
        assert f"{said} {m.store / datafs.OLD}" in m.log(), m.log()[-3000:]
    _assert_ours(m.store, 8 * MiB)
    for name, d in files.items():
        assert m.path("step_1", name).read_bytes() == d
    assert not (m.store / datafs.OLD).exists() and not (m.store / datafs.STAGING).exists()
    assert _data_mount(m.store / datafs.STAGING) is None


@pytest.mark.parametrize("how", ["tmpfs", "mode"])
def test_a_mount_on_data_that_is_not_mtcfs_s_is_refused_untouched(make_mount, how):
    m = make_mount(**SMALL)
    _write(m.path("f.bin"), b"x" * 10_000)
    m.stop()
    data = m.store / "data"
    subprocess.run(["umount", str(data)], check=True)
    shutil.rmtree(data)
    data.mkdir(mode=0o700)
    if how == "tmpfs":  # someone else's tmpfs
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs",
                        str(data)], check=True)
    else:  # named as mtcfs names it, but open to others
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", datafs.SOURCE,
                        str(data)], check=True)
    before = snapshot(m.store)
    r = subprocess.run(MTCFS + [m.job, str(m.mnt), "-o", f"store={m.store},size=8M"],
                       capture_output=True, text=True, timeout=60)
    assert not is_mounted(str(m.mnt))
    one_line_error(r, 2, str(data), "not mtcfs's", "nothing was touched")
    assert snapshot(m.store) == before


def test_removing_a_test_directory_leaves_no_mount():
    root = Path(tempfile.mkdtemp(prefix="mtcfs-test-", dir="/dev/shm"))
    from support.mount import Mount, track
    track(root)
    m = Mount(root / "m", options=SMALL)
    try:
        m.start()
        _write(m.path("f.bin"), b"y" * 1000)
    finally:
        m.cleanup()
    assert _data_mount(m.store) is not None  # it outlives the daemon...
    remove_tree(root)
    assert not root.exists()
    assert not [p for p in leaked_data_mounts() if p.startswith(str(root))]


def test_make_room_counts_writes_the_daemon_did_not_see_and_evicts_ahead(shm_dir):
    """In-process core on a store with its data tmpfs: bytes written into ``data/``
    behind the daemon's back (as passthrough writes are) count in ``room()`` at once, and
    ``await budget.make_room()`` evicts a checkpoint the backup holds until the headroom
    is free again; the checkpoint stays readable from the backup (missing, not deleted)."""
    import trio
    from support.corefs import CS, sealed, write_file

    from mtcfs.core.core import Filesystem
    from mtcfs.core.model import ROOT_INO
    from mtcfs.core.store import Store

    cap = 16 * CS
    store = Store(str(shm_dir / "store"), "job", CS, data_size=datafs.tmpfs_size(cap, CS))
    assert store.data_limit == datafs.tmpfs_size(cap, CS)
    fs = Filesystem(store, capacity=cap, chunk_size=CS, job="job")

    async def body() -> None:
        async with trio.open_nursery() as n:
            fs.start(n)
            try:
                for k in (1, 2):
                    d = await fs.mkdir(ROOT_INO, b"step_%d" % k, 0o755, 0, 0)
                    await sealed(fs, await write_file(fs, d.ino, b"x", os.urandom(3 * CS)))
                    fs.step_registry.seal(f"step_{k}")
                fs.steps["step_1"].backed_up_ns = 1  # the backup tier holds it
                b = fs.budget
                assert b.headroom == 8 * CS and b.room() >= 8 * CS  # capacity / 2
                assert await b.make_room() >= 8 * CS and fs.counters.evicted_steps == 0
                unseen = os.path.join(store.data_dir, "passthrough-stand-in")
                with open(unseen, "wb") as f:
                    f.write(b"\x01" * 3 * CS)
                assert b.room() <= 7 * CS < b.free()  # statfs sees it, ``used`` does not
                assert await b.make_room() >= 8 * CS
                assert fs.counters.evicted_steps == 1 and b.headroom_active
                v = fs.versions[fs.tree.resolve("step_1/x").vid]
                assert v.alloc == 0 and v.missing  # dropped, not deleted
                os.unlink(unseen)
            finally:
                n.cancel_scope.cancel()
                fs.close()
                store.close()
    trio.run(body)
    assert datafs.mount_of_data(str(shm_dir / "store" / "data")) is not None


def test_a_tmpfs_grown_for_reads_past_size_is_kept_after_a_crash_then_set_back(make_mount):
    """A daemon grew the data tmpfs for chunks read past size= and was killed before it
    set it back: the next start with the same size= mounts (it is no smaller size=), and
    once the tmpfs holds no more than its size the daemon sets it back."""
    m = make_mount(**SMALL)
    base = datafs.tmpfs_size(8 * MiB, CHUNK)
    data = m.store / "data"
    datafs.resize(str(data), 24 * MiB)  # as Store.grow_data does
    extra = data / "over-size-stand-in"
    extra.write_bytes(b"\x02" * (base + MiB))  # more than its size
    m.kill9()
    m.start()
    assert datafs.usage(str(data))[0] == 24 * MiB
    extra.unlink()
    _write(m.path("f.bin"), b"f" * 10_000)  # a seal: the budget sets the size back
    m.wait_for(lambda: datafs.usage(str(data))[0] == base, 30, "the size set back")
    assert m.path("f.bin").read_bytes() == b"f" * 10_000
