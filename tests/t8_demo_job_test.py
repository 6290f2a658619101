"""The scope=job demo (examples/demo_job.py) runs end to end: four mounts that are one
directory, a 4-rank FSDP2 job saving with DCP, a node lost and replaced on an empty store,
the job restarted on 2 ranks (nodes 2 and 3) loading bit-exact with resharding; it cleans
up, also on Ctrl-C."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from support.demo import assert_cleaned_up, interrupt_after, run_demo

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo_job.py"
NODES = 4

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing")


def test_demo_job_passes():
    pytest.importorskip("torch")
    t0 = time.monotonic()
    stdout, out = run_demo(DEMO)
    assert "DIFFERENT" not in stdout, out
    # 6 steps on 4 ranks, a save every 3; then 2 ranks load step_6 and save step_8
    four = ".metadata __0_0.distcp __1_0.distcp __2_0.distcp __3_0.distcp"
    for step in (3, 6):
        assert f"step_{step} saved by 4 ranks" in stdout, out
        assert re.search(rf"^step_{step} +4 .* yes$", stdout, re.MULTILINE), out
    assert stdout.count(f": {four}\n") >= 2 * NODES + 1, out  # every node, and node 3 again
    assert re.search(r"^step_8 +2 .* yes$", stdout, re.MULTILINE), out
    assert "new node 3 (empty store" in stdout and "the same as every other node" in stdout
    # rank 3's shards came back from its replica (node 0), not from a backup tier
    m = re.search(r"^its own files \(.*\) back after [\d.]+ s: (\d+) chunks from the peers "
                  r"\(its replica is on node 0\), 0 from a backup tier; 'replicated 1/1' again",
                  stdout, re.MULTILINE)
    assert m and int(m.group(1)) > 0, out
    m = re.search(r"^loaded step_6 with 2 ranks in [\d.]+ s .*: (\d+)/(\d+)$", stdout,
                  re.MULTILINE)
    assert m and m.group(1) == m.group(2) and int(m.group(1)) >= 20, out
    assert_cleaned_up(stdout, NODES, min_pids=NODES)
    assert time.monotonic() - t0 < 120


def test_demo_job_ctrl_c_stops_the_ranks_and_unmounts():
    pytest.importorskip("torch")
    code, out = interrupt_after([sys.executable, str(DEMO), "--steps", "3000", "--every", "3",
                                 "--width", "64"], "step_3 saved by 4 ranks")
    assert code == 130, out
    assert "interrupted" in out
    assert_cleaned_up(out, NODES, min_pids=NODES)
