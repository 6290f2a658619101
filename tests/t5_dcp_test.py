"""PyTorch Distributed Checkpoint (real torch.distributed.checkpoint) through a real mount.

Single process, no process group (DCP then assumes one rank). Every load is compared bit
for bit with what was saved: every tensor of the model and of the optimizer state.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from support.ckpt import (apply_dcp_state, assert_same, count_tensors, dcp_state,  # noqa: E402
                          torch_train_state)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _load_into_fresh(path: str, seed: int = 999):
    """A new model/optimizer with other values, loaded from DCP checkpoint ``path``."""
    model, opt = torch_train_state(seed)
    state = dcp_state(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path)
    apply_dcp_state(model, opt, state)
    return model, opt, state


def _committed(mount) -> list[str]:
    return [r["step"] for r in mount.checkpoints()]


def test_save_then_load_is_bit_exact(mount):
    model, opt = torch_train_state(0)
    saved = copy.deepcopy(dcp_state(model, opt))
    assert count_tensors(saved) >= 12  # weights, biases, exp_avg, exp_avg_sq, steps
    dcp.save(dcp_state(model, opt), checkpoint_id=str(mount.path("step_100")))

    assert sorted(os.listdir(mount.path("step_100"))) == [".metadata", "__0_0.distcp"]
    mount.wait_state("step_100", "local", timeout=10)
    for name in (".metadata", "__0_0.distcp"):
        assert mount.state(f"step_100/{name}") == "local"

    model2, opt2, loaded = _load_into_fresh(str(mount.path("step_100")))
    assert_same(saved, loaded)
    # ...and what the fresh model/optimizer now hold, read back the same canonical way.
    assert_same(saved, dcp_state(model2, opt2))
    assert_same(model.state_dict(), model2.state_dict())

    rows = mount.checkpoints()
    assert [r["step"] for r in rows] == ["step_100"]
    row = rows[0]
    assert row["number"] == 100 and row["committed_by"] == ".metadata"
    assert row["files"] == 2 and row["ram"] == "complete" and row["backup"] == "-"
    assert row["bytes"] == sum(os.path.getsize(mount.path("step_100", n))
                               for n in (".metadata", "__0_0.distcp"))


def test_async_save_then_load_is_bit_exact(mount):
    model, opt = torch_train_state(1)
    saved = copy.deepcopy(dcp_state(model, opt))
    fut = dcp.async_save(dcp_state(model, opt), checkpoint_id=str(mount.path("step_7")))
    fut.result(timeout=60)
    mount.wait_state("step_7", "local", timeout=10)
    _, _, loaded = _load_into_fresh(str(mount.path("step_7")))
    assert_same(saved, loaded)
    assert _committed(mount) == ["step_7"]


def test_resave_into_existing_dir_gives_new_values(mount):
    path = str(mount.path("step_5"))
    m1, o1 = torch_train_state(1)
    dcp.save(dcp_state(m1, o1), checkpoint_id=path)
    mount.wait_state("step_5", "local", timeout=10)
    old_hash = os.getxattr(mount.path("step_5", "__0_0.distcp"), "user.mtcfs.blake3")

    m2, o2 = torch_train_state(2, steps=3)
    new = copy.deepcopy(dcp_state(m2, o2))
    dcp.save(dcp_state(m2, o2), checkpoint_id=path)
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp"]
    mount.wait_state("step_5/__0_0.distcp", "local", timeout=10)
    assert os.getxattr(mount.path("step_5", "__0_0.distcp"), "user.mtcfs.blake3") != old_hash

    _, _, loaded = _load_into_fresh(path)
    assert_same(new, loaded)
    assert mount.state("step_5") == "local"
    assert _committed(mount) == ["step_5"]


def test_checkpoints_lists_exactly_the_committed_steps(mount):
    saved = {}
    for n in (1, 2, 3):
        model, opt = torch_train_state(n)
        saved[n] = copy.deepcopy(dcp_state(model, opt))
        dcp.save(dcp_state(model, opt), checkpoint_id=str(mount.path(f"step_{n}")))
        mount.wait_state(f"step_{n}", "local", timeout=10)
    # A save that died before DCP wrote .metadata: data file only, never committed.
    os.mkdir(mount.path("step_4"))
    mount.path("step_4", "__0_0.distcp").write_bytes(os.urandom(100_000))
    # A directory that is not a checkpoint at all.
    os.mkdir(mount.path("logs"))
    mount.path("logs", "train.log").write_text("hello\n")

    assert mount.state("step_4") == "incomplete"
    assert mount.state("logs") == "local"
    rows = mount.checkpoints()
    assert [r["step"] for r in rows] == ["step_1", "step_2", "step_3"]
    assert [r["number"] for r in rows] == [1, 2, 3]
    assert all(r["committed_by"] == ".metadata" and r["files"] == 2 for r in rows)

    for n in (1, 2, 3):  # every one still loads bit-exact
        _, _, loaded = _load_into_fresh(str(mount.path(f"step_{n}")))
        assert_same(saved[n], loaded)
