"""Smoke: mount, write, read back, xattrs, unmount."""

import os

import blake3

#: Both ways: passthrough and the daemon's path (conftest.py: fuse_path).
FUSE_PATHS = ("passthrough", "daemon")


def test_write_read_seal(mount):
    data = os.urandom(3 * 1024 * 1024 + 17)
    p = mount.path("f.bin")
    p.write_bytes(data)
    assert p.read_bytes() == data
    mount.wait_state("f.bin", "local")
    assert os.getxattr(p, "user.mtcfs.blake3").decode() == blake3.blake3(data).hexdigest()
    st = os.statvfs(mount.mnt)
    assert st.f_blocks * st.f_frsize == 2 * 1024 ** 3


def test_mtcfs_seal_commits_a_directory(mount):
    """torch.save-style checkpoints: the user seals the step directory explicitly."""
    os.mkdir(mount.path("ckpt_7"))
    mount.path("ckpt_7", "model.pt").write_bytes(b"weights")
    assert mount.state("ckpt_7") == "incomplete"
    r = mount.cli("seal", str(mount.path("ckpt_7")))
    assert "ckpt_7" in r.stdout
    assert mount.state("ckpt_7") == "local"
    assert [(c["step"], c["number"], c["committed_by"]) for c in mount.checkpoints()] == \
        [("ckpt_7", 7, "mtcfs seal")]
    # Sealing something that is not a top-level directory is a clear error.
    os.mkdir(mount.path("ckpt_7", "sub"))
    r = mount.cli("seal", str(mount.path("ckpt_7", "sub")), check=False)
    assert r.returncode == 1 and "not a top-level directory" in r.stderr


def test_umount_force_clears_a_dead_daemon(mount):
    """After the daemon dies, the mount point is dead (ENOTCONN): `mtcfs status` names the
    errno; --force clears it."""
    import signal

    from support.mount import is_mounted
    os.kill(mount.pid, signal.SIGKILL)
    mount.wait_for(lambda: not os.path.exists(f"/proc/{mount.pid}"), 10, "daemon to die")
    assert is_mounted(str(mount.mnt))
    # `mtcfs status` says why, with the errno, rather than "not on an mtcfs mount".
    r = mount.cli("status", str(mount.path("sub", "dir")), check=False)
    assert r.returncode == 1
    assert r.stderr.strip() == (f"mtcfs: cannot read the mtcfs mount at {mount.mnt}: "
                                "Transport endpoint is not connected (ENOTCONN)")
    r = mount.cli("umount", "--force", str(mount.mnt))
    assert r.returncode == 0
    assert not is_mounted(str(mount.mnt))
    mount.pid = None
    mount.start()          # the same store mounts again
    assert mount.status()["ram"]["files"] >= 1


def test_mount_t_fuse_mtcfs_and_fstab_style_options(shm_dir):
    """`mount -t fuse.mtcfs` goes through mount.fuse3, which runs `mtcfs` from PATH with
    the generic options fstab adds; `umount` ends the daemon."""
    import shutil
    import subprocess

    import pytest

    from support.mount import is_mounted
    if not shutil.which("mount.fuse3") or not shutil.which("mtcfs"):
        pytest.skip("mount.fuse3 or the mtcfs helper is not on PATH (run scripts/setup.sh)")
    mnt, store = shm_dir / "mnt", shm_dir / "store"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "fuse.mtcfs", "fstabjob", str(mnt), "-o",
                        f"store={store},size=64M,noatime,nodev,_netdev"],
                       capture_output=True, text=True, timeout=60)
    try:
        assert r.returncode == 0, r.stderr
        assert is_mounted(str(mnt))
        with open("/proc/self/mountinfo") as f:
            line = next(ln for ln in f if ln.split()[4] == str(mnt))
        assert " - fuse.mtcfs fstabjob " in line
        (mnt / "x").write_bytes(b"hello")
        assert os.statvfs(mnt).f_blocks * os.statvfs(mnt).f_frsize == 64 * 1024 * 1024
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=60)
    assert not is_mounted(str(mnt))
    # The daemon is gone: the store can be served again at once.
    r = subprocess.run(["mount", "-t", "fuse.mtcfs", "fstabjob", str(mnt), "-o",
                        f"store={store},size=64M"], capture_output=True, text=True, timeout=60)
    try:
        assert r.returncode == 0, r.stderr
        assert (mnt / "x").read_bytes() == b"hello"
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=60)
