"""kill -9 during eviction (issue 39, item 9): a committed, backed-up step whose data leaves
RAM must never come back with chunks the metadata lists as present whose bytes are gone.

Eviction drops a step's data (core/capacity.py ``drop_step_data``, core/versions.py
``drop_data``): its chunks become missing in the versions' rows, and its data files lose
their bytes. The rows must say "missing" before the bytes go: the daemon here SIGKILLs
itself at a failpoint (mtcfs/base/failpoints.py, ``NAME=kill``) either just before the
eviction's transaction commits, or after the commit with only the first file's bytes
dropped. Mounted again, ``mtcfs verify`` exits 0 and every file reads back bit-exact (from
RAM, or faulted back in from the backup). Before the fix the data files were truncated
inside the transaction: the kill rolled the rows back to "present" over zeros, and verify
said ``MISMATCH step_1/__0_0.distcp: chunk 0 ...``.
"""

from __future__ import annotations

import os
import random

import pytest

MiB = 1 << 20


def _write_step(m, name: str, rng: random.Random) -> dict[str, bytes]:
    """A DCP-like step: two shards of a few 256 KiB chunks, then ``.metadata`` (commits it)."""
    files = {f"__{i}_0.distcp": rng.randbytes(MiB + rng.randint(1, 4097)) for i in range(2)}
    files[".metadata"] = rng.randbytes(3000)
    os.mkdir(m.path(name))
    for fname, data in files.items():
        m.path(name, fname).write_bytes(data)
    return files


@pytest.mark.parametrize("point", ["core.evict_in_transaction", "core.evict_after_commit"])
def test_kill9_during_eviction_keeps_every_chunk_matching_its_hash(make_mount, tmp_path,
                                                                   monkeypatch, point):
    monkeypatch.setenv("MTCFS_FAILPOINTS", f"{point}=kill")
    m = make_mount("node", backup=f"file://{tmp_path}/backup", backup_interval="1ckpt",
                   chunk_size="256K", keep=1)
    rng = random.Random(39)
    steps = {"step_1": _write_step(m, "step_1", rng)}
    m.wait_state("step_1", "backed-up", timeout=60)
    pid = m.pid
    # step_2's backup completes, then keep=1 evicts step_1: the daemon kills itself there.
    steps["step_2"] = _write_step(m, "step_2", rng)

    def dead() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    m.wait_for(dead, 60, f"the daemon to die at failpoint {point}")
    m.kill9()  # (clears the dead mount)
    monkeypatch.delenv("MTCFS_FAILPOINTS")
    m.start()

    r = m.cli("verify", str(m.mnt), check=False)
    assert (r.returncode, r.stdout.strip()) == (0, "all chunks match their hashes"), \
        r.stdout + r.stderr
    for step, files in steps.items():
        for fname, data in files.items():
            assert m.path(step, fname).read_bytes() == data, f"{step}/{fname}"
    r = m.cli("verify", str(m.mnt), check=False)  # and after the reads faulted chunks in
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_store_whose_held_chunks_lost_their_bytes_is_repaired_at_mount(make_mount, tmp_path):
    """The state an older mtcfs left after such a kill (or a damaged disk): the rows list
    every chunk as held, the data files are holes of the right size. The store check at
    mount makes those chunks missing (logged), so verify exits 0 and the reads fetch them
    from the backup, bit-exact (before: verify exited 1, ``MISMATCH ...``)."""
    m = make_mount("node", backup=f"file://{tmp_path}/backup", backup_interval="1ckpt",
                   chunk_size="256K")
    files = _write_step(m, "step_1", random.Random(9))
    m.wait_state("step_1", "backed-up", timeout=60)
    m.stop()
    data_files = list((m.store / "data").iterdir())
    assert len(data_files) == len(files)
    for p in data_files:
        size = p.stat().st_size
        os.truncate(p, 0)
        os.truncate(p, size)

    m.start()
    r = m.cli("verify", str(m.mnt), check=False)
    assert (r.returncode, r.stdout.strip()) == (0, "all chunks match their hashes"), \
        r.stdout + r.stderr
    assert "store check: version" in m.log()
    for fname, data in files.items():
        assert m.path("step_1", fname).read_bytes() == data, fname
