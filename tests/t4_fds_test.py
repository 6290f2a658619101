"""The number of files is limited by ``size=``, not by the daemon's descriptor limit.

The daemon opens data files when it needs them and keeps a bounded LRU of descriptors
(mtcfs/core/store/fdcache.py); before, it kept one descriptor per closed file version and hit
EMFILE at RLIMIT_NOFILE files (issue 12). The daemon here runs with RLIMIT_NOFILE=256.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading

import blake3

NOFILE = 256
FILES = 3000


@contextlib.contextmanager
def nofile(limit: int):
    """RLIMIT_NOFILE of this process (and so of the daemon it starts) lowered meanwhile."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def start_limited(m):
    with nofile(NOFILE):
        return m.start()


def daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def content(i: int) -> bytes:
    return f"file {i}\n".encode() * (1 + i % 50)


def test_thousands_of_files_under_a_low_fd_limit(make_mount):
    m = make_mount(start=False, size="1G")
    start_limited(m)
    limit = resource.prlimit(m.pid, resource.RLIMIT_NOFILE)[0]
    assert limit == NOFILE
    step = m.path("step_1")
    os.mkdir(step)
    for i in range(FILES):
        (step / f"f{i:05d}").write_bytes(content(i))
    assert sorted(os.listdir(step)) == [f"f{i:05d}" for i in range(FILES)]
    m.cli("seal", str(step))
    assert m.state("step_1") == "local"
    for i in range(FILES):
        assert (step / f"f{i:05d}").read_bytes() == content(i)
    sample = [0, 1, FILES // 2, FILES - 1]
    for i in sample:
        assert os.getxattr(step / f"f{i:05d}", "user.mtcfs.blake3").decode() == \
            blake3.blake3(content(i)).hexdigest()
    assert daemon_fds(m.pid) < NOFILE
    st = m.status()
    assert st["ram"]["files"] >= FILES
    assert st["fds"]["limit"] == NOFILE // 4 and st["fds"]["open"] <= st["fds"]["limit"]
    assert st["fds"]["evictions"] > 0

    # Readers in several threads over more files than the descriptor cache holds.
    errors: list[str] = []

    def reader(k: int) -> None:
        for i in range(k, FILES, 7):
            if (step / f"f{i:05d}").read_bytes() != content(i):
                errors.append(f"f{i:05d}")

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []

    # Remount: every file is still there and bit-exact; a new version of one file too.
    m.stop()
    start_limited(m)
    assert sorted(os.listdir(step)) == [f"f{i:05d}" for i in range(FILES)]
    for i in range(FILES):
        assert (step / f"f{i:05d}").read_bytes() == content(i)
    with open(step / "f00007", "r+b") as f:
        f.write(b"X")
    assert (step / "f00007").read_bytes() == b"X" + content(7)[1:]
    assert daemon_fds(m.pid) < NOFILE


def test_backup_and_restore_of_thousands_of_files_under_a_low_fd_limit(make_mount, tmp_path):
    """The backup reads every file of the step through worker threads (chunk_reader), the
    restore creates them all with no data (import_step) and faults them in (prefetch and
    reads): none of it may need a descriptor per file."""
    from support.mount import remove_tree

    n = 2000
    m = make_mount(start=False, backup=f"file://{tmp_path}/backup", backup_interval="1ckpt")
    start_limited(m)
    step = m.path("step_1")
    os.mkdir(step)
    for i in range(n):
        (step / f"f{i:05d}").write_bytes(content(i))
    m.cli("seal", str(step))
    m.wait_state("step_1", "backed-up", timeout=120)
    assert daemon_fds(m.pid) < NOFILE

    m.stop()  # the node is lost: the RAM tier comes back from the backup
    remove_tree(m.store)  # its data tmpfs too (it outlives the daemon)
    start_limited(m)
    assert sorted(os.listdir(step)) == [f"f{i:05d}" for i in range(n)]
    for i in range(0, n, 3):  # reads fault in while the prefetcher restores the rest
        assert (step / f"f{i:05d}").read_bytes() == content(i)

    def restored():
        st = m.status()
        return st if st["restore"]["pending_chunks"] == 0 else None
    st = m.wait_for(restored, 120, "restore prefetch to finish")
    assert st["restore"]["corrupt_chunks"] == 0 and st["errors"] == []
    for i in range(n):
        assert (step / f"f{i:05d}").read_bytes() == content(i)
    assert m.state("step_1") == "backed-up"
    assert daemon_fds(m.pid) < NOFILE
    assert st["fds"]["open"] <= st["fds"]["limit"]
