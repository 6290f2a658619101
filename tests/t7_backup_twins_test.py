"""Data-parallel twins whose backup timers pick different steps still back up a common step.

Found by the goodput run (docs/goodput.md): after a node was replaced, the twins' time-based
backup timers picked different steps; each waited ``share_wait_s`` (60 s) for a share the
other never uploaded, and no step became complete on both ranks for the rest of the run, so
a whole-job failure had nothing recent to restore from.

Here rank 0 starts sharing ``step_1``; rank 1 (a replacement that never held ``step_1``)
starts sharing ``step_2``; then rank 0 commits ``step_2`` too. The backup interval is an hour,
so each timer fires once. What a user checks: ``step_2`` is complete on both ranks in the
bucket well inside the default share wait, restorable bit-exact from either rank's manifest,
rank 0's backup of ``step_1`` ended too (not stuck in its wait), and ``mtcfs status`` shows
no backup lag and no failure.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from support.poll import wait_for

from mtcfs.tiers.backup import BackupStore, FileBackend
from mtcfs.tiers.backup.chunk_store import DEFAULT_SHARE_WAIT_S
from mtcfs.tiers.backup.layout import manifest_key

MiB = 1 << 20
#: Well under the default share wait (60 s): a common step must not cost a timed-out wait.
BOUND_S = 20.0


def _blob(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _write_step(root: Path, step: str, files: dict[str, bytes]) -> None:
    d = root / step
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    (d / "commit_success.txt").write_text("ok")


def _restore(store: BackupStore, step: str, rank: int) -> dict[str, bytes]:
    m = store.get_step(step, rank)
    return {e.path.split("/", 1)[1]: b"".join(store.get_chunk(h) for h in e.chunks)
            for e in m.entries if e.kind == "file" and not e.path.endswith(".txt")}


def test_twins_on_different_steps_converge_on_a_common_step(make_cluster, tmp_path):
    assert DEFAULT_SHARE_WAIT_S >= 3 * BOUND_S  # the bound below is not a timed-out wait
    bucket = tmp_path / "bucket"
    c = make_cluster(2, options={"assume_data_parallelism": 2, "chunk_size": "256K",
                                 "backup": f"file://{bucket}", "backup_interval": "1h"})
    be = FileBackend(bucket)
    view = BackupStore(be, rank=0, world_size=2)
    # Training changes the weights: the two steps share no chunk.
    step1 = {"shard.bin": _blob(1, 4 * MiB), "opt.bin": _blob(2, MiB + 77)}
    step2 = {"shard.bin": _blob(3, 4 * MiB), "opt.bin": _blob(4, MiB + 77)}

    _write_step(c[0].mnt, "step_1", step1)
    wait_for(lambda: be.exists(manifest_key("step_1", 0)), 30, "rank 0 begins step_1")
    t0 = time.monotonic()
    _write_step(c[1].mnt, "step_2", step2)  # the replacement's first step
    wait_for(lambda: be.exists(manifest_key("step_2", 1)), 30, "rank 1 begins step_2")
    _write_step(c[0].mnt, "step_2", step2)

    def both(step: str) -> bool:
        got = view.complete_ranks().get(step)
        return got is not None and got[1] == {0, 1}

    wait_for(lambda: both("step_2"), BOUND_S, "step_2 complete on both ranks")
    took = time.monotonic() - t0
    for r in (0, 1):
        assert _restore(view, "step_2", r) == step2
    for r in (0, 1):
        c[r].wait_state("step_2", "backed-up", timeout=BOUND_S)
        b = c.status(r)["backup"]
        assert (b["lag_steps"], b["last_error"], b["failures"]) == (0, None, 0), b
    # Rank 0 finished step_1 first (its wait ended, it uploaded the rest), then joined
    # step_2; retention then retired step_1, older than the newest step complete on every
    # rank (it was never restorable for the job: rank 1 never held it).
    assert c.status(0)["backup"]["backups"] == 2
    wait_for(lambda: "step_1" not in view.complete_ranks(), BOUND_S, "step_1 retired")
    print(f"step_2 complete on both ranks {took:.1f} s after rank 1 began it")
