"""Running the examples as a user would: in a subprocess, and interrupted with Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from .mount import force_unmount, is_mounted
from .poll import alive


def interrupt_after(argv: list[str], marker: str, timeout: float = 60.0) -> tuple[int, str]:
    """Run ``argv``, send SIGINT once a line of its output contains ``marker``, and return
    (exit status, all output). Fails the test if the output ends before the marker."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line)
            if marker in line:
                break
        else:
            pytest.fail("".join(lines))
        p.send_signal(signal.SIGINT)
        rest, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, "".join(lines) + rest


def scratch_of(out: str) -> str:
    """The scratch directory a demo printed (``scratch: DIR``)."""
    m = re.search(r"^scratch: (\S+)$", out, re.MULTILINE)
    assert m, out
    return m.group(1)


def assert_cleaned_up(out: str, nodes: int, min_pids: int = 0) -> None:
    """What a demo must leave behind: no mount under its scratch directory (``n<r>/mnt``
    for each of ``nodes``), no scratch directory, and none of the processes it named
    (``pid N``, at least ``min_pids`` of them) or started with its scratch directory on
    the command line (a trainer) still running after 10 s."""
    scratch = scratch_of(out)
    mnts = [os.path.join(scratch, f"n{r}", "mnt") for r in range(nodes)]
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
    assert len(pids) >= min_pids, out
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (any(alive(p) for p in pids) or _using(scratch)):
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], f"processes left running: {pids}"
    assert not _using(scratch), f"processes left running: {_using(scratch)}"


def _using(scratch: str) -> list[str]:
    """Command lines of live processes that name ``scratch`` (the demos' workers)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if scratch + "/" in cmd and alive(int(pid)):
            out.append(cmd)
    return out


def run_demo(demo: "os.PathLike[str] | str", timeout: float = 300) -> tuple[str, str]:
    """Run a demo script to its end; assert it exited 0, printed a ``PASS`` line and no
    ``FAIL``. Returns (stdout, stdout + stderr) for the caller's own checks."""
    r = subprocess.run([sys.executable, str(demo)], capture_output=True, text=True,
                       timeout=timeout, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert re.search(r"^PASS$", r.stdout, re.MULTILINE) and "FAIL" not in r.stdout, out
    return r.stdout, out
