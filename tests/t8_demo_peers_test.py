"""The peer-tier demo (examples/demo_peers.py) runs end to end: three mounts on loopback, a
node lost and restored from its peer (not the backup), bit-exact training; it cleans up."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from support.demo import assert_cleaned_up, interrupt_after, run_demo

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo_peers.py"

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing")


def test_demo_peers_passes():
    pytest.importorskip("torch")
    t0 = time.monotonic()
    stdout, out = run_demo(DEMO)
    assert "DIFFERENT" not in stdout, out
    # 40 steps, a checkpoint every 10, node 1 lost at step 28: step_20 comes back
    assert "node 1 lost at step 28" in stdout, out
    assert "restored step_20" in stdout and "resumed at step 20 -> 40" in stdout, out
    assert "node 1's loaded state bit-exact: yes" in stdout, out
    # ... from its ring peer (rank 2), and nothing from the configured backup tier
    m = re.search(r"^served by: peers: (\d+) chunks, backup: 0 chunks; manifest from "
                  r"peer rank 2; chunks downloaded from the backup: 0$", stdout,
                  re.MULTILINE)
    assert m and int(m.group(1)) > 0, out
    assert "'replicated 1/1'" in stdout, out
    for rank in range(3):
        assert re.search(rf"^node {rank}: .*: identical; weights and optimizer state "
                         r"(\d+)/\1 entries identical$", stdout, re.MULTILINE), out
    assert_cleaned_up(stdout, 3)
    assert time.monotonic() - t0 < 120


def test_demo_peers_ctrl_c_unmounts():
    pytest.importorskip("torch")
    code, out = interrupt_after([sys.executable, str(DEMO), "--steps", "500", "--every", "5",
                                 "--width", "64"], "step_10 saved on every node")
    assert code == 130, out
    assert "interrupted" in out
    assert_cleaned_up(out, 3)
