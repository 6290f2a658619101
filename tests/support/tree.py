"""A directory tree as a value, to assert that something left it as it was."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry below and including ``root``, never following a symlink: its type and mode,
    and a file's bytes or a link's target."""
    out: dict[str, tuple] = {}

    def one(p: str) -> None:
        st = os.lstat(p)
        rel = os.path.relpath(p, root)
        if stat.S_ISLNK(st.st_mode):
            out[rel] = ("link", os.readlink(p))
        elif stat.S_ISREG(st.st_mode):
            out[rel] = ("file", stat.S_IMODE(st.st_mode), Path(p).read_bytes())
        else:
            out[rel] = ("dir" if stat.S_ISDIR(st.st_mode) else "other", st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                for name in os.listdir(p):
                    one(os.path.join(p, name))

    one(str(root))
    return out
