"""Mount options: parsing, and the user-visible failure of a bad one (exit 2, no mount)."""

import subprocess
import sys

import pytest

from mtcfs.options import OptionError, parse_mount_options, parse_size
from support.mount import is_mounted


def test_parse_full_option_set():
    o = parse_mount_options("myjob", "/mnt/ckpt", [
        "store=/dev/shm/x,size=60G,backup=gs://bucket/prefix,backup_interval=10m,keep=3",
        "chunk_size=8M,allow_other,debug,rw,nosuid,nodev,_netdev,x-systemd.automount"])
    assert o.store == "/dev/shm/x"
    assert o.size == 60 * 1024 ** 3
    assert o.backup == "gs://bucket/prefix"
    assert o.backup_interval.seconds == 600 and o.backup_interval.checkpoints is None
    assert o.keep == 3 and o.chunk_size == 8 * 1024 ** 2
    assert o.allow_other and o.debug


def test_checkpoint_count_interval():
    o = parse_mount_options("j", "/m", ["backup=file:///b,backup_interval=5ckpt"])
    assert o.backup_interval.checkpoints == 5 and o.backup_interval.seconds is None


@pytest.mark.parametrize("text,bytes_", [("512K", 512 * 1024), ("1.5G", 3 * 1024 ** 3 // 2),
                                         ("60GiB", 60 * 1024 ** 3), ("4096", 4096)])
def test_sizes(text, bytes_):
    assert parse_size(text) == bytes_


@pytest.mark.parametrize("opt,word", [
    ("size=lots", "size=lots"), ("bogus=1", "bogus"), ("keep=0", "keep=0"),
    ("backup=s3://x", "backup=s3://x"), ("backup=file://relative", "backup=file://relative"),
    ("backup_interval=often", "backup_interval=often"), ("chunk_size=3M", "chunk_size=3M"),
    ("allow_other=1", "allow_other=1"), ("restore=yesterday", "restore=yesterday")])
def test_bad_option_names_the_option(opt, word):
    with pytest.raises(OptionError) as ei:
        parse_mount_options("j", "/m", [opt])
    assert word in str(ei.value)


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
