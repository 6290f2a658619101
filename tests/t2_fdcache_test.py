"""The descriptor cache (mtcfs/core/store/fdcache.py) on real files: bounded, and a descriptor
a thread leased is never closed or reused under it while the loop evicts and drops."""

from __future__ import annotations

import os
import random
import threading
import time

from mtcfs.core.store.fdcache import FdCache

FILES = 200
LIMIT = 8


class V:
    """What the cache uses of a version: vid and fd."""

    def __init__(self, vid: int) -> None:
        self.vid, self.fd = vid, -1


def test_leases_survive_eviction_and_drop(tmp_path):
    def path(vid: int) -> str:
        return str(tmp_path / str(vid))

    def data(vid: int) -> bytes:
        return f"version {vid} ".encode() * 100

    for vid in range(FILES):
        with open(path(vid), "wb") as f:
            f.write(data(vid))
    fds = FdCache(lambda vid: os.open(path(vid), os.O_RDWR | os.O_CLOEXEC), LIMIT)
    vs = [V(i) for i in range(FILES)]
    base = len(os.listdir("/proc/self/fd"))
    errors: list[str] = []
    stop = time.monotonic() + 3.0

    def reader(seed: int) -> None:  # a worker thread: replication, fault-in, seal
        rnd = random.Random(seed)
        while time.monotonic() < stop:
            v = rnd.choice(vs)
            fd = fds.lease(v)
            try:
                time.sleep(0.0005)  # the loop evicts meanwhile
                got = os.pread(fd, 2000, 0)
            except OSError as exc:
                errors.append(f"{v.vid}: {exc}")
                continue
            finally:
                fds.unlease(v, fd)
            if got != data(v.vid):
                errors.append(f"{v.vid}: wrong bytes")

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    rnd = random.Random(0)
    loops = 0
    while time.monotonic() < stop:  # the loop: get (opens, evicts), drop (data going)
        v = rnd.choice(vs)
        if rnd.random() < 0.1:
            fds.drop(v)
        elif os.pread(fds.get(v), 2000, 0) != data(v.vid):
            errors.append(f"loop {v.vid}: wrong bytes")
        loops += 1
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert loops > 1000 and fds.evictions > 0
    # Bounded: at most LIMIT cached once no lease is out, and nothing leaked.
    assert len(fds) <= LIMIT
    assert len(os.listdir("/proc/self/fd")) - base <= LIMIT
    fds.close_all()
    assert len(fds) == 0 and all(v.fd == -1 for v in vs)
    assert len(os.listdir("/proc/self/fd")) <= base


def test_kept_descriptor_outlives_its_path_until_dropped(tmp_path):
    """A version a namespace install replaced keeps reading what it opened, even once its
    path names other data; evictions pass it by; drop closes it."""
    for vid in range(20):
        (tmp_path / str(vid)).write_bytes(f"old {vid}".encode())
    fds = FdCache(lambda vid: os.open(str(tmp_path / str(vid)), os.O_RDWR | os.O_CLOEXEC), 4)
    vs = [V(i) for i in range(20)]
    fds.keep(vs[0])
    os.replace(tmp_path / "1", tmp_path / "0")  # the path now names other data
    for v in vs[2:]:
        fds.get(v)
    assert vs[0].fd >= 0 and os.pread(vs[0].fd, 100, 0) == b"old 0"
    assert len(fds) == 4 + 1
    fds.unkeep(vs[0])
    for v in vs[2:7]:  # evicted meanwhile: opened again, evicting the oldest
        fds.get(v)
    assert vs[0].fd == -1 and len(fds) == 4  # evictable again
    kept = vs[3]
    fds.keep(kept)
    fd = fds.lease(kept)
    fds.drop(kept)
    assert kept.fd == -1 and os.pread(fd, 100, 0) == b"old 3"  # leased: still open
    fds.unlease(kept, fd)
    try:
        os.fstat(fd)
        closed = False
    except OSError:
        closed = True
    assert closed
    fds.close_all()
