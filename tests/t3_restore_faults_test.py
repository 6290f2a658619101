"""Restores that go wrong half-way, driven through the core in process (no FUSE): what the
node had must still be there, and nothing half-made may stay (found by an adversarial review
of the restore paths; docs/reliability.md).

- ``import_step`` (core/checkpoints.py) checks a manifest's tree before it links anything;
- the Orbax MTC replicator (tiers/mtc/replicator.py) keeps the node's complete steps until
  the step the job chose is here (or, short of RAM, until its manifest was read).
"""

from __future__ import annotations

import errno
import types

import pytest
import trio
from support.corefs import run, sealed, write_file
from t1_backup_ranks_test import NOW, blob, make_step

from mtcfs.base.errors import FsError
from mtcfs.base.manifest import Entry, StepManifest
from mtcfs.core.model import ROOT_INO
from mtcfs.tiers.backup import BackupStore, FileBackend


def test_import_step_refuses_a_manifest_it_could_apply_only_in_part(tmp_path) -> None:
    """A manifest from a peer or the bucket whose entries are not parents-before-children
    parses (``StepManifest.from_bytes``) but cannot make a tree. ``import_step`` refuses it
    with EINVAL before anything is linked: no ``step_7/`` in the mount, no record, and a
    good manifest of the same step imports afterwards. Before, the in-memory tree kept what
    was linked before the failure (SQLite rolled back), and every later import of step_7
    failed with EEXIST."""
    good = make_step(7, {"a": blob(7, 1000)})
    e1 = good.entries[1]
    bad_entries = [good.entries[0], e1,
                   Entry(path="step_7/sub/b", kind="file", mode=0o644, mtime_ns=2,
                         size=1000, chunk_size=e1.chunk_size, chunks=e1.chunks,
                         blake3=e1.blake3),
                   Entry(path="step_7/sub", kind="dir", mode=0o755, mtime_ns=1)]
    bad = StepManifest.from_bytes(StepManifest(job="job", step="step_7", step_number=7,
                                               created_ns=NOW, entries=bad_entries).to_bytes())
    twice = StepManifest(job="job", step="step_7", step_number=7, created_ns=NOW,
                         entries=[good.entries[0], e1, e1])

    async def body(fs) -> None:
        for m, why in ((bad, "before its directory"), (twice, "comes twice")):
            with pytest.raises(FsError) as ei:
                fs.tier_api.import_step(m)
            assert ei.value.errno == errno.EINVAL and why in str(ei.value)
            assert sorted(fs.inodes[ROOT_INO].children or {}) == [] and not fs.steps
        fs.tier_api.import_step(good)
        assert sorted(fs.inodes[ROOT_INO].children or {}) == [b"step_7"]
        assert fs.tree.resolve("step_7/a").is_file

    run(body, tmp_path)


class _FromBackup:
    """The backup tier as the fetcher's chunk source (as the daemon wires it)."""

    def __init__(self, store: BackupStore) -> None:
        self.store = store

    async def fetch(self, digest: str, tried=None) -> bytes:
        try:
            return await trio.to_thread.run_sync(self.store.get_chunk, digest)
        except Exception as exc:  # noqa: BLE001 (any miss is EIO to the read)
            raise FsError(errno.EIO, str(exc)) from None


@pytest.mark.parametrize("case", ["unreadable", "restored", "short-of-ram"])
def test_an_mtc_restore_keeps_the_nodes_complete_step_until_the_chosen_one_is_here(
        tmp_path, case) -> None:
    """mtc, one node: RAM holds the complete step 100; the backup tier holds step 200.

    - ``unreadable``: 200's manifest cannot be read (corrupt, or the bucket went away). The
      restore fails and step 100 is still there. Before, the replicator had removed it
      first, so the node's only good checkpoint was gone and every retry failed again.
    - ``restored``: 200 comes back bit-exact, and 100 is removed after (what Orbax expects).
    - ``short-of-ram``: the RAM tier cannot hold both: 100 is removed once 200's manifest
      was read, and 200 comes back.
    """
    from mtcfs.tiers.mtc.replicator import MtcReplicator
    from mtcfs.tiers.restore.restorer import Restorer

    be = FileBackend(str(tmp_path / "bucket"))
    chunks: dict[str, bytes] = {}
    bs = BackupStore(be, clock_ns=lambda: NOW)
    want = blob(2, 300_000)
    bs.put_step(make_step(200, {"a": want}, chunks=chunks, name="200"), chunks.__getitem__)
    if case == "unreadable":
        (tmp_path / "bucket" / "steps" / "200" / "manifest.json").write_bytes(b"{not json")
    seen: dict[str, object] = {}

    async def body(fs) -> None:
        d = await fs.mkdir(ROOT_INO, b"100", 0o755, 0, 0)
        await sealed(fs, await write_file(fs, d.ino, b"a", blob(1, 300_000)))
        fs.step_registry.seal("100")
        fs.fetcher.chunk_source = _FromBackup(bs)

        async def prefetch() -> None:
            for v, _i in fs.chunks.pending():
                await fs.chunks.fault_in(v, 0, v.size)

        async with trio.open_nursery() as n:
            api = fs.tier_api
            restorer = Restorer(api, rank=0, nodes=1, restore="latest", backup_url="file://x",
                                backup_store=bs, peer=None, prefetcher=None, mtc=True)
            rep = MtcReplicator(api, rank=0, nodes=1, job="job",
                                jax_coordinator="127.0.0.1:1", backup_store=bs,
                                fetch_step=lambda k: restorer.restore(k, check_space=True),
                                kick_prefetch=lambda: n.start_soon(prefetch))
            try:
                with trio.fail_after(30):
                    seen["restored"] = await rep.restore(
                        types.SimpleNamespace(job_name="job"))
            except Exception as exc:  # noqa: BLE001 (RestoreFailed, BadManifest: failed)
                seen["error"] = repr(exc)
        seen["steps"] = sorted(fs.steps)
        seen["root"] = sorted(fs.inodes[ROOT_INO].children or {})
        marker = seen["restored"]["marker"] if "restored" in seen else None
        if marker:  # the restored step, under the name the trainer looks for
            fh, _ = await fs.open(fs.tree.resolve(f"{marker}/a").ino, 0)
            seen["bytes"] = await fs.read(fh, 0, 1 << 20)
            await fs.release(fh)

    run(body, tmp_path, capacity=450_000 if case == "short-of-ram" else 1 << 30)
    if case == "unreadable":
        assert "error" in seen and seen["steps"] == ["100"] and seen["root"] == [b"100"], seen
    else:
        assert seen.get("restored"), seen
        assert b"100" not in seen["root"] and seen.get("bytes") == want, seen["root"]
