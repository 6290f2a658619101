"""The Orbax multi-tier checkpointing demo (examples/demo_mtc.py) runs end to end: real JAX
processes with Orbax's ReplicatorCheckpointManager on mtc mounts, a node lost and replaced,
the job restored bit-exact from the peer; it cleans up, also on Ctrl-C."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from support.demo import assert_cleaned_up, interrupt_after, run_demo

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo_mtc.py"

pytestmark = [pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing")]


def test_demo_mtc_passes():
    pytest.importorskip("orbax.checkpoint")
    stdout, out = run_demo(DEMO)
    assert "Orbax lists [1, 2, 3]" in stdout, out
    m = re.search(r"every process restored step \[3\]; node 1: marker demo-s3-n1-w0\.restore "
                  r"[\d.]+ s after its replicator\.yaml .* from peer rank 0, (\d+) bytes\)",
                  stdout)
    assert m and int(m.group(1)) > 0, out
    assert "every shard of every array bit-exact: yes" in stdout, out
    assert "Orbax lists [3, 4, 5]" in stdout, out
    assert_cleaned_up(stdout, 2, min_pids=1)


def test_demo_mtc_ctrl_c_unmounts():
    pytest.importorskip("orbax.checkpoint")
    code, out = interrupt_after([sys.executable, str(DEMO)], "mounted with -o mtc")
    assert code == 130, out
    assert "interrupted" in out
    assert_cleaned_up(out, 2)
