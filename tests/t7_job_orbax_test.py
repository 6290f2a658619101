"""scope=job with real multi-host Orbax: two JAX processes (CPU, 2 devices each), each saving
through ITS OWN node's mount of one job namespace, restore in fresh processes on swapped nodes.

Orbax treats the two directories as one: process 0 creates ``<step>.orbax-checkpoint-tmp``,
process 1 writes ``ocdbt.process_1`` into it (after polling for ``array_metadatas/``, which
process 0 made, to appear), and process 0 alone renames the step directory to ``<step>``
over files both wrote. Restore reads each process's part through the other node's mount.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from support.orbax_ranks import ARRAYS, run_processes

pytest.importorskip("jax")
pytest.importorskip("orbax.checkpoint")

pytestmark = pytest.mark.filterwarnings("ignore")

RUN_TIMEOUT = 120.0  # seconds per run of the processes; a run takes a few seconds
STEPS = 3            # saved 1..3 with max_to_keep=2: steps 2 and 3 stay


def tree(root: Path) -> dict[str, str]:
    """Every entry below ``root``: relative path -> ``"dir"`` or the sha256 of the file."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        for d in dirnames:
            out[str(rel / d)] = "dir"
        for f in filenames:
            out[str(rel / f)] = hashlib.sha256((Path(dirpath) / f).read_bytes()).hexdigest()
    return out


def assert_committed_alike(dirs: list[Path]) -> None:
    """Each node lists only the committed steps 2 and 3, no tmp leftovers, and every node
    sees the same entries with the same content."""
    trees = [tree(d) for d in dirs]
    for d, t in zip(dirs, trees):
        assert sorted(os.listdir(d)) == ["2", "3"], d
        assert not [p for p in t if "orbax-checkpoint-tmp" in p], (d, sorted(t))
        for step in ("2", "3"):
            for i in range(len(dirs)):  # every process's part is under the committed name
                assert t[f"{step}/default/ocdbt.process_{i}"] == "dir", (d, step, i)
            assert f"{step}/commit_success.txt" in t, (d, step)
    assert all(t == trees[0] for t in trees[1:]), "the nodes list different checkpoint trees"


def assert_restored(rows: list[dict], flip: bool) -> None:
    """Every process restored step 3, every array bit-exact, the same global digests."""
    for i, r in enumerate(rows):
        assert r["process_id"] == i and r["flip"] == flip
        assert r["step"] == STEPS and r["all_steps"] == [STEPS - 1, STEPS], r
        assert r["ok"] and set(r["arrays"]) == set(ARRAYS), r
    for name in ARRAYS:
        digests = {r["arrays"][name]["expected_sha256"] for r in rows}
        assert len(digests) == 1, (name, digests)


def test_multihost_orbax_across_job_mounts(make_cluster):
    c = make_cluster(2, options={"scope": "job", "replicas": 1})
    ckpt = [c.node(i).path("ckpt") for i in range(2)]
    ckpt[0].mkdir()
    assert ckpt[1].is_dir()  # node 0's mkdir is seen through node 1's mount

    saved = run_processes(ckpt, "save", steps=STEPS, timeout=RUN_TIMEOUT)
    assert [r["all_steps"] for r in saved] == [[STEPS - 1, STEPS]] * 2
    assert_committed_alike(ckpt)

    # Fresh processes, process 0 on node 1 and process 1 on node 0: each reads its part of
    # every array through the node that did not write it.
    assert_restored(run_processes(ckpt[::-1], "restore", timeout=RUN_TIMEOUT), flip=False)
    # Unswapped, but on the process-reversed mesh: each reads the other process's files.
    assert_restored(run_processes(ckpt, "restore", flip=True, timeout=RUN_TIMEOUT), flip=True)
    assert_committed_alike(ckpt)  # restore changed nothing
