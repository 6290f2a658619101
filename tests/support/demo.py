"""Running the examples as a user would: in a subprocess, and interrupted with Ctrl-C."""

from __future__ import annotations

import signal
import subprocess

import pytest


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
