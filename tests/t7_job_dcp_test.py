"""PyTorch DCP with several torch ranks spread over the nodes of one ``scope=job`` cluster.

With ``scope=job`` the mounts of all nodes are one directory: each torch rank (one OS
process, gloo on loopback, FSDP2-sharded model and Adam state; tests/support/dcp_ranks.py)
saves into or loads from the mount of the node hosting it, and sees what ranks on other
nodes wrote. Loads run with ranks moved to other nodes, and with fewer ranks than the save
(DCP reshards: a rank reads the files other ranks wrote on other nodes). Every load is
compared bit for bit with its save: the digest of every full tensor of the model and the
optimizer.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("torch")

from support.cluster import Cluster  # noqa: E402
from support.dcp_ranks import run_ranks  # noqa: E402

OPTIONS = {"scope": "job", "replicas": 1}


def _dirs(c: Cluster, placement: list[int]) -> list[Path]:
    """The directory of each torch rank: the mount of node ``placement[rank]``."""
    return [c.node(n).path() for n in placement]


def _assert_visible_everywhere(c: Cluster, step: int, world: int) -> None:
    """Every node lists ``.metadata`` and each rank's ``__<r>_0.distcp`` in ``step_<step>``,
    with the same sizes."""
    want = sorted([".metadata", *(f"__{r}_0.distcp" for r in range(world))])
    sizes = {}
    for n in range(c.nodes):
        d = c.node(n).path(f"step_{step}")
        assert sorted(os.listdir(d)) == want, f"node {n} lists step_{step}"
        sizes[n] = {name: os.path.getsize(d / name) for name in want}
    assert all(s == sizes[0] for s in sizes.values()), f"sizes differ between nodes: {sizes}"


def _assert_loaded(loaded: list[dict], saved: list[dict]) -> None:
    """Every loading rank holds exactly, bit for bit, every tensor the save held."""
    ref = saved[0]["digests"]
    assert len(ref) >= 20  # weights, biases, exp_avg, exp_avg_sq, step of 4 layers
    assert all(r["digests"] == ref for r in saved), "the saving ranks disagree"
    for r in loaded:
        bad = sorted(k for k in ref.keys() | r["digests"].keys()
                     if r["digests"].get(k) != ref.get(k))
        assert not bad, f"rank {r['rank']}/{r['world']} loaded other values: {bad}"


def test_save_and_async_save_on_two_nodes_load_with_ranks_moved(make_cluster):
    """4 ranks on 2 nodes (0,1 on node 0; 2,3 on node 1): save at step 1, async_save at
    step 2 (later in the same training run); both load with rank i on node (i+1)%2."""
    c = make_cluster(2, options=OPTIONS)
    save_on = _dirs(c, [0, 0, 1, 1])
    saved = {1: run_ranks(save_on, "save", 1, seed=3, train_steps=2)}
    _assert_visible_everywhere(c, 1, 4)
    saved[2] = run_ranks(save_on, "async_save", 2, seed=3, train_steps=4)
    _assert_visible_everywhere(c, 2, 4)
    assert saved[1][0]["digests"] != saved[2][0]["digests"]

    load_on = _dirs(c, [1, 0, 1, 0])
    for step, s in saved.items():
        _assert_loaded(run_ranks(load_on, "load", step), s)


def test_reshard_four_ranks_to_two_and_three(make_cluster):
    """Saved by 4 ranks on 4 nodes (rank i on node i); loaded by 2 ranks on nodes 2,3 and
    by 3 ranks on nodes 1,2,3, each rank reading shards written on other nodes."""
    c = make_cluster(4, options=OPTIONS)
    saved = run_ranks(_dirs(c, [0, 1, 2, 3]), "save", 5)
    _assert_visible_everywhere(c, 5, 4)

    _assert_loaded(run_ranks(_dirs(c, [2, 3]), "load", 5), saved)
    _assert_loaded(run_ranks(_dirs(c, [1, 2, 3]), "load", 5), saved)
