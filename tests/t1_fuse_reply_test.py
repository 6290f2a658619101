"""The reply to an open or create under either pyfuse3 mtcfs runs with: its own patched
one (FUSE passthrough: ``FileInfo.backing_id``) or PyPI's, where the patched one could not
be built (scripts/build_fuse.sh falls back to it). The container image at 0.1.0 had PyPI's,
and every open and create through its mount failed EIO: ``FileInfo`` got ``backing_id=0``,
an argument PyPI's does not take (issue 44)."""

from __future__ import annotations

import pyfuse3
import pytest

from mtcfs import fuse_ops


class StockFileInfo:
    """pyfuse3 3.5.0's FileInfo as PyPI ships it: no backing_id."""

    def __init__(self, fh: int = 0, direct_io: bool = False, keep_cache: bool = True,
                 nonseekable: bool = False) -> None:
        self.fh, self.direct_io, self.keep_cache = fh, direct_io, keep_cache


def test_without_a_backing_file_the_reply_fits_pypis_pyfuse3(monkeypatch):
    monkeypatch.setattr(fuse_ops.pyfuse3, "FileInfo", StockFileInfo)
    fi = fuse_ops.file_info(7, keep_cache=False, direct_io=True, backing_id=0)
    assert (fi.fh, fi.keep_cache, fi.direct_io) == (7, False, True)


@pytest.mark.skipif(not hasattr(pyfuse3, "passthrough"), reason="PyPI's pyfuse3: no passthrough")
def test_with_a_backing_file_the_reply_carries_its_id():
    fi = fuse_ops.file_info(7, keep_cache=False, direct_io=False, backing_id=3)
    assert (fi.fh, fi.backing_id) == (7, 3)
