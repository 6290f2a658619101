"""POSIX behaviour of a real mtcfs mount, checked side by side with tmpfs.

Every test taking ``fsdir`` runs twice: on a directory inside a real mtcfs mount and on a
plain tmpfs directory (/dev/shm). Both runs make the same assertions, so mtcfs must give
the same results and the same errno as tmpfs. Where mtcfs deliberately differs (statfs,
st_blksize, directory st_size, the virtual ``user.mtcfs.*`` attributes, top-level step
directories, ENOSPC at ``size=``) the mtcfs behaviour is tested on its own in the
``test_mtcfs_*`` tests; symlinks that would leave the mount (EPERM) in t4_local_access.
Read-backs also go around the page cache (:func:`uncached`), and the restart test compares
what the daemon kept with what the kernel showed.

One mount serves the whole module (a mount costs about 2 s to stop); each test gets its
own directory in it, removed afterwards with ``shutil.rmtree`` (itself a check of
unlink/rmdir). Tests that need their own mount (restart) use ``make_mount``.
"""

from __future__ import annotations

import ctypes
import errno
import multiprocessing
import os
import re
import shutil
import stat
import struct
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from support.mount import Mount, remove_tree  # noqa: E402
from support.poll import err  # noqa: E402

MiB = 1024 * 1024
MOUNT_SIZE = "3G"


# ---------------------------------------------------------------------- fixtures

#: Both ways: the kernel reading and writing the store's files itself (passthrough) and the
#: daemon (conftest.py: fuse_path).
FUSE_PATHS = ("passthrough", "daemon")


@pytest.fixture(scope="module")
def shared_mount(fuse_path):
    """One mtcfs mount for the module (store and mount point on /dev/shm)."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing")
    root = Path(tempfile.mkdtemp(prefix="mtcfs-posix-", dir="/dev/shm"))
    # allow_other: without it FUSE lets no user but the mounting one in, whatever the modes
    # (test_permissions_other_user).
    m = Mount(root / "m", options={"size": MOUNT_SIZE, "allow_other": None})
    try:
        m.start()
        yield m
    finally:
        m.cleanup()
        remove_tree(root)  # its data tmpfs first


@pytest.fixture(params=["mtcfs", "tmpfs"])
def fsdir(request):
    """An empty directory on mtcfs or on tmpfs; the test asserts the same on both."""
    if request.param == "tmpfs":
        yield request.getfixturevalue("shm_dir")
        return
    m = request.getfixturevalue("shared_mount")
    d = m.path("t-" + re.sub(r"[^A-Za-z0-9_-]", "_", request.node.name))
    d.mkdir()
    yield d
    shutil.rmtree(d)  # no ignore_errors: a failing removal is a bug too
    assert not d.exists()


def pattern(n: int, seed: int = 0) -> bytes:
    """``n`` pseudo-random bytes, cheap to make (a random block repeated with a counter)."""
    block = os.urandom(min(n, MiB) or 1)
    out = bytearray()
    i = seed
    while len(out) < n:
        out += struct.pack("<Q", i) + block[8:]
        i += 1
    return bytes(out[:n])


def write_all(fd: int, data) -> None:
    mv = memoryview(data)
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


def pread_all(fd: int, n: int, off: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        b = os.pread(fd, n - len(out), off + len(out))
        if not b:
            break
        out += b
    return bytes(out)


def uncached(p) -> bytes:
    """The bytes of ``p`` as the filesystem holds them, not as the page cache does.

    mtcfs keeps the page cache across opens (keep_cache) and uses the writeback cache, so
    a plain read-back can be served by the kernel and hide what the daemon stored. Drop
    the file's clean pages first (a no-op on tmpfs, whose pages are the storage). The
    kernel's cached size still bounds the read: only a remount (test_mtcfs_restart_*)
    shows the daemon's own idea of the size.
    """
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return pread_all(fd, os.fstat(fd).st_size + 1, 0)
    finally:
        os.close(fd)


def wait_sealed(p) -> None:
    """On mtcfs, wait until ``p`` is sealed (so the next writer copies on write)."""
    try:
        os.getxattr(p, "user.mtcfs.blake3")  # waits for the seal
    except OSError as exc:
        if exc.errno != errno.ENODATA:  # tmpfs: no such attribute, nothing to wait for
            raise


def user_xattrs(p, follow: bool = True) -> dict[str, bytes]:
    """The listed extended attributes of ``p`` with their values (mtcfs does not list its
    virtual ``user.mtcfs.*`` ones, so both filesystems list the same)."""
    return {n: os.getxattr(p, n, follow_symlinks=follow)
            for n in os.listxattr(p, follow_symlinks=follow)}


# ---------------------------------------------------------------------- create / open

def test_create_excl_trunc(fsdir):
    p = fsdir / "f"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    write_all(fd, b"hello world")
    os.close(fd)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o644
    assert err(os.open, p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644) == errno.EEXIST
    assert err(os.open, p, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o644) == errno.EEXIST
    # O_CREAT alone on an existing file opens it untouched (and ignores the mode).
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    assert os.read(fd, 100) == b"hello world"
    os.close(fd)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o644
    # O_CREAT|O_TRUNC empties it.
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    assert os.fstat(fd).st_size == 0
    write_all(fd, b"new")
    os.close(fd)
    assert p.read_bytes() == b"new"
    # O_EXCL on a dangling symlink: EEXIST, the target is not created.
    os.symlink("nowhere", fsdir / "dangling")
    assert err(os.open, fsdir / "dangling", os.O_WRONLY | os.O_CREAT | os.O_EXCL) == errno.EEXIST
    assert not (fsdir / "nowhere").exists()
    # Missing parent, missing file without O_CREAT, file as a directory.
    assert err(os.open, fsdir / "nodir" / "f", os.O_WRONLY | os.O_CREAT) == errno.ENOENT
    assert err(os.open, fsdir / "missing", os.O_RDONLY) == errno.ENOENT
    assert err(os.open, p / "x", os.O_WRONLY | os.O_CREAT) == errno.ENOTDIR
    assert err(os.open, fsdir / ("n" * 256), os.O_WRONLY | os.O_CREAT) == errno.ENAMETOOLONG
    # Directories: O_DIRECTORY probes (TensorStore), writing a directory.
    assert err(os.open, fsdir / "missing", os.O_RDONLY | os.O_DIRECTORY) == errno.ENOENT
    assert err(os.open, p, os.O_RDONLY | os.O_DIRECTORY) == errno.ENOTDIR
    assert err(os.open, fsdir, os.O_WRONLY) == errno.EISDIR
    (fsdir / "sub").mkdir()
    assert err(os.open, fsdir / "sub", os.O_WRONLY | os.O_CREAT) == errno.EISDIR
    assert err(os.open, fsdir / "sub", os.O_WRONLY | os.O_CREAT | os.O_EXCL) == errno.EEXIST
    os.rmdir(fsdir / "sub")
    assert sorted(os.listdir(fsdir)) == ["dangling", "f"]


def test_open_trunc_existing(fsdir):
    p = fsdir / "meta"
    p.write_bytes(b"A" * 100_000)
    for i, flags in enumerate([os.O_WRONLY | os.O_TRUNC, os.O_RDWR | os.O_TRUNC]):
        fd = os.open(p, flags)
        try:
            assert os.fstat(fd).st_size == 0
            assert os.stat(p).st_size == 0
            write_all(fd, b"v%d" % i)
        finally:
            os.close(fd)
        assert p.read_bytes() == b"v%d" % i
        assert uncached(p) == b"v%d" % i
    # O_RDONLY|O_TRUNC: unspecified by POSIX, Linux truncates.
    p.write_bytes(b"B" * 5000)
    wait_sealed(p)
    fd = os.open(p, os.O_RDONLY | os.O_TRUNC)
    try:
        assert os.fstat(fd).st_size == 0
        assert os.read(fd, 10) == b""
    finally:
        os.close(fd)
    assert os.stat(p).st_size == 0
    assert uncached(p) == b""
    # Rewritten several times in a row (Orbax's _CHECKPOINT_METADATA).
    for i in range(5):
        p.write_bytes(b"{\"round\": %d}" % i)
        assert p.read_bytes() == b"{\"round\": %d}" % i
    assert os.stat(p).st_size == len(b"{\"round\": 4}")
    assert uncached(p) == b"{\"round\": 4}"


def test_sequential_writes(fsdir):
    p = fsdir / "seq"
    data = pattern(9 * MiB + 12345)
    sizes = [1, 511, 4096, 65536, 1000003, 4 * MiB, 17]
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    off, i = 0, 0
    try:
        while off < len(data):
            n = sizes[i % len(sizes)]
            write_all(fd, data[off:off + n])
            off = min(off + n, len(data))
            i += 1
            assert os.lseek(fd, 0, os.SEEK_CUR) == off
        os.fsync(fd)
    finally:
        os.close(fd)
    assert os.stat(p).st_size == len(data)
    assert p.read_bytes() == data
    assert uncached(p) == data
    # Buffered Python I/O, small writes.
    q = fsdir / "buffered"
    with open(q, "wb") as f:
        for j in range(0, len(data), 777):
            f.write(data[j:j + 777])
    assert q.read_bytes() == data
    assert uncached(q) == data


def test_random_offset_writes(fsdir):
    p = fsdir / "scatter"
    model = bytearray()
    import random
    rng = random.Random(1234)
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for _ in range(200):
            off = rng.choice([rng.randrange(0, 8 * MiB), rng.randrange(0, 4096),
                              rng.randrange(0, 64) * 131072 - rng.randrange(0, 2)])
            off = max(0, off)
            n = rng.choice([1, 7, 4095, 4096, 4097, 65536, 300000])
            buf = os.urandom(n)
            assert os.pwrite(fd, buf, off) == n
            if off > len(model):
                model.extend(b"\0" * (off - len(model)))  # a hole reads as zeros
            model[off:off + n] = buf
        # A write far past EOF leaves a hole.
        os.pwrite(fd, b"tail", 20 * MiB)
        model.extend(b"\0" * (20 * MiB - len(model)))
        model += b"tail"
        assert os.fstat(fd).st_size == len(model)
        assert pread_all(fd, len(model), 0) == model
        assert pread_all(fd, 100, 20 * MiB - 50) == model[-54:]
        assert os.pread(fd, 100, len(model)) == b""
    finally:
        os.close(fd)
    assert p.read_bytes() == model
    assert uncached(p) == model


def test_concurrent_pread(fsdir):
    p = fsdir / "shared.bin"
    data = pattern(24 * MiB + 333)
    p.write_bytes(data)
    nthreads = 6

    def reader(seed: int) -> int:
        import random
        rng = random.Random(seed)
        fd = os.open(p, os.O_RDONLY)
        try:
            for _ in range(120):
                off = rng.randrange(0, len(data))
                n = rng.choice([2048, 4096, 131072, 1000001, 4 * MiB, rng.randrange(1, 3 * MiB)])
                got = pread_all(fd, n, off)
                assert got == data[off:off + n], (seed, off, n)
        finally:
            os.close(fd)
        return seed

    with ThreadPoolExecutor(nthreads) as ex:
        assert sorted(ex.map(reader, range(nthreads))) == list(range(nthreads))
    # Many opens of the same small file at once (DCP .metadata by every rank).
    small = fsdir / ".metadata"
    small.write_bytes(b"m" * 5000)
    with ThreadPoolExecutor(8) as ex:
        assert set(ex.map(lambda _: small.read_bytes(), range(64))) == {b"m" * 5000}


def test_fsync_file_and_directory(fsdir):
    d = fsdir / "d"
    d.mkdir()
    p = d / "x"
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, b"data" * 1000)
        os.fsync(fd)
        os.fdatasync(fd)
        write_all(fd, b"more")
        os.fsync(fd)
    finally:
        os.close(fd)
    for target in (d, fsdir):
        dfd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
            os.fdatasync(dfd)
        finally:
            os.close(dfd)
    assert p.read_bytes() == b"data" * 1000 + b"more"
    assert uncached(p) == b"data" * 1000 + b"more"
    # fsync of a read-only descriptor is allowed.
    fd = os.open(p, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


# ---------------------------------------------------------------------- directories

def _mkdir_worker(base: str, rank: int, barrier) -> None:
    try:
        barrier.wait(10)
        os.makedirs(os.path.join(base, "ckpt", "a", "b", "c"), exist_ok=True)
        with open(os.path.join(base, "ckpt", "a", "b", "c", f"rank{rank}"), "wb") as f:
            f.write(b"%d" % rank)
        try:
            os.mkdir(os.path.join(base, "once"))
            won = True
        except FileExistsError:
            won = False
        os.makedirs(os.path.join(base, "once", "sub"), exist_ok=True)
        os._exit(0 if won else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(2)


def test_mkdir_race_processes(fsdir):
    ctx = multiprocessing.get_context("fork")
    for round_ in range(3):
        base = fsdir / f"r{round_}"
        base.mkdir()
        n = 6
        barrier = ctx.Barrier(n)
        procs = [ctx.Process(target=_mkdir_worker, args=(str(base), i, barrier)) for i in range(n)]
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join(30)
        codes = sorted(pr.exitcode for pr in procs)
        assert 2 not in codes and None not in codes, codes
        assert codes.count(0) == 1, codes  # exactly one mkdir won, the others saw EEXIST
        leaf = base / "ckpt" / "a" / "b" / "c"
        assert sorted(os.listdir(leaf)) == sorted(f"rank{i}" for i in range(n))
        assert os.listdir(base / "once") == ["sub"]
        assert os.stat(base).st_nlink == 4  # ., ckpt/.., once/..
    # makedirs from threads of one process too.
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda i: os.makedirs(fsdir / "t" / "x" / "y" / f"z{i % 2}", exist_ok=True),
                    range(32)))
    assert sorted(os.listdir(fsdir / "t" / "x" / "y")) == ["z0", "z1"]
    assert err(os.mkdir, fsdir / "t") == errno.EEXIST
    assert err(os.mkdir, fsdir / "nope" / "x") == errno.ENOENT


def test_readdir_large(fsdir):
    d = fsdir / "big"
    d.mkdir()
    names = {f"__{i}_{'x' * (i % 50)}.distcp" for i in range(3000)}
    for n in names:
        fd = os.open(d / n, os.O_WRONLY | os.O_CREAT, 0o644)
        os.close(fd)
    for i in range(20):
        (d / f"sub{i}").mkdir()
    listed = os.listdir(d)
    assert len(listed) == len(names) + 20  # no duplicates, none missing
    assert set(listed) == names | {f"sub{i}" for i in range(20)}
    with os.scandir(d) as it:
        entries = list(it)
    assert len(entries) == len(listed)
    assert {e.name for e in entries} == set(listed)
    assert {e.name for e in entries if e.is_dir()} == {f"sub{i}" for i in range(20)}
    assert all(e.is_file() for e in entries if not e.name.startswith("sub"))
    # Removing entries while listing: every name is seen at most once.
    seen = []
    with os.scandir(d) as it:
        for k, e in enumerate(it):
            seen.append(e.name)
            if k % 3 == 0 and e.is_file():
                os.unlink(e.path)
    assert len(seen) == len(set(seen)) == len(listed)
    assert len(os.listdir(d)) == len(listed) - sum(1 for k, n in enumerate(seen)
                                                    if k % 3 == 0 and not n.startswith("sub"))


# ---------------------------------------------------------------------- rename

def test_rename_file_over_existing(fsdir):
    tgt, tmp = fsdir / ".metadata", fsdir / ".metadata.tmp"
    tgt.write_bytes(b"old" * 1000)
    old_ino = os.stat(tgt).st_ino
    reader = os.open(tgt, os.O_RDONLY)  # an open descriptor of the replaced file
    try:
        tmp.write_bytes(b"new contents")
        new_ino = os.stat(tmp).st_ino
        os.rename(tmp, tgt)
        assert tgt.read_bytes() == b"new contents"
        assert os.stat(tgt).st_ino == new_ino != old_ino
        assert not tmp.exists()
        assert os.pread(reader, 3000, 0) == b"old" * 1000  # the victim lives on while open
        assert os.fstat(reader).st_nlink == 0
        os.posix_fadvise(reader, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(reader, 3000, 0) == b"old" * 1000
    finally:
        os.close(reader)
    # The replaced file is still being written through an open descriptor.
    w = os.open(tgt, os.O_WRONLY | os.O_APPEND)
    try:
        (fsdir / "replacement").write_bytes(b"replacement")
        os.rename(fsdir / "replacement", tgt)
        write_all(w, b"-orphan" * 100_000)
        os.fsync(w)
    finally:
        os.close(w)
    assert uncached(tgt) == b"replacement"
    # The DCP coordinator sequence: write tmp, fsync, unlink old, rename.
    for i in range(4):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        write_all(fd, b"round %d" % i)
        os.fsync(fd)
        os.close(fd)
        if i % 2:
            os.unlink(tgt)
        os.rename(tmp, tgt)
        assert tgt.read_bytes() == b"round %d" % i
    # Orbax's manifest.ocdbt replaced by rename(X.__lock -> X), several times.
    man = fsdir / "manifest.ocdbt"
    for i in range(5):
        lock = fsdir / "manifest.ocdbt.__lock"
        lock.write_bytes(b"manifest %d" % i)
        os.rename(lock, man)
    assert man.read_bytes() == b"manifest 4"
    assert sorted(os.listdir(fsdir)) == [".metadata", "manifest.ocdbt"]
    # Errors: missing source, file over directory, directory over file, dir over non-empty.
    (fsdir / "d").mkdir()
    (fsdir / "e").mkdir()
    (fsdir / "e" / "f").write_bytes(b"")
    assert err(os.rename, fsdir / "missing", fsdir / "x") == errno.ENOENT
    assert err(os.rename, man, fsdir / "d") == errno.EISDIR
    assert err(os.rename, fsdir / "d", man) == errno.ENOTDIR
    assert err(os.rename, fsdir / "d", fsdir / "e") == errno.ENOTEMPTY
    assert err(os.rename, fsdir / "e", fsdir / "e" / "inside") == errno.EINVAL
    # Renaming a file onto itself or onto a hard link of itself does nothing.
    os.rename(man, man)
    os.link(man, fsdir / "hl")
    os.rename(man, fsdir / "hl")
    assert man.exists() and (fsdir / "hl").exists()
    # A directory over an empty directory replaces it.
    (fsdir / "d" / "keep").write_bytes(b"k")
    (fsdir / "empty").mkdir()
    n = os.stat(fsdir).st_nlink
    os.rename(fsdir / "d", fsdir / "empty")
    assert os.stat(fsdir).st_nlink == n - 1
    assert (fsdir / "empty" / "keep").read_bytes() == b"k"
    assert not (fsdir / "d").exists()


def _make_tree(root: Path) -> dict[str, bytes]:
    files = {
        "_CHECKPOINT_METADATA": b'{"step": 100}',
        "default/_METADATA": b"{}" * 100,
        "default/manifest.ocdbt": pattern(3000),
        "default/ocdbt.process_0/manifest.ocdbt": pattern(500),
        "default/ocdbt.process_0/d/" + "a" * 32: pattern(3 * MiB + 5),
        "default/ocdbt.process_0/d/" + "b" * 32: pattern(100),
        "default/array_metadatas/process_0": b"[]",
        "default/d/" + "c" * 32: b"",
        "commit_success.txt": b"Checkpoint commit was successful",
    }
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    (root / "default" / "empty_dir").mkdir()
    os.symlink("manifest.ocdbt", root / "default" / "link")
    return files


def test_rename_directory_tree(fsdir):
    tmp = fsdir / "100.orbax-checkpoint-tmp-1712345678"
    tmp.mkdir()
    files = _make_tree(tmp)
    inner = os.stat(tmp / "default").st_ino
    os.rename(tmp / "default", fsdir / "default.orbax-checkpoint-tmp")  # move out and back
    os.rename(fsdir / "default.orbax-checkpoint-tmp", tmp / "default")
    assert os.stat(tmp / "default").st_ino == inner
    os.rename(tmp, fsdir / "100")
    new = fsdir / "100"
    assert not tmp.exists()
    assert sorted(os.listdir(fsdir)) == ["100"]
    for rel, data in files.items():
        assert (new / rel).read_bytes() == data, rel
        assert uncached(new / rel) == data, rel
    assert os.readlink(new / "default" / "link") == "manifest.ocdbt"
    assert (new / "default" / "link").read_bytes() == files["default/manifest.ocdbt"]
    assert os.listdir(new / "default" / "empty_dir") == []
    found = {str(Path(dp, f).relative_to(new)) for dp, _dn, fn in os.walk(new) for f in fn}
    assert found == set(files) | {"default/link"}
    # ".." of a moved directory is its new parent.
    assert os.stat(new / "default" / "..").st_ino == os.stat(new).st_ino
    assert os.stat(new / "..").st_ino == os.stat(fsdir).st_ino
    # A directory moved into another directory: link counts follow.
    (fsdir / "other").mkdir()
    n_before = os.stat(fsdir).st_nlink
    os.rename(new / "default", fsdir / "other" / "default")
    assert os.stat(fsdir).st_nlink == n_before
    assert os.stat(new).st_nlink == 2
    assert os.stat(fsdir / "other").st_nlink == 3
    assert (fsdir / "other" / "default" / "_METADATA").read_bytes() == files["default/_METADATA"]
    assert os.stat(fsdir / "other" / "default" / "..").st_ino == os.stat(fsdir / "other").st_ino


def test_rename_directory_with_open_file(fsdir):
    tmp = fsdir / "7.orbax-checkpoint-tmp-1"
    (tmp / "d").mkdir(parents=True)
    w = os.open(tmp / "d" / "data", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    r = None
    try:
        first = pattern(2 * MiB + 7)
        write_all(w, first)
        (tmp / "d" / "other").write_bytes(b"x")
        r = os.open(tmp / "d" / "other", os.O_RDONLY)
        os.rename(tmp, fsdir / "7")
        second = pattern(MiB + 3, seed=99)
        write_all(w, second)  # keep writing through the descriptor opened under the old name
        os.fsync(w)
        assert os.read(r, 10) == b"x"
    finally:
        os.close(w)
        if r is not None:
            os.close(r)
    assert (fsdir / "7" / "d" / "data").read_bytes() == first + second
    assert uncached(fsdir / "7" / "d" / "data") == first + second
    assert not (tmp / "d" / "data").exists()
    assert sorted(os.listdir(fsdir / "7" / "d")) == ["data", "other"]


RENAME_NOREPLACE = 1


def _renameat2(old: Path, new: Path, flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        pytest.skip("libc has no renameat2")
    at_fdcwd = -100
    rc = libc.renameat2(at_fdcwd, os.fsencode(old), at_fdcwd, os.fsencode(new),
                        ctypes.c_uint(flags))
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def test_rename_noreplace(fsdir):
    a, b = fsdir / "a", fsdir / "b"
    a.write_bytes(b"A")
    b.write_bytes(b"B")
    assert err(_renameat2, a, b, RENAME_NOREPLACE) == errno.EEXIST
    assert a.read_bytes() == b"A" and b.read_bytes() == b"B"
    _renameat2(a, fsdir / "c", RENAME_NOREPLACE)
    assert not a.exists() and (fsdir / "c").read_bytes() == b"A"
    (fsdir / "dd").mkdir()
    assert err(_renameat2, fsdir / "dd", b, RENAME_NOREPLACE) == errno.EEXIST
    _renameat2(fsdir / "dd", fsdir / "ee", RENAME_NOREPLACE)
    assert (fsdir / "ee").is_dir()


# ---------------------------------------------------------------------- unlink / rmdir

def test_unlink_while_open(fsdir):
    p = fsdir / "victim"
    data = pattern(3 * MiB + 1)
    p.write_bytes(data)
    r = os.open(p, os.O_RDONLY)
    w = os.open(p, os.O_RDWR)
    try:
        os.unlink(p)
        assert "victim" not in os.listdir(fsdir)
        assert err(os.stat, p) == errno.ENOENT
        assert os.fstat(r).st_nlink == 0
        assert pread_all(r, len(data), 0) == data
        os.pwrite(w, b"ZZ", 10)  # still writable through an open descriptor
        assert os.pread(r, 4, 9) == data[9:10] + b"ZZ" + data[12:13]
        os.fsync(w)
        os.posix_fadvise(r, 0, 0, os.POSIX_FADV_DONTNEED)
        assert pread_all(r, len(data), 0) == data[:10] + b"ZZ" + data[12:]
        # A new file under the same name is a different file.
        p.write_bytes(b"fresh")
        assert p.read_bytes() == b"fresh"
        assert os.fstat(r).st_size == len(data)
    finally:
        os.close(r)
        os.close(w)
    assert p.read_bytes() == b"fresh"
    assert err(os.unlink, fsdir / "missing") == errno.ENOENT
    (fsdir / "dir").mkdir()
    assert err(os.unlink, fsdir / "dir") == errno.EISDIR


def test_rmdir(fsdir):
    (fsdir / "full" / "sub").mkdir(parents=True)
    (fsdir / "withfile").mkdir()
    (fsdir / "withfile" / "f").write_bytes(b"1")
    (fsdir / "file").write_bytes(b"1")
    assert err(os.rmdir, fsdir / "full") == errno.ENOTEMPTY
    assert err(os.rmdir, fsdir / "withfile") == errno.ENOTEMPTY
    assert err(os.rmdir, fsdir / "missing") == errno.ENOENT
    assert err(os.rmdir, fsdir / "file") == errno.ENOTDIR
    n = os.stat(fsdir).st_nlink
    os.rmdir(fsdir / "full" / "sub")
    os.rmdir(fsdir / "full")
    assert os.stat(fsdir).st_nlink == n - 1
    assert err(os.rmdir, fsdir / "full") == errno.ENOENT
    os.unlink(fsdir / "withfile" / "f")
    os.rmdir(fsdir / "withfile")
    assert sorted(os.listdir(fsdir)) == ["file"]
    # rmdir of a directory that is still open: listing it then gives nothing.
    (fsdir / "open").mkdir()
    dfd = os.open(fsdir / "open", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.rmdir(fsdir / "open")
        assert os.listdir(dfd) == []
        assert err(os.open, "new", os.O_WRONLY | os.O_CREAT, dir_fd=dfd) == errno.ENOENT
    finally:
        os.close(dfd)
    # shutil.rmtree of a tree (Orbax max_to_keep).
    _make_tree(fsdir / "42")
    shutil.rmtree(fsdir / "42")
    assert sorted(os.listdir(fsdir)) == ["file"]


# ---------------------------------------------------------------------- attributes

def test_truncate(fsdir):
    p = fsdir / "t"
    data = pattern(2 * MiB + 100)
    p.write_bytes(data)
    os.truncate(p, 5 * MiB)  # grow: zeros
    assert os.stat(p).st_size == 5 * MiB
    assert p.read_bytes() == data + b"\0" * (5 * MiB - len(data))
    os.truncate(p, 1000)  # shrink
    assert p.read_bytes() == data[:1000]
    os.truncate(p, 0)
    assert p.read_bytes() == b""
    os.truncate(p, 3000)
    assert p.read_bytes() == b"\0" * 3000
    assert uncached(p) == b"\0" * 3000
    fd = os.open(p, os.O_RDWR)
    try:
        write_all(fd, data[:MiB])
        os.ftruncate(fd, 10)
        assert os.fstat(fd).st_size == 10
        os.pwrite(fd, b"end", 20)
        assert os.fstat(fd).st_size == 23
        assert os.pread(fd, 100, 0) == data[:10] + b"\0" * 10 + b"end"
        os.ftruncate(fd, 2 * MiB)
        assert pread_all(fd, 2 * MiB, 0) == data[:10] + b"\0" * 10 + b"end" + b"\0" * (2 * MiB - 23)
    finally:
        os.close(fd)
    assert os.stat(p).st_size == 2 * MiB
    assert uncached(p) == data[:10] + b"\0" * 10 + b"end" + b"\0" * (2 * MiB - 23)
    os.truncate(p, 7)
    assert uncached(p) == data[:7]
    (fsdir / "dir").mkdir()
    assert err(os.truncate, fsdir / "dir", 0) == errno.EISDIR
    assert err(os.truncate, fsdir / "missing", 0) == errno.ENOENT
    fd = os.open(p, os.O_RDONLY)
    try:
        assert err(os.ftruncate, fd, 0) == errno.EINVAL
    finally:
        os.close(fd)


def test_chmod_chown_utime_stat(fsdir):
    p = fsdir / "f"
    p.write_bytes(b"12345")
    st = os.stat(p)
    assert stat.S_ISREG(st.st_mode) and st.st_size == 5 and st.st_nlink == 1
    assert st.st_uid == os.getuid() and st.st_gid == os.getgid()
    assert st.st_ino != 0 and st.st_ino != os.stat(fsdir).st_ino
    assert abs(st.st_mtime_ns - time.time_ns()) < 30e9
    os.chmod(p, 0o640)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
    os.chmod(p, 0o4755)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o4755
    os.chmod(p, 0o600)
    if os.getuid() == 0:
        os.chown(p, 1234, 5678)
        st = os.stat(p)
        assert (st.st_uid, st.st_gid) == (1234, 5678)
        os.chown(p, -1, 42)
        assert (os.stat(p).st_uid, os.stat(p).st_gid) == (1234, 42)
        os.chown(p, 0, 0)
    os.utime(p, ns=(1_000_000_001, 2_000_000_002))
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_001, 2_000_000_002)
    os.utime(p, ns=(0, 0))  # the epoch is a time like any other
    assert (os.stat(p).st_atime_ns, os.stat(p).st_mtime_ns) == (0, 0)
    os.utime(p, ns=(-5_000_000_000, -3))
    assert (os.stat(p).st_atime_ns, os.stat(p).st_mtime_ns) == (-5_000_000_000, -3)
    before = time.time_ns()
    os.utime(p)  # now
    st = os.stat(p)
    assert st.st_mtime_ns >= before - 1e9 and abs(st.st_mtime_ns - time.time_ns()) < 5e9
    ctime = st.st_ctime_ns
    time.sleep(0.01)
    os.chmod(p, 0o644)
    assert os.stat(p).st_ctime_ns > ctime
    # fchmod / futimens on an open descriptor; mtime set then survives close.
    fd = os.open(p, os.O_RDWR)
    try:
        os.fchmod(fd, 0o604)
        os.write(fd, b"x")
        os.utime(fd, ns=(3_000_000_003, 4_000_000_004))
    finally:
        os.close(fd)
    st = os.stat(p)
    assert stat.S_IMODE(st.st_mode) == 0o604 and st.st_mtime_ns == 4_000_000_004
    assert p.read_bytes() == b"x2345"
    assert uncached(p) == b"x2345"
    # Directories and symlinks.
    d = fsdir / "d"
    d.mkdir(mode=0o755)
    (d / "a").mkdir()
    (d / "b").mkdir()
    (d / "file").write_bytes(b"")
    st = os.stat(d)
    assert stat.S_ISDIR(st.st_mode) and st.st_nlink == 4
    os.chmod(d, 0o700)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    os.utime(d, ns=(5, 6_000_000_000))
    assert os.stat(d).st_mtime_ns == 6_000_000_000
    os.utime(d, ns=(0, 0))
    assert (os.stat(d).st_atime_ns, os.stat(d).st_mtime_ns) == (0, 0)
    os.symlink("f", fsdir / "ln")
    os.utime(fsdir / "ln", ns=(7, 8_000_000_000), follow_symlinks=False)
    assert os.lstat(fsdir / "ln").st_mtime_ns == 8_000_000_000
    assert os.stat(p).st_mtime_ns == 4_000_000_004
    # A file's mtime moves when it is written.
    os.utime(p, ns=(1, 1_000_000_000))
    with open(p, "r+b") as f:
        f.write(b"y")
    assert os.stat(p).st_mtime_ns > 1_000_000_000
    # A directory's mtime moves when an entry is added.
    os.utime(d, ns=(1, 1_000_000_000))
    (d / "new").write_bytes(b"")
    assert os.stat(d).st_mtime_ns > 1_000_000_000
    for change in (lambda: os.unlink(d / "new"), lambda: os.rename(d / "file", d / "file2"),
                   lambda: os.rmdir(d / "a")):
        os.utime(d, ns=(1, 1_000_000_000))
        change()
        assert os.stat(d).st_mtime_ns > 1_000_000_000
    assert err(os.chmod, fsdir / "missing", 0o600) == errno.ENOENT


def test_symlink_readlink(fsdir):
    (fsdir / "target.txt").write_bytes(b"payload")
    (fsdir / "dir").mkdir()
    (fsdir / "dir" / "inner").write_bytes(b"in")
    os.symlink("target.txt", fsdir / "ln")
    os.symlink("dir", fsdir / "dirln")
    os.symlink("does/not/exist", fsdir / "dangling")
    long_target = "/".join(["seg" * 10] * 30)
    os.symlink(long_target, fsdir / "long")
    assert os.readlink(fsdir / "ln") == "target.txt"
    assert os.readlink(fsdir / "long") == long_target
    st = os.lstat(fsdir / "ln")
    assert stat.S_ISLNK(st.st_mode) and st.st_size == len("target.txt")
    assert os.stat(fsdir / "ln").st_ino == os.stat(fsdir / "target.txt").st_ino
    assert (fsdir / "ln").read_bytes() == b"payload"
    assert os.listdir(fsdir / "dirln") == ["inner"]
    assert (fsdir / "dirln" / "inner").read_bytes() == b"in"
    assert not (fsdir / "dangling").exists() and os.path.lexists(fsdir / "dangling")
    assert err(os.stat, fsdir / "dangling") == errno.ENOENT
    assert err(os.readlink, fsdir / "target.txt") == errno.EINVAL
    assert err(os.readlink, fsdir / "missing") == errno.ENOENT
    assert err(os.symlink, "x", fsdir / "ln") == errno.EEXIST
    # Writing through a symlink writes the target; unlinking the link keeps the target.
    with open(fsdir / "ln", "ab") as f:
        f.write(b"+")
    assert (fsdir / "target.txt").read_bytes() == b"payload+"
    assert uncached(fsdir / "target.txt") == b"payload+"
    os.unlink(fsdir / "ln")
    assert (fsdir / "target.txt").read_bytes() == b"payload+"
    # Renaming a symlink keeps its target.
    os.rename(fsdir / "dangling", fsdir / "moved")
    assert os.readlink(fsdir / "moved") == "does/not/exist"
    # Loop.
    os.symlink("loop2", fsdir / "loop1")
    os.symlink("loop1", fsdir / "loop2")
    assert err(os.stat, fsdir / "loop1") == errno.ELOOP


def test_hard_links(fsdir):
    a, b = fsdir / "a", fsdir / "sub" / "b"
    (fsdir / "sub").mkdir()
    a.write_bytes(b"shared content")
    os.link(a, b)
    sa, sb = os.stat(a), os.stat(b)
    assert sa.st_ino == sb.st_ino and sa.st_nlink == sb.st_nlink == 2
    with open(b, "r+b") as f:
        f.seek(0)
        f.write(b"SHARED")
    assert a.read_bytes() == b"SHARED content"
    assert uncached(a) == b"SHARED content"
    os.link(a, fsdir / "c")
    assert os.stat(b).st_nlink == 3
    os.chmod(fsdir / "c", 0o600)
    assert stat.S_IMODE(os.stat(a).st_mode) == 0o600
    os.unlink(a)
    assert os.stat(b).st_nlink == 2
    assert b.read_bytes() == b"SHARED content"
    # Rewrite with O_TRUNC through one name: every name sees the new content.
    b.write_bytes(b"v2")
    assert (fsdir / "c").read_bytes() == b"v2"
    assert uncached(fsdir / "c") == b"v2"
    os.unlink(fsdir / "c")
    assert os.stat(b).st_nlink == 1 and b.read_bytes() == b"v2"
    assert err(os.link, b, fsdir / "sub") == errno.EEXIST
    assert err(os.link, fsdir / "sub", fsdir / "dirlink") == errno.EPERM
    assert err(os.link, fsdir / "missing", fsdir / "x") == errno.ENOENT
    # A hard link survives renaming the other name and the directory it is in.
    os.link(b, fsdir / "top")
    os.rename(fsdir / "sub", fsdir / "sub2")
    assert (fsdir / "sub2" / "b").read_bytes() == b"v2"
    os.unlink(fsdir / "top")
    assert os.stat(fsdir / "sub2" / "b").st_nlink == 1
    # Link of a file that is open and unlinked-then-relinked names.
    fd = os.open(fsdir / "sub2" / "b", os.O_RDONLY)
    try:
        os.link(fsdir / "sub2" / "b", fsdir / "again")
        os.unlink(fsdir / "sub2" / "b")
        assert os.fstat(fd).st_nlink == 1
        assert os.read(fd, 10) == b"v2"
    finally:
        os.close(fd)
    assert (fsdir / "again").read_bytes() == b"v2"


def test_user_xattrs(fsdir):
    p = fsdir / "f"
    p.write_bytes(b"x")
    (fsdir / "d").mkdir()
    assert user_xattrs(p) == {}
    os.setxattr(p, "user.a", b"1")
    os.setxattr(p, "user.bin", b"\0\xff" * 2000)
    os.setxattr(p, "user.empty", b"")
    assert os.getxattr(p, "user.a") == b"1"
    assert os.getxattr(p, "user.bin") == b"\0\xff" * 2000
    assert os.getxattr(p, "user.empty") == b""
    assert user_xattrs(p) == {"user.a": b"1", "user.bin": b"\0\xff" * 2000, "user.empty": b""}
    assert sorted(os.listxattr(p)) == ["user.a", "user.bin", "user.empty"]
    os.setxattr(p, "user.a", b"22")
    assert os.getxattr(p, "user.a") == b"22"
    assert err(os.setxattr, p, "user.a", b"3", os.XATTR_CREATE) == errno.EEXIST
    assert err(os.setxattr, p, "user.nope", b"3", os.XATTR_REPLACE) == errno.ENODATA
    os.setxattr(p, "user.a", b"4", os.XATTR_REPLACE)
    os.setxattr(p, "user.new", b"5", os.XATTR_CREATE)
    assert os.getxattr(p, "user.a") == b"4" and os.getxattr(p, "user.new") == b"5"
    assert err(os.getxattr, p, "user.missing") == errno.ENODATA
    os.removexattr(p, "user.a")
    assert err(os.getxattr, p, "user.a") == errno.ENODATA
    assert err(os.removexattr, p, "user.a") == errno.ENODATA
    assert sorted(os.listxattr(p)) == ["user.bin", "user.empty", "user.new"]
    # On directories; kept across rename and a content rewrite.
    assert os.listxattr(fsdir / "d") == []
    os.setxattr(fsdir / "d", "user.dir", b"yes")
    assert os.listxattr(fsdir / "d") == ["user.dir"]
    os.rename(p, fsdir / "g")
    p = fsdir / "g"
    p.write_bytes(b"rewritten")
    assert os.getxattr(p, "user.new") == b"5"
    assert err(os.getxattr, fsdir / "missing", "user.a") == errno.ENOENT



def test_names_outside_user_are_absent_and_writes_that_ask_for_them_succeed(shared_mount):
    """The kernel asks for security.capability before every write(2); the answer is "no
    such attribute" (never EIO or ENOTSUP, which would fail or disable the check), and no
    namespace but user.* can be set (mtcfs only: tmpfs keeps trusted.* for root)."""
    fsdir = shared_mount.path("t-names-outside-user")
    fsdir.mkdir()
    p = fsdir / "f"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for i in range(64):  # each write(2) sends a GETXATTR security.capability
            assert os.pwrite(fd, bytes([i]) * 4096, i * 4096) == 4096
    finally:
        os.close(fd)
    assert p.read_bytes() == b"".join(bytes([i]) * 4096 for i in range(64))
    os.setxattr(p, "user.a", b"1")
    for name in ("security.capability", "trusted.a"):
        assert err(os.getxattr, p, name) == errno.ENODATA, name
    assert err(os.setxattr, p, "trusted.a", b"1") in (errno.ENOTSUP, errno.EPERM)
    assert err(os.getxattr, p, "trusted.a") == errno.ENODATA
    assert os.getxattr(p, "user.a") == b"1"
    assert err(os.getxattr, fsdir / "missing", "security.capability") == errno.ENOENT
    shutil.rmtree(fsdir)


# ---------------------------------------------------------------------- append / large / r+w

def test_o_append(fsdir):
    p = fsdir / "log"
    p.write_bytes(b"head|")
    a1 = os.open(p, os.O_WRONLY | os.O_APPEND)
    a2 = os.open(p, os.O_WRONLY | os.O_APPEND)
    try:
        for i in range(50):
            os.write(a1 if i % 2 else a2, b"<%d>" % i)
        assert os.lseek(a1, 0, os.SEEK_CUR) == os.fstat(a1).st_size
    finally:
        os.close(a1)
        os.close(a2)
    expect = b"head|" + b"".join(b"<%d>" % i for i in range(50))
    assert p.read_bytes() == expect
    assert uncached(p) == expect
    # A plain writer and an appending writer on the same file at once.
    w = os.open(p, os.O_RDWR)
    a = os.open(p, os.O_WRONLY | os.O_APPEND)
    try:
        os.pwrite(w, b"HEAD", 0)
        os.write(a, b"|tail")
        os.pwrite(w, b"!", 4)
        os.fsync(w)
        os.fsync(a)
    finally:
        os.close(w)
        os.close(a)
    expect = b"HEAD!" + expect[5:] + b"|tail"
    assert p.read_bytes() == expect
    assert uncached(p) == expect
    # Python's "ab" on an existing, closed file; large appends.
    big = pattern(3 * MiB + 11)
    with open(p, "ab") as f:
        f.write(big)
    assert p.read_bytes() == expect + big
    assert uncached(p) == expect + big
    with open(fsdir / "newlog", "ab") as f:
        f.write(b"1")
    with open(fsdir / "newlog", "ab") as f:
        f.write(b"2")
    assert (fsdir / "newlog").read_bytes() == b"12"
    assert uncached(fsdir / "newlog") == b"12"


def test_large_file_16mib_writes(fsdir):
    p = fsdir / "__0_0.distcp"
    total, step = 200 * MiB, 16 * MiB
    base = bytearray(os.urandom(step))
    h = blake3.blake3()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.monotonic()
    try:
        off, i = 0, 0
        while off < total:
            n = min(step, total - off)
            base[:8] = struct.pack("<Q", i)
            chunk = memoryview(base)[:n]
            h.update(chunk)
            write_all(fd, chunk)
            off += n
            i += 1
        os.fsync(fd)
    finally:
        os.close(fd)
    t_write = time.monotonic() - t0
    want = h.hexdigest()
    assert os.stat(p).st_size == total
    h2 = blake3.blake3()
    buf = bytearray(step)
    got = 0
    with open(p, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h2.update(memoryview(buf)[:n])
            got += n
    assert got == total
    assert h2.hexdigest() == want
    assert t_write < 30
    if err(os.getxattr, p, "user.mtcfs.state") == 0:  # on mtcfs: the sealed hash agrees
        assert os.getxattr(p, "user.mtcfs.blake3").decode() == want


def test_read_while_writing(fsdir):
    p = fsdir / "growing"
    data = pattern(16 * MiB + 5)
    w = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    r = os.open(p, os.O_RDONLY)
    try:
        # Interleaved: every write is visible to the other descriptor at once.
        step = 1 * MiB + 3
        for off in range(0, 4 * MiB, step):
            write_all(w, data[off:off + step])
            assert os.fstat(r).st_size == off + len(data[off:off + step])
            assert pread_all(r, step, off) == data[off:off + step]
        os.ftruncate(w, 0)
        os.lseek(w, 0, os.SEEK_SET)
        # Concurrent: a reader thread only ever sees a prefix of what is being written.
        stop = threading.Event()
        problems: list[str] = []

        def reader() -> None:
            fd = os.open(p, os.O_RDONLY)
            try:
                while not stop.is_set():
                    size = os.fstat(fd).st_size
                    got = pread_all(fd, size, 0)
                    if got != data[:len(got)]:
                        problems.append(f"read {len(got)} bytes that are no prefix")
                        return
            finally:
                os.close(fd)

        t = threading.Thread(target=reader)
        t.start()
        try:
            for off in range(0, len(data), 256 * 1024):
                write_all(w, data[off:off + 256 * 1024])
        finally:
            stop.set()
            t.join()
        assert not problems, problems
        assert pread_all(r, len(data) + 10, 0) == data
    finally:
        os.close(w)
        os.close(r)
    assert p.read_bytes() == data
    assert uncached(p) == data


def test_rewrite_in_place_seen_by_open_reader(fsdir):
    """A descriptor opened before another one rewrites the file reads the new bytes
    (one file, one content), also once the page cache has dropped them."""
    p = fsdir / "ckpt.bin"
    old = pattern(4 * MiB, seed=1)
    p.write_bytes(old)
    wait_sealed(p)
    r = os.open(p, os.O_RDONLY)
    try:
        assert pread_all(r, 4 * MiB, 0) == old
        new = pattern(4 * MiB, seed=2)
        w = os.open(p, os.O_RDWR)
        try:
            os.pwrite(w, new[:MiB], 0)
            os.fsync(w)
        finally:
            os.close(w)
        expect = new[:MiB] + old[MiB:]
        assert pread_all(r, 4 * MiB, 0) == expect
        os.posix_fadvise(r, 0, 0, os.POSIX_FADV_DONTNEED)
        assert pread_all(r, 4 * MiB, 0) == expect
        # Rewritten with O_TRUNC (DCP re-saving into an existing dir).
        w = os.open(p, os.O_WRONLY | os.O_TRUNC)
        try:
            write_all(w, new[:3 * MiB])
            os.fsync(w)
        finally:
            os.close(w)
        assert os.fstat(r).st_size == 3 * MiB
        os.posix_fadvise(r, 0, 0, os.POSIX_FADV_DONTNEED)
        assert pread_all(r, 4 * MiB, 0) == new[:3 * MiB]
    finally:
        os.close(r)


def test_copy_tools(fsdir):
    """Copying a checkpoint tree with its xattrs in and out: shutil, cp -a, tar."""
    import subprocess
    src = fsdir / "src"
    files = _make_tree(src)
    os.setxattr(src / "default" / "_METADATA", "user.tag", b"t")
    shutil.copytree(src, fsdir / "copy", symlinks=True)
    outs = [fsdir / "copy"]
    if shutil.which("cp"):
        r = subprocess.run(["cp", "-a", "--preserve=all", str(src), str(fsdir / "cp")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        outs.append(fsdir / "cp")
    if shutil.which("tar"):
        (fsdir / "untar").mkdir()
        r = subprocess.run(["tar", "--xattrs", "--xattrs-include=user.*", "-C", str(src), "-cf",
                            str(fsdir / "t.tar"), "."], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        r = subprocess.run(["tar", "--xattrs", "--xattrs-include=user.*", "-C",
                            str(fsdir / "untar"), "-xf", str(fsdir / "t.tar")],
                           capture_output=True, text=True)
        assert r.returncode == 0 and not r.stderr, r.stderr
        outs.append(fsdir / "untar")
    for out in outs:
        for rel, data in files.items():
            assert uncached(out / rel) == data, (out, rel)
        assert os.readlink(out / "default" / "link") == "manifest.ocdbt"
        assert os.listxattr(out / "default" / "_METADATA") == ["user.tag"]
    # posix_fallocate (glibc writes zeros where the filesystem has no fallocate).
    fd = os.open(fsdir / "prealloc", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"abc")
        os.posix_fallocate(fd, 0, 3 * MiB)
        assert os.fstat(fd).st_size == 3 * MiB
        assert os.pread(fd, 5, 0) == b"abc\0\0"
    finally:
        os.close(fd)
    assert uncached(fsdir / "prealloc") == b"abc" + b"\0" * (3 * MiB - 3)


def _as_nobody(fn) -> int:
    """Run ``fn()`` in a child process as uid/gid 65534; its errno (0 on success)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            fn()
        except OSError as exc:
            code = exc.errno
        except BaseException:
            code = 255
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch users")
def test_another_users_write_or_truncate_and_a_chown_clear_setuid_and_setgid(fsdir):
    """A write, a truncate or an O_TRUNC open by a user without CAP_FSETID clears
    set-user-ID and (group-executable) set-group-ID, and so does root's chown. On mtcfs
    with FUSE_HANDLE_KILLPRIV_V2 the kernel leaves this to the filesystem
    (t4_killpriv_test.py, docs/fuse-build.md)."""
    path = fsdir
    while str(path) != "/dev/shm":
        os.chmod(path, os.stat(path).st_mode | 0o005)
        path = path.parent

    def write(f: Path) -> None:
        with open(f, "r+b") as fp:
            fp.write(b"y")
    ways = {"write": write, "truncate": lambda f: os.truncate(f, 10),
            "O_TRUNC": lambda f: os.close(os.open(f, os.O_WRONLY | os.O_TRUNC))}
    for how, fn in ways.items():
        f = fsdir / how
        f.write_bytes(b"x" * 100)
        os.chmod(f, 0o6777)  # anyone may write it
        assert _as_nobody(lambda: fn(f)) == 0, how
        assert (how, stat.S_IMODE(os.stat(f).st_mode)) == (how, 0o777)
    f = fsdir / "chown"
    f.write_bytes(b"x")
    os.chmod(f, 0o6755)
    os.chown(f, 65534, 65534)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o755
    d = fsdir / "dir"
    d.mkdir()
    os.chmod(d, 0o2775)
    os.chown(d, 65534, 65534)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o2775  # a directory keeps set-group-ID


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch users")
def test_permissions_other_user(fsdir):
    """The kernel checks modes (default_permissions) from the attributes mtcfs reports."""
    path = fsdir
    while str(path) != "/dev/shm":  # let another user reach the test directory
        os.chmod(path, os.stat(path).st_mode | 0o005)
        path = path.parent
    secret, public = fsdir / "secret", fsdir / "public"
    secret.write_bytes(b"s")
    public.write_bytes(b"p")
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    os.chmod(fsdir, 0o755)
    assert _as_nobody(lambda: secret.read_bytes()) == errno.EACCES
    assert _as_nobody(lambda: public.read_bytes()) == 0
    assert _as_nobody(lambda: public.write_bytes(b"x")) == errno.EACCES
    assert _as_nobody(lambda: (fsdir / "new").write_bytes(b"x")) == errno.EACCES
    assert _as_nobody(lambda: os.unlink(public)) == errno.EACCES
    assert _as_nobody(lambda: os.chmod(public, 0o666)) == errno.EPERM
    os.chmod(fsdir, 0o1777)  # sticky, world-writable: create yes, remove others' no
    assert _as_nobody(lambda: (fsdir / "mine").write_bytes(b"m")) == 0
    assert os.stat(fsdir / "mine").st_uid == 65534
    assert _as_nobody(lambda: os.unlink(public)) == errno.EPERM
    assert _as_nobody(lambda: os.unlink(fsdir / "mine")) == 0
    os.chown(public, 65534, 65534)
    assert _as_nobody(lambda: public.write_bytes(b"mine now")) == 0
    assert uncached(public) == b"mine now"
    os.chmod(fsdir, 0o755)


def test_mmap_and_o_direct(fsdir):
    """TensorStore may be configured for memmap or direct file I/O."""
    import mmap
    p = fsdir / "mapped"
    data = pattern(5 * MiB + 17)
    p.write_bytes(data)
    expect = bytearray(data)
    fd = os.open(p, os.O_RDWR)
    mm = mmap.mmap(fd, 0)
    try:
        assert mm[:] == data
        mm[100:200] = b"z" * 100
        expect[100:200] = b"z" * 100
        mm.flush()
        os.close(fd)  # the mapping outlives the descriptor
        fd = -1
        mm[4 * MiB:4 * MiB + 5] = b"after"
        expect[4 * MiB:4 * MiB + 5] = b"after"
        mm.flush()
    finally:
        mm.close()
        if fd >= 0:
            os.close(fd)
    assert uncached(p) == expect
    # O_DIRECT with page-aligned buffers.
    block = mmap.mmap(-1, MiB)
    block.write(pattern(MiB, seed=3))
    fd = os.open(fsdir / "direct", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        assert os.pwritev(fd, [block], 0) == MiB
        assert os.pwritev(fd, [block], 2 * MiB) == MiB
        back = mmap.mmap(-1, MiB)
        assert os.preadv(fd, [back], 2 * MiB) == MiB
        assert back[:] == block[:]
        assert os.fstat(fd).st_size == 3 * MiB
    finally:
        os.close(fd)
    assert uncached(fsdir / "direct") == block[:] + b"\0" * MiB + block[:]


def test_concurrent_writers(fsdir):
    """Several threads each write their own file at once (DCP ``thread_count``)."""
    datas = {i: pattern(6 * MiB + i, seed=i * 1000) for i in range(4)}

    def writer(i: int) -> None:
        fd = os.open(fsdir / f"__0_{i}.distcp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for off in range(0, len(datas[i]), MiB):
                write_all(fd, memoryview(datas[i])[off:off + MiB])
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(writer, datas))
    for i, data in datas.items():
        assert uncached(fsdir / f"__0_{i}.distcp") == data


def test_locks(fsdir):
    """OFD and flock locks (TensorStore's *.__lock): kept by the kernel on FUSE."""
    import fcntl
    p = fsdir / "manifest.ocdbt.__lock"
    p.write_bytes(b"")
    fd1 = os.open(p, os.O_RDWR)
    fd2 = os.open(p, os.O_RDWR)
    try:
        whole = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        fcntl.fcntl(fd1, fcntl.F_OFD_SETLK, whole)
        assert err(fcntl.fcntl, fd2, fcntl.F_OFD_SETLK, whole) in (errno.EAGAIN, errno.EACCES)
        unlock = struct.pack("hhqqi", fcntl.F_UNLCK, os.SEEK_SET, 0, 0, 0)
        fcntl.fcntl(fd1, fcntl.F_OFD_SETLK, unlock)
        fcntl.fcntl(fd2, fcntl.F_OFD_SETLKW, whole)
        fcntl.fcntl(fd2, fcntl.F_OFD_SETLK, unlock)
        fcntl.flock(fd1, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert err(fcntl.flock, fd2, fcntl.LOCK_EX | fcntl.LOCK_NB) == errno.EWOULDBLOCK
        fcntl.flock(fd1, fcntl.LOCK_UN)
        fcntl.flock(fd2, fcntl.LOCK_SH | fcntl.LOCK_NB)
    finally:
        os.close(fd1)
        os.close(fd2)


# ---------------------------------------------------------------------- long names, special files

LONG = "n" * 256  # one byte over NAME_MAX

_LONG_NAME_CALLS = {
    "stat": lambda d: os.stat(d / LONG),
    "chmod": lambda d: os.chmod(d / LONG, 0o600),
    "chown": lambda d: os.chown(d / LONG, os.getuid(), os.getgid()),
    "lchown": lambda d: os.lchown(d / LONG, os.getuid(), os.getgid()),
    "truncate": lambda d: os.truncate(d / LONG, 0),
    "link": lambda d: os.link(d / LONG, d / "x"),
    "rename": lambda d: os.rename(d / LONG, d / "x"),
    "rmdir": lambda d: os.rmdir(d / LONG),
    "unlink": lambda d: os.unlink(d / LONG),
    "create": lambda d: os.close(os.open(d / LONG, os.O_CREAT | os.O_WRONLY, 0o644)),
    "mkdir": lambda d: os.mkdir(d / LONG),
    "mkfifo": lambda d: os.mkfifo(d / LONG),
    "link_to": lambda d: os.link(d / "f", d / LONG),
    "rename_to": lambda d: os.rename(d / "f", d / LONG),
    "symlink": lambda d: os.symlink("f", d / LONG),
}


@pytest.mark.parametrize("call", sorted(_LONG_NAME_CALLS))
def test_name_longer_than_255_bytes_is_enametoolong(fsdir, call):
    """A name over NAME_MAX is ENAMETOOLONG whatever the call, also when nothing has that
    name (a lookup of it must not answer ENOENT)."""
    (fsdir / "f").write_bytes(b"f")
    assert err(_LONG_NAME_CALLS[call], fsdir) == errno.ENAMETOOLONG
    assert sorted(os.listdir(fsdir)) == ["f"]
    # 255 bytes is still a valid name.
    ok = fsdir / ("n" * 255)
    ok.write_bytes(b"ok")
    assert ok.read_bytes() == b"ok"


_SPECIAL = [("fifo", stat.S_IFIFO, 0), ("chr", stat.S_IFCHR, os.makedev(1, 3)),
            ("blk", stat.S_IFBLK, os.makedev(7, 200))]


def _make_specials(d: Path) -> dict[str, tuple[int, int, int]]:
    """A FIFO, a character and a block device node and a bound Unix socket in ``d``;
    name -> (file type, permission bits, rdev) as created."""
    out = {}
    os.mkfifo(d / "fifo", 0o640)
    out["fifo"] = (stat.S_IFIFO, 0o640, 0)
    for name, fmt, rdev in _SPECIAL[1:]:
        os.mknod(d / name, fmt | 0o600, rdev)
        out[name] = (fmt, 0o600, rdev)
    import socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(d / "sock"))
    finally:
        s.close()
    out["sock"] = (stat.S_IFSOCK, stat.S_IMODE(os.lstat(d / "sock").st_mode), 0)
    return out


def _check_specials(d: Path, made: dict[str, tuple[int, int, int]],
                    nlinks: dict[str, int] | None = None) -> None:
    for name, (fmt, perm, rdev) in made.items():
        st = os.lstat(d / name)
        assert stat.S_IFMT(st.st_mode) == fmt, name
        assert stat.S_IMODE(st.st_mode) == perm, name
        assert st.st_rdev == rdev, name
        assert st.st_size == 0 and st.st_nlink == (nlinks or {}).get(name, 1), name


def test_fifo_socket_and_device_nodes(fsdir):
    """mkfifo, mknod of character and block devices and a Unix socket's bind create the
    node; stat shows its type, mode and rdev; it renames, chmods and unlinks like a file."""
    made = _make_specials(fsdir)
    _check_specials(fsdir, made)
    assert sorted(os.listdir(fsdir)) == ["blk", "chr", "fifo", "sock"]
    assert err(os.mkfifo, fsdir / "fifo") == errno.EEXIST
    assert err(os.mknod, fsdir / "chr", stat.S_IFCHR | 0o600, os.makedev(1, 3)) == errno.EEXIST
    # The FIFO is a pipe (the kernel serves it; no data reaches the filesystem).
    fd = os.open(fsdir / "fifo", os.O_RDWR | os.O_NONBLOCK)
    try:
        os.write(fd, b"through the pipe")
        assert os.read(fd, 100) == b"through the pipe"
    finally:
        os.close(fd)
    assert os.stat(fsdir / "fifo").st_size == 0
    # A server on the socket's path is reached through it.
    import socket
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(fsdir / "sock")
        srv.bind(str(fsdir / "sock"))
        srv.listen(1)
        cli = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        cli.connect(str(fsdir / "sock"))
        conn, _ = srv.accept()
        cli.sendall(b"hello")
        assert conn.recv(5) == b"hello"
        conn.close()
        cli.close()
    finally:
        srv.close()
    os.chmod(fsdir / "chr", 0o644)
    assert stat.S_IMODE(os.stat(fsdir / "chr").st_mode) == 0o644
    assert os.stat(fsdir / "chr").st_rdev == os.makedev(1, 3)
    os.rename(fsdir / "blk", fsdir / "blk2")
    assert stat.S_ISBLK(os.lstat(fsdir / "blk2").st_mode)
    assert os.lstat(fsdir / "blk2").st_rdev == os.makedev(7, 200)
    os.link(fsdir / "fifo", fsdir / "fifo.link")
    assert os.lstat(fsdir / "fifo").st_nlink == 2
    assert os.lstat(fsdir / "fifo.link").st_ino == os.lstat(fsdir / "fifo").st_ino
    assert err(os.truncate, fsdir / "chr", 0) in (errno.EINVAL, errno.EACCES, errno.ENXIO)
    os.unlink(fsdir / "fifo.link")
    for name in ("fifo", "chr", "blk2", "sock"):
        os.unlink(fsdir / name)
    assert os.listdir(fsdir) == []


def test_mtcfs_special_files_survive_a_remount(make_mount):
    m = make_mount()
    (m.mnt / "d").mkdir()
    made = _make_specials(m.mnt / "d")
    os.link(m.mnt / "d" / "chr", m.mnt / "chr.link")
    before = {n: os.lstat(m.mnt / "d" / n) for n in made}
    m.stop()
    m.start()
    _check_specials(m.mnt / "d", made, {"chr": 2})
    for n, st in before.items():
        assert os.lstat(m.mnt / "d" / n).st_ino == st.st_ino
        assert os.lstat(m.mnt / "d" / n).st_mtime_ns == st.st_mtime_ns
    assert os.lstat(m.mnt / "chr.link").st_nlink == 2
    fd = os.open(m.mnt / "d" / "fifo", os.O_RDWR | os.O_NONBLOCK)
    os.write(fd, b"x")
    assert os.read(fd, 1) == b"x"
    os.close(fd)
    shutil.rmtree(m.mnt / "d")
    os.unlink(m.mnt / "chr.link")


# ---------------------------------------------------------------------- mtcfs only

def test_mtcfs_statfs_capacity(shared_mount):
    st = os.statvfs(shared_mount.mnt)
    assert st.f_blocks * st.f_frsize == 3 * 1024 ** 3
    assert st.f_bavail <= st.f_bfree <= st.f_blocks
    assert st.f_namemax == 255
    d = shared_mount.path("statfs-test")
    d.mkdir()
    try:
        free0 = os.statvfs(shared_mount.mnt).f_bavail * st.f_frsize
        p = d / "eight"
        p.write_bytes(pattern(8 * MiB))
        free1 = os.statvfs(shared_mount.mnt).f_bavail * st.f_frsize
        assert free0 - free1 == 8 * MiB
        # Unlinked while open: the space is freed at the last close.
        fd = os.open(p, os.O_RDONLY)
        os.unlink(p)
        assert os.statvfs(shared_mount.mnt).f_bavail * st.f_frsize == free1
        os.close(fd)
        shared_mount.wait_for(lambda: os.statvfs(shared_mount.mnt).f_bavail * st.f_frsize == free0,
                              timeout=10, what="space of an unlinked file to be freed")
    finally:
        shutil.rmtree(d)


def test_mtcfs_blksize(shared_mount):
    d = shared_mount.path("blksize-test")
    d.mkdir()
    try:
        p = d / "f"
        p.write_bytes(b"x")
        assert os.stat(p).st_blksize >= MiB
        with open(p, "rb") as f:
            assert os.fstat(f.fileno()).st_blksize >= MiB
        # st_blocks counts 512-byte units of the size.
        p.write_bytes(b"y" * 5000)
        assert os.stat(p).st_blocks == (5000 + 511) // 512
        # A directory reports 4096 bytes whatever its entries (tmpfs counts them).
        assert os.stat(d).st_size == 4096
    finally:
        shutil.rmtree(d)


def test_mtcfs_rewrite_gives_new_blake3(shared_mount):
    d = shared_mount.path("rewrite-test")
    d.mkdir()
    try:
        p = d / "_CHECKPOINT_METADATA"
        v1 = pattern(3 * MiB + 1, seed=1)
        p.write_bytes(v1)
        shared_mount.wait_state("rewrite-test/_CHECKPOINT_METADATA", "local", timeout=10)
        h1 = os.getxattr(p, "user.mtcfs.blake3").decode()
        assert h1 == blake3.blake3(v1).hexdigest()
        v2 = b"short"
        fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
        try:
            write_all(fd, v2)
            assert shared_mount.state("rewrite-test/_CHECKPOINT_METADATA") == "writing"
        finally:
            os.close(fd)
        assert p.read_bytes() == v2
        h2 = os.getxattr(p, "user.mtcfs.blake3").decode()
        assert h2 == blake3.blake3(v2).hexdigest() != h1
        # Rewritten in place without O_TRUNC: the hash follows too.
        with open(p, "r+b") as f:
            f.write(b"S")
        assert os.getxattr(p, "user.mtcfs.blake3").decode() == blake3.blake3(b"Short").hexdigest()
        # Truncated by path.
        os.truncate(p, 2)
        assert os.getxattr(p, "user.mtcfs.blake3").decode() == blake3.blake3(b"Sh").hexdigest()
        assert shared_mount.state("rewrite-test/_CHECKPOINT_METADATA") == "local"
        # Readable by name, but not listed (copy tools would try to set them on copies).
        assert os.listxattr(p) == []
        assert os.getxattr(d, "user.mtcfs.state") == b"local"
        assert err(os.setxattr, p, "user.mtcfs.blake3", b"x") == errno.EPERM
        # The hash of a large file written in 16 MiB writes.
        big = d / "big"
        data = pattern(40 * MiB + 3)
        fd = os.open(big, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for off in range(0, len(data), 16 * MiB):
                write_all(fd, memoryview(data)[off:off + 16 * MiB])
        finally:
            os.close(fd)
        shared_mount.wait_state("rewrite-test/big", "local", timeout=20)
        assert os.getxattr(big, "user.mtcfs.blake3").decode() == blake3.blake3(data).hexdigest()
    finally:
        shutil.rmtree(d)


def test_mtcfs_orbax_commit_at_top_level(shared_mount):
    """The Orbax commit rename at the job root keeps the tree and commits the step."""
    tmp = shared_mount.path("300.orbax-checkpoint-tmp-99")
    tmp.mkdir()
    try:
        files = _make_tree(tmp)
        assert shared_mount.state("300.orbax-checkpoint-tmp-99") == "incomplete"
        os.rename(tmp, shared_mount.path("300"))
        new = shared_mount.path("300")
        for rel, data in files.items():
            assert (new / rel).read_bytes() == data, rel
        assert shared_mount.wait_for(
            lambda: any(c["step"] == "300" for c in shared_mount.checkpoints()), timeout=10,
            what="step 300 to be committed")
        assert shared_mount.state("300") == "local"
    finally:
        shutil.rmtree(shared_mount.path("300"), ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def _snapshot(root: Path) -> dict:
    """Everything a remount must keep: names, types, modes, owners, sizes, mtimes,
    contents, symlink targets, hard-link groups, user xattrs."""
    out: dict = {}
    inos: dict[int, str] = {}
    for dp, dns, fns in os.walk(root):
        for name in sorted(dns + fns):
            p = Path(dp, name)
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            rec = {"mode": st.st_mode, "uid": st.st_uid, "gid": st.st_gid,
                   "nlink": st.st_nlink, "mtime": st.st_mtime_ns,
                   "xattrs": user_xattrs(p, follow=False) if not stat.S_ISLNK(st.st_mode) else {}}
            if stat.S_ISREG(st.st_mode):
                rec["size"] = st.st_size
                rec["blake3"] = blake3.blake3(p.read_bytes()).hexdigest()
                rec["link_group"] = inos.setdefault(st.st_ino, rel)
            elif stat.S_ISLNK(st.st_mode):
                rec["target"] = os.readlink(p)
            out[rel] = rec
    return out


def test_mtcfs_restart_keeps_everything(make_mount):
    m = make_mount()
    root = m.mnt
    _make_tree(root / "step_5")
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "empty").write_bytes(b"")
    (root / "a" / "mode600").write_bytes(b"secret")
    os.chmod(root / "a" / "mode600", 0o600)
    os.chmod(root / "a" / "b", 0o711)
    (root / "a" / "owned").write_bytes(b"o")
    if os.getuid() == 0:
        os.chown(root / "a" / "owned", 1234, 5678)
    big = pattern(9 * MiB + 7)
    (root / "a" / "big").write_bytes(big)
    fd = os.open(root / "a" / "sparse", os.O_WRONLY | os.O_CREAT, 0o644)
    os.pwrite(fd, b"end", 5 * MiB)
    os.close(fd)
    os.link(root / "a" / "big", root / "a" / "b" / "big.hardlink")
    os.link(root / "a" / "mode600", root / "toplink")
    os.symlink("../a/big", root / "a" / "b" / "rel.symlink")
    os.symlink("nonexistent/target", root / "dangling.symlink")
    os.setxattr(root / "a" / "big", "user.k", b"v" * 300)
    os.setxattr(root / "a" / "b", "user.dirattr", b"\0\1\2")
    (root / "renamed.tmp").write_bytes(b"renamed")
    os.rename(root / "renamed.tmp", root / "renamed")
    (root / "gone").write_bytes(b"gone")
    os.unlink(root / "gone")
    # Rewritten after its first seal: the new version must be what survives.
    (root / "a" / "rewritten").write_bytes(b"first version" * 1000)
    m.wait_state("a/rewritten", "local", timeout=10)
    (root / "a" / "rewritten").write_bytes(b"second")
    os.utime(root / "a" / "mode600", ns=(10**18, 1_500_000_000_123_456_789))
    os.utime(root / "a" / "owned", ns=(0, 0))
    os.utime(root / "a" / "b", ns=(0, 0))
    # Writes the kernel's caches could hide from a read-back: only a remount shows what
    # the daemon stored.
    (root / "w").mkdir()
    (root / "w" / "rdonly_trunc").write_bytes(b"will be emptied")
    (root / "w" / "append").write_bytes(b"head|")
    (root / "w" / "trunc_path").write_bytes(pattern(3 * MiB))
    (root / "w" / "rewritten_under_reader").write_bytes(pattern(2 * MiB, seed=5))
    m.wait_state("w/append", "local", timeout=10)
    m.wait_state("w/rewritten_under_reader", "local", timeout=10)
    os.close(os.open(root / "w" / "rdonly_trunc", os.O_RDONLY | os.O_TRUNC))
    w = os.open(root / "w" / "append", os.O_RDWR)
    a = os.open(root / "w" / "append", os.O_WRONLY | os.O_APPEND)
    os.pwrite(w, b"HEAD", 0)
    os.write(a, b"|tail")
    os.close(w)
    os.close(a)
    os.truncate(root / "w" / "trunc_path", MiB + 1)
    os.truncate(root / "w" / "trunc_path", 2 * MiB)
    r = os.open(root / "w" / "rewritten_under_reader", os.O_RDONLY)
    with open(root / "w" / "rewritten_under_reader", "r+b") as f:
        f.seek(MiB)
        f.write(b"new bytes")
    os.close(r)
    fd = os.open(root / "w" / "scattered", os.O_RDWR | os.O_CREAT, 0o644)
    for off in (7 * MiB, 0, 3 * MiB + 5, 100):
        os.pwrite(fd, b"@%d@" % off, off)
    os.ftruncate(fd, 5 * MiB)
    os.close(fd)
    before = _snapshot(root)
    assert len(before) >= 25
    m.stop()
    assert not os.path.ismount(root)
    m.start()
    after = _snapshot(root)
    assert sorted(after) == sorted(before)
    for rel in before:
        assert after[rel] == before[rel], rel
    assert (root / "a" / "big").read_bytes() == big
    assert (root / "a" / "rewritten").read_bytes() == b"second"
    assert (root / "w" / "rdonly_trunc").read_bytes() == b""
    assert (root / "w" / "append").read_bytes() == b"HEAD||tail"
    assert os.stat(root / "a" / "big").st_ino == os.stat(root / "a" / "b" / "big.hardlink").st_ino
    assert os.stat(root / "a" / "big").st_nlink == 2
    assert os.getxattr(root / "a" / "big", "user.mtcfs.blake3").decode() == \
        blake3.blake3(big).hexdigest()
    # Still fully writable after the restart.
    (root / "a" / "big").write_bytes(b"after")
    assert (root / "a" / "b" / "big.hardlink").read_bytes() == b"after"
    os.unlink(root / "a" / "b" / "big.hardlink")
    assert os.stat(root / "a" / "big").st_nlink == 1
    shutil.rmtree(root / "step_5")
    assert "step_5" not in os.listdir(root)



def test_mtcfs_enospc_at_size_limit(make_mount):
    """Past ``size=`` writes fail with ENOSPC. With the writeback cache the error may only
    show at fsync or close (as on NFS); the space comes back once the file is deleted."""
    m = make_mount(size="48M")
    st = os.statvfs(m.mnt)
    assert st.f_blocks * st.f_frsize == st.f_bfree * st.f_frsize == 48 * MiB
    p = m.path("too_big")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
    failed = 0
    try:
        for _ in range(8):
            write_all(fd, pattern(8 * MiB))
        os.fsync(fd)
    except OSError as exc:
        failed = exc.errno
    finally:
        try:
            os.close(fd)
        except OSError as exc:
            failed = failed or exc.errno
    assert failed == errno.ENOSPC
    assert m.status()["counters"]["enospc"] > 0
    os.unlink(p)
    m.wait_for(lambda: m.status()["ram"]["used"] == 0, timeout=10, what="space to be freed")
    data = pattern(40 * MiB)
    q = m.path("fits")
    q.write_bytes(data)
    assert uncached(q) == data


def test_mtcfs_zz_no_leaks(shared_mount):
    """Runs last on the shared mount: every test removed its files, so once the kernel
    has forgotten them all no byte of the RAM tier may still be counted."""
    assert os.listdir(shared_mount.mnt) == []
    shared_mount.wait_for(lambda: shared_mount.status()["ram"]["used"] == 0, timeout=15,
                          what="RAM tier usage to return to 0")
    st = os.statvfs(shared_mount.mnt)
    assert st.f_bfree == st.f_blocks


# ---------------------------------------------------------------------- rewrites (issue 18)

def test_a_file_laid_out_closed_and_rewritten_at_once_is_hashed_about_once(make_mount,
                                                                          monkeypatch):
    """fio's pattern through the mount: a file written and closed, reopened for writing at
    once while its seal hashes it (slowed by failpoint seal.chunk), rewritten whole in a
    random order of 1 MiB blocks, closed. The bytes and user.mtcfs.blake3 are the new
    ones, and the seals hashed less than the file twice: the reopen stops the first hash
    and keeps what it hashed (before, it waited for the whole hash, and every chunk was
    hashed again at the next seal: exactly twice the file)."""
    import random

    monkeypatch.setenv("MTCFS_FAILPOINTS", "seal.chunk=sleep(0.05)")
    m = make_mount("node")
    chunk = m.status()["chunk_size"]
    size = 8 * chunk
    old, new = os.urandom(size), os.urandom(size)
    p = m.path("laid-out")
    h0 = m.status()["counters"]["seal_bytes_hashed"]
    with open(p, "wb") as f:
        f.write(old)
    fd = os.open(p, os.O_RDWR)  # at once: the seal of that close is under way
    try:
        blocks = list(range(0, size, MiB))
        random.Random(18).shuffle(blocks)
        for off in blocks:
            assert os.pwrite(fd, new[off:off + MiB], off) == MiB
    finally:
        os.close(fd)
    wait_sealed(p)
    hashed = m.status()["counters"]["seal_bytes_hashed"] - h0
    assert size <= hashed <= 2 * size - chunk, hashed
    assert uncached(p) == new
    assert os.getxattr(p, "user.mtcfs.blake3").decode() == blake3.blake3(new).hexdigest()


def test_rewrite_of_one_byte_of_a_sealed_file_costs_the_chunks_written(shared_mount,
                                                                       fuse_path):
    """Reopen a sealed 256 MiB file (a dense head, the rest a hole) for writing, change one
    byte in two chunks, close, a reader holding it open throughout: the bytes are the old ones with those bytes changed,
    user.mtcfs.blake3 is the true blake3, the seal hashed the two chunks written (on the
    daemon's path; with passthrough the daemon does not see the writes and hashes the
    whole file again, docs/passthrough.md) and RAM grew by less than a chunk (a page
    written in the hole)."""
    m = shared_mount
    d = m.path("t-rewrite-one-byte")
    d.mkdir()
    p = d / "big"
    size, head = 256 * MiB, pattern(8 * MiB + 5)
    try:
        with open(p, "wb") as f:
            f.write(head)
            f.truncate(size)
        wait_sealed(p)
        st0 = m.status()
        chunk = st0["chunk_size"]
        reader = os.open(p, os.O_RDONLY)  # held open across the rewrite: nothing copied
        try:
            fd = os.open(p, os.O_RDWR)
            try:
                for off, b in [(3 * MiB + 1, b"\xaa"), (100 * MiB + 7, b"\x01")]:
                    assert os.pwrite(fd, b, off) == 1
            finally:
                os.close(fd)
            wait_sealed(p)
            assert os.pread(reader, 1, 3 * MiB + 1) == b"\xaa"  # one file, one content
        finally:
            os.close(reader)
        st1 = m.status()
        hashed = st1["counters"]["seal_bytes_hashed"] - st0["counters"]["seal_bytes_hashed"]
        # the two chunks written, not the other 62 (passthrough: every chunk again)
        assert hashed == (2 * chunk if fuse_path == "daemon" else size)
        assert st1["ram"]["used"] - st0["ram"]["used"] <= chunk  # the hole stays a hole
        expect = bytearray(head + bytes(size - len(head)))
        expect[3 * MiB + 1] = 0xAA
        expect[100 * MiB + 7] = 1
        assert uncached(p) == expect
        assert os.getxattr(p, "user.mtcfs.blake3").decode() == blake3.blake3(expect).hexdigest()
    finally:
        shutil.rmtree(d)
