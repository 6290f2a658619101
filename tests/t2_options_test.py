"""Mount options: the user-visible failure of a bad one (exit 2, no mount); the parsing is
in t1_options_test.py."""

import subprocess
import sys

from support.mount import is_mounted


def test_cli_bad_option_exit_2_nothing_mounted(shm_dir):
    mnt = shm_dir / "mnt"
    mnt.mkdir()
    r = subprocess.run([sys.executable, "-m", "mtcfs", "job", str(mnt), "-o",
                        f"store={shm_dir}/s,size=12Q"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "size=12Q" in lines[0]
    assert not is_mounted(str(mnt))
    assert not (shm_dir / "s").exists()
