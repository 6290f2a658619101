"""Backup tier and restore through real mounts: file:// and the GCS emulator.

Each test saves real DCP checkpoints, waits until the step is ``backed-up``, then loses the
node (clean unmount, the store directory wiped) and mounts again on an empty store with the
same backup: the newest checkpoint must reappear at once and load bit-exact. Also: restore of
an older step, dedup of unchanged tensors, a corrupted chunk object (EIO, reported; other
files fine), transient GCS faults (retried; restore still bit-exact), and a step evicted from
RAM read back from the backup.

Also: a re-save into a step already backed up is backed up again, and a checkpoint that
backup retention retires while it is no longer in RAM disappears rather than stay visible
with no data anywhere.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import time
import uuid
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from support.ckpt import (assert_same, chunk_digests, dcp_load_like, dcp_state,  # noqa: E402
                          tensor_state, torch_train_state, zeros_like_state)
from support.gcs import FlakyProxy  # noqa: E402
from support.mount import drop_page_cache, remove_tree  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CHUNK = 256 * 1024
MIB_FLOATS = 262144  # float32 elements in 1 MiB


@pytest.fixture(params=["file", "gcs"])
def backup_url(request, tmp_path, monkeypatch) -> str:
    """A fresh backup location: a file:// directory or a gs:// prefix on the emulator."""
    if request.param == "file":
        return f"file://{tmp_path}/backup"
    emu = request.getfixturevalue("gcs_emulator")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emu.url)  # inherited by the daemon
    return f"gs://{emu.bucket}/t6-{uuid.uuid4().hex[:12]}"


def _mount(make_mount, url: str, name: str = "node"):
    return make_mount(name, backup=url, backup_interval="1ckpt", chunk_size="256K")


def _save(mount, step: str, state, threads: int = 1) -> None:
    path = str(mount.path(step))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=threads))


def _load(mount, step: str, like):
    return dcp_load_like(mount.path(step), like)


def _lose_node(mount) -> float:
    """Unmount, wipe the RAM tier, mount again on the empty store; seconds to remount."""
    mount.stop()
    remove_tree(mount.store)  # its data tmpfs too (it outlives the daemon)
    t0 = time.monotonic()
    mount.start()
    return time.monotonic() - t0


def _wait_restored(mount, timeout: float = 60.0) -> dict:
    def done():
        st = mount.status()
        return st if st["restore"]["pending_chunks"] == 0 else None
    return mount.wait_for(done, timeout, "restore prefetch to finish")


def _train_state(seed: int):
    model, opt = torch_train_state(seed, width=256)
    return copy.deepcopy({**dcp_state(model, opt), "extra": tensor_state(4, MIB_FLOATS, seed)})


def test_lose_node_restores_latest_then_older_step(make_mount, backup_url):
    m = _mount(make_mount, backup_url)
    s1, s2 = _train_state(1), _train_state(2)
    _save(m, "step_1", s1)
    m.wait_state("step_1", "backed-up", timeout=60)
    _save(m, "step_2", s2)
    m.wait_state("step_2", "backed-up", timeout=60)
    for name in (".metadata", "__0_0.distcp"):
        assert m.state(f"step_2/{name}") == "backed-up"
    sizes = {n: os.path.getsize(m.path("step_2", n)) for n in os.listdir(m.path("step_2"))}

    _lose_node(m)
    # Only the newest complete checkpoint comes back by itself, namespace first.
    assert sorted(os.listdir(m.mnt)) == ["step_2"]
    assert {n: os.path.getsize(m.path("step_2", n)) for n in os.listdir(m.path("step_2"))} \
        == sizes
    assert m.state("step_2") == "backed-up"
    st = m.status()
    assert st["restore"]["step"] == "step_2"
    assert st["ram"]["checkpoints"] == 1 and st["errors"] == []
    assert_same(s2, _load(m, "step_2", s2))  # reads wait for their chunks
    st = _wait_restored(m)
    assert st["restore"]["corrupt_chunks"] == 0
    for name in sizes:
        assert m.state(f"step_2/{name}") == "backed-up"
    rows = {r["step"]: r for r in m.checkpoints()}
    assert rows["step_2"]["ram"] == "complete" and rows["step_2"]["backup"] == "complete"
    assert rows["step_1"]["ram"] == "-" and rows["step_1"]["backup"] == "complete"

    # An older step on request.
    r = m.cli("restore", str(m.mnt), "--step", "1", "--json")
    res = json.loads(r.stdout)
    assert res["step"] == "step_1" and res["imported"] is True
    assert sorted(os.listdir(m.mnt)) == ["step_1", "step_2"]
    assert_same(s1, _load(m, "step_1", s1))
    assert_same(s2, _load(m, "step_2", s2))
    again = json.loads(m.cli("restore", str(m.mnt), "--step", "1", "--json").stdout)
    assert again["imported"] is False
    missing = m.cli("restore", str(m.mnt), "--step", "99", check=False)
    assert missing.returncode != 0 and "99" in missing.stderr
    assert [r["step"] for r in m.checkpoints()] == ["step_1", "step_2"]


def test_a_rewrite_during_the_backup_upload_keeps_one_chunk_and_nothing_is_lost(
        make_mount, tmp_path, monkeypatch):
    """Issue 18: a file rewritten while the backup tier uploads it (its old version
    pinned) used to be copied whole first. Now RAM grows by the chunk changed; the upload
    reads the old bytes, each verified against its digest (a changed byte would be an
    error in status); the file reads the new bytes, and so does a restore of the step."""
    monkeypatch.setenv("MTCFS_FAILPOINTS", "backup.put_chunk=sleep(0.5)")  # the daemon's
    m = _mount(make_mount, f"file://{tmp_path}/backup")
    data = bytearray(os.urandom(32 * CHUNK))
    m.path("step_1").mkdir()
    m.path("step_1", "data.bin").write_bytes(bytes(data))
    m.wait_for(lambda: m.state("step_1/data.bin") != "writing", 30, "data.bin sealed")
    m.path("step_1", "commit_success.txt").write_text("ok")  # commits: the upload starts
    m.wait_for(lambda: m.status()["backup"]["uploading"] == "step_1", 30,
               "the upload to start")
    used0 = m.status()["ram"]["used"]
    with open(m.path("step_1", "data.bin"), "r+b") as f:
        f.seek(5 * CHUNK + 3)
        f.write(b"Z")
    data[5 * CHUNK + 3] = ord("Z")
    m.wait_for(lambda: m.state("step_1/data.bin") != "writing", 30, "the rewrite sealed")
    assert m.state("step_1") != "backed-up", "the upload ended before the rewrite"
    grown = m.status()["ram"]["used"] - used0
    assert grown <= CHUNK, f"RAM grew by {grown} bytes for a 1-byte rewrite while pinned"
    assert m.path("step_1", "data.bin").read_bytes() == data
    m.wait_state("step_1", "backed-up", timeout=120)
    assert m.status()["errors"] == []
    _lose_node(m)
    assert m.path("step_1", "data.bin").read_bytes() == data
    assert m.status()["errors"] == []


def test_unchanged_tensors_are_not_uploaded_again(make_mount, backup_url):
    m = _mount(make_mount, backup_url)
    n, changed = 16, {5: 2}
    s1 = tensor_state(n, MIB_FLOATS, seed=1)
    _save(m, "step_1", s1)
    m.wait_state("step_1", "backed-up", timeout=60)
    b1 = m.status()["backup"]
    assert b1["last_step"] == "step_1"
    assert b1["last_bytes_uploaded"] > 0.9 * n * (1 << 20) * 0.9  # fp32 barely compresses

    s2 = tensor_state(n, MIB_FLOATS, seed=1, changed=changed)
    _save(m, "step_2", s2)
    m.wait_state("step_2", "backed-up", timeout=60)
    b2 = m.status()["backup"]
    assert b2["last_step"] == "step_2"
    logical = b2["last_bytes_logical"]
    assert logical >= n * (1 << 20)
    changed_bytes = len(changed) * (1 << 20)
    # The changed tensor's chunks (it may straddle two more), the small .metadata, and the
    # manifest/marker: far below the step's size.
    assert b2["last_bytes_uploaded"] < changed_bytes + 2 * CHUNK + 64 * 1024, b2
    assert b2["last_bytes_uploaded"] < logical / 8

    _lose_node(m)
    assert_same(s2, _load(m, "step_2", s2))


def test_corrupt_chunk_object_gives_eio_and_is_reported(make_mount, tmp_path):
    bk = tmp_path / "backup"
    m = _mount(make_mount, f"file://{bk}")
    state = tensor_state(16, MIB_FLOATS // 2, seed=3)  # 8 MiB over 4 data files
    _save(m, "step_1", state, threads=4)
    m.wait_state("step_1", "backed-up", timeout=60)
    names = sorted(os.listdir(m.path("step_1")))
    data_files = [n for n in names if n.endswith(".distcp")]
    assert len(data_files) >= 3, names
    content = {n: m.path("step_1", n).read_bytes() for n in names}

    def chunk_object(h: str) -> Path:
        p = bk / "chunks" / h[:2] / f"{h}.zst"
        assert p.is_file(), p
        return p

    # Corrupt one chunk of the first data file with garbage bytes, and one chunk of the
    # second with a valid zstd object of another chunk (decodes fine, wrong hash).
    bad1 = chunk_digests(content[data_files[0]], CHUNK)[2]
    p1 = chunk_object(bad1)
    p1.write_bytes(os.urandom(p1.stat().st_size))
    digests2 = chunk_digests(content[data_files[1]], CHUNK)
    bad2, donor = digests2[1], digests2[3]
    chunk_object(bad2).write_bytes(chunk_object(donor).read_bytes())

    _lose_node(m)
    assert sorted(os.listdir(m.path("step_1"))) == names
    for n in (data_files[0], data_files[1]):
        with pytest.raises(OSError) as ei:
            m.path("step_1", n).read_bytes()
        assert ei.value.errno == errno.EIO
    for n in names:
        if n in (data_files[0], data_files[1]):
            continue
        assert m.path("step_1", n).read_bytes() == content[n], n

    st = m.status()
    errors = "\n".join(st["errors"])
    assert bad1[:16] in errors and bad2[:16] in errors, errors
    assert st["restore"]["corrupt_chunks"] >= 2
    assert st["backup"]["store"]["corrupt_chunks"] >= 2
    # Waiting for the restore to finish ends with a clear error, not a hang.
    r = m.cli("restore", str(m.mnt), check=False, timeout=60)
    assert r.returncode == 1 and "could not be restored" in r.stderr, r.stderr
    # The bad chunks are never served: the files stay unreadable, not silently wrong.
    # (DCP wraps the rank's OSError into a CheckpointException carrying its traceback.)
    with pytest.raises(CheckpointException) as ei:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(zeros_like_state(state), checkpoint_id=str(m.path("step_1")))
    assert "[Errno 5]" in str(ei.value), ei.value


def test_transient_gcs_faults_are_retried(make_mount, gcs_emulator, monkeypatch):
    with FlakyProxy(gcs_emulator.url, fail_rate=0.3, seed=7) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        url = f"gs://{gcs_emulator.bucket}/t6-flaky-{uuid.uuid4().hex[:12]}"
        m = _mount(make_mount, url)
        s1 = _train_state(4)
        _save(m, "step_1", s1)
        m.wait_state("step_1", "backed-up", timeout=80)
        st = m.status()["backup"]
        assert st["last_step"] == "step_1"
        assert proxy.counts["status_503"] > 0
        before = proxy.counts["status_503"]

        _lose_node(m)
        assert sorted(os.listdir(m.mnt)) == ["step_1"]
        assert_same(s1, _load(m, "step_1", s1))
        st = _wait_restored(m)
        assert st["restore"]["corrupt_chunks"] == 0
        assert proxy.counts["status_503"] > before  # the restore went through faults too
        assert st["backup"]["store"]["retries"] > 0


def test_resave_into_backed_up_step_is_backed_up_again(make_mount, tmp_path):
    m = _mount(make_mount, f"file://{tmp_path}/backup")
    old, new = _train_state(5), _train_state(6)
    _save(m, "step_1", old)
    m.wait_state("step_1", "backed-up", timeout=60)
    _save(m, "step_1", new)  # DCP rewrites the files in place and re-commits .metadata
    assert_same(new, _load(m, "step_1", new))
    # The new version is uploaded again (the re-commit of .metadata counts as a commit).
    m.wait_state("step_1/__0_0.distcp", "backed-up", timeout=15)
    m.wait_state("step_1", "backed-up", timeout=15)
    _lose_node(m)
    assert_same(new, _load(m, "step_1", new))


def test_evicted_step_is_faulted_back_in(make_mount, tmp_path):
    m = make_mount("node", backup=f"file://{tmp_path}/backup", backup_interval="1ckpt",
                   chunk_size="256K", keep=2)
    states = {}
    for n in (1, 2, 3):
        states[n] = tensor_state(4, MIB_FLOATS, seed=10 + n)
        _save(m, f"step_{n}", states[n])
        m.wait_state(f"step_{n}", "backed-up", timeout=60)
    rows = m.wait_for(lambda: (r := {x["step"]: x for x in m.checkpoints()})
                      and r["step_1"]["ram"] == "evicted" and r, 10, "step_1 to leave RAM")
    assert rows["step_2"]["ram"] == "complete" and rows["step_3"]["ram"] == "complete"
    assert m.state("step_1/__0_0.distcp") == "remote"
    before = m.status()["counters"]["chunks_faulted"]
    for name in os.listdir(m.path("step_1")):
        drop_page_cache(m.path("step_1", name))
    assert_same(states[1], _load(m, "step_1", states[1]))
    assert m.status()["counters"]["chunks_faulted"] > before  # really read from the backup
    for n in (2, 3):
        assert_same(states[n], _load(m, f"step_{n}", states[n]))


def test_every_visible_checkpoint_stays_readable(make_mount, tmp_path):
    m = make_mount("node", backup=f"file://{tmp_path}/backup", backup_interval="1ckpt",
                   chunk_size="256K", keep=2, backup_keep=3)
    states = {}
    for n in (1, 2, 3, 4):
        states[n] = tensor_state(2, MIB_FLOATS, seed=20 + n)
        _save(m, f"step_{n}", states[n])
        m.wait_state(f"step_{n}", "backed-up", timeout=60)
    time.sleep(0.5)
    for step in sorted(os.listdir(m.mnt)):
        n = int(step.split("_")[1])
        for name in os.listdir(m.path(step)):
            drop_page_cache(m.path(step, name))
        assert_same(states[n], _load(m, step, states[n]))


def test_mtcfs_backup_now_and_status(make_mount, tmp_path):
    """With a count-based interval not yet reached, `mtcfs backup` uploads the newest
    checkpoint at once and reports what it sent; status then shows nothing pending."""
    m = make_mount("node", backup=f"file://{tmp_path}/backup", backup_interval="5ckpt")
    state = tensor_state(4, 64 * 1024, seed=3)
    _save(m, "step_1", state)
    m.wait_state("step_1", "local")
    assert m.status()["backup"]["pending"] == ["step_1"]
    r = m.cli("backup", str(m.mnt), "--json")
    res = json.loads(r.stdout)
    assert res["last_step"] == "step_1" and res["last_bytes_uploaded"] > 0
    assert m.state("step_1") == "backed-up"
    assert m.status()["backup"]["pending"] == []
    _lose_node(m)
    assert_same(state, _load(m, "step_1", state))


def test_special_files_round_trip_through_the_backup(make_mount, tmp_path):
    """FIFOs, sockets and device nodes in a checkpoint are metadata of its step manifest:
    a node restored from the backup tier has them back with their type, mode and rdev."""
    import socket
    import stat

    m = _mount(make_mount, f"file://{tmp_path}/backup")
    d = m.path("step_7")
    d.mkdir()
    (d / "sub").mkdir()
    (d / "data.bin").write_bytes(b"x" * 300_000)
    os.mkfifo(d / "sub" / "fifo", 0o620)
    os.mknod(d / "chr", stat.S_IFCHR | 0o640, os.makedev(1, 5))
    os.mknod(d / "blk", stat.S_IFBLK | 0o600, os.makedev(7, 3))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(d / "sock"))
    s.close()
    want = {n: os.lstat(d / n) for n in ("sub/fifo", "chr", "blk", "sock")}
    (d / "commit_success.txt").write_bytes(b"ok")
    m.wait_state("step_7", "backed-up", timeout=60)
    _lose_node(m)
    assert sorted(os.listdir(m.path("step_7"))) == ["blk", "chr", "commit_success.txt",
                                                    "data.bin", "sock", "sub"]
    for n, st in want.items():
        got = os.lstat(m.path("step_7", n))
        assert got.st_mode == st.st_mode, n
        assert got.st_rdev == st.st_rdev, n
        assert got.st_mtime_ns == st.st_mtime_ns, n
        assert got.st_size == 0, n
    assert m.path("step_7", "data.bin").read_bytes() == b"x" * 300_000
    assert m.status()["errors"] == []


@pytest.mark.parametrize("how", ["mv", "ln"])
def test_a_file_taken_out_of_an_evicted_checkpoint_outlives_its_retirement(
        make_mount, tmp_path, how):
    """keep=1 drops step_1's data from RAM once step_2 is backed up. The user then moves
    (or hard-links) ``step_1/model.bin`` out of the checkpoint. step_3's backup then
    retires step_1 (backup_keep=2): its backup copy and its chunks go. The file outside
    must read its bytes bit-exact. Before, the move was a metadata change only, and the
    read got EIO."""
    m = make_mount("node", backup=f"file://{tmp_path}/backup", backup_interval="1ckpt",
                   chunk_size="256K", keep=1, backup_keep=2)
    data = {n: os.urandom(3 << 20) for n in (1, 2, 3)}

    def save(n: int) -> None:
        d = m.path(f"step_{n}")
        d.mkdir()
        (d / "model.bin").write_bytes(data[n])
        m.cli("seal", str(d))
        m.wait_state(f"step_{n}", "backed-up", timeout=60)

    save(1)
    save(2)
    m.wait_state("step_1/model.bin", "remote", timeout=30)  # only the backup holds it
    if how == "mv":
        os.rename(m.path("step_1", "model.bin"), m.path("kept.bin"))
    else:
        os.link(m.path("step_1", "model.bin"), m.path("kept.bin"))
    save(3)
    from mtcfs.tiers.backup import BackupStore, FileBackend
    backup = BackupStore(FileBackend(tmp_path / "backup"))
    m.wait_for(lambda: sorted(s.step for s in backup.list_steps()) == ["step_2", "step_3"],
               30, "step_1 to be retired from the backup")
    drop_page_cache(m.path("kept.bin"))
    assert m.path("kept.bin").read_bytes() == data[1]
    assert m.path("step_3", "model.bin").read_bytes() == data[3]
