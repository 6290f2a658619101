"""The peer-tier demo (examples/demo_peers.py) runs end to end: three mounts on loopback, a
node lost and restored from its peer (not the backup), bit-exact training; it cleans up."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.demo import interrupt_after
from support.mount import force_unmount, is_mounted

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo_peers.py"

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing")


def _scratch(out: str) -> str:
    m = re.search(r"^scratch: (\S+)$", out, re.MULTILINE)
    assert m, out
    return m.group(1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _assert_cleaned_up(out: str) -> None:
    scratch = _scratch(out)
    mnts = [os.path.join(scratch, f"n{r}", "mnt") for r in range(3)]
    try:
        with open("/proc/self/mountinfo") as f:
            left = [line.split()[4] for line in f
                    if line.split()[4].startswith(scratch + "/")]
        assert not left, f"mounts left behind: {left}"
        assert not [m for m in mnts if is_mounted(m)]
    finally:
        for m in mnts:
            force_unmount(m)
    assert not os.path.exists(scratch)
    pids = [int(p) for p in re.findall(r"\bpid (\d+)", out)]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], f"daemons left running: {pids}"


def test_demo_peers_passes():
    pytest.importorskip("torch")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True,
                       timeout=300, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert re.search(r"^PASS$", r.stdout, re.MULTILINE), out
    assert "FAIL" not in r.stdout and "DIFFERENT" not in r.stdout, out
    # 40 steps, a checkpoint every 10, node 1 lost at step 28: step_20 comes back
    assert "node 1 lost at step 28" in r.stdout, out
    assert "restored step_20" in r.stdout and "resumed at step 20 -> 40" in r.stdout, out
    assert "node 1's loaded state bit-exact: yes" in r.stdout, out
    # ... from its ring peer (rank 2), and nothing from the configured backup tier
    m = re.search(r"^served by: peers: (\d+) chunks, backup: 0 chunks; manifest from "
                  r"peer rank 2; chunks downloaded from the backup: 0$", r.stdout,
                  re.MULTILINE)
    assert m and int(m.group(1)) > 0, out
    assert "'replicated 1/1'" in r.stdout, out
    for rank in range(3):
        assert re.search(rf"^node {rank}: .*: identical; weights and optimizer state "
                         r"(\d+)/\1 entries identical$", r.stdout, re.MULTILINE), out
    _assert_cleaned_up(r.stdout)
    assert time.monotonic() - t0 < 120


def test_demo_peers_ctrl_c_unmounts():
    pytest.importorskip("torch")
    code, out = interrupt_after([sys.executable, str(DEMO), "--steps", "500", "--every", "5",
                                 "--width", "64"], "step_10 saved on every node")
    assert code == 130, out
    assert "interrupted" in out
    _assert_cleaned_up(out)
