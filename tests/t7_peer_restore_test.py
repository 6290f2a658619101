"""The peer tier through real mounts: a replacement node gets its checkpoint back from its
peers (real gRPC on loopback), bit-exact, and the backup tier only when no peer has it.

Every rank trains its own tiny torch model (a seed per rank) and saves real DCP checkpoints
(``torch.distributed.checkpoint``, no process group) into its own mount. A node is then
lost (SIGKILL, its store wiped) and started again on the empty store, as a replacement node
would be: its newest step must be there at once and come back bit for bit — every file's
bytes and every tensor loaded with DCP — and ``mtcfs status`` must tell where it came from.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import threading
import time
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from mtcfs.base.manifest import StepManifest  # noqa: E402
from support.ckpt import (assert_same, chunk_digests, dcp_load_like,  # noqa: E402
                          dcp_state, tensor_state, torch_train_state)
from support.mount import is_mounted  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: Small chunks, so each rank's checkpoint is several chunks spread over its holders.
CHUNK = "256K"
CHUNK_BYTES = 256 * 1024
MIB_FLOATS = 262144  # float32 elements in 1 MiB
STEPS = (10, 20)
#: Training iterations before each saved step (a real optimizer state that changes).
ITERS = {10: 2, 20: 4}


# ------------------------------------------------------------------ helpers

def _train(rank: int, step: int) -> dict:
    """The state rank ``rank`` saves at ``step``: its own model, deterministic per rank."""
    model, opt = torch_train_state(seed=1000 + rank, width=256, steps=ITERS[step])
    return copy.deepcopy(dcp_state(model, opt))


def _save(mount, step: str, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP warns it runs single-rank
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(mount.path(step)),
                                                            thread_count=1))


def _train_and_save(cluster) -> dict[int, dict]:
    """Every rank saves step_10 and step_20 into its own mount; returns rank -> step_20 state."""
    states = {}
    for r in range(len(cluster)):
        for s in STEPS:
            st = _train(r, s)
            _save(cluster[r], f"step_{s}", st)
        states[r] = st
    return states


def _call(fn, *args):
    """``fn(*args)``'s result, or the exception it raised (for threads)."""
    try:
        return fn(*args)
    except BaseException as exc:  # noqa: BLE001 (handed to the test thread)
        return exc


def _files(root: Path) -> dict[str, bytes]:
    """relative path -> bytes of every file below ``root``."""
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = Path(dirpath, n)
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


def _wait_all_replicated(cluster, step: str, timeout: float = 60.0) -> None:
    for r in range(len(cluster)):
        cluster.wait_replicated(r, step, timeout=timeout)
        for name in os.listdir(cluster[r].path(step)):  # a file's state follows its step's
            assert cluster.state(r, f"{step}/{name}") == cluster.state(r, step)


def _wait_restored(mount, timeout: float = 60.0) -> dict:
    def done():
        st = mount.status()
        return st if st["restore"] and st["restore"]["pending_chunks"] == 0 else None
    return mount.wait_for(done, timeout, "the restore to bring every chunk")


def _replace(cluster, *ranks: int) -> None:
    """Crash ``ranks`` (SIGKILL), lose their RAM tier, start replacements on empty stores
    (all at once, as a scheduler restarting a failed slice would)."""
    for r in ranks:
        cluster.kill9(r)
    for r in ranks:
        cluster.wipe(r)
        assert not any(cluster[r].store.iterdir())
    cluster.restart_many(ranks)


@contextlib.contextmanager
def _replace_with_holder_frozen(cluster, rank: int, holder: int):
    """Crash ``rank``, wipe it and start its replacement; the moment the replacement's mount
    appears (its namespace is imported, its data not here yet), freeze rank ``holder``, the
    peer its chunks come from, with SIGSTOP. Yields ``resume()``, which lets ``holder`` run
    again (done on leaving at the latest)."""
    pid, mnt = cluster[holder].pid, cluster[rank].mnt
    cluster.kill9(rank)
    cluster.wipe(rank)
    restarted: list[object] = []
    starter = threading.Thread(target=lambda: restarted.append(_call(cluster.restart, rank)))
    frozen = [False]

    def resume() -> None:
        if frozen[0]:
            os.kill(pid, signal.SIGCONT)
            frozen[0] = False

    starter.start()
    try:
        deadline = time.monotonic() + 60
        while not is_mounted(str(mnt)):  # it mounts once its namespace is imported
            assert starter.is_alive(), f"the replacement of rank {rank} failed: {restarted}"
            assert time.monotonic() < deadline, f"the replacement of rank {rank} never mounted"
            time.sleep(0.001)
        os.kill(pid, signal.SIGSTOP)
        frozen[0] = True
        yield resume
    finally:
        resume()
        starter.join(60)
    assert len(restarted) == 1 and not isinstance(restarted[0], BaseException), restarted


def _assert_back(cluster, rank: int, before: dict[str, bytes], state: dict) -> dict:
    """``rank``'s step_20 is back: same files, same bytes, same tensors; returns its status."""
    m = cluster[rank]
    assert sorted(os.listdir(m.mnt)) == ["step_20"]
    assert sorted(_files(m.path("step_20"))) == sorted(before)
    for name, data in before.items():
        assert os.path.getsize(m.path("step_20", name)) == len(data)
    after = _files(m.path("step_20"))  # reads wait for the chunks not here yet
    for name, data in before.items():
        assert after[name] == data, f"rank {rank}: step_20/{name} differs after restore"
    assert_same(state, dcp_load_like(m.path("step_20"), state))
    st = _wait_restored(m)
    assert st["restore"]["step"] == "step_20"
    assert st["restore"]["corrupt_chunks"] == 0
    assert st["errors"] == [], st["errors"]
    return st


# ------------------------------------------------------------------ tests

def test_lost_node_comes_back_from_its_peer_not_the_backup(make_cluster, tmp_path):
    """3 nodes, one replica each: a wiped rank gets step_20 from its ring peer. A backup
    tier is configured but never used (an interval of 1000 checkpoints, so nothing is
    uploaded): nothing of the restore comes from it."""
    c = make_cluster(3, options={"replicas": 1, "chunk_size": CHUNK,
                                 "backup": f"file://{tmp_path}/backup",
                                 "backup_interval": "1000ckpt"})
    states = _train_and_save(c)
    _wait_all_replicated(c, "step_20")
    assert {c.state(r, "step_20") for r in range(3)} == {"replicated 1/1"}
    before = {r: _files(c[r].path("step_20")) for r in range(3)}
    assert all(sorted(f) == [".metadata", "__0_0.distcp"] for f in before.values())
    st1 = c.status(1)
    assert st1["peers"]["peers"] == [2] and st1["peers"]["holds_for"] == [0]
    assert st1["backup"]["backups"] == 0  # the backup tier holds nothing of rank 1

    _replace(c, 1)
    st = _assert_back(c, 1, before[1], states[1])
    restore = st["restore"]
    assert restore["manifest_from"] == "peer rank 2", restore
    assert restore["chunks_from"]["peers"] > 0, restore
    assert restore["chunks_from"]["backup"] == 0, restore
    assert st["backup"]["store"]["chunks_downloaded"] == 0
    assert c.status(2)["peers"]["server"]["chunks_sent"] >= restore["chunks_from"]["peers"]
    # The other ranks are untouched, and the replacement replicates its step again.
    for r in (0, 2):
        assert _files(c[r].path("step_20")) == before[r]
    assert c.wait_replicated(1, "step_20", timeout=30) == "replicated 1/1"


def test_node_and_its_replica_lost_come_back_from_the_backup(make_cluster, tmp_path):
    """3 nodes, one replica each, every step backed up: rank 1 and the rank holding its
    replica (rank 2) are lost together. No peer has rank 1's data any more; it comes back,
    bit-exact, from the backup tier (and rank 2's from its peer, rank 0)."""
    c = make_cluster(3, options={"replicas": 1, "chunk_size": CHUNK,
                                 "backup": f"file://{tmp_path}/backup",
                                 "backup_interval": "1ckpt"})
    states = _train_and_save(c)
    for r in range(3):
        c[r].wait_state("step_20", "backed-up", timeout=60)
        for name in os.listdir(c[r].path("step_20")):
            assert c.state(r, f"step_20/{name}") == "backed-up"
    before = {r: _files(c[r].path("step_20")) for r in range(3)}
    assert c.status(2)["peers"]["holds_for"] == [1]

    _replace(c, 1, 2)
    st1 = _assert_back(c, 1, before[1], states[1])
    assert st1["restore"]["manifest_from"] == "backup", st1["restore"]
    assert st1["restore"]["chunks_from"]["backup"] > 0, st1["restore"]
    assert st1["restore"]["chunks_from"]["peers"] == 0, st1["restore"]
    st2 = _assert_back(c, 2, before[2], states[2])
    assert st2["restore"]["chunks_from"]["peers"] > 0, st2["restore"]
    assert _files(c[0].path("step_20")) == before[0]


def test_corrupt_replica_is_detected_and_fetched_from_the_other_holder(make_cluster):
    """3 nodes, two replicas each (rank 0's data on ranks 1 and 2). Every chunk of rank 0's
    data in rank 1's replica store is corrupted; rank 0 is lost. Its restore must notice
    (rank 1 deletes the bad copies and says so) and take every chunk from rank 2."""
    c = make_cluster(3, options={"replicas": 2, "chunk_size": CHUNK})
    states = _train_and_save(c)
    _wait_all_replicated(c, "step_20")
    assert {c.state(r, "step_20") for r in range(3)} == {"replicated 2/2"}
    assert c.status(0)["peers"]["peers"] == [1, 2]
    before = _files(c[0].path("step_20"))

    replicas = c[1].store / "replicas"
    digests: set[str] = set()
    for p in sorted((replicas / "manifests" / "0").glob("*.json")):
        digests |= StepManifest.from_bytes(p.read_bytes()).chunk_set()
    step20 = StepManifest.from_bytes(
        (replicas / "manifests" / "0" / "step_20.json").read_bytes()).chunk_set()
    assert step20 and step20 <= digests
    for h in digests:
        path = replicas / "chunks" / h[:2] / h
        data = bytearray(path.read_bytes())
        for i in range(0, len(data), 4096):  # flip a byte in every page
            data[i] ^= 0xFF
        path.chmod(0o644)
        with open(path, "r+b") as f:  # in place: same file, same size, wrong bytes
            f.write(data)
    sent_by_2 = c.status(2)["peers"]["server"]["chunks_sent"]

    _replace(c, 0)
    st = _assert_back(c, 0, before, states[0])
    assert st["restore"]["chunks_from"]["peers"] >= len(step20), st["restore"]
    assert set(st["restore"]["chunks_from"]) == {"peers"}  # no backup tier here
    p1 = c.status(1)["peers"]
    assert p1["replica_store"]["corrupt_deleted"] > 0, p1["replica_store"]
    assert p1["server"]["chunks_unavailable"] > 0, p1["server"]
    # Every chunk rank 1 had was bad: rank 2 served all of them.
    assert c.status(2)["peers"]["server"]["chunks_sent"] - sent_by_2 >= len(step20)


def test_reads_of_a_restoring_file_wait_for_its_chunks(make_cluster):
    """2 nodes: the replacement of rank 1 shows its namespace at once, while its chunks are
    still on rank 0; a read of chunks not here yet waits for them (here: until rank 0,
    frozen with SIGSTOP the moment the mount appears, runs again) and returns the right
    bytes."""
    c = make_cluster(2, options={"replicas": 1, "chunk_size": CHUNK})
    model, opt = torch_train_state(seed=7, width=256, steps=3)
    # A bigger file (16 MiB of extra tensors, 64+ chunks), so that most of it is still on
    # the peer when the mount appears.
    state = copy.deepcopy({**dcp_state(model, opt),
                           "extra": tensor_state(16, MIB_FLOATS, seed=7)})
    _save(c[1], "step_20", state)
    _save(c[0], "step_20", _train(0, 20))
    _wait_all_replicated(c, "step_20")
    before = _files(c[1].path("step_20"))
    data_file = "__0_0.distcp"
    assert len(before[data_file]) > 16 * 2**20
    chunks = {h for data in before.values() for h in chunk_digests(data, CHUNK_BYTES)}

    mnt = c[1].mnt
    with _replace_with_holder_frozen(c, 1, holder=0) as resume:
        # The namespace is all there, every size right, before the data.
        assert sorted(os.listdir(mnt)) == ["step_20"]
        assert sorted(os.listdir(mnt / "step_20")) == sorted(before)
        for name, data in before.items():
            assert os.path.getsize(mnt / "step_20" / name) == len(data)
        time.sleep(0.3)  # fetches rank 0 answered before it froze have landed by now
        assert os.getxattr(mnt / "step_20" / data_file, "user.mtcfs.state") == b"restoring"

        got: list[object] = []
        reader = threading.Thread(
            target=lambda: got.append(_call((mnt / "step_20" / data_file).read_bytes)))
        reader.start()
        reader.join(1.0)
        assert reader.is_alive() and not got, \
            f"a read of chunks that are not here yet did not wait: {got!r:.200}"
        resume()
        reader.join(60)
        assert not reader.is_alive(), "the read still waits after rank 0 runs again"
        assert isinstance(got[0], bytes), got[0]
        assert got[0] == before[data_file]
    st = _assert_back(c, 1, before, state)
    assert st["restore"]["manifest_from"] == "peer rank 0"
    assert st["restore"]["chunks_from"]["peers"] >= len(chunks), st["restore"]


def test_replacement_with_time_based_backup_survives_its_restore(make_cluster, tmp_path):
    """2 nodes, a time-based backup interval (the default kind): step_10 is backed up at
    once, step_20 only later. A replacement of rank 1 restores step_20 from rank 0 (frozen
    for a second, so the data takes a while); its backup policy finds step_20 not backed up
    and due at once. The node must stay up, restore, and back the step up once its data is
    here. (Regression: the upload read chunks not restored yet, and the KeyError took the
    daemon down.)"""
    c = make_cluster(2, options={"replicas": 1, "chunk_size": CHUNK,
                                 "backup": f"file://{tmp_path}/backup",
                                 "backup_interval": "1h"})
    states = _train_and_save(c)
    _wait_all_replicated(c, "step_20")
    for r in range(2):
        assert c.state(r, "step_10") == "backed-up"
    before = _files(c[1].path("step_20"))

    with _replace_with_holder_frozen(c, 1, holder=0):
        time.sleep(1.0)  # the backup policy has had its go at step_20, data not here yet
        assert c.status(1)["ram"]["checkpoints"] == 1
    st = _assert_back(c, 1, before, states[1])
    assert st["restore"]["manifest_from"] == "peer rank 0"
    c[1].wait_state("step_20", "backed-up", timeout=30)
    st = c.status(1)
    assert st["errors"] == [], st["errors"]
    assert st["backup"]["last_step"] == "step_20", st["backup"]
    assert _files(c[1].path("step_20")) == before
