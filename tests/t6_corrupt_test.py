"""Corruption in the RAM tier (issue 12, item 5): a byte changed in a data file under the
store is never served.

* changed while the daemon was down: the first read after the start verifies the chunk, and
  gets the right bytes from the backup tier (file://), which also repairs the store; with no
  other source the read fails with EIO, never the wrong bytes;
* changed behind the running daemon's back: the background scrub (``scrub_interval=``)
  finds it within its interval and repairs it from the backup tier; a later read returns the
  right bytes.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import time
from pathlib import Path

import pytest

from support.mount import drop_page_cache

MiB = 1 << 20
CHUNK = 256 * 1024


def _data(n: int, seed: int) -> bytes:
    import random
    return random.Random(seed).randbytes(n)


def _write_step(m, step: str, data: bytes) -> None:
    d = m.path(step)
    d.mkdir()
    (d / "model.bin").write_bytes(data)
    (d / "commit_success.txt").write_bytes(b"ok")
    m.wait_for(lambda: any(c["step"] == step for c in m.checkpoints()), 30, f"{step} committed")


def _wait_backed_up(m, step: str) -> None:
    m.wait_for(lambda: any(c["step"] == step and c["backup"] == "complete"
                           for c in m.checkpoints()), 60, f"{step} backed up")


def _data_file(store: Path, step: str, name: str = "model.bin") -> Path:
    """The data file of ``step/name`` (read from the store's metadata, daemon down or not)."""
    db = sqlite3.connect(f"file:{store / 'meta.sqlite3'}?mode=ro", uri=True)
    try:
        (top,) = db.execute("SELECT ino FROM inodes WHERE parent=1 AND name=?",
                            (step.encode(),)).fetchone()
        (vid,) = db.execute("SELECT vid FROM inodes WHERE parent=? AND name=?",
                            (top, name.encode())).fetchone()
    finally:
        db.close()
    return store / "data" / str(vid)


def _flip(path: Path, off: int) -> None:
    """Flip one bit at ``off`` of ``path`` in place, as bit rot would."""
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([b[0] ^ 0x10]), off)
    finally:
        os.close(fd)


def test_a_byte_changed_while_down_is_refetched_from_the_backup_on_first_read(make_mount, tmp_path):
    data = _data(3 * CHUNK + 1000, 1)
    m = make_mount("n", backup=f"file://{tmp_path}/backup", backup_interval="1ckpt",
                   chunk_size="256K")
    _write_step(m, "step_100", data)
    _wait_backed_up(m, "step_100")
    m.stop()
    f = _data_file(m.store, "step_100")
    _flip(f, CHUNK + 12345)  # chunk 1
    m.start()
    got = m.path("step_100", "model.bin").read_bytes()
    assert got == data  # bit-exact: the corrupt chunk came from the backup tier
    assert f.read_bytes() == data  # and the store is repaired
    st = m.status()
    assert st["counters"]["corrupt_chunks"] == 1
    assert any("step_100/model.bin" in e and "chunk 1" in e for e in st["errors"])
    r = m.cli("verify", str(m.mnt), check=False)
    assert r.returncode == 0, r.stdout
    metrics = m.cli("metrics", str(m.mnt)).stdout
    assert "mtcfs_corrupt_chunks_total" in metrics


def test_the_verification_at_start_finds_damage_before_anyone_reads(make_mount, tmp_path):
    """A restarted daemon hashes what its RAM tier holds in the background, the newest
    files first: a byte changed while it was down is found, and repaired from the backup
    tier, with no read at all; then nothing is left for a first read (or a passthrough
    open) to hash, and the bytes are right."""
    old, new = _data(2 * CHUNK, 11), _data(3 * CHUNK + 1000, 12)
    m = make_mount("n", backup=f"file://{tmp_path}/backup", backup_interval="1ckpt",
                   chunk_size="256K", scrub_interval="0")
    _write_step(m, "step_100", old)
    _write_step(m, "step_200", new)
    _wait_backed_up(m, "step_200")
    m.stop()
    f = _data_file(m.store, "step_200")
    _flip(f, 2 * CHUNK + 4321)  # chunk 2 of the newest checkpoint
    m.start()
    m.wait_for(lambda: m.status()["scrub"]["start_seconds"] is not None, 30,
               "the verification at start to finish")
    st = m.status()
    sc = st["scrub"]
    assert sc["corrupt_chunks"] == 1 and sc["unverified_chunks"] == 0, sc
    # every chunk in RAM at the start, both checkpoints (commit files included), once
    assert sc["start_chunks"] == 2 + 4 + 2 and sc["start_done_bytes"] == sc["start_total_bytes"]
    assert any("verification at start" in e and "step_200/model.bin" in e and "chunk 2" in e
               for e in st["errors"]), st["errors"]
    m.wait_for(lambda: f.read_bytes() == new, 20, "the store repaired from the backup tier")
    assert st["reads"].get("last_failure") in (None, "")
    assert m.path("step_200", "model.bin").read_bytes() == new
    assert m.path("step_100", "model.bin").read_bytes() == old
    line = m.cli("status", str(m.mnt)).stdout
    assert "verified at start: 8 chunks in" in line, line
    assert "mtcfs_start_verify_seconds" in m.cli("metrics", str(m.mnt)).stdout


@pytest.mark.parametrize("chunk", [CHUNK, 64 * 1024], ids=["thread", "inline"])
def test_a_byte_changed_while_down_with_no_other_source_is_eio_not_wrong_bytes(make_mount,
                                                                             chunk):
    # (chunks up to 64 KiB are hashed on the daemon's loop, larger ones in a thread)
    data = _data(3 * chunk + 1000, 2)
    m = make_mount("n", chunk_size=f"{chunk // 1024}K")
    _write_step(m, "step_100", data)
    m.stop()
    _flip(_data_file(m.store, "step_100"), 2 * chunk + 7)  # chunk 2
    m.start()
    p = m.path("step_100", "model.bin")
    with open(p, "rb", buffering=0) as fh:
        assert os.pread(fh.fileno(), chunk, 0) == data[:chunk]  # good chunks are served
        with pytest.raises(OSError) as exc:
            os.pread(fh.fileno(), chunk, 2 * chunk)
        assert exc.value.errno == errno.EIO
        with pytest.raises(OSError) as exc:  # and again: known bad, never served
            os.pread(fh.fileno(), 100, 2 * chunk + 5)
        assert exc.value.errno == errno.EIO
    st = m.status()
    assert st["counters"]["corrupt_chunks"] == 1
    assert "step_100/model.bin, chunk 2" in st["reads"]["last_failure"]


def test_the_scrub_finds_a_byte_changed_behind_the_daemon_and_repairs_it(make_mount, tmp_path):
    data = _data(4 * CHUNK, 3)
    m = make_mount("n", backup=f"file://{tmp_path}/backup", backup_interval="1ckpt",
                   chunk_size="256K", scrub_interval="1s")
    _write_step(m, "step_100", data)
    _wait_backed_up(m, "step_100")
    p = m.path("step_100", "model.bin")
    assert p.read_bytes() == data
    f = _data_file(m.store, "step_100")
    passes = m.status()["scrub"]["passes"]
    _flip(f, 3 * CHUNK + 99)  # chunk 3, behind the running daemon's back
    t0 = time.monotonic()
    m.wait_for(lambda: m.status()["counters"]["corrupt_chunks"] >= 1, 20, "the scrub to find it")
    found_s = time.monotonic() - t0
    m.wait_for(lambda: f.read_bytes() == data, 20, "the store repaired")
    st = m.status()
    assert st["scrub"]["passes"] > passes and st["scrub"]["last_finished"]
    assert found_s < 10, found_s
    assert any("step_100/model.bin" in e and "chunk 3" in e for e in st["errors"])
    drop_page_cache(p)
    assert p.read_bytes() == data
    assert "scrub:" in m.cli("status", str(m.mnt)).stdout


def test_the_scrub_marks_a_corrupt_chunk_it_cannot_repair_and_reads_fail(make_mount):
    data = _data(2 * CHUNK, 4)
    m = make_mount("n", chunk_size="256K", scrub_interval="1s")
    _write_step(m, "step_100", data)
    p = m.path("step_100", "model.bin")
    f = _data_file(m.store, "step_100")
    _flip(f, 10)  # chunk 0
    m.wait_for(lambda: m.status()["counters"]["corrupt_chunks"] >= 1, 20, "the scrub to find it")
    drop_page_cache(p)
    with open(p, "rb", buffering=0) as fh:
        with pytest.raises(OSError) as exc:
            os.pread(fh.fileno(), CHUNK, 0)
        assert exc.value.errno == errno.EIO
        assert os.pread(fh.fileno(), CHUNK, CHUNK) == data[CHUNK:]


def test_scope_job_a_rejoining_node_verifies_the_files_it_kept(make_cluster, monkeypatch):
    """scope=job: a node that restarts keeps its own files through the job's namespace
    snapshot (the new version takes the old data file over). A byte changed while it was
    down is still caught by the first read, and the right bytes come from the replica."""
    monkeypatch.setenv("MTCFS_NS_TRIM_OPS", "4")  # the log is folded while rank 1 is down
    c = make_cluster(2, options={"scope": "job", "replicas": 1, "chunk_size": "256K"})
    data = _data(3 * CHUNK + 77, 7)
    d = c.node(0).path("step_5")
    d.mkdir()
    c.node(1).path("step_5", "__1_0.distcp").write_bytes(data)
    c.node(0).path("step_5", ".metadata").write_bytes(b"meta")  # commits step_5
    c.wait_replicated(1, "step_5")
    applied = c.status(1)["namespace"]["seq"]  # the last op rank 1 applied
    c.stop(1)
    _flip(_data_file(c.node(1).store, "step_5", "__1_0.distcp"), CHUNK + 5)
    # The job moves on and folds its namespace log into a new base: rank 1 is behind it
    # and joins by installing that snapshot, keeping the file it wrote. (A base past what
    # rank 1 applied: a fold of ops it had applied, still under way at its stop, would
    # leave it the log to replay, not a snapshot to install.)
    for i in range(6, 12):
        c.node(0).path(f"step_{i}").mkdir()
    c.node(0).wait_for(lambda: (c.status(0)["namespace"].get("base_rev") or 0) > applied, 30,
                       "the namespace log folded past rank 1's last op")
    c.restart(1)
    assert c.status(1)["namespace"].get("snapshots_installed", 0) >= 1
    assert c.node(1).path("step_5", "__1_0.distcp").read_bytes() == data
    st = c.node(1).status()
    assert st["scrub"]["corrupt_chunks"] == 1, st["scrub"]
