"""The step registry (core/step_registry.py) driven through the core in-process (no FUSE):
commits by marker, rename and ``mtcfs seal``; forgetting; the backup state (marked,
changed, retired, pending); imports; what survives a restart.

Each test ends with the consistency check (:func:`consistent`): a registry loaded again from
the same store holds the same records, field by field, as the rows of the ``steps`` table;
every record is the root's entry of its name and a directory; every step's file versions
are registered in the version store; a step counted as backed up has all of its own
versions backed up.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import trio
from support.corefs import CS, open_fs, run, sealed, write_file

from mtcfs.base.errors import FsError
from mtcfs.core.core import Filesystem
from mtcfs.core.model import ROOT_INO
from mtcfs.core.records import StepRecord
from mtcfs.core.step_registry import StepRegistry


def fields(r: StepRecord) -> tuple[Any, ...]:
    """What a record's row holds."""
    return (r.name, r.number, r.ino, r.committed_ns, r.backed_up_ns, r.source)


def consistent(fs: Filesystem) -> None:
    again = StepRegistry(fs.db, fs.tree, fs.vstore, fs, job=fs.job, rank=fs.rank,
                         delete_step=fs.reclaim.delete_step)
    again.load()
    assert {n: fields(r) for n, r in again.records.items()} == \
        {n: fields(r) for n, r in fs.steps.items()}
    rows = {row[0]: tuple(row) for row in fs.db.execute(
        "SELECT name, number, ino, committed_ns, backed_up_ns, source FROM steps")}
    assert rows == {n: fields(r) for n, r in fs.steps.items()}
    root = fs.inodes[ROOT_INO].children
    assert root is not None
    for name, rec in fs.steps.items():
        assert rec.name == name
        assert root.get(name.encode(errors="surrogateescape")) == rec.ino
        assert fs.inodes[rec.ino].is_dir
        versions = fs.step_registry.versions_of(rec)
        for v in versions:
            assert fs.vstore.versions.get(v.vid) is v
        if rec.backed_up_ns is not None:
            assert all(v.backed_up for v in versions if v.origin < 0), name


def events(fs: Filesystem) -> list[tuple[str, Any]]:
    seen: list[tuple[str, Any]] = []
    fs.subscribe(lambda ev, obj: seen.append((ev, obj)) if ev != "sealed" else None)
    return seen


async def dcp_step(fs: Filesystem, name: bytes, data: bytes = b"x" * (2 * CS + 5)) -> int:
    """A DCP-style step: a shard, then .metadata; both sealed. Its directory's inode."""
    d = await fs.mkdir(ROOT_INO, name, 0o755, 0, 0)
    await sealed(fs, await write_file(fs, d.ino, b"__0_0.distcp", data))
    await sealed(fs, await write_file(fs, d.ino, b".metadata", b"m" * 100))
    return d.ino


def test_a_marker_commits_once_and_a_save_into_the_same_directory_commits_again(tmp_path):
    async def body(fs: Filesystem) -> None:
        seen = events(fs)
        d = await fs.mkdir(ROOT_INO, b"step_10", 0o755, 0, 0)
        await sealed(fs, await write_file(fs, d.ino, b"__0_0.distcp", b"a" * 1000))
        assert "step_10" not in fs.steps  # no marker: not complete
        meta = await write_file(fs, d.ino, b".metadata", b"m")
        await sealed(fs, meta)
        rec = fs.steps["step_10"]
        assert (rec.number, rec.ino, rec.source) == (10, d.ino, ".metadata")
        assert [e for e, _o in seen] == ["committed"]
        first = rec.committed_ns
        await trio.sleep(0.02)  # the commit time is the coarse clock's (a few ms a tick)
        await write_file(fs, d.ino, b".metadata", b"n")  # DCP saves into it again
        await sealed(fs, meta)
        assert fs.steps["step_10"] is rec and rec.committed_ns > first
        assert [e for e, _o in seen].count("committed") == 2
        assert fs.step_registry.of(fs.inodes[meta]) is rec
        assert fs.step_registry.of(fs.inodes[ROOT_INO]) is None
        consistent(fs)
    run(body, tmp_path)


def test_mtcfs_seal_takes_any_top_level_directory_and_refuses_the_rest(tmp_path):
    async def body(fs: Filesystem) -> None:
        d = await fs.mkdir(ROOT_INO, b"final-model", 0o755, 0, 0)
        sub = await fs.mkdir(d.ino, b"sub", 0o755, 0, 0)
        f = await write_file(fs, ROOT_INO, b"notes.txt", b"hi")
        await sealed(fs, f)
        for path, code in (("nothing", errno.ENOENT), ("notes.txt", errno.ENOTDIR),
                           ("final-model/sub", errno.EINVAL)):
            with pytest.raises(FsError) as e:
                fs.step_registry.seal(path)
            assert e.value.errno == code, path
        rec = fs.step_registry.seal("final-model")
        assert (rec.name, rec.number, rec.ino, rec.source) == \
            ("final-model", 0, d.ino, "mtcfs seal")
        at = rec.committed_ns
        assert fs.step_registry.seal("final-model") is rec and rec.committed_ns == at
        assert sub.ino not in {r.ino for r in fs.steps.values()}
        consistent(fs)
    run(body, tmp_path)


def test_an_orbax_rename_commits_and_moving_or_removing_the_directory_forgets(tmp_path):
    async def body(fs: Filesystem) -> None:
        seen = events(fs)
        tmp = await fs.mkdir(ROOT_INO, b"5.orbax-checkpoint-tmp-17", 0o755, 0, 0)
        f = await write_file(fs, tmp.ino, b"params", b"p" * 500)
        await sealed(fs, f)
        assert not fs.steps
        await fs.rename(ROOT_INO, b"5.orbax-checkpoint-tmp-17", ROOT_INO, b"5")
        rec = fs.steps["5"]
        assert (rec.number, rec.ino, rec.source) == (5, tmp.ino, "orbax-rename")
        consistent(fs)
        await fs.rename(ROOT_INO, b"5", ROOT_INO, b"old-5")  # no longer a step
        assert "5" not in fs.steps and ("step_removed", "5") in seen
        consistent(fs)
        await dcp_step(fs, b"step_6")
        fs.reclaim.delete_step(fs.steps["step_6"])  # an rmdir of every name below, then of it
        assert "step_6" not in fs.steps and ("step_removed", "step_6") in seen
        consistent(fs)
    run(body, tmp_path)


def test_backup_state_follows_marks_changes_and_retirement(tmp_path):
    async def body(fs: Filesystem) -> None:
        reg = fs.step_registry
        await dcp_step(fs, b"step_1")
        await dcp_step(fs, b"step_2")
        for name in ("step_1", "step_2"):
            _m, pinned = reg.snapshot(name)
            reg.mark_backed_up(name, pinned)
            fs.tier_api.unpin(pinned)
        r1 = fs.steps["step_1"]
        assert r1.backed_up_ns is not None
        assert all(v.backed_up for v in reg.versions_of(r1))
        consistent(fs)
        # A file of step_1 is rewritten: its backup copy no longer matches.
        gen = r1.generation
        r1.replicated = 2
        d = fs.inodes[r1.ino]
        shard = await write_file(fs, d.ino, b"__0_0.distcp", b"y" * 300)
        await sealed(fs, shard)
        assert r1.backed_up_ns is None and r1.generation > gen and r1.replicated == 0
        consistent(fs)
        _m, pinned = reg.snapshot("step_1")
        reg.mark_backed_up("step_1", pinned)
        fs.tier_api.unpin(pinned)
        # The backup tier keeps only step_2: step_1 (in RAM) stays, no longer backed up.
        assert reg.retired({"step_2"}) == []
        assert r1.backed_up_ns is None
        assert not any(v.backed_up for v in reg.versions_of(r1))
        assert fs.steps["step_2"].backed_up_ns is not None
        consistent(fs)
        # step_2's data left RAM; once the backup tier drops it too, it is deleted.
        fs.reclaim.drop_step_data(fs.steps["step_2"])
        assert not reg.in_ram(fs.steps["step_2"])
        assert reg.retired(set()) == ["step_2"]
        assert "step_2" not in fs.steps and b"step_2" not in fs.inodes[ROOT_INO].children
        consistent(fs)
    run(body, tmp_path)


def test_snapshot_refuses_an_unknown_or_unsealed_step_and_pins_the_rest(tmp_path):
    async def body(fs: Filesystem) -> None:
        reg = fs.step_registry
        with pytest.raises(FsError) as e:
            reg.snapshot("step_3")
        assert e.value.errno == errno.ENOENT
        ino = await dcp_step(fs, b"step_3")
        fh, _attr = await fs.create(ino, b"late", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
        assert not reg.sealed(fs.steps["step_3"])
        with pytest.raises(FsError) as e:
            reg.snapshot("step_3")
        assert e.value.errno == errno.EAGAIN
        await fs.release(fh)
        with trio.fail_after(10):
            while not reg.sealed(fs.steps["step_3"]):
                await trio.sleep(0.01)
        m, pinned = reg.snapshot("step_3")
        assert (m.job, m.step, m.step_number, m.rank) == ("job", "step_3", 3, 0)
        assert sorted(e.path for e in m.entries) == \
            ["step_3", "step_3/.metadata", "step_3/__0_0.distcp", "step_3/late"]
        assert all(v.pins == 1 for v in pinned) and len(pinned) == 3
        fs.tier_api.unpin(pinned)
        assert all(v.pins == 0 for v in pinned)
        consistent(fs)
    run(body, tmp_path)


def test_an_imported_step_is_recorded_backed_up_with_its_data_missing(tmp_path):
    async def body(fs: Filesystem) -> None:
        reg = fs.step_registry
        await dcp_step(fs, b"step_4")
        m, pinned = reg.snapshot("step_4")
        fs.tier_api.unpin(pinned)
        fs.reclaim.delete_step(fs.steps["step_4"])
        rec = fs.tier_api.import_step(m)
        assert fs.steps["step_4"] is rec
        assert (rec.number, rec.source) == (4, "restore") and rec.backed_up_ns is not None
        assert not reg.in_ram(rec) and reg.sealed(rec)
        assert [v.size for v in reg.versions_of(rec)] == [100, 2 * CS + 5]
        with pytest.raises(FsError) as e:
            fs.tier_api.import_step(m)
        assert e.value.errno == errno.EEXIST
        consistent(fs)
    run(body, tmp_path)


def test_records_pending_backups_and_lost_rows_after_a_restart(tmp_path):
    saved: dict[str, tuple[Any, ...]] = {}

    async def first(fs: Filesystem) -> None:
        await dcp_step(fs, b"step_7")
        await dcp_step(fs, b"step_8")
        fs.step_registry.set_backup_pending("step_8")
        # a row whose directory is gone (a crash between the two), and a commit never
        # recorded (a crash between the marker's seal and the commit)
        fs.db.execute("INSERT INTO steps(name, number, ino, committed_ns, backed_up_ns, source)"
                      " VALUES ('step_9', 9, 999, 1, NULL, '.metadata')")
        fs.db.execute("DELETE FROM steps WHERE name='step_7'")
        saved.update({n: fields(r) for n, r in fs.steps.items() if n == "step_8"})

    async def second(fs: Filesystem) -> None:
        assert set(fs.steps) == {"step_7", "step_8"}
        assert fields(fs.steps["step_8"]) == saved["step_8"]
        assert fs.steps["step_7"].source == ".metadata"
        assert fs.step_registry.backup_pending() == "step_8"
        fs.step_registry.set_backup_pending(None)
        assert fs.step_registry.backup_pending() is None
        consistent(fs)
    run(first, tmp_path)
    run(second, tmp_path)
    fs = open_fs(Path(tmp_path) / "store")
    try:
        assert fs.tier_api.backup_pending() is None and set(fs.steps) == {"step_7", "step_8"}
        consistent(fs)
    finally:
        fs.close()
        fs.store.close()


def test_sealing_a_directory_whose_name_is_not_utf8_is_refused_and_records_nothing(tmp_path):
    """``mtcfs seal`` of a directory named with bytes that are not UTF-8: EINVAL, nothing
    recorded, and the directory is removed as any other later. Before, a record went into
    memory and its SQLite write raised UnicodeEncodeError; the later rmdir failed on the
    same encoding with the tree already changed in memory."""
    async def body(fs) -> None:
        await fs.mkdir(ROOT_INO, b"run\xff", 0o755, 0, 0)
        with pytest.raises(FsError) as exc:
            fs.step_registry.seal("run\udcff")
        assert exc.value.errno == errno.EINVAL
        assert fs.steps == {}
        await fs.rmdir(ROOT_INO, b"run\xff")
        assert fs.inodes[ROOT_INO].children == {}

    run(body, tmp_path)


def test_scope_job_a_step_committed_at_close_is_announced_again_when_its_writer_leaves(
        tmp_path):
    """scope=job seals and publishes a file at close(2), before its RELEASE: the step its
    marker commits is not yet sealed for the tiers (a writer still holds the marker), so
    the replication that woke on 'committed' finds it not ready. The RELEASE of that last
    writer must wake the tiers again ('closed'); before, replication waited for its next
    2-second poll, and a step written on the node that wrote the marker reached its peer
    2 s late in every save (benchmarks/bench_scale.py, "replicated everywhere")."""
    from support.jobcore import run_job, write_sealed

    async def body(cores, _job):
        fs = cores[0]
        seen: list[tuple[str, Any]] = []
        fs.subscribe(lambda ev, obj: seen.append((ev, obj)))
        d = await fs.mkdir(ROOT_INO, b"step_1", 0o755, 0, 0)
        await write_sealed(fs, d.ino, b"shard.bin", os.urandom(3 * CS))
        fh, attr = await fs.create(d.ino, b"commit_success.txt", 0o644,
                                   os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0, 0)
        await fs.write(fh, 0, b"ok")
        await fs.flush(fh)  # close(2): sealed, published, the step committed
        with trio.fail_after(10):
            while "step_1" not in fs.steps:
                await trio.sleep(0.01)
        rec = fs.steps["step_1"]
        assert ("committed", rec) in seen
        assert not fs.tier_api.step_sealed(rec)  # the marker's writer is still there
        seen.clear()
        await fs.release(fh)
        assert fs.tier_api.step_sealed(rec)
        closed = [obj for ev, obj in seen if ev == "closed"]
        assert [v.vid for v in closed] == [fs.inodes[attr.ino].vid], seen

    run_job(tmp_path, body)
