"""Programs that write new files in small pieces, beside a save of large tensors
(``make bench-small-writers``): what the per-thread choice of direct writes
(mtcfs/direct_writes.py) gives each.

``python -m benchmarks.bench_small_writers [--reps 3] [--base DIR] [--json OUT]``

Three workloads, seconds, median of ``--reps``:

- ``tar -x``: GNU tar extracts 8 files of 32 MiB (it writes 10 KiB records), a new
  process each time;
- ``torch.save``, **small tensors**: a state dict of 6,000 tensors of 1-16 KiB (49 MiB;
  torch.save writes one ``writev`` per tensor), saved twice by a new thread: its first
  save, then its next;
- ``torch.save``, **large tensors**: 62 tensors of 8 MiB (496 MiB), the same way: what
  direct writes are for, to show it stays.

On tmpfs, the no-op FUSE ceiling (``noop_fs.py``), mtcfs (direct writes on, the
default), mtcfs with ``direct_writes=no`` and, with ``--base DIR``, ``mtcfs-base``: the
code of another tree (a ``git worktree`` of the commit to compare) with its default
options. Figures in docs/benchmarks.md, "Direct writes for large pieces only".
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (MiB, BenchResult, first_and_next, median, scratch_dir,
                               write_targets)


def tensors(count: int, numel: Callable[[int], int]) -> dict[str, Any]:
    import torch
    g = torch.Generator().manual_seed(18)
    return {f"t{i}": torch.rand(numel(i), generator=g) for i in range(count)}


def tar_x(archive: Path, d: Path) -> float:
    """Seconds for GNU tar to extract ``archive`` into a new directory under ``d``."""
    dest = d / "x"
    dest.mkdir()
    t0 = time.perf_counter()
    subprocess.run(["tar", "-xf", str(archive), "-C", str(dest)], check=True, timeout=600)
    dt = time.perf_counter() - t0
    shutil.rmtree(dest)
    return dt


def save(path: Path, sd: dict[str, Any]) -> float:
    """Seconds of one ``torch.save`` of ``sd`` to new file ``path`` (removed after)."""
    import torch
    t0 = time.perf_counter()
    torch.save(sd, path)
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def run(reps: int, base: Path | None = None) -> BenchResult:
    res = BenchResult("small-writers", f"Small and large writers, seconds, median of {reps}",
                      ["target", "tar -x 256 MiB", "small tensors: first save", "next save",
                       "large tensors: first save", "next save"])
    small = tensors(6000, lambda i: 256 * (1 + i % 16))
    large = tensors(62, lambda i: 2 * MiB)
    with scratch_dir("/dev/shm", "smallw") as root, contextlib.ExitStack() as stack:
        src = root / "src"
        src.mkdir()
        for i in range(8):
            (src / f"shard{i}.bin").write_bytes(os.urandom(32 * MiB))
        archive = root / "ckpt.tar"
        subprocess.run(["tar", "-cf", str(archive), "-C", str(src), "."], check=True)
        shutil.rmtree(src)
        dirs, m = write_targets(stack, root, base, res.notes)
        got: dict[str, dict[str, list[float]]] = {n: {} for n in dirs}
        names = list(dirs)
        for rep in range(reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:  # rotated
                d = dirs[name]
                g = got[name]
                g.setdefault("tar", []).append(tar_x(archive, d))
                for key, sd in (("small", small), ("large", large)):
                    first, nxt = first_and_next(
                        lambda i: save(d / f"s{i}.pt", sd))
                    g.setdefault(f"{key} first", []).append(first)
                    g.setdefault(f"{key} next", []).append(nxt)
                print(f"  rep {rep + 1} {name}: " + ", ".join(
                    f"{k} {v[-1]:.3f} s" for k, v in g.items()), flush=True)
        for name, g in got.items():
            res.rows.append([name] + [f"{median(g[k]):.3f}" for k in
                                      ("tar", "small first", "small next", "large first",
                                       "large next")])
        res.samples = got
        res.notes.append(f"mtcfs: {m.status()['fuse']}")
    res.notes.append(f"load average {os.getloadavg()}")
    return res


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run import reps_base_main
    return reps_base_main(argv, "benchmarks.bench_small_writers", __doc__, "small-writers", run)


if __name__ == "__main__":
    sys.exit(main())
