"""Orbax CheckpointManager (real orbax-checkpoint, TensorStore OCDBT, jax on CPU) through a
real mount: sync and async saves, max_to_keep, bit-exact restore, commit detection."""

from __future__ import annotations

import os

import pytest

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def _state(i: int) -> dict:
    """A small train state whose every leaf depends on ``i``; several dtypes."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(i), 3)
    return {
        "params": {
            "dense": {"kernel": jax.random.normal(k1, (256, 128), jnp.float32),
                      "bias": jnp.arange(128, dtype=jnp.float32) * (i + 1)},
            "embed": jax.random.normal(k2, (512, 64)).astype(jnp.bfloat16),
        },
        "opt": {"mu": jax.random.uniform(k3, (256, 128)), "count": jnp.asarray(i, jnp.int32)},
        "step": jnp.asarray(i, jnp.int64 if jax.config.jax_enable_x64 else jnp.int32),
    }


def _assert_same(a, b) -> None:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def _restore(mgr, step: int):
    target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), _state(0))
    return mgr.restore(step, args=ocp.args.StandardRestore(target))


def _listed(mount) -> list[int]:
    return [r["number"] for r in mount.checkpoints()]


def test_sync_save_max_to_keep_and_restore(mount):
    opts = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False)
    with ocp.CheckpointManager(str(mount.mnt), options=opts) as mgr:
        for i in range(4):
            assert mgr.save(i, args=ocp.args.StandardSave(_state(i)))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3]
        assert mgr.latest_step() == 3
        _assert_same(_restore(mgr, 3), _state(3))
        _assert_same(_restore(mgr, 2), _state(2))

    assert sorted(os.listdir(mount.mnt)) == ["2", "3"]  # no tmp dirs left behind
    for s in ("2", "3"):
        assert mount.state(s) == "local"
    rows = mount.checkpoints()
    assert [r["step"] for r in rows] == ["2", "3"]
    assert all(r["committed_by"] == "orbax-rename" and r["ram"] == "complete" for r in rows), rows

    # A new manager over the same directory (a restarted job) sees the same steps.
    with ocp.CheckpointManager(str(mount.mnt), options=opts) as mgr:
        assert mgr.all_steps() == [2, 3]
        _assert_same(_restore(mgr, mgr.latest_step()), _state(3))


def test_async_save_and_restore(mount):
    opts = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
    with ocp.CheckpointManager(str(mount.mnt), options=opts) as mgr:
        for i in (10, 20, 30):
            mgr.save(i, args=ocp.args.StandardSave(_state(i)))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [20, 30]
        for s in ("20", "30"):
            mount.wait_state(s, "local", timeout=10)
        _assert_same(_restore(mgr, 30), _state(30))
        _assert_same(_restore(mgr, 20), _state(20))
        assert _listed(mount) == mgr.all_steps()


def test_checkpoints_lists_exactly_orbax_steps(mount):
    # A step dir Orbax never committed (a crash before its rename) is not a checkpoint.
    os.mkdir(mount.path("7.orbax-checkpoint-tmp-1234"))
    mount.path("7.orbax-checkpoint-tmp-1234", "junk").write_bytes(b"x" * 1000)
    assert mount.state("7.orbax-checkpoint-tmp-1234") == "incomplete"
    opts = ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=False)
    with ocp.CheckpointManager(str(mount.mnt), options=opts) as mgr:
        for i in (1, 2, 3, 4, 5):
            mgr.save(i, args=ocp.args.StandardSave(_state(i)))
        mgr.wait_until_finished()
        steps = mgr.all_steps()
    assert steps == [3, 4, 5]
    assert _listed(mount) == steps
    # Orbax leaves foreign tmp dirs alone (cleanup_tmp_directories is off): still incomplete.
    assert mount.state("7.orbax-checkpoint-tmp-1234") == "incomplete"
