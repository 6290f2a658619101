"""Smoke: mount, write, read back, xattrs, unmount."""

import os

import blake3


def test_write_read_seal(mount):
    data = os.urandom(3 * 1024 * 1024 + 17)
    p = mount.path("f.bin")
    p.write_bytes(data)
    assert p.read_bytes() == data
    mount.wait_state("f.bin", "local")
    assert os.getxattr(p, "user.mtcfs.blake3").decode() == blake3.blake3(data).hexdigest()
    st = os.statvfs(mount.mnt)
    assert st.f_blocks * st.f_frsize == 2 * 1024 ** 3
