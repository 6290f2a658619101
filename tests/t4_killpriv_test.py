"""FUSE_HANDLE_KILLPRIV_V2 (issue 18, docs/fuse-build.md): on a mount whose FUSE connection
negotiated it, the kernel sends no GETXATTR of ``security.capability`` before every
write(2), and mtcfs clears set-user-ID and set-group-ID bits itself, on a write, a
truncate, an ``O_TRUNC`` open and a chown, through the mount and in the core.

The mounted tests need mtcfs's pyfuse3 on libfuse >= 3.17 (``scripts/build_fuse.sh``, run
by ``scripts/setup.sh``); where setup could not build it they are skipped with that reason,
and the mount must then say so in ``mtcfs status``. The side-by-side POSIX behaviour
(another user's write, a truncate, a chown) is in t4_posix_test.py.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import pyfuse3
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from support import corefs  # noqa: E402
from support.mount import Mount, remove_tree  # noqa: E402

from mtcfs.core.core import Filesystem  # noqa: E402
from mtcfs.core.model import ROOT_INO  # noqa: E402

#: Both ways: passthrough and the daemon's path (conftest.py: fuse_path).
FUSE_PATHS = ("passthrough", "daemon")

#: mtcfs's pyfuse3 (third_party/pyfuse3/killpriv-v2.patch) is installed.
PATCHED = hasattr(pyfuse3, "handle_killpriv_v2")
needs_patched = pytest.mark.skipif(
    not PATCHED, reason="the stock pyfuse3 cannot negotiate FUSE_HANDLE_KILLPRIV_V2 "
                        "(scripts/build_fuse.sh did not build mtcfs's; see its setup warning)")


@pytest.fixture(scope="module")
def mnt(fuse_path):
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing")
    root = Path(tempfile.mkdtemp(prefix="mtcfs-killpriv-", dir="/dev/shm"))
    m = Mount(root / "m", options={"size": "1G", "allow_other": None})
    try:
        m.start()
        yield m
    finally:
        try:
            m.cleanup()
        finally:
            remove_tree(root)  # the store (on /dev/shm: RAM), its data tmpfs first


def _getxattrs(m: Mount) -> int:
    return m.status()["counters"]["foreign_getxattrs"]


@needs_patched
def test_the_mount_negotiates_killpriv_v2_and_says_so(mnt):
    st = mnt.status()
    assert st["fuse"]["killpriv_v2"] is True
    major, minor = (int(x) for x in st["fuse"]["libfuse"].split(".")[:2])
    assert (major, minor) >= (3, 17)
    out = mnt.cli("status", str(mnt.mnt)).stdout
    assert f"FUSE:     libfuse {st['fuse']['libfuse']}, FUSE_HANDLE_KILLPRIV_V2" in out


@needs_patched
def test_writes_send_no_getxattr_each(mnt):
    """200 pwrite(2)s of 4 KiB at scattered offsets of one open file: the kernel asks for
    security.capability at most once (before the inode is marked S_NOSEC), not 200 times
    (libfuse 3.14: one GETXATTR per write, docs/benchmarks.md)."""
    path = mnt.path("many-writes")
    before = _getxattrs(mnt)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(200):
            os.pwrite(fd, bytes([i]) * 4096, (i * 7919 % 200) * 4096)
    finally:
        os.close(fd)
    assert _getxattrs(mnt) - before <= 2
    data = path.read_bytes()
    assert len(data) == 200 * 4096
    for i in range(200):
        off = (i * 7919 % 200) * 4096
        assert data[off:off + 4096] == bytes([i]) * 4096


@needs_patched
@pytest.mark.parametrize("how", ["write", "ftruncate", "O_TRUNC", "chown"])
def test_root_changing_a_setuid_file_clears_setuid_and_group_executable_setgid(mnt, how):
    """Under FUSE_HANDLE_KILLPRIV_V2 the kernel leaves the bits to the filesystem and does
    not say whether the caller had CAP_FSETID, so mtcfs clears them for root too (POSIX
    allows it; tmpfs keeps them for root: the one difference, docs/fuse-build.md). A
    set-group-ID bit without group execute (mandatory locking) stays."""
    for mode, left in ((0o6755, 0o755), (0o6745, 0o2745)):
        path = mnt.path(f"suid-{how}-{mode:o}")
        path.write_bytes(b"x" * 100)
        os.chmod(path, mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == mode
        if how == "write":
            with open(path, "r+b") as f:
                f.write(b"y")
        elif how == "ftruncate":
            os.truncate(path, 10)
        elif how == "O_TRUNC":
            os.close(os.open(path, os.O_WRONLY | os.O_TRUNC))
        else:
            os.chown(path, 65534, -1)
        assert stat.S_IMODE(os.stat(path).st_mode) == left, how


def test_a_mount_without_killpriv_v2_says_so_and_its_writes_each_send_a_getxattr(mnt):
    """What `mtcfs status` says matches what the kernel does: with the flag the counter
    stays still across writes, without it it grows by one a write."""
    st = mnt.status()
    path = mnt.path("counted")
    before = _getxattrs(mnt)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(50):
            os.pwrite(fd, b"z" * 4096, i * 8192)
    finally:
        os.close(fd)
    sent = _getxattrs(mnt) - before
    out = mnt.cli("status", str(mnt.mnt)).stdout
    if st["fuse"]["killpriv_v2"]:
        assert sent <= 2
    else:
        assert sent >= 50
        assert "no FUSE_HANDLE_KILLPRIV_V2: a GETXATTR before each write" in out


# ---------------------------------------------------------------------- the core's rule

def _core(fn, tmp_path: Path, kills: bool) -> None:
    async def body(fs: Filesystem) -> None:
        fs.kills_suidgid = kills
        await fn(fs)
    corefs.run(body, tmp_path)


async def _suid_file(fs: Filesystem, name: bytes, mode: int) -> int:
    ino = await corefs.write_file(fs, ROOT_INO, name, b"x" * 1000)
    await fs.setattr(ino, mode=mode)
    return ino


@pytest.mark.parametrize("kills", [True, False])
def test_the_core_clears_the_bits_only_when_the_connection_leaves_it_to_it(tmp_path, kills):
    """Off (libfuse 3.14), the kernel clears them with a SETATTR of the mode, so the core
    must not: a write by root keeps them, as on tmpfs. An O_TRUNC open is the exception:
    FUSE's atomic O_TRUNC drops the kernel's clearing, so the core clears either way."""
    async def write(fs: Filesystem, ino: int) -> None:
        fh, _ = await fs.open(ino, os.O_WRONLY)
        await fs.write(fh, 0, b"y")
        await fs.release(fh)

    async def open_(fs: Filesystem, ino: int, flags: int) -> None:
        fh, _ = await fs.open(ino, flags)
        await fs.release(fh)

    ways = {
        "write": write,
        "truncate": lambda fs, ino: fs.setattr(ino, size=10),
        "O_TRUNC": lambda fs, ino: open_(fs, ino, os.O_WRONLY | os.O_TRUNC),
        "chown": lambda fs, ino: fs.setattr(ino, gid=65534),
        # read-only: nothing changes
        "read-only open": lambda fs, ino: open_(fs, ino, os.O_RDONLY | os.O_TRUNC),
        # a mode sent with the chown wins
        "chown with mode": lambda fs, ino: fs.setattr(ino, mode=0o6700, gid=65534),
    }

    async def body(fs: Filesystem) -> None:
        modes = {}
        for i, (how, fn) in enumerate(ways.items()):
            ino = await _suid_file(fs, b"f%d" % i, 0o6755)
            await fn(fs, ino)
            modes[how] = fs.inodes[ino].mode
            inos[ino] = fs.inodes[ino].mode
        assert {k: stat.S_IMODE(v) for k, v in modes.items()} == want

    async def after_restart(fs: Filesystem) -> None:
        assert {ino: fs.inodes[ino].mode for ino in inos} == inos

    kept = 0o755 if kills else 0o6755
    # O_TRUNC: cleared either way (the kernel's atomic O_TRUNC path never does it)
    want = {"write": kept, "truncate": kept, "O_TRUNC": 0o755, "chown": kept,
            "read-only open": 0o6755, "chown with mode": 0o6700}
    inos: dict[int, int] = {}
    _core(body, tmp_path, kills)
    _core(after_restart, tmp_path, kills)  # what was cleared was written down


def test_a_directorys_setgid_survives_a_chown(tmp_path):
    async def body(fs: Filesystem) -> None:
        d = await fs.mkdir(ROOT_INO, b"d", 0o2775, 0, 0)
        await fs.setattr(d.ino, gid=65534)
        assert stat.S_IMODE(fs.inodes[d.ino].mode) == 0o2775
    _core(body, tmp_path, True)
