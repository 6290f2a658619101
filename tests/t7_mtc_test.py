"""Orbax's multi-tier checkpointing for real, with mtcfs as every node's replicator.

Each rank of a cluster mounts with ``mtc,jax_coordinator=127.0.0.1:PORT``; one JAX process
per rank (tests/support/mtc_trainer.py: CPU, 2 devices each) uses that mount as its local
checkpoint directory and runs Orbax's own ``initialize_multi_tier_checkpointing`` and
``ReplicatorCheckpointManager``, unchanged. The only channel between the two is the file
protocol (../shared/reference/orbax-mtc-protocol.md, docs/orbax-mtc.md):

- at mount, mtcfs writes ``jax-init-info.txt`` (``<rank>\\n<jax_coordinator>\\n``), which
  Orbax reads to join the JAX job (process 0 serves the coordinator on PORT);
- Orbax writes ``replicator.yaml`` (job-name, node-rank, nodes, peer-ranks, data
  parallelism, backup interval); mtcfs checks it, adopts it and deletes it, or writes
  ``replicator.failed`` (Orbax raises RuntimeError with its text);
- mtcfs places ``<job>-s<step>-n<rank>-w0.restore`` (the agreed step's directory renamed,
  or an empty ``s0`` file); Orbax renames it back to ``<step>`` and restores it;
- Orbax saves ``<step>.orbax-checkpoint-tmp`` and commits it by renaming it to ``<step>``;
  mtcfs replicates the step to the yaml's peer ranks and backs it up on the yaml's interval.

Every restore is checked bit for bit against the values the trainer saved at that step, on
every process (``ok``), and every process must restore the same step (Orbax would not notice
a mix). ``--layout dp`` (replicated over the two slices, as MTC assumes) and ``distinct``
(every node's data its own, so a node handed another node's files fails loudly) are both
used. A JAX launch takes ~5 s here.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("orbax.checkpoint")

from support.mtc_trainer import free_port, orbax_peer_ranks, run_trainers
from support.prom import value as metric

pytestmark = pytest.mark.filterwarnings("ignore")

SLICES = 2
RUN_TIMEOUT = 180.0   # seconds per launch of the trainers (a launch takes ~5 s)
WAIT = 60.0           # seconds for replication / backup to finish


# ------------------------------------------------------------------ helpers

def _mtc_cluster(make_cluster, nodes: int, backup: Path | None = None):
    """A started cluster of ``nodes`` mtc mounts sharing one JAX coordinator port.

    Returns:
        (cluster, port)
    """
    port = free_port()
    options = {"mtc": True, "jax_coordinator": f"127.0.0.1:{port}", "replicas": 1,
               "chunk_size": "256K"}
    if backup is not None:
        options["backup"] = f"file://{backup}"
    return make_cluster(nodes, options=options), port


def _train(c, port: int, tmp_path: Path, *, tag: str, **kw) -> list[dict]:
    """One launch: a trainer per rank, on that rank's mount; raises unless all are ok."""
    kw.setdefault("num_slices", SLICES)
    kw.setdefault("timeout", RUN_TIMEOUT)
    try:
        return run_trainers([c[r].mnt for r in range(len(c))], None, coordinator_port=port,
                            run_name=c.job, workdir=tmp_path / f"run-{tag}", **kw)
    except RuntimeError as exc:  # the daemons' side of the story
        logs = "\n".join(f"--- daemon of rank {r} ---\n{c[r].log()[-6000:]}"
                         for r in range(len(c)))
        raise RuntimeError(f"{exc}\n{logs}") from None


def _assert_restored(rows: list[dict], step: int | None) -> None:
    """Every process restored ``step`` (None: there was nothing), bit for bit."""
    assert [r["step"] for r in rows] == [step] * len(rows), \
        [(r["process_id"], r["step"], r.get("error")) for r in rows]
    for r in rows:
        assert r["ok"], r
        if step is not None:
            assert r["arrays"] and all(a["ok"] for a in r["arrays"].values()), r["arrays"]
            assert r["steps_at_start"] == [step], r  # nothing else left for Orbax to list


def _assert_root_clean(c, rank: int, steps: list[int], port: int) -> None:
    """The mount root of ``rank`` after a run: its steps and jax-init-info.txt, nothing of
    the handshake left (no yaml, no marker, no error file, no uncommitted tmp)."""
    m = c[rank]
    names = set(os.listdir(m.mnt))
    assert (m.mnt / "jax-init-info.txt").read_text() == f"{rank}\n127.0.0.1:{port}\n"
    errors = m.path("replicator.errors")
    assert "replicator.errors" not in names, errors.read_text()
    assert names == {"jax-init-info.txt", *map(str, steps)}, sorted(names)


def _wait_replicated(c, step: int) -> None:
    for r in range(len(c)):
        c.wait_replicated(r, str(step), timeout=WAIT)


# ------------------------------------------------------------------ tests

@pytest.mark.parametrize("nodes", [2, 4])
def test_initialize_save_and_replicate_to_orbax_peer_ranks(make_cluster, tmp_path, nodes):
    """2 and 4 processes, 2 slices: the handshake, nothing to restore (the s0 marker), three
    saves; every node's step is replicated to the peer ranks Orbax named (the process at
    the same position in the other slice: not the ring mtcfs would pick by itself)."""
    c, port = _mtc_cluster(make_cluster, nodes)
    rows = _train(c, port, tmp_path, tag="save", restore=True, expect_step=None,
                  save_steps=[1, 2, 3], layout="dp")
    _assert_restored(rows, None)
    for r in rows:
        assert r["coordinator"] == f"127.0.0.1:{port}"
        assert r["all_steps"] == [1, 2, 3] and r["latest_step"] == 3, r
        assert "replicator_errors" not in r, r["replicator_errors"]
    _wait_replicated(c, 3)
    for r in range(nodes):
        want = orbax_peer_ranks(r, nodes, SLICES)
        st = c.status(r)
        assert st["mtc"]["config"]["peer_ranks"] == want, st["mtc"]
        assert st["mtc"]["config"]["node_rank"] == r and st["mtc"]["config"]["nodes"] == nodes
        assert st["peers"]["peers"] == want, st["peers"]
        assert st["peers"]["holds_for"] == want, st["peers"]  # the pairing is symmetric
        assert c.state(r, "3") == "replicated 1/1"
        assert st["errors"] == [], st["errors"]
        _assert_root_clean(c, r, [1, 2, 3], port)
    if nodes == 4:
        assert c.status(0)["peers"]["peers"] == [2]  # a ring would have said [1]


@pytest.mark.parametrize("layout", ["dp", "distinct"])
def test_replaced_node_restores_from_its_peer(make_cluster, tmp_path, layout):
    """2 nodes: rank 1's daemon is SIGKILLed and its RAM tier lost; a replacement starts on
    an empty store. The restarted job restores step 3 bit-exact on both processes (rank 1's
    from its peer), then saves new steps, which replicate again."""
    c, port = _mtc_cluster(make_cluster, 2)
    _train(c, port, tmp_path, tag="save", save_steps=[1, 2, 3], layout=layout)
    _wait_replicated(c, 3)

    c.kill9(1)
    c.wipe(1)
    c.restart(1)
    assert not (c[1].mnt / "3").exists()  # nothing of it local until the restore

    rows = _train(c, port, tmp_path, tag="restore", restore=True, expect_step=3,
                  save_steps=[4, 5], layout=layout)
    _assert_restored(rows, 3)
    for r in rows:
        assert r["all_steps"] == [3, 4, 5], r
    digests = [{k: a["shards_sha256"] for k, a in r["arrays"].items()} for r in rows]
    # dp: the two processes are data-parallel twins, their shards alike; distinct: not.
    assert (digests[0] == digests[1]) == (layout == "dp"), digests
    last = [c.status(r)["mtc"]["last_restore"] for r in range(2)]
    assert [str(x["step"]) for x in last] == ["3", "3"], last
    assert "peer" in str(last[1]["source"]), last[1]
    assert "peer" not in str(last[0]["source"]) and "backup" not in str(last[0]["source"]), \
        last[0]
    # What an operator sees: the status line and the metrics.
    text = c[1].cli("status", str(c[1].mnt)).stdout
    assert "orbax mtc: restored" in text and "-s3-n1-w0.restore" in text, text
    metrics = c[1].cli("metrics", str(c[1].mnt)).stdout
    restore_s = metric(metrics, "mtcfs_mtc_restore_seconds")
    assert restore_s is not None and restore_s >= 0, metrics
    assert metric(metrics, "mtcfs_mtc_failed") == 0, metrics
    _wait_replicated(c, 5)
    for r in range(2):
        _assert_root_clean(c, r, [3, 4, 5], port)


def test_whole_job_lost_restores_from_the_backup_tier(make_cluster, tmp_path):
    """2 nodes, ``backup-interval-steps: 1`` in the yaml: every step is backed up. Both
    nodes are lost at once (SIGKILL, stores wiped) and replaced: no peer holds anything, so
    step 3 comes back from the backup tier, bit-exact on both processes."""
    c, port = _mtc_cluster(make_cluster, 2, backup=tmp_path / "bucket")
    _train(c, port, tmp_path, tag="save", save_steps=[1, 2, 3], backup_interval_steps=1,
           layout="distinct")
    for r in range(2):
        c[r].wait_state("3", "backed-up", timeout=WAIT)
        st = c.status(r)
        assert st["mtc"]["config"]["backup_interval_steps"] == 1, st["mtc"]

    for r in range(2):
        c.kill9(r)
    c.restart_many(range(2), wipe=True)
    for r in range(2):
        assert not (c[r].mnt / "3").exists()

    rows = _train(c, port, tmp_path, tag="restore", restore=True, expect_step=3,
                  save_steps=[4], backup_interval_steps=1, layout="distinct")
    _assert_restored(rows, 3)
    for r in range(2):
        last = c.status(r)["mtc"]["last_restore"]
        assert str(last["step"]) == "3" and "backup" in str(last["source"]), last
        c[r].wait_state("4", "backed-up", timeout=WAIT)
        _assert_root_clean(c, r, [3, 4], port)


def test_nodes_with_different_latest_steps_restore_the_newest_common_one(make_cluster,
                                                                          tmp_path):
    """Both nodes save steps 1 and 2. Then node 0 alone gets a committed step 3 (a copy of
    its step 2 written as ``3.orbax-checkpoint-tmp-x`` and renamed to ``3``, as if the job
    died after node 0's commit of step 3 and before node 1's). The restarted job must restore
    step 2 on both processes, not 3 on one and 2 on the other; node 0 lists no step 3 any
    more, and saving step 3 again works."""
    c, port = _mtc_cluster(make_cluster, 2)
    _train(c, port, tmp_path, tag="save", save_steps=[1, 2], layout="distinct")
    _wait_replicated(c, 2)

    m0 = c[0]
    tmp = m0.path("3.orbax-checkpoint-tmp-x")
    shutil.copytree(m0.path("2"), tmp)
    os.rename(tmp, m0.path("3"))
    c.wait_replicated(0, "3", timeout=WAIT)  # committed and replicated like any step
    assert sorted(os.listdir(m0.mnt)) == ["1", "2", "3", "jax-init-info.txt"]

    rows = _train(c, port, tmp_path, tag="restore", restore=True, expect_step=2,
                  save_steps=[3], layout="distinct")
    _assert_restored(rows, 2)
    for r in rows:
        assert r["saved"] == {"3": True} and r["all_steps"] == [2, 3], r
        assert r["listing_after_init"] == ["2", "jax-init-info.txt"], r
    # Step 3 on node 0 is now the one the trainer saved: the bytes of step 3, not step 2's.
    rows = _train(c, port, tmp_path, tag="again", restore=True, expect_step=3,
                  layout="distinct")
    _assert_restored(rows, 3)


def test_malformed_replicator_yaml_fails_the_trainer_and_the_daemon_stays_up(make_cluster,
                                                                             tmp_path):
    """A yaml mtcfs refuses: the trainer gets Orbax's RuntimeError with mtcfs's message, the
    daemon answers ``status`` and handles the next yaml; a hand-written bad yaml leaves its
    verdict in ``replicator.failed``."""
    c, port = _mtc_cluster(make_cluster, 2)

    # One process on rank 0's mount: Orbax writes "nodes: 1" to a mount of a 2-node job.
    t0 = time.monotonic()
    rows = run_trainers([c[0].mnt], None, num_slices=1, coordinator_port=port,
                        run_name=c.job, check=False, timeout=60, workdir=tmp_path / "run-one")
    assert time.monotonic() - t0 < 30, "the refusal should reach the trainer at once"
    err = rows[0]["error"] or ""
    assert not rows[0]["ok"] and err.startswith("RuntimeError: Replicator fatal errors:"), rows
    assert "nodes: 1" in err and "nodes=2" in err, err
    st = c.status(0)
    assert st["mtc"]["state"] == "failed" and "nodes" in (st["mtc"]["last_error"] or ""), st["mtc"]
    assert not c[0].path("replicator.yaml").exists()  # acknowledged all the same
    assert not c[0].path("replicator.failed").exists()  # Orbax read and deleted it

    # Hand-written yamls on rank 1: each refused, the verdict left for us to read.
    good = (f"job-name: {c.job}\nframework: orbax\nassume-data-parallelism: 2\nnode-rank: 1\n"
            "nodes: 2\npeer-ranks: [0]\nbackup-interval-minutes: 30")
    m1 = c[1]
    failed = m1.path("replicator.failed")
    for change, words in [(("peer-ranks: [0]", "peer-ranks: [1]"), ["peer-ranks: 1", "this node"]),
                          (("node-rank: 1", "node-rank: 5"), ["node-rank: 5"])]:
        tmp = m1.path("replicator.yaml.tmp")
        tmp.write_text(good.replace(*change))
        os.replace(tmp, m1.path("replicator.yaml"))
        m1.wait_for(lambda: not m1.path("replicator.yaml").exists(), 30, "the yaml's ack")
        text = m1.wait_for(lambda: failed.exists() and failed.read_text(), 10,
                           "replicator.failed")
        for w in words:
            assert w in text, text
        assert c.status(1)["mtc"]["state"] == "failed"
        failed.unlink()

    # The daemons are still the job's replicators: a proper launch works.
    rows = _train(c, port, tmp_path, tag="good", restore=True, expect_step=None,
                  save_steps=[1], layout="distinct")
    _assert_restored(rows, None)
    for r in range(2):
        assert c.status(r)["mtc"]["state"] != "failed"
