"""A store filesystem that another process fills: a tmpfs of its own under a node's store,
and a filler file (on a training host /dev/shm is shared with data loaders and NCCL)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

MiB = 1 << 20
#: scope=job, the options of the full-store tests
JOB = {"scope": "job", "replicas": 1, "chunk_size": "1M"}


def fill(path: Path, leave: int = 0) -> None:
    """Fill the filesystem of ``path`` with that file (appended to), leaving about
    ``leave`` bytes; a filesystem that says ENOSPC first is full."""
    st = os.statvfs(path.parent)
    room = st.f_bavail * st.f_frsize - leave
    blk = b"\xee" * MiB
    with open(path, "ab", buffering=0) as f:
        try:
            while room > 0:
                room -= f.write(blk[:min(room, MiB)])
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


@contextlib.contextmanager
def job_with_small_store(make_cluster: Any, full: int = 1) -> Iterator[tuple[Any, Path]]:
    """A started two-node scope=job cluster whose rank ``full`` has its store on a 24 MiB
    tmpfs (``size=20M``, ``coord_timeout=4s``); yields (cluster, that store). Skips
    unless root; unmounts everything at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    c = make_cluster(2, options=JOB, start=False,
                     per_rank_options={full: {"coord_timeout": "4s", "size": "20M"}})
    store = c.node(full).store
    store.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(store)],
                   check=True)
    try:
        c.start()
        yield c, store
    finally:
        c.cleanup()
        subprocess.run(["umount", "-l", str(store)], check=False)


def seed_then_fill(c: Any, store: Path, files: dict[str, bytes], leave: int = 0) -> Path:
    """Rank 0 writes ``step_1/<name>`` for each of ``files`` (in order); once rank 1 sees
    the last one, fill ``store``'s filesystem, leaving about ``leave`` bytes. Returns the
    filler's path (unlink it to give the room back)."""
    n0, n1 = c.node(0), c.node(1)
    n0.path("step_1").mkdir()
    for name, data in files.items():
        n0.path("step_1", name).write_bytes(data)
    last = n1.path("step_1", list(files)[-1])
    n1.wait_for(lambda: os.path.exists(last), 30, f"{last} on rank 1")
    filler = store / "filler.bin"
    fill(filler, leave)
    return filler
