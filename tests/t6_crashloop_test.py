"""A kill -9 loop with the backup on (issue 12, item 6).

Each iteration writes one DCP-like step (2-3 files, ``.metadata`` last) and SIGKILLs the
daemon at a seeded point: inside a file (a torn save), between files, or a seeded moment
after the commit (while the step seals or uploads); then mounts the same store again. At the
end every step whose ``.metadata`` close returned is there bit-exact (in RAM, or faulted back
in from the backup tier), and the backup has completed for the newest of them.

Short form (the suite): 7 kills, files of 2-8 MiB, size=48M (eviction under pressure).
Long form (the issue's run)::

    MTCFS_CRASHLOOP_ITERS=15 MTCFS_CRASHLOOP_MIB=20-100 MTCFS_CRASHLOOP_SIZE=4G \\
        MTCFS_CRASHLOOP_SEED=12 pytest -q tests/t6_crashloop_test.py::test_kill9_loop_with_backup
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import time

import pytest

from mtcfs.cli import _request, control_socket
from support.prom import value as metric

MiB = 1 << 20
PIECE = 1 * MiB


def _env_range(name: str, default: str) -> tuple[int, int]:
    lo, _, hi = os.environ.get(name, default).partition("-")
    return int(lo), int(hi or lo)


class Killed(Exception):
    pass


def _write_step(m, name: str, rng: random.Random, mib: tuple[int, int], kill_at: int | None,
                kill_after_commit: float | None) -> dict[str, bytes] | None:
    """Write one step; SIGKILL the daemon once ``kill_at`` bytes are written (None: never).

    Returns the files of the step if its ``.metadata`` was closed before the kill, else None.
    """
    files = {f"__{i}_0.distcp": rng.randbytes(rng.randint(*mib) * MiB + rng.randint(0, 4097))
             for i in range(rng.randint(2, 3))}
    files[".metadata"] = rng.randbytes(rng.randint(100, 5000))
    written = 0
    try:
        os.makedirs(m.path(name), exist_ok=True)
        for fname, data in files.items():
            with open(m.path(name, fname), "wb") as f:
                for off in range(0, len(data), PIECE):
                    if kill_at is not None and written >= kill_at:
                        m.kill9()
                        raise Killed
                    f.write(data[off:off + PIECE])
                    written += min(PIECE, len(data) - off)
    except Killed:
        return None
    except OSError:
        if m.pid is None:  # close() after the kill: the save is torn
            return None
        raise
    if kill_after_commit is not None:
        time.sleep(kill_after_commit)
        m.kill9()
    return files


def _sha(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def test_kill9_loop_with_backup(make_mount, shm_dir):
    seed = int(os.environ.get("MTCFS_CRASHLOOP_SEED", "12"))
    iters = int(os.environ.get("MTCFS_CRASHLOOP_ITERS", "7"))
    mib = _env_range("MTCFS_CRASHLOOP_MIB", "2-8")
    size = os.environ.get("MTCFS_CRASHLOOP_SIZE", "48M")
    rng = random.Random(seed)
    bucket = shm_dir / "bucket"
    bucket.mkdir()
    m = make_mount("node", size=size, backup=f"file://{bucket}", backup_interval="1ckpt",
                   keep=2, backup_keep=1000)
    committed: dict[str, dict[str, bytes]] = {}
    enospc = kills = 0
    t0 = time.monotonic()
    for i in range(1, iters + 1):
        name = f"step_{i}"
        est = 3 * (mib[0] + mib[1]) // 2 * MiB
        where = rng.random()
        kill_at = rng.randint(0, est) if where < 0.6 else None
        after = rng.uniform(0.0, 0.6) if kill_at is None else None
        try:
            files = _write_step(m, name, rng, mib, kill_at, after)
        except OSError as exc:
            # With backup= a step awaiting its backup is never deleted to make room: a save
            # may be refused while the backup catches up. Then, as a job would, wait for it,
            # drop the failed save and save again.
            if exc.errno != errno.ENOSPC:
                raise
            enospc += 1
            m.wait_for(lambda: not m.status()["backup"]["pending"] and
                       not m.status()["backup"]["uploading"], 60, "the backup to catch up")
            shutil.rmtree(m.path(name))
            files = _write_step(m, name, rng, mib, None, None)
        if files is not None:
            committed[name] = files
        if m.pid is None:  # killed: the store comes back
            kills += 1
            m.start()
    assert committed, "the seed gave no committed step; pick another"
    newest = max(committed, key=lambda n: int(n.split("_")[1]))

    def newest_backed_up():
        rows = {r["step"]: r for r in m.checkpoints()}
        return rows.get(newest, {}).get("backup") == "complete"
    m.wait_for(newest_backed_up, 120, f"the backup of {newest}")

    listed = {r["step"]: r for r in m.checkpoints()}
    lost = []
    verified = 0
    for name, files in committed.items():
        if not m.path(name).is_dir():
            lost.append(f"{name} ({listed.get(name, {}).get('backup', 'not in the backup')})")
            continue
        for fname, data in files.items():
            got = m.path(name, fname).read_bytes()
            assert len(got) == len(data) and _sha(got) == _sha(data), f"{name}/{fname}"
            verified += len(got)
    assert not lost, f"committed steps gone from the mount: {lost}\n{m.log()[-3000:]}"
    st = m.status()
    assert st["counters"]["deleted_unsaved_steps"] == 0 and not st["ram"]["deleted_unsaved"]
    print(f"crash loop seed={seed}: {iters} saves, {kills} kills, {len(committed)} steps "
          f"committed, {verified / MiB:.0f} MiB verified bit-exact, {enospc} saves refused "
          f"(ENOSPC) while the backup caught up, {time.monotonic() - t0:.0f} s")
    assert enospc <= iters // 2, f"{enospc} saves refused"
    # What a user checks: mtcfs status names the last backup, even one a daemon killed
    # since had finished.
    last = m.status()["backup"]
    assert last["last_finished"] is not None and last["last_step"] is not None, last


# --------------------------------------------------------------- one test per cause found


def _file(path, nbytes: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(nbytes)
    with open(path, "wb") as f:
        for off in range(0, nbytes, 4 * MiB):
            f.write(data[off:off + 4 * MiB])
    return data


def _commit(m, name: str, nbytes: int, seed: int) -> bytes:
    os.makedirs(m.path(name), exist_ok=True)
    data = _file(m.path(name, "shard.distcp"), nbytes, seed)
    m.path(name, ".metadata").write_bytes(b"meta " + name.encode())
    m.wait_for(lambda: name in {r["step"] for r in m.checkpoints()}, 30, f"{name} to commit")
    return data


def _evicted(m, name: str) -> None:
    """Wait (bounded) until the step ``name`` the daemon deleted is gone from the mount too:
    the daemon tells the kernel to forget the name asynchronously (pyfuse3's
    invalidate_entry_async, as it may not block inside the write that needed the room), so
    a lookup right after that write may still hit the kernel's cached entry for a moment."""
    m.wait_for(lambda: not m.path(name).exists(), timeout=10, what=f"{name} gone from the mount")


def _backup_state(m, name: str) -> str | None:
    return {r["step"]: r["backup"] for r in m.checkpoints()}.get(name)


def test_pending_backup_resumes_after_kill9(make_mount, shm_dir, monkeypatch):
    """A backup a SIGKILL interrupted is resumed after the remount, although a newer step
    committed meanwhile (before: only the newest was backed up; the interrupted one stayed
    'pending' for ever, and mtcfs status said the backup had run 'never')."""
    bucket = shm_dir / "bucket"
    bucket.mkdir()
    # Each chunk upload pauses (mtcfs/base/failpoints.py): the upload of step_1 (10 chunks) is
    # certain to be running when the kill comes, however fast the machine.
    monkeypatch.setenv("MTCFS_FAILPOINTS", "backup.put_chunk=sleep(0.5)")
    m = make_mount("node", size="1G", backup=f"file://{bucket}", backup_interval="1ckpt",
                   keep=2, backup_keep=100, chunk_size="4M")
    first = _commit(m, "step_0", 4 * MiB, 0)
    m.wait_for(lambda: _backup_state(m, "step_0") == "complete", 30, "the first backup")
    sock = control_socket(str(m.mnt))[0]

    def uploading() -> str | None:  # in-process: a CLI run takes longer than the upload
        return _request(sock, "status")["backup"]["uploading"]

    name, newer = "step_1", "step_2"
    os.mkdir(m.path(name))
    big = _file(m.path(name, "shard.distcp"), 40 * MiB, 1)
    m.path(name, ".metadata").write_bytes(b"big")
    m.wait_for(lambda: uploading() == name, 30, "the upload to start")
    os.mkdir(m.path(newer))
    m.path(newer, ".metadata").write_bytes(b"newer")
    m.wait_for(lambda: _request(sock, "status")["ram"]["checkpoints"] == 3, 10,
               f"{newer} to commit")
    assert uploading() == name and _backup_state(m, name) != "complete"
    m.kill9()
    monkeypatch.delenv("MTCFS_FAILPOINTS")
    m.start()
    # The interrupted step is backed up, then the newest; status names the last backup.
    m.wait_for(lambda: _backup_state(m, name) == "complete", 60, f"the backup of {name}")
    m.wait_for(lambda: _backup_state(m, newer) == "complete", 60,
               "the backup of the newest step")
    assert m.path(name, "shard.distcp").read_bytes() == big
    assert m.path("step_0", "shard.distcp").read_bytes() == first


def test_status_shows_last_backup_after_kill9(make_mount, shm_dir):
    bucket = shm_dir / "bucket"
    bucket.mkdir()
    m = make_mount("node", size="256M", backup=f"file://{bucket}", backup_interval="1ckpt")
    _commit(m, "step_1", 4 * MiB, 1)
    m.wait_for(lambda: _backup_state(m, "step_1") == "complete", 30, "the backup")
    m.kill9()
    m.start()
    b = m.status()["backup"]
    assert b["last_step"] == "step_1" and b["last_finished"] is not None, b
    assert "never" not in m.cli("status", str(m.mnt)).stdout


def test_crash_leftovers_never_push_out_a_committed_step(make_mount):
    """The torn leftover of a save the crash interrupted is deleted under pressure before
    any committed step (before: it stayed, and the committed step_1 was deleted)."""
    # (on the daemon's path, which evicts exactly as much as a write needs; passthrough
    # evicts a headroom ahead, min(size/2, 4 GiB): at this size= half of it, and the order
    # of what goes is the same: t4_capacity_test, t4_data_tmpfs_test)
    m = make_mount("node", size="72M", keep=1, passthrough="no")
    s1 = _commit(m, "step_1", 20 * MiB, 1)
    os.mkdir(m.path("step_2"))
    fd = os.open(m.path("step_2", "shard.distcp"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, random.Random(2).randbytes(20 * MiB))
    os.fsync(fd)  # out of the kernel's cache: the leftover takes its room in the store
    m.kill9()  # mid-save: no .metadata
    try:
        os.close(fd)
    except OSError:
        pass
    m.start()
    s3 = _commit(m, "step_3", 20 * MiB, 3)
    os.mkdir(m.path("step_4"))
    s4 = _file(m.path("step_4", "shard.distcp"), 20 * MiB, 4)
    _evicted(m, "step_2")
    assert m.path("step_1", "shard.distcp").read_bytes() == s1
    assert m.path("step_3", "shard.distcp").read_bytes() == s3
    assert m.path("step_4", "shard.distcp").read_bytes() == s4
    st = m.status()
    assert st["counters"]["evicted_leftovers"] == 1
    assert st["counters"]["deleted_unsaved_steps"] == 0
    assert "incomplete leftover of a save a crash interrupted" in m.log()


def test_eviction_goes_oldest_first(make_mount):
    """An older step that cannot go now (open) is not replaced by a newer one: the write
    waits for it (ENOSPC); once it is closed, it is the one that goes."""
    # (on the daemon's path, which evicts exactly as much as a write needs; passthrough
    # evicts a headroom ahead, min(size/2, 4 GiB): at this size= half of it, and the order
    # of what goes is the same: t4_capacity_test, t4_data_tmpfs_test)
    m = make_mount("node", size="72M", keep=1, passthrough="no")
    s1 = _commit(m, "step_1", 20 * MiB, 1)
    s2 = _commit(m, "step_2", 20 * MiB, 2)
    s3 = _commit(m, "step_3", 20 * MiB, 3)
    os.mkdir(m.path("step_4"))
    with open(m.path("step_1", "shard.distcp"), "rb") as held:
        with pytest.raises(OSError) as ei:
            _file(m.path("step_4", "shard.distcp"), 20 * MiB, 4)
        assert ei.value.errno == errno.ENOSPC
        assert m.path("step_2", "shard.distcp").read_bytes() == s2
        assert held.read() == s1
    os.unlink(m.path("step_4", "shard.distcp"))
    s4 = _file(m.path("step_4", "shard.distcp"), 20 * MiB, 4)
    _evicted(m, "step_1")
    assert m.path("step_2", "shard.distcp").read_bytes() == s2
    assert m.path("step_3", "shard.distcp").read_bytes() == s3
    assert m.path("step_4", "shard.distcp").read_bytes() == s4


def test_unsaved_step_never_deleted_silently(make_mount, shm_dir):
    """With backup=, a committed step awaiting its backup is never deleted to make room:
    ENOSPC. With evict_unsaved=yes it may be, oldest first, with a warning in the log and
    in mtcfs status, and counted in the metrics."""
    bucket = shm_dir / "bucket"
    bucket.mkdir()
    m = make_mount("a", size="56M", keep=1, backup=f"file://{bucket}",
                   backup_interval="100ckpt")
    s1 = _commit(m, "step_1", 20 * MiB, 1)
    s2 = _commit(m, "step_2", 20 * MiB, 2)
    os.mkdir(m.path("step_3"))
    with pytest.raises(OSError) as ei:
        _file(m.path("step_3", "shard.distcp"), 20 * MiB, 3)
    assert ei.value.errno == errno.ENOSPC
    assert m.path("step_1", "shard.distcp").read_bytes() == s1
    assert m.path("step_2", "shard.distcp").read_bytes() == s2
    assert m.status()["counters"]["deleted_unsaved_steps"] == 0

    bucket2 = shm_dir / "bucket2"
    bucket2.mkdir()
    n = make_mount("b", size="56M", keep=1, backup=f"file://{bucket2}",
                   backup_interval="100ckpt", evict_unsaved="yes")
    _commit(n, "step_1", 20 * MiB, 1)
    t2 = _commit(n, "step_2", 20 * MiB, 2)
    os.mkdir(n.path("step_3"))
    t3 = _file(n.path("step_3", "shard.distcp"), 20 * MiB, 3)
    _evicted(n, "step_1")
    assert n.path("step_2", "shard.distcp").read_bytes() == t2
    assert n.path("step_3", "shard.distcp").read_bytes() == t3
    st = n.status()
    assert st["counters"]["deleted_unsaved_steps"] == 1
    assert st["ram"]["deleted_unsaved"] == ["step_1"]
    assert "WARNING" in n.cli("status", str(n.mnt)).stdout
    metrics = n.cli("metrics", str(n.mnt)).stdout
    assert metric(metrics, "mtcfs_deleted_unsaved_steps_total") == 1, metrics
    assert "deleted checkpoint step_1 from RAM under memory pressure" in n.log()


# ------------------------------------------- what is (not) a crash leftover (review of i12)


def _plain(m, name: str, nbytes: int, seed: int) -> bytes:
    """A torch.save / HF ``checkpoint-N`` save: plain files, committed by ``mtcfs seal``
    (not sealed here: the job ended before it ran it)."""
    os.makedirs(m.path(name), exist_ok=True)
    return _file(m.path(name, "model.bin"), nbytes, seed)


def _refused(m, name: str, nbytes: int, seed: int) -> None:
    os.makedirs(m.path(name), exist_ok=True)
    with pytest.raises(OSError) as ei:
        _file(m.path(name, "model.bin"), nbytes, seed)
    assert ei.value.errno == errno.ENOSPC


def test_unsealed_plain_step_is_no_leftover_after_clean_unmount(make_mount):
    """The review's reproduction: a finished, unsealed checkpoint-N (the user's only copy)
    survives a clean unmount and a remount under pressure (before: a write of the next
    save deleted it as 'the incomplete leftover of a save a crash interrupted')."""
    m = make_mount("node", size="8M", evict_unsaved="no")
    c100 = _plain(m, "checkpoint-100", 5_000_000, 100)
    m.stop()
    m.start()
    _refused(m, "checkpoint-200", 5_000_000, 200)
    assert m.path("checkpoint-100", "model.bin").read_bytes() == c100
    st = m.status()
    assert st["counters"]["evicted_leftovers"] == 0
    assert "incomplete leftover" not in m.log()


def test_plain_step_is_no_leftover_even_after_a_crash(make_mount):
    """A directory of plain files is never a leftover, even if the daemon was killed: no
    library defines it as unfinished (it may be finished and await ``mtcfs seal``)."""
    m = make_mount("node", size="8M", evict_unsaved="no")
    c100 = _plain(m, "checkpoint-100", 5_000_000, 100)
    m.kill9()
    m.start()
    _refused(m, "checkpoint-200", 5_000_000, 200)
    assert m.path("checkpoint-100", "model.bin").read_bytes() == c100
    assert m.status()["counters"]["evicted_leftovers"] == 0


def test_unfinished_dcp_save_is_no_leftover_after_clean_unmount(make_mount):
    """An unfinished DCP save (``*.distcp``, no ``.metadata``) is a leftover only if the
    daemon before did not stop cleanly: after a clean unmount no crash interrupted it."""
    m = make_mount("node", size="8M", evict_unsaved="no")
    os.mkdir(m.path("step_1"))
    s1 = _file(m.path("step_1", "__0_0.distcp"), 5_000_000, 1)
    m.stop()
    m.start()
    _refused(m, "step_2", 5_000_000, 2)
    assert m.path("step_1", "__0_0.distcp").read_bytes() == s1
    assert m.status()["counters"]["evicted_leftovers"] == 0


def test_step_whose_marker_reseals_after_kill_is_no_leftover(make_mount):
    """A DCP step whose ``.metadata`` was still unsealed at a SIGKILL is sealed again after
    the start (behind the re-hash of its shards): in those seconds it is not committed yet,
    but it holds its marker, so it is never a leftover (before: it was, and a write under
    pressure in that window deleted the newest complete checkpoint)."""
    import trio

    from mtcfs.base.chunking import DEFAULT_CHUNK_SIZE
    from support.corefs import Filesystem, Store

    m = make_mount("node", size="64M", evict_unsaved="no")
    os.mkdir(m.path("step_1"))
    _file(m.path("step_1", "__0_0.distcp"), 4 * MiB, 1)
    meta = os.open(m.path("step_1", ".metadata"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(meta, b"meta step_1")
    os.fsync(meta)
    # An unfinished DCP save and an Orbax temporary directory: leftovers after the kill.
    os.mkdir(m.path("step_2"))
    _file(m.path("step_2", "__0_0.distcp"), 1 * MiB, 2)
    os.mkdir(m.path("3.orbax-checkpoint-tmp-17"))
    _file(m.path("3.orbax-checkpoint-tmp-17", "array"), 1 * MiB, 3)
    for rel in ("step_1/__0_0.distcp", "step_2/__0_0.distcp", "3.orbax-checkpoint-tmp-17/array"):
        m.wait_state(rel, "local", timeout=30)  # sealed before the kill
    m.kill9()
    try:
        os.close(meta)
    except OSError:
        pass

    async def main() -> None:
        # The store as the next daemon loads it; the check runs before the re-seal ends.
        fs = Filesystem(Store(str(m.store), m.job, DEFAULT_CHUNK_SIZE), capacity=64 * MiB,
                        chunk_size=DEFAULT_CHUNK_SIZE, job=m.job)
        try:
            assert "step_1" not in fs.steps
            async with trio.open_nursery() as n:
                fs.start(n)
                seen.append({d.name for d in fs.eviction.crash_leftovers()})
                with trio.fail_after(30):  # then the re-seal commits it
                    while "step_1" not in fs.steps:
                        await trio.sleep(0.01)
                seen.append({d.name for d in fs.eviction.crash_leftovers()})
                n.cancel_scope.cancel()
        finally:
            fs.close()
            fs.store.close()
    seen: list[set[bytes]] = []
    trio.run(main)
    assert seen == [{b"step_2", b"3.orbax-checkpoint-tmp-17"}] * 2, seen


def test_interrupted_backup_retried_until_it_completes(make_mount, shm_dir):
    """The backup a kill interrupted stays the one to resume until it completes: a first
    attempt after the restart that fails (a bucket error) is retried with the backoff
    (before: it was forgotten after that attempt; only the newest step was backed up and
    the interrupted one never was)."""
    bucket = shm_dir / "bucket"
    bucket.mkdir()
    broken = bucket / "chunks"
    broken.write_bytes(b"not a directory: every chunk upload fails")
    m = make_mount("node", size="256M", backup=f"file://{bucket}", backup_interval="100ckpt",
                   keep=2, backup_keep=100)
    s1 = _commit(m, "step_1", 4 * MiB, 1)
    r = m.cli("backup", str(m.mnt), "--step", "step_1", check=False)
    assert r.returncode != 0, r.stdout  # failed: recorded as the backup in progress
    s2 = _commit(m, "step_2", 4 * MiB, 2)
    m.kill9()
    m.start()  # resumes step_1 first: fails while the bucket is broken
    m.wait_for(lambda: m.status()["backup"]["failures"] >= 2, 30, "failed attempts")
    broken.unlink()
    m.wait_for(lambda: _backup_state(m, "step_1") == "complete", 90, "the backup of step_1")
    m.wait_for(lambda: _backup_state(m, "step_2") == "complete", 90, "the backup of step_2")
    assert m.path("step_1", "shard.distcp").read_bytes() == s1
    assert m.path("step_2", "shard.distcp").read_bytes() == s2
