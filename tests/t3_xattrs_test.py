"""Extended attributes (core/xattrs.py): ``user.*`` attributes are kept with the inode,
under its own number, whatever number the kernel asked by, and survive a restart."""

import sqlite3

from mtcfs.core.inodes import FIRST_KID
from mtcfs.core.model import ROOT_INO
from support.corefs import open_fs, run, write_file
from support.jobcore import published_on, run_job, write_sealed


def _reopened(path):
    """(xattrs by inode number, next_ino) of the store at ``path`` opened again."""
    fs = open_fs(path, rank=1)
    try:
        return ({n: dict(i.xattrs) for n, i in fs.inodes.items() if i.xattrs},
                fs.tree.next_ino)
    finally:
        fs.close()
        fs.store.close()


def test_a_setxattr_through_a_kernel_alias_is_kept_under_the_inode(tmp_path):
    """scope=job: rank 1's kernel knows a file rank 0 rewrote by a new number (an alias,
    Inode.kid, so that it drops its cached size). setxattr and removexattr by that number
    must change the row of the inode itself. Before, the row was stored under the alias:
    after a restart the attribute was gone, and the inode counter, recovered past every
    row, jumped into the aliases' range (2^48), so this node numbered the job's next
    files differently from every other node."""
    got = {}

    async def body(cores, job):
        fs0, fs1 = cores
        ino = await write_sealed(fs0, ROOT_INO, b"f", b"one")
        await published_on(fs1, ino, 3)
        await fs1.lookup(ROOT_INO, b"f")  # rank 1's kernel knows it
        await write_sealed(fs0, ROOT_INO, b"f", b"two!")  # rank 0 rewrites it
        await published_on(fs1, ino, 4)
        kid = (await fs1.lookup(ROOT_INO, b"f")).ino  # the number rank 1's kernel uses now
        assert kid != ino
        await fs1.setxattr(kid, b"user.tag", b"v")
        await fs1.setxattr(kid, b"user.gone", b"x")
        await fs1.removexattr(kid, b"user.gone")
        got["ino"], got["next"] = ino, fs1.tree.next_ino

    run_job(tmp_path, body)
    assert _reopened(tmp_path / "store1") == ({got["ino"]: {b"user.tag": b"v"}}, got["next"])


def test_a_stray_attribute_row_is_dropped_and_moves_no_counter(tmp_path):
    """A store written by a tree with the defect above holds an xattr row under an alias
    number: at the next start the row is dropped and the inode counter stays below the
    aliases' range."""
    async def body(fs):
        await write_file(fs, ROOT_INO, b"f", b"x")

    run(body, tmp_path)
    _attrs, before = _reopened(tmp_path / "store")
    db = sqlite3.connect(tmp_path / "store" / "meta.sqlite3")
    with db:
        db.execute("INSERT INTO xattrs(ino, name, value) VALUES (?, ?, ?)",
                   (FIRST_KID + 1, b"user.tag", b"v"))
    db.close()
    assert _reopened(tmp_path / "store") == ({}, before)
    db = sqlite3.connect(tmp_path / "store" / "meta.sqlite3")
    assert db.execute("SELECT count(*) FROM xattrs").fetchone() == (0,)
    db.close()
