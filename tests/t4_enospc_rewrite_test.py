"""ENOSPC in the middle of a rewrite of a sealed file (O_RDWR, no O_TRUNC), on a real mount.

Two ways to run out of room: the backing filesystems of the store (a tmpfs of its own here,
filled by another process while mtcfs's own ``size=`` still has plenty; as root the data
directory is a tmpfs of its own under it, filled too), and ``size=`` itself. The promise (README): a closed file is never lost or silently changed; a fault is a
clear error (ENOSPC to the writer). So: the writer gets ENOSPC (at fsync or close, since
the kernel's writeback cache sends the data later), the mount stays up, a reader never
sees a byte nobody wrote, the file afterwards holds its old bytes and, of the failed
writes, at most a prefix in order; it is sealed once there is room again, its blake3 is of
those bytes, ``size=`` counts what the store holds, and all of it is the same after a
clean remount and after a kill -9.

Before the fixes (2026-11-25): the daemon died (``sqlite3.OperationalError:
database or disk is full`` from the seal's commit ended its nursery: every process got
ENOTCONN), or, when the metadata still fitted, a short ``pwrite`` of tmpfs made the
version longer than its data file and its seal failed for the rest of the mount
("data file is shorter than ..."), the file left unsealed; an open whose commit failed
got EIO, and then left the new version current in memory only: never sealed ("writing"
for the rest of the mount), and the next writer wrote into the data file that the rows,
still naming the old version, took for the old bytes.
"""

import errno
import os
import subprocess
import uuid
from pathlib import Path

import blake3
import pytest

from support.mount import Mount, drop_page_cache, unmount_below

MiB = 1 << 20


@pytest.fixture
def small_store():
    """(root, mounts): a tmpfs of 24 MiB of its own at ``root`` (root only) for the store;
    the mounts appended to ``mounts`` are cleaned up, then the tmpfs is unmounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = Path("/dev/shm") / f"mtcfs-enospc-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(d)], check=True)
    mounts: list[Mount] = []
    try:
        yield d, mounts
    finally:
        for m in mounts:
            m.cleanup()
        unmount_below(d)  # the stores' data tmpfs mounts, then d
        os.rmdir(d)
        for m in mounts:
            if m.mnt.exists():
                m.mnt.rmdir()


def _mount(root: Path, mounts: list, size: str) -> Mount:
    m = Mount(root, options={"size": size}, store=root / "store",
              mnt=Path(f"{root}-mnt"))
    mounts.append(m)
    return m.start()


def _fill(path: Path, leave: int) -> None:
    """Fill the filesystem of ``path`` with that file, leaving about ``leave`` bytes."""
    st = os.statvfs(path.parent)
    room = st.f_bavail * st.f_frsize - leave
    blk = b"\xee" * MiB
    with open(path, "wb", buffering=0) as f:
        while room > 0:
            room -= f.write(blk[:min(room, MiB)])


class _Filler:
    """Fillers of the store's filesystems: ``root``'s (the metadata's) and, when the daemon
    gave ``data/`` a tmpfs of its own (store/datafs.py), that one too."""

    def __init__(self, root: Path, m: Mount) -> None:
        self.store = root / "filler"
        data = m.store / "data"
        self.paths = [self.store] + ([data / "filler"] if os.path.ismount(data) else [])

    def fill(self, leave: int) -> None:
        for p in self.paths:
            _fill(p, leave)

    def truncate_store(self, left: int) -> None:
        """Leave ``left`` bytes free on the metadata's filesystem."""
        os.truncate(self.store, os.path.getsize(self.store) - left)

    def unlink(self) -> None:
        for p in self.paths:
            os.unlink(p)


def _store_bytes(m: Mount) -> int:
    """What the store's data files hold (du: st_blocks; a file with two names once)."""
    d = m.store / "data"
    sts = {st.st_ino: st for st in (os.stat(d / n) for n in os.listdir(d))}
    return sum(st.st_blocks * 512 for st in sts.values())


def _read(p: Path) -> bytes:
    drop_page_cache(p)
    return p.read_bytes()


def _sealed_hash(m: Mount, rel: str) -> str:
    m.wait_for(lambda: m.state(rel) != "writing", 30, f"{rel} sealed")
    return os.getxattr(m.path(rel), "user.mtcfs.blake3").decode()


def _rewrite(p: Path, off: int, data: bytes) -> int | None:
    """Open ``p`` O_RDWR (no O_TRUNC), write ``data`` at ``off``, fsync, close: the errno
    the writer got (None: none)."""
    try:
        fd = os.open(p, os.O_RDWR)
        try:
            mv = memoryview(data)
            while mv:
                n = os.pwrite(fd, mv, off)
                mv, off = mv[n:], off + n
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return exc.errno
    return None


def _prefix_then_holes(got: bytes, wrote: bytes) -> int:
    """How much of ``wrote`` ``got`` holds, asserting that the rest of ``got`` is zeros
    (holes never written): a failed write leaves a prefix of itself, never other bytes."""
    k = 0
    while k < len(got) and k < len(wrote) and got[k] == wrote[k]:
        k += 1
    assert got[k:] == bytes(len(got) - k), f"bytes nobody wrote after {k} bytes"
    return k


def _check_after(m: Mount, rel: str, expect: bytes) -> None:
    p = m.path(rel)
    assert os.stat(p).st_size == len(expect)
    assert _read(p) == expect
    assert _sealed_hash(m, rel) == blake3.blake3(expect).hexdigest()
    assert m.status()["ram"]["used"] == _store_bytes(m)


def _check_after_restarts(m: Mount, rel: str, expect: bytes) -> None:
    """:func:`_check_after` now, after a clean remount, and after a kill -9 and a start."""
    _check_after(m, rel, expect)
    m.stop()
    m.start()
    _check_after(m, rel, expect)
    m.kill9()
    m.start()
    _check_after(m, rel, expect)


def _sparse(size: int, pieces: dict[int, bytes]) -> bytes:
    out = bytearray(size)
    for off, b in pieces.items():
        out[off:off + len(b)] = b
    return bytes(out)


def _write_sparse(p: Path, size: int, pieces: dict[int, bytes]) -> None:
    with open(p, "wb") as f:
        for off, b in pieces.items():
            f.seek(off)
            f.write(b)
        f.truncate(size)


def _sealed_file(m: Mount, rel: str, data: bytes) -> Path:
    """``rel`` on ``m`` written with ``data`` and sealed (its blake3 checked); its path."""
    p = m.path(rel)
    p.write_bytes(data)
    assert _sealed_hash(m, rel) == blake3.blake3(data).hexdigest()
    return p


def _sealed_sparse(m: Mount, rel: str, size: int) -> tuple[Path, bytes, bytes, bytes]:
    """(path, bytes, head, tail): a sealed file of ``size`` bytes on ``m`` with 1 MiB of
    random data at each end and a hole between."""
    head, tail = os.urandom(MiB), os.urandom(MiB)
    pieces = {0: head, size - MiB: tail}
    old = _sparse(size, pieces)
    p = m.path(rel)
    _write_sparse(p, len(old), pieces)
    assert _sealed_hash(m, rel) == blake3.blake3(old).hexdigest()
    return p, old, head, tail


def test_store_filesystem_full_during_a_rewrite_into_holes(small_store):
    """A sealed sparse file (1 MiB of data at each end of 32 MiB) is rewritten with 6 MiB
    into its hole while another process fills the store's tmpfs (1 MiB left): ENOSPC to
    the writer, the daemon stays up, a reader's old bytes are exact, and the file holds
    its old data plus a prefix of the new."""
    root, mounts = small_store
    m = _mount(root, mounts, "24M")
    p, old, head, tail = _sealed_sparse(m, "f.bin", 32 * MiB)
    used0 = m.status()["ram"]["used"]
    enospc0 = m.status()["counters"]["enospc"]
    new = os.urandom(6 * MiB)
    filler = _Filler(root, m)
    with open(p, "rb") as reader:
        filler.fill(leave=MiB)
        err = _rewrite(p, 8 * MiB, new)
        assert err == errno.ENOSPC, f"the writer got {err and errno.errorcode[err]}"
        reader.seek(0)
        assert reader.read(MiB) == head
        reader.seek(31 * MiB)
        assert reader.read() == tail
    assert m.status()["counters"]["enospc"] > enospc0
    filler.unlink()  # room again: the seal, tried again, gets through
    got = _read(p)
    assert len(got) == len(old)
    k = _prefix_then_holes(got[8 * MiB:14 * MiB], new)
    assert k < len(new)
    expect = old[:8 * MiB] + new[:k] + old[8 * MiB + k:]
    assert got == expect
    _check_after(m, "f.bin", expect)
    assert m.status()["ram"]["used"] <= used0 + k + 2 * 4096
    _check_after_restarts(m, "f.bin", expect)


def test_store_filesystem_full_during_a_rewrite_that_extends_the_file(small_store):
    """The same with writes past the end (6 MiB appended to a sealed 4 MiB file, 1 MiB
    left on the store's tmpfs): tmpfs writes what it has pages for and returns short. The
    version must be as long as its data file, not as the request (else its seal failed
    for the rest of the mount: the file never sealed again until a restart).

    (The kernel's writeback cache trusts its own i_size for a regular file, so until it
    forgets the inode it shows the file as long as the writer made it, zeros past what
    reached the daemon: checked here on the daemon's side, after a remount.)"""
    root, mounts = small_store
    m = _mount(root, mounts, "24M")
    old = os.urandom(4 * MiB)
    p = _sealed_file(m, "f.bin", old)
    new = os.urandom(6 * MiB)
    filler = _Filler(root, m)
    with open(p, "rb") as reader:
        filler.fill(leave=MiB)
        err = _rewrite(p, len(old), new)
        assert err == errno.ENOSPC, f"the writer got {err and errno.errorcode[err]}"
        assert reader.read(len(old)) == old
    filler.unlink()
    m.wait_for(lambda: m.state("f.bin") != "writing", 30, "the seal")
    assert not any("shorter" in e for e in m.status()["errors"]), m.status()["errors"]
    m.stop()
    m.start()
    got = _read(m.path("f.bin"))
    assert got[:len(old)] == old
    k = _prefix_then_holes(got[len(old):], new)
    expect = old + new[:k]
    assert got == expect
    _check_after_restarts(m, "f.bin", expect)


def test_size_budget_full_during_a_rewrite_into_holes(small_store):
    """size= runs out (the tmpfs has room): a rewrite of a sparse file writes 6 MiB into
    its hole with 4 MiB of budget left. ENOSPC to the writer; the file holds its old
    data plus at most a prefix of the new, and size= counts exactly the store's bytes."""
    root, mounts = small_store
    m = _mount(root, mounts, "8M")
    p, old, head, tail = _sealed_sparse(m, "s.bin", 64 * MiB)
    new = os.urandom(8 * MiB)
    with open(p, "rb") as reader:
        err = _rewrite(p, 16 * MiB, new)
        assert err == errno.ENOSPC, f"the writer got {err and errno.errorcode[err]}"
        assert reader.read(MiB) == head
    got = _read(p)
    k = _prefix_then_holes(got[16 * MiB:24 * MiB], new)
    expect = old[:16 * MiB] + new[:k] + old[16 * MiB + k:]
    assert got == expect
    _check_after(m, "s.bin", expect)
    assert m.status()["ram"]["used"] <= 8 * MiB
    _check_after_restarts(m, "s.bin", expect)


def test_store_filesystem_full_at_the_open_of_a_rewrite(small_store):
    """No room at all on the store's filesystem when a sealed file is opened O_RDWR: the
    open (its rows: the new version, the inode) gets ENOSPC, or succeeds and its writes
    get ENOSPC; either way the old content stays, sealed, after a remount and a kill -9,
    and a rewrite once there is room again works."""
    root, mounts = small_store
    m = _mount(root, mounts, "24M")
    old = os.urandom(3 * MiB)
    p = _sealed_file(m, "f.bin", old)
    filler = _Filler(root, m)
    filler.fill(leave=0)
    err = _rewrite(p, MiB, b"Z" * 8192)
    assert err == errno.ENOSPC, f"the writer got {err and errno.errorcode[err]}"
    # Tried again while still full: never a byte changed under rows that name the old
    # version (a crash now must find it intact).
    assert _rewrite(p, MiB, b"Y" * 8192) == errno.ENOSPC
    m.kill9()
    filler.unlink()
    m.start()
    _check_after(m, "f.bin", old)
    filler.fill(leave=0)
    assert _rewrite(p, MiB, b"Z" * 8192) == errno.ENOSPC
    filler.unlink()
    got = _read(p)
    assert got in (old, old[:MiB] + b"Z" * 8192 + old[MiB + 8192:])
    _check_after(m, "f.bin", got)
    m.kill9()
    m.start()
    _check_after(m, "f.bin", got)
    assert _rewrite(p, 0, b"A") is None
    want = b"A" + got[1:]
    assert _read(p) == want
    m.stop()
    m.start()
    _check_after(m, "f.bin", want)


def _names(m: Mount) -> list[str]:
    return sorted(os.listdir(m.mnt))


def test_a_full_store_refuses_new_names_before_changing_anything(small_store):
    """The store's filesystem full, then nearly full (512 KiB left, under the 2 MiB kept
    for the metadata): mkdir, create, rename, symlink and link get ENOSPC and the mount
    shows no change, now and after a remount; with 512 KiB left unlink and rmdir still
    work, so room can be freed. Before, on the full filesystem each of them got ENOSPC
    from the failed commit with the namespace in memory already changed: the new names
    showed (a file created there and written once room came back was gone at the next
    start) and the renamed entry stood under its new name until a remount put it back."""
    root, mounts = small_store
    m = _mount(root, mounts, "24M")
    for d in ("a", "b", "gone"):
        (m.mnt / d).mkdir()
    (m.mnt / "f.bin").write_bytes(b"f" * 4096)
    (m.mnt / "old.bin").write_bytes(b"o" * 4096)
    m.wait_for(lambda: m.state("f.bin") != "writing", 30, "f.bin sealed")
    before = _names(m)
    filler = _Filler(root, m)
    filler.fill(leave=0)
    tries = {
        "mkdir": lambda: (m.mnt / "new").mkdir(),
        "create": lambda: open(m.mnt / "new.bin", "wb").close(),
        "rename": lambda: os.rename(m.mnt / "a", m.mnt / "step_1"),
        "symlink": lambda: os.symlink("f.bin", m.mnt / "lnk"),
        "link": lambda: os.link(m.mnt / "f.bin", m.mnt / "f2.bin"),
    }
    for left in (0, 512 * 1024):
        filler.truncate_store(left)
        for what, fn in tries.items():
            with pytest.raises(OSError) as ei:
                fn()
            assert ei.value.errno == errno.ENOSPC, what
            assert _names(m) == before, f"{what} changed the namespace and got ENOSPC"
    os.unlink(m.mnt / "old.bin")
    os.rmdir(m.mnt / "gone")
    after = sorted(set(before) - {"old.bin", "gone"})
    assert _names(m) == after
    filler.unlink()
    (m.mnt / "new").mkdir()
    after = sorted(after + ["new"])
    assert _names(m) == after
    for restart in (m.stop, m.kill9):
        restart()
        m.start()
        assert _names(m) == after
        assert (m.mnt / "f.bin").read_bytes() == b"f" * 4096
