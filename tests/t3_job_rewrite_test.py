"""Rewrites of sealed files at chunk granularity in scope=job (issue 18): reopening a
published file for writing and changing a few bytes costs work and RAM in proportion to
the chunks changed, as in scope=node (t3_rewrite_test.py), and the job still names each
publication exactly, so that a publication tried again never replaces a newer one.

In-process cores sharing one namespace log in memory (tests/support/jobcore.py, chunks of
CS = 64 KiB); the real mounts on etcd are in t7_job_namespace_test.py."""

import dataclasses
import errno
import os

import blake3
import trio

from mtcfs.base.chunking import chunk_hash
from mtcfs.base.errors import FsError
from mtcfs.base.ns_ops import Publish
from mtcfs.core import jobns
from mtcfs.core.jobns import publication_id
from mtcfs.core.model import ROOT_INO
from support.corefs import CS, ChunksOf, sealed
from support.jobcore import NodeLog, published_on, read_all, run_job, write_sealed


def _chunks(data: bytes) -> list[str]:
    return [chunk_hash(data[i:i + CS]) for i in range(0, len(data), CS)]


async def _published(a, b, name: bytes, data: bytes) -> int:
    """Write ``data`` as ``name`` at the root on node ``a``, sealed, and wait until node
    ``b`` holds it as the job's version; its inode number."""
    ino = await write_sealed(a, ROOT_INO, name, data)
    await published_on(b, ino, len(data))
    return ino


def _pinned_by_a_fetch(fs, ino: int, data: bytes):
    """A peer's fetch of chunk 3 of ``data`` from ``fs``, where file ``ino`` holds it: the
    fetch pins ``ino``'s current version, which is returned (the caller unpins it)."""
    v = fs.versions[fs.inodes[ino].vid]
    got = fs.tier_api.pin_chunk(chunk_hash(data[3 * CS:4 * CS]))
    assert got is not None and got[0] is v
    return v


async def _published_as(fs, ino: int, data: bytes) -> None:
    """Wait (10 s at most) until ``fs`` has ``data``'s chunks as the job's version of ``ino``."""
    want = _chunks(data)
    with trio.fail_after(10):
        while (fs.inodes[ino].published or {}).get("chunks") != want:
            await trio.sleep(0.01)


def _serves(fs, data: bytes) -> None:
    """``fs`` serves every chunk of ``data`` by digest, verified, as to a peer's fetch."""
    for i, d in enumerate(_chunks(data)):
        got = fs.tier_api.pin_chunk(d)
        assert got is not None, i
        v, off, length = got
        try:
            assert fs.tier_api.read_chunk_at(v, off, length, d) == data[i * CS:(i + 1) * CS], i
        finally:
            fs.tier_api.unpin([v])


async def _rewrite(fs, ino: int, writes) -> None:
    fh, _ = await fs.open(ino, os.O_RDWR)
    for off, b in writes:
        assert await fs.write(fh, off, b) == len(b)
    await fs.flush(fh)  # close(2): in scope=job the last writer's close seals and publishes
    await fs.release(fh)


def test_a_job_rewrite_of_one_byte_copies_nothing_and_hashes_one_chunk(tmp_path):
    """A published file of 20 chunks in a RAM tier of 30, rewritten in place by one byte:
    the open used to copy the whole file (ENOSPC here: 40 > 30) and the seal to hash it
    whole; now the new version takes the data file over and its seal hashes the one chunk
    changed. Every node gets the new chunks, this node serves them, and
    ``user.mtcfs.blake3`` is the true hash."""
    data = bytearray(os.urandom(20 * CS))

    async def body(cores, job):
        a, b = cores
        d = (await a.mkdir(ROOT_INO, b"step_1", 0o755, 0, 0)).ino
        f = await write_sealed(a, d, b"w.bin", bytes(data))
        await published_on(b, f, len(data))
        file0 = os.stat(a.store.data_path(a.inodes[f].vid)).st_ino
        used0, hashed0 = a.used, a.counters.seal_bytes_hashed
        fh, _ = await a.open(f, os.O_RDWR)
        assert os.stat(a.store.data_path(a.inodes[f].vid)).st_ino == file0  # no copy
        assert a.used == used0
        assert await a.write(fh, 7 * CS + 3, b"Z") == 1
        await a.flush(fh)
        await a.release(fh)
        data[7 * CS + 3] = ord("Z")
        v2 = await sealed(a, f)
        assert list(v2.chunks) == _chunks(bytes(data))
        assert a.counters.seal_bytes_hashed - hashed0 == CS
        assert a.used == used0
        await _published_as(b, f, bytes(data))
        assert b.versions[b.inodes[f].vid].origin == 0
        _serves(a, bytes(data))
        assert await read_all(a, f) == data
        want = blake3.blake3(data).hexdigest()
        assert (await a.getxattr(f, b"user.mtcfs.blake3")).decode() == want

    run_job(tmp_path, body, capacity=30 * CS)


def test_a_job_rewrite_while_a_peer_reads_the_old_version_keeps_its_bytes(tmp_path):
    """A peer's fetch pins the published version (``pin_chunk``) while this node rewrites
    two of its chunks: the pinned version reads every old byte, verified, until the pin
    goes; RAM grows by the two chunks it keeps (a copy of the file was 20)."""
    data = bytearray(os.urandom(20 * CS))
    old = bytes(data)

    async def body(cores, job):
        a, b = cores
        f = await _published(a, b, b"w.bin", old)
        v1 = a.versions[a.inodes[f].vid]
        got = a.tier_api.pin_chunk(_chunks(old)[3])
        assert got is not None and got[0] is v1
        used0 = a.used
        await _rewrite(a, f, [(3 * CS, b"x"), (11 * CS + 5, b"y")])
        data[3 * CS] = ord("x")
        data[11 * CS + 5] = ord("y")
        await sealed(a, f)
        await _published_as(b, f, bytes(data))
        assert a.used - used0 == 2 * CS
        _serves(a, bytes(data))
        for i in range(20):  # the pinned version: every old chunk, verified
            chunk = old[i * CS:(i + 1) * CS]
            assert a.tier_api.read_chunk_at(v1, i * CS, CS, chunk_hash(chunk)) == chunk, i
        a.tier_api.unpin([v1])
        assert v1.vid not in a.versions
        assert a.used == used0
        assert await read_all(a, f) == data

    run_job(tmp_path, body)


def test_a_publication_tried_again_never_replaces_a_newer_rewrite(tmp_path):
    """A publication tried again (after etcd timed out) carries ``expect``, the job's
    version it may replace. A rewrite's seal leaves the whole-file hash to be computed when
    asked, so two rewrites both publish an empty ``blake3``: ``expect`` must name the
    version by its manifest, or a retried older rewrite would replace a newer one on every
    node (a lost update)."""
    first = bytearray(os.urandom(4 * CS))

    async def body(cores, job):
        a, b = cores
        f = await _published(a, b, b"w.bin", bytes(first))
        assert a.inodes[f].published["blake3"] == ""  # 4 chunks: computed when asked
        await _rewrite(a, f, [(CS, b"1")])
        first[CS] = ord("1")
        v1 = await sealed(a, f)
        await _published_as(b, f, bytes(first))
        assert a.inodes[f].published["blake3"] == ""  # computed when asked
        expect = publication_id(a.inodes[f].published)
        retry = Publish(ino=f, vid=v1.vid, size=v1.size, chunk_size=v1.chunk_size,
                        chunks=tuple(v1.chunks), blake3="", mtime_ns=1, expect=expect,
                        rank=0, id="retry.1")
        second = bytearray(first)
        second[2 * CS] ^= 0xFF
        await _rewrite(b, f, [(2 * CS, bytes([second[2 * CS]]))])  # another rank's rewrite
        await _published_as(a, f, bytes(second))
        assert a.inodes[f].published["blake3"] == ""
        assert job.apply(retry) == {0: errno.ESTALE, 1: errno.ESTALE}
        for fs in cores:
            assert fs.inodes[f].published["chunks"] == _chunks(bytes(second))
        assert await read_all(b, f) == second
        # The version it expects is still the job's: the retry is applied. An expect
        # written as a whole-file blake3 (by an mtcfs before this change) still matches.
        again = dataclasses.replace(retry, id="retry.2",
                                    expect=publication_id(a.inodes[f].published))
        assert not [r for r in job.apply(again).values() if isinstance(r, int)]  # no errno
        for fs in cores:
            assert fs.inodes[f].published["chunks"] == _chunks(bytes(first))
        # one chunk: published with its whole-file hash (a seal of more leaves it "")
        g = await _published(a, b, b"g.bin", bytes(second[:CS]))
        pub = a.inodes[g].published
        assert pub["blake3"] == blake3.blake3(second[:CS]).hexdigest()
        legacy = Publish(ino=g, vid=a.inodes[g].vid, size=pub["size"],
                         chunk_size=pub["chunk_size"], chunks=tuple(pub["chunks"]),
                         blake3=pub["blake3"], mtime_ns=1, expect=pub["blake3"], rank=0,
                         id="retry.3")
        assert not [r for r in job.apply(legacy).values() if isinstance(r, int)]

    run_job(tmp_path, body)


def test_a_snapshot_install_never_takes_a_pinned_old_versions_shared_file(tmp_path):
    """A node that installs a snapshot keeps its complete local copies of the content the
    snapshot names, by taking their data files over. A pinned old version of a rewritten
    file reads a data file the rewrite changes (its own bytes of the changed chunks are
    kept aside): it is no copy of its content, so another file with that content (here g,
    the same bytes as f before its rewrite) must not take that file over, or g would read
    the rewrite's bytes. g reads its own bytes after the install, and the pinned version
    reads its own until its pin goes, whatever f's later rewrites do."""
    old = os.urandom(6 * CS)

    async def body(cores, job):
        a, b = cores
        g = await _published(a, b, b"g.bin", old)
        f = await _published(a, b, b"f.bin", old)
        v1 = a.versions[a.inodes[f].vid]
        got = a.tier_api.pin_chunk(_chunks(old)[3])  # a peer's fetch of f's old chunk
        assert got is not None
        if got[0] is not v1:  # the index named g's copy: pin f's version too
            a.tier_api.unpin([got[0]])
            v1.pins += 1
        await _rewrite(a, f, [(3 * CS + 1, b"#")])
        new = bytearray(old)
        new[3 * CS + 1] = ord("#")
        await _published_as(b, f, bytes(new))
        assert v1.shared is not None and v1 in v1.shared.readers
        a.tier_api.ns_install(b.tier_api.ns_snapshot())
        assert await read_all(a, g) == old
        assert await read_all(a, f) == new
        # f's rewrite got a copy, not the shared file: a second rewrite of f leaves what
        # the pinned old version reads alone
        await _rewrite(a, f, [(0, b"%")])
        for i in range(6):
            chunk = old[i * CS:(i + 1) * CS]
            assert a.tier_api.read_chunk_at(v1, i * CS, CS, chunk_hash(chunk)) == chunk, i
        a.tier_api.unpin([v1])

    run_job(tmp_path, body)


class _Publications(NodeLog):
    """This node's namespace log, whose publications follow ``plan``, one step each:
    "hold" waits for :attr:`go`; "eio" times out (EIO, as etcd's deadline would) without
    reaching the job. Those past the plan, and every other op, go through."""

    def __init__(self, job, fs, *plan: str) -> None:
        super().__init__(job, fs)
        self.plan = list(plan)
        self.go = trio.Event()

    async def submit(self, op):
        if isinstance(op, Publish) and self.plan:
            if self.plan.pop(0) == "hold":
                await self.go.wait()
            else:
                raise FsError(errno.EIO, "etcd did not answer")
        return await super().submit(op)


async def _reopen_while_published(a, f: int, n) -> tuple[int, int]:
    """On core ``a``: write b"A" at 0 of file ``f`` and close it in nursery ``n`` (its
    publication held by the log); once that version is being published, open ``f`` again
    and write b"B" at CS. Returns (first handle, second handle), both still to release."""
    fh1, _ = await a.open(f, os.O_RDWR)
    await a.write(fh1, 0, b"A")
    n.start_soon(a.flush, fh1)  # close(2): seals, then publishes
    v1 = a.versions[a.inodes[f].vid]
    with trio.fail_after(10):
        while not v1.publishing:
            await trio.sleep(0.01)
    fh2, _ = await a.open(f, os.O_RDWR)
    await a.write(fh2, CS, b"B")
    return fh1, fh2


def _stale_chunks(fs, ino: int) -> list[int]:
    """Chunks of ``ino``'s current version on ``fs`` whose bytes are not its digest."""
    v = fs.versions[fs.inodes[ino].vid]
    fd = fs.vstore.fd(v)
    return [i for i, d in enumerate(v.chunks)
            if chunk_hash(os.pread(fd, min(CS, v.size - i * CS), i * CS)) != d]


def test_a_reopen_while_a_failed_publication_waits_to_be_tried_again(tmp_path):
    """A rewrite's close got EIO (etcd timed out): its publication is tried again in the
    background. The file is reopened and written meanwhile, twice. The publication tried
    again must not make the old version this node's current one again over the open
    writer (the old version only reads the writer's file by then: a second open took that
    file over as if it held the old bytes, and published the old digest of a chunk over
    the first writer's bytes). Every sealed chunk matches its digest, and the last close
    publishes what was written."""
    old = os.urandom(6 * CS)

    async def body(cores, job):
        a, b = cores
        f = await _published(a, b, b"f.bin", old)
        a.ns_log = _Publications(job, a, "eio")
        fh1, _ = await a.open(f, os.O_RDWR)
        await a.write(fh1, 0, b"A")
        try:
            await a.flush(fh1)
            raise AssertionError("the close should have got EIO")
        except FsError as exc:
            assert exc.errno == errno.EIO
        await a.release(fh1)
        await trio.sleep(0.05)  # the publication waits 1 s before it is tried again
        v1 = a.versions[a.inodes[f].vid]
        assert v1.sealed and v1.seal_error
        fh2, _ = await a.open(f, os.O_RDWR)
        with trio.fail_after(10):
            while v1.pins:  # the publication's next try has come and gone
                await trio.sleep(0.05)
        await a.write(fh2, 2 * CS + 7, b"B")
        fh3, _ = await a.open(f, os.O_RDWR)
        await a.write(fh3, 4 * CS, b"C")
        await a.flush(fh3)
        await a.release(fh3)
        await a.flush(fh2)
        await a.release(fh2)
        want = bytearray(old)
        want[0:1], want[2 * CS + 7:2 * CS + 8], want[4 * CS:4 * CS + 1] = b"A", b"B", b"C"
        await _published_as(b, f, bytes(want))
        assert _stale_chunks(a, f) == []
        assert await read_all(a, f) == want
        _serves(a, bytes(want))  # what b fetches, verified

    run_job(tmp_path, body)


def test_a_snapshot_install_never_hands_a_pinned_versions_file_to_a_later_rewrite(tmp_path):
    """A peer's fetch pins the current version of f; a snapshot install then makes a new
    version of the same content and keeps the local data file for it. A rewrite of f
    afterwards changes that file in place: the pinned version must still read its own
    bytes (the install copies for it rather than hand its file over)."""
    old = os.urandom(6 * CS)

    async def body(cores, job):
        a, b = cores
        f = await _published(a, b, b"f.bin", old)
        v1 = _pinned_by_a_fetch(a, f, old)
        a.tier_api.ns_install(b.tier_api.ns_snapshot())
        await _rewrite(a, f, [(3 * CS + 1, b"#")])
        try:
            for i in range(6):
                chunk = old[i * CS:(i + 1) * CS]
                assert a.tier_api.read_chunk_at(v1, i * CS, CS, chunk_hash(chunk)) == chunk, i
        finally:
            a.tier_api.unpin([v1])
        new = bytearray(old)
        new[3 * CS + 1] = ord("#")
        assert await read_all(a, f) == new

    run_job(tmp_path, body)


def test_a_snapshot_install_during_a_rewrite_gives_a_pinned_readers_ram_back(tmp_path):
    """A rewrite shares its data file with a pinned old version (a peer's fetch) when a
    snapshot install comes. Once the pin goes, the old version leaves the writer's group:
    later writes copy nothing for it, and size= counts exactly what the data files hold."""
    old = os.urandom(6 * CS)

    async def body(cores, job):
        a, b = cores
        f = await _published(a, b, b"f.bin", old)
        v1 = _pinned_by_a_fetch(a, f, old)
        fh, _ = await a.open(f, os.O_RDWR)
        v2 = a.versions[a.inodes[f].vid]
        assert v2.shared is not None
        a.tier_api.ns_install(b.tier_api.ns_snapshot())
        a.tier_api.unpin([v1])
        await a.write(fh, 2 * CS, b"y")
        await a.write(fh, 4 * CS, b"z")
        await a.flush(fh)
        await a.release(fh)
        held = sum(os.fstat(a.vstore.fd(v)).st_blocks * 512 for v in a.versions.values())
        assert v2.shared is None and v1.preserved is None
        assert a.used == held

    run_job(tmp_path, body)


def test_a_writer_opened_while_the_last_close_is_published_publishes_over_it(tmp_path):
    """The file is reopened for writing while its last close's publication is on its way
    to the job (the open copies). That publication is applied first: every node has the
    first close's bytes; then the writer's close publishes over it, and every node has the
    second close's bytes, read back verified on the node that wrote them."""
    old = os.urandom(4 * CS)

    async def body(cores, job):
        a, b = cores
        f = await _published(a, b, b"f.bin", old)
        a.ns_log = log = _Publications(job, a, "hold")
        async with trio.open_nursery() as n:
            fh1, fh2 = await _reopen_while_published(a, f, n)
            log.go.set()
        await a.release(fh1)
        first = bytearray(old)
        first[0:1] = b"A"
        await _published_as(b, f, bytes(first))
        await a.flush(fh2)
        await a.release(fh2)
        second = bytearray(first)
        second[CS:CS + 1] = b"B"
        await _published_as(b, f, bytes(second))
        assert await read_all(a, f) == second
        assert _stale_chunks(a, f) == []

    run_job(tmp_path, body)


def test_a_writer_whose_close_fails_behind_a_slow_publication_ends_with_the_jobs_version(
        tmp_path):
    """As above, but the writer's close gets EIO (etcd timed out) and its publication is
    tried again later, expecting the version before the first one. The first publication
    is applied meanwhile, so the job keeps it: the try again is refused (ESTALE) and this
    node ends with the job's version too, not the failed writer's bytes that no other node
    has."""
    old = os.urandom(6 * CS)

    async def body(cores, job):
        a, b = cores
        f = await _published(a, b, b"f.bin", old)
        a.ns_log = log = _Publications(job, a, "hold", "eio")
        async with trio.open_nursery() as n:
            fh1, fh2 = await _reopen_while_published(a, f, n)
            try:
                await a.flush(fh2)
                raise AssertionError("the second close should have got EIO")
            except FsError as exc:
                assert exc.errno == errno.EIO
            await a.release(fh2)
            v2 = a.versions[a.inodes[f].vid]
            log.go.set()
        await a.release(fh1)
        with trio.fail_after(10):
            while v2.pins:  # the second close's publication tried again, and given up
                await trio.sleep(0.05)
        first = bytearray(old)
        first[0:1] = b"A"
        await _published_as(b, f, bytes(first))
        assert await read_all(a, f) == first
        assert list(a.versions[a.inodes[f].vid].chunks) == _chunks(bytes(first))

    run_job(tmp_path, body)


def test_a_snapshot_install_of_a_rewritten_file_counts_the_file_its_readers_keep(tmp_path):
    """A rewrite takes a pinned version's file over and is closed and published; a snapshot
    install then forgets both (the file gets a copy). While the old version's pin lasts it
    holds the shared file alone, which counts against size= (with its kept chunks); after
    the unpin size= is what the data files hold."""
    old = os.urandom(6 * CS)

    async def body(cores, job):
        a, b = cores
        f = await _published(a, b, b"f.bin", old)
        v1 = _pinned_by_a_fetch(a, f, old)
        await _rewrite(a, f, [(3 * CS + 1, b"#")])
        new = bytearray(old)
        new[3 * CS + 1] = ord("#")
        await _published_as(b, f, bytes(new))
        a.tier_api.ns_install(b.tier_api.ns_snapshot())
        registered = sum(os.fstat(a.vstore.fd(v)).st_blocks * 512
                         for v in a.versions.values())
        kept = sum(len(x) for x in (v1.preserved or {}).values())
        assert a.used == registered + len(old) + kept
        a.tier_api.unpin([v1])
        assert a.used == sum(os.fstat(a.vstore.fd(v)).st_blocks * 512
                             for v in a.versions.values())
        assert await read_all(a, f) == new

    run_job(tmp_path, body)


def test_a_retried_publication_never_matches_a_file_whose_bytes_are_the_manifest(tmp_path):
    """``expect`` names the job's version by the hash of its manifest; an older mtcfs named
    it by the whole-file hash, which still matches. The two must never be taken for each
    other: a file whose bytes are exactly another file's manifest text has the whole-file
    hash that the manifest's unprefixed hash would be, and a retry expecting the other
    file's version must not replace it."""
    data = os.urandom(3 * CS)

    async def body(cores, job):
        a, b = cores
        f = await _published(a, b, b"f.bin", data)
        pub = a.inodes[f].published
        text = b"%d:%d:" % (pub["size"], pub["chunk_size"]) + "".join(pub["chunks"]).encode()
        g = await _published(a, b, b"g.bin", text)
        assert a.inodes[g].published["blake3"] == blake3.blake3(text).hexdigest()
        v = a.versions[a.inodes[f].vid]
        retry = Publish(ino=g, vid=v.vid, size=v.size, chunk_size=v.chunk_size,
                        chunks=tuple(v.chunks), blake3=v.blake3, mtime_ns=1,
                        expect=publication_id(pub), rank=0, id="retry.g")
        assert job.apply(retry) == {0: errno.ESTALE, 1: errno.ESTALE}
        assert await read_all(a, g) == text

    run_job(tmp_path, body)


def test_a_snapshot_install_whose_copy_fails_completes_and_fetches_that_file(tmp_path,
                                                                             monkeypatch):
    """The install copies a pinned version's data for the new version (above). When that
    copy fails (the store full: ENOSPC), the install still completes, every other file
    keeps its local data, and the file's chunks are fetched again like another rank's:
    it reads its own bytes, and the namespace in memory and in SQLite agree (checked by
    run_job). Before, the OSError left the install half done: the namespace cleared in
    memory, the transaction rolled back."""
    old = os.urandom(6 * CS)
    other = os.urandom(3 * CS)

    def full(src: int, dst: int, size: int) -> None:
        os.pwrite(dst, b"x" * CS, 0)  # a partial copy, then the store is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    async def body(cores, job):
        a, b = cores
        f = await _published(a, b, b"f.bin", old)
        g = await _published(a, b, b"g.bin", other)
        v1 = _pinned_by_a_fetch(a, f, old)
        monkeypatch.setattr(jobns, "copy_extents", full)
        a.tier_api.ns_install(b.tier_api.ns_snapshot())
        a.tier_api.unpin([v1])
        assert not a.versions[a.inodes[g].vid].missing  # g's file taken over, unpinned
        assert a.versions[a.inodes[f].vid].missing == set(range(6))
        a.fetcher.chunk_source = src = ChunksOf(old)
        assert await read_all(a, f) == old
        assert src.fetches == 6
        assert await read_all(a, g) == other

    run_job(tmp_path, body)


def test_a_snapshot_install_keeps_every_local_copy_of_one_content(tmp_path):
    """Two files of this node with the same bytes (identical shards) and a snapshot that
    names both: each keeps its own local copy, the one a peer's fetch pins by a copy and
    the other by taking its file over. Before, the install knew one copy per content
    (the last it saw, here the pinned one, copied): the other file's chunks were missing
    and fetched again from the job's other nodes."""
    same = os.urandom(5 * CS)

    async def body(cores, job):
        a, b = cores
        f = await _published(a, b, b"f.bin", same)
        g = await _published(a, b, b"g.bin", same)
        vg = a.versions[a.inodes[g].vid]
        vg.pins += 1  # as a peer's fetch of g's chunk does
        a.tier_api.ns_install(b.tier_api.ns_snapshot())
        a.tier_api.unpin([vg])
        for ino in (f, g):
            assert not a.versions[a.inodes[ino].vid].missing, ino
            assert await read_all(a, ino) == same  # no chunk source: only local bytes

    run_job(tmp_path, body)
