"""The checkpoints component (core/checkpoints.py: pins, chunk readers, imports,
``mtcfs verify``) and the reclaim component (core/capacity.py: what eviction does to the
namespace) driven through the core in-process (no FUSE).

Each test ends with the consistency check (:func:`consistent`): no pin is left; the budget's
``used`` is what the registered versions' data files hold; every chunk held in RAM is found
by the chunk index and no chunk of a missing one is; the directory entries in memory are the
rows of ``dentries``, and every inode with a name has its row; every step is a directory
at the root.
"""

from __future__ import annotations

import errno
import os
import hashlib

import pytest
import trio
from support.corefs import CS, run, sealed, write_file

from mtcfs.base.errors import FsError
from mtcfs.core.core import Filesystem
from mtcfs.core.model import ROOT_INO, Inode


def consistent(fs: Filesystem) -> None:
    assert all(v.pins == 0 for v in fs.versions.values())
    assert fs.used == sum(v.alloc for v in fs.versions.values())
    for v in fs.versions.values():
        if v.sealed:
            for i, d in enumerate(v.chunks):
                if i not in v.missing:
                    assert fs.tier_api.has_local_chunk(d), (v.vid, i)
    held = {d for v in fs.versions.values() if v.sealed
            for i, d in enumerate(v.chunks) if i not in v.missing}
    for v in fs.versions.values():
        for i in v.missing:
            if v.chunks[i] not in held:
                assert not fs.tier_api.has_local_chunk(v.chunks[i])
    in_memory = {(ino.ino, name, child) for ino in fs.inodes.values() if ino.children
                 for name, child in ino.children.items()}
    rows = {(p, bytes(n), c) for p, n, c in fs.db.execute(
        "SELECT parent, name, ino FROM dentries")}
    assert rows == in_memory
    with_rows = {r[0] for r in fs.db.execute("SELECT ino FROM inodes")}
    assert {c for _p, _n, c in in_memory} <= with_rows
    root = fs.inodes[ROOT_INO].children
    assert root is not None
    for name, rec in fs.steps.items():
        assert root.get(name.encode()) == rec.ino and fs.inodes[rec.ino].is_dir


async def step(fs: Filesystem, name: bytes, files: dict[bytes, bytes]) -> Inode:
    """A DCP-style step ``name`` holding ``files`` and its marker ``.metadata``, sealed and
    committed: its directory."""
    d = await fs.mkdir(ROOT_INO, name, 0o755, 0, 0)
    for fname, data in files.items():
        await sealed(fs, await write_file(fs, d.ino, fname, data))
    await sealed(fs, await write_file(fs, d.ino, b".metadata", b"m" * 10))
    assert name.decode() in fs.steps
    return fs.inodes[d.ino]


def test_a_pinned_chunk_is_read_bit_exact_after_its_file_is_deleted_then_freed(tmp_path):
    async def body(fs: Filesystem) -> None:
        cp = fs.checkpoints
        data = bytes(range(256)) * (3 * CS // 256) + b"tail"
        ino = await write_file(fs, ROOT_INO, b"f", data)
        v = await sealed(fs, ino)
        assert cp.pin_chunk("0" * 64) is None  # a digest no file holds
        pinned = cp.pin_chunk(v.chunks[3])
        assert pinned is not None
        pv, off, length = pinned
        assert (pv, off, length) == (v, 3 * CS, 4) and v.pins == 1
        await fs.unlink(ROOT_INO, b"f")
        assert fs.tier_api.read_chunk_at(pv, off, length, v.chunks[3]) == b"tail"
        cp.unpin([pv])  # the last pin of a version no name holds: freed with it
        assert v.vid not in fs.versions and not fs.tier_api.has_local_chunk(v.chunks[0])
        consistent(fs)
    run(body, tmp_path)


def test_a_chunk_reader_refuses_a_chunk_not_in_ram_with_eio(tmp_path):
    async def body(fs: Filesystem) -> None:
        data = hashlib.sha256(b"a").digest() * (2 * CS // 32 + 1)
        await step(fs, b"step_1", {b"a": data})
        m, pinned = fs.step_registry.snapshot("step_1")
        read = fs.checkpoints.chunk_reader(pinned)
        first = m.entries[[e.path for e in m.entries].index("step_1/a")].chunks
        assert b"".join(read(d) for d in first) == data
        fs.checkpoints.unpin(pinned)
        fs.reclaim.drop_step_data(fs.steps["step_1"])  # its data leaves RAM, the step stays
        _m, pinned = fs.step_registry.snapshot("step_1")
        read = fs.checkpoints.chunk_reader(pinned)
        with pytest.raises(FsError) as e:
            read(first[0])
        assert e.value.errno == errno.EIO and "not in RAM" in str(e.value)
        fs.checkpoints.unpin(pinned)
        consistent(fs)
    run(body, tmp_path)


def test_drop_step_data_keeps_a_pinned_version_and_only_other_ranks_files(tmp_path):
    async def body(fs: Filesystem) -> None:
        d = await step(fs, b"step_2", {b"a": b"a" * (CS + 1), b"b": b"b" * (CS + 2)})
        a = fs.versions[fs.inodes[d.children[b"a"]].vid]  # type: ignore[index]
        b = fs.versions[fs.inodes[d.children[b"b"]].vid]  # type: ignore[index]
        rec = fs.steps["step_2"]
        fs.reclaim.drop_step_data(rec, others_only=True)  # all of them this rank's own
        assert not a.missing and not b.missing
        a.pins += 1  # a reader holds a
        fs.reclaim.drop_step_data(rec)
        assert not a.missing and b.missing == {0, 1} and b.alloc == 0
        assert fs.steps["step_2"] is rec and not fs.step_registry.in_ram(rec)
        fs.tier_api.unpin([a])
        consistent(fs)
    run(body, tmp_path)


def test_delete_dir_tree_removes_everything_below_tells_the_kernel_and_frees(tmp_path):
    async def body(fs: Filesystem) -> None:
        seen: list[tuple[str, object]] = []
        fs.subscribe(lambda ev, obj: seen.append((ev, obj)) if ev != "sealed" else None)
        top = await fs.mkdir(ROOT_INO, b"leftover", 0o755, 0, 0)  # never a step
        sub = await fs.mkdir(top.ino, b"sub", 0o755, 0, 0)
        f1 = await write_file(fs, sub.ino, b"f1", b"1" * (CS + 7))
        f2 = await write_file(fs, top.ino, b"f2", b"2" * 9)
        await sealed(fs, f1)
        await sealed(fs, f2)
        await fs.link(f2, sub.ino, b"f2-again")  # a second name, inside the same tree
        kept = await step(fs, b"step_3", {b"a": b"k" * 100})
        used_before = fs.used
        vids = {fs.inodes[n].vid for n in (f1, f2)}
        gone = {top.ino, sub.ino, f1, f2}
        fs.reclaim.delete_dir_tree(fs.inodes[top.ino])
        assert b"leftover" not in fs.inodes[ROOT_INO].children  # type: ignore[operator]
        assert ("invalidate_entry", (ROOT_INO, b"leftover", top.ino)) in seen
        for n in gone:  # no name, no data, no row; the number kept while the kernel knows it
            ino = fs.inodes[n]
            assert ino.nlink == 0 and ino.vid is None and ino.lookups >= 1
        assert not vids & set(fs.versions) and fs.used < used_before and "step_3" in fs.steps
        fs.forget([(n, fs.inodes[n].lookups) for n in gone])  # the kernel forgets: numbers go
        assert not gone & set(fs.inodes)
        assert fs.db.execute(f"SELECT COUNT(*) FROM inodes WHERE ino IN"
                             f" ({','.join(map(str, gone))})").fetchone()[0] == 0
        fs.reclaim.delete_step(fs.steps["step_3"])  # a step goes with its record
        assert "step_3" not in fs.steps and fs.inodes[kept.ino].nlink == 0
        assert ("step_removed", "step_3") in seen
        consistent(fs)
    run(body, tmp_path)


def test_deleting_a_step_keeps_a_hard_link_outside_it(tmp_path):
    """Eviction or keep= deletes a step whose file also has a name outside the step (``ln
    step_1/a keep``, the file's latest link): that name and its bytes stay. Before, the
    deletion unlinked each file by its latest link, so ``keep`` was removed, the file's
    data freed, and ``step_1/a`` left in a directory that was gone."""
    async def body(fs: Filesystem) -> None:
        d = await fs.mkdir(ROOT_INO, b"step_1", 0o755, 0, 0)
        f = await write_file(fs, d.ino, b"a", b"payload")
        await sealed(fs, f)
        fs.step_registry.seal("step_1")
        await fs.link(f, d.ino, b"b")  # a second name inside the step
        await fs.link(f, ROOT_INO, b"keep")  # the latest link: outside
        fs.reclaim.delete_step(fs.steps["step_1"])
        root = fs.inodes[ROOT_INO]
        assert sorted(root.children or {}) == [b"keep"]
        ino = fs.inodes[root.children[b"keep"]]  # type: ignore[index]
        assert (ino.nlink, ino.parent, ino.name) == (1, ROOT_INO, b"keep")
        fh, _ = await fs.open(ino.ino, os.O_RDONLY)
        assert await fs.read(fh, 0, 100) == b"payload"
        await fs.release(fh)
        consistent(fs)
    run(body, tmp_path)


def test_verify_finds_a_flipped_byte_and_the_chunk_is_never_served_again(tmp_path):
    async def body(fs: Filesystem) -> None:
        data = os.urandom(2 * CS)  # two chunks of different digests
        await step(fs, b"step_4", {b"a": data})
        v = fs.versions[fs.inodes[fs.tree.resolve("step_4/a").ino].vid]  # type: ignore[index]
        assert await fs.checkpoints.verify() == []
        fd = fs.fds.get(v)
        os.pwrite(fd, b"w", CS + 5)
        bad = await fs.checkpoints.verify()
        assert bad == [f"step_4/a: chunk 1 (bytes {CS}..{2 * CS}) does not match"
                       f" {v.chunks[1][:16]}"]
        assert 1 in v.missing  # known bad: a hole now, faulted in again if read
        _m, pinned = fs.step_registry.snapshot("step_4")
        with pytest.raises(FsError) as e:
            fs.tier_api.chunk_reader(pinned)(v.chunks[1])
        assert e.value.errno == errno.EIO
        fs.tier_api.unpin(pinned)
        consistent(fs)
    run(body, tmp_path)


class _BackupSource:
    """The backup tier as the fetcher's chunk source (as the daemon wires it)."""

    def __init__(self, store) -> None:
        self.store = store

    async def fetch(self, digest: str, tried=None) -> bytes:
        try:
            return self.store.get_chunk(digest)
        except Exception as exc:  # noqa: BLE001 (any miss is EIO to the read)
            raise FsError(errno.EIO, str(exc)) from None


class _Counting(_BackupSource):
    """The backup tier as a chunk source that counts its fetches (``fail``: every fetch
    fails, as with a bucket out of reach)."""

    def __init__(self, store, fail: bool = False) -> None:
        super().__init__(store)
        self.fetched: list[str] = []
        self.fail = fail

    async def fetch(self, digest: str, tried=None) -> bytes:
        self.fetched.append(digest)
        if self.fail:
            raise FsError(errno.EIO, "the backup tier is out of reach")
        return await super().fetch(digest, tried)


async def _backed_up_steps(fs: Filesystem, backup, first: bytes, *, sub: bool = False,
                           before_evict=None) -> None:
    """Steps 1-3, each a file ``x`` of 3 chunks (step_1's is ``first``; with ``sub``, in
    ``step_1/sub/x``) and a file ``y``, sealed, committed and backed up to ``backup``; then
    the keep=2 policy drops step_1's data from RAM (the backup holds it).
    ``before_evict(fs)`` runs just before that."""
    reg = fs.step_registry
    for n in (1, 2, 3):
        d = await fs.mkdir(ROOT_INO, b"step_%d" % n, 0o755, 0, 0)
        if sub and n == 1:
            d = await fs.mkdir(d.ino, b"sub", 0o755, 0, 0)
        content = first if n == 1 else os.urandom(3 * CS)
        await sealed(fs, await write_file(fs, d.ino, b"x", content))
        await sealed(fs, await write_file(fs, d.ino, b"y", os.urandom(CS)))
        reg.seal(f"step_{n}")
        m, pinned = reg.snapshot(f"step_{n}")
        backup.put_step(m, lambda h, vs=pinned: next(
            fs.vstore.read_verified(v, i * CS, CS, None) for v in vs
            for i, c in enumerate(v.chunks) if c == h))
        reg.mark_backed_up(f"step_{n}", pinned)
        fs.tier_api.unpin(pinned)
    if before_evict is not None:
        await before_evict(fs)
    assert fs.evict() == ["step_1"]  # keep=2: step_1's data leaves RAM


async def _read_path(fs: Filesystem, path: str) -> bytes:
    ino = fs.tree.resolve(path)
    fh, _ = await fs.open(ino.ino, os.O_RDONLY)
    try:
        return await fs.read(fh, 0, 1 << 20)
    finally:
        await fs.release(fh)


_TAKE_OUT = {
    # how the file leaves step_1 -> where it is read after step_1 is retired
    "rename": "kept.bin",  # mv step_1/x kept.bin
    "rename-into-dir": "keep/x",  # mv step_1/x keep/
    "rename-into-a-newer-step": "step_3/old_x",  # mv step_1/x step_3/old_x
    "link": "kept.bin",  # ln step_1/x kept.bin
    "link-before-eviction": "kept.bin",  # ln step_1/x kept.bin while step_1 is in RAM
    "rename-step": "best/x",  # mv step_1 best
    "rename-subdir": "keep/sub/x",  # mv step_1/sub keep/
}


@pytest.mark.parametrize("how", sorted(_TAKE_OUT))
def test_a_file_taken_out_of_an_evicted_step_keeps_its_bytes_when_the_step_is_retired(
        tmp_path, how):
    """keep= drops step_1's data from RAM (the backup holds it). The user then takes a file
    out of the checkpoint to keep it (moves or hard-links it, or its directory, or renames
    the step's directory): a metadata change, after which no checkpoint names the file.
    ``backup_keep=1`` then retires step_1 and sweeps the chunks no kept step names: the
    file must still read its bytes. Before, it read EIO: only the backup had its chunks
    (found by an adversarial review). Now the move fetches them first; a hard link made
    while the step is in RAM keeps the file's data there when the step is evicted."""
    from mtcfs.tiers.backup import BackupStore, FileBackend

    backup = BackupStore(FileBackend(tmp_path / "backup"))
    data = os.urandom(3 * CS)

    async def link_first(fs: Filesystem) -> None:
        await fs.link(fs.tree.resolve("step_1/x").ino, ROOT_INO, b"kept.bin")

    async def body(fs: Filesystem) -> None:
        fs.fetcher.chunk_source = _BackupSource(backup)
        await _backed_up_steps(fs, backup, data, sub=how == "rename-subdir",
                               before_evict=link_first if how == "link-before-eviction" else None)
        s1 = fs.inodes[fs.steps["step_1"].ino]
        x = fs.tree.resolve("step_1/sub/x" if how == "rename-subdir" else "step_1/x")
        if how == "rename":
            await fs.rename(s1.ino, b"x", ROOT_INO, b"kept.bin", 0)
        elif how == "rename-into-dir":
            keep = await fs.mkdir(ROOT_INO, b"keep", 0o755, 0, 0)
            await fs.rename(s1.ino, b"x", keep.ino, b"x", 0)
        elif how == "rename-into-a-newer-step":
            await fs.rename(s1.ino, b"x", fs.steps["step_3"].ino, b"old_x", 0)
        elif how == "link":
            await fs.link(x.ino, ROOT_INO, b"kept.bin")
        elif how == "rename-step":
            await fs.rename(ROOT_INO, b"step_1", ROOT_INO, b"best", 0)
        elif how == "rename-subdir":
            keep = await fs.mkdir(ROOT_INO, b"keep", 0o755, 0, 0)
            await fs.rename(s1.ino, b"sub", keep.ino, b"sub", 0)
        assert not fs.versions[x.vid].missing  # type: ignore[index]
        backup.retain(1, grace_s=0)  # what `mtcfs gc` does with backup_keep=1
        fs.step_registry.retired({s.step for s in backup.list_steps()})
        assert await _read_path(fs, _TAKE_OUT[how]) == data
        consistent(fs)

    run(body, tmp_path)


def test_a_file_moved_inside_its_evicted_step_is_not_fetched(tmp_path):
    """A rename inside the step (the step still names the file, the backup keeps its
    chunks while it keeps the step) fetches nothing: the data stays out of RAM."""
    from mtcfs.tiers.backup import BackupStore, FileBackend

    backup = BackupStore(FileBackend(tmp_path / "backup"))

    async def body(fs: Filesystem) -> None:
        src = fs.fetcher.chunk_source = _Counting(backup)
        await _backed_up_steps(fs, backup, os.urandom(3 * CS))
        s1 = fs.inodes[fs.steps["step_1"].ino]
        sub = await fs.mkdir(s1.ino, b"sub", 0o755, 0, 0)
        await fs.rename(s1.ino, b"x", sub.ino, b"y", 0)
        assert src.fetched == []
        assert fs.versions[fs.tree.resolve("step_1/sub/y").vid].missing == {0, 1, 2}  # type: ignore[index]
        consistent(fs)

    run(body, tmp_path)


@pytest.mark.parametrize("how", ["rename", "link", "rename-step"])
def test_taking_a_file_out_of_an_evicted_step_fails_whole_when_its_chunks_cannot_be_fetched(
        tmp_path, how):
    """With the backup out of reach, taking the file out of the step fails with EIO (the
    error the read would get) within the fault-in deadline, and nothing moved: the file
    is still in the step, under its name."""
    from mtcfs.tiers.backup import BackupStore, FileBackend

    backup = BackupStore(FileBackend(tmp_path / "backup"))

    async def body(fs: Filesystem) -> None:
        src = fs.fetcher.chunk_source = _Counting(backup)
        await _backed_up_steps(fs, backup, os.urandom(3 * CS))
        src.fail = True
        fs.fetcher.fetch_deadline_s = 0.5
        s1 = fs.inodes[fs.steps["step_1"].ino]
        x = fs.tree.resolve("step_1/x")
        with pytest.raises(FsError) as e:
            if how == "rename":
                await fs.rename(s1.ino, b"x", ROOT_INO, b"kept.bin", 0)
            elif how == "link":
                await fs.link(x.ino, ROOT_INO, b"kept.bin")
            else:
                await fs.rename(ROOT_INO, b"step_1", ROOT_INO, b"best", 0)
        assert e.value.errno == errno.EIO and src.fetched
        assert sorted(fs.inodes[ROOT_INO].children or {}) == [b"step_1", b"step_2", b"step_3"]
        assert fs.tree.resolve("step_1/x") is x and x.nlink == 1 and "step_1" in fs.steps
        consistent(fs)

    run(body, tmp_path)


@pytest.mark.parametrize("how", ["rename", "link"])
def test_scope_job_a_file_another_node_takes_out_of_an_evicted_step_is_fetched_by_its_owner(
        tmp_path, how):
    """scope=job: rank 0's file ``step_1/x`` is backed up and its data dropped from rank 0's
    RAM. Rank 1 moves (or links) it out of the step. Rank 1 does not fetch it (not its
    file); rank 0, applying the op from the job's log, fetches it back in the background,
    so the step's retirement leaves its bytes in RAM. Before, it stayed missing on rank 0."""
    from support.jobcore import published_on, read_all, run_job, write_sealed

    from mtcfs.tiers.backup import BackupStore, FileBackend

    backup = BackupStore(FileBackend(tmp_path / "backup"))
    data = os.urandom(3 * CS)

    async def body(cores, _job) -> None:
        fs0, fs1 = cores
        fs0.fetcher.chunk_source = _BackupSource(backup)
        d = await fs0.mkdir(ROOT_INO, b"step_1", 0o755, 0, 0)
        x = await write_sealed(fs0, d.ino, b"x", data)
        await published_on(fs1, x, len(data))
        rec = fs0.step_registry.seal("step_1")
        m, pinned = fs0.step_registry.snapshot("step_1")
        backup.put_step(m, lambda h, vs=pinned: next(
            fs0.vstore.read_verified(v, i * CS, CS, None) for v in vs
            for i, c in enumerate(v.chunks) if c == h))
        fs0.step_registry.mark_backed_up("step_1", pinned)
        fs0.tier_api.unpin(pinned)
        fs0.reclaim.drop_step_data(rec)
        v0 = fs0.versions[fs0.inodes[x].vid]
        assert v0.missing == {0, 1, 2}
        if how == "rename":
            await fs1.rename(d.ino, b"x", ROOT_INO, b"kept.bin", 0)
        else:
            await fs1.link(x, ROOT_INO, b"kept.bin")
        with trio.fail_after(10):
            while v0.missing:
                await trio.sleep(0.01)
        assert v0.pins == 0
        assert await read_all(fs0, fs0.tree.resolve("kept.bin").ino) == data

    run_job(tmp_path, body)
