"""Cold reads of one sealed file, several code trees in one run (``make bench-ab``).

``python -m benchmarks.bench_ab --tree before=/path/to/old --tree after=. [--reps 12]
[--size 256] [--json OUT]``

Each ``--tree LABEL=DIR`` gets its own mount, whose daemon runs the code in ``DIR``
(``PYTHONPATH=DIR``; a ``git worktree`` of the commit to compare). One file of ``--size``
MiB is written to each mount and sealed; then, ``--reps`` times and in an order that
rotates each repeat, the page cache is dropped and each file read once (16 MiB
``readinto``). Reported per tree: cold read GB/s (median, min, max) and the daemon's CPU
time per MiB read (utime + stime from /proc/PID/stat).

``--write`` adds the large sequential write to each repeat, in the same rotating order: a
new file of ``--size`` MiB written in 16 MiB ``os.write`` calls, fsync and close, timed
together (as ``make bench``'s write), with the daemon's CPU per MiB over the same window;
the file is removed once sealed, before the next tree's turn.

Why one run: on this 2-core VM, cold reads of the same tree in separate runs spread by
10-25 %, and a before/after pair taken in separate runs can differ by more than the code
does (issue 15's "cold read 15 % lower" was that). One mount per tree, interleaved reads,
the same machine state for all.

Position matters: the file written first read 8-12 % slower than the others in every run,
whatever its tree, so a throw-away mount of the first tree writes its file first and is
not measured (``--no-warm-mount`` turns it off).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import time
from pathlib import Path

from benchmarks.common import (
    REPO,
    SCRATCH_SHM,
    UniqueData,
    cpu_seconds,
    daemon_pid,
    drop_caches,
    gbps,
    git_state,
    machine_info,
    mtcfs_mount,
    mtcfs_state,
    read_file,
    scratch_dir,
    wait_until,
    write_file,
    write_json,
)

MiB = 1 << 20


def print_table(title: str, samples: dict[str, dict[str, list[float]]], key: str) -> None:
    """Print ``title`` and one row per tree: GB/s (median, min, max) and CPU ms/MiB
    (median) of the samples ``<key>gbps`` and ``<key>cpu_ms_per_mib``."""
    print(title)
    print(f"{'tree':<12} {'GB/s median':>12} {'min':>6} {'max':>6} {'CPU ms/MiB':>11}")
    for t, s in samples.items():
        g, c = s[f"{key}gbps"], s[f"{key}cpu_ms_per_mib"]
        print(f"{t:<12} {statistics.median(g):>12.2f} {min(g):>6.2f} {max(g):>6.2f} "
              f"{statistics.median(c):>11.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, metavar="LABEL=DIR",
                    help="a label and a source tree whose daemon to measure (repeatable)")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--size", type=int, default=256, help="file size, MiB")
    ap.add_argument("--no-warm-mount", action="store_true")
    ap.add_argument("--write", action="store_true",
                    help="also time a large sequential write in each repeat")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    trees: dict[str, Path] = {}
    for spec in args.tree:
        label, sep, d = spec.partition("=")
        if not sep or not (Path(d) / "mtcfs" / "__init__.py").is_file():
            ap.error(f"--tree {spec}: want LABEL=DIR with DIR a source tree of mtcfs")
        trees[label] = Path(d).resolve()
    if not drop_caches():
        ap.error("cannot write /proc/sys/vm/drop_caches: run as root")
    size = args.size * MiB
    labels = list(trees)
    samples: dict[str, dict[str, list[float]]] = {
        t: {"gbps": [], "cpu_ms_per_mib": [], "write_gbps": [], "write_cpu_ms_per_mib": []}
        for t in labels}
    os.chdir("/")  # `python -m mtcfs` puts the cwd first on sys.path; PYTHONPATH must win
    with scratch_dir(SCRATCH_SHM, "ab") as root, contextlib.ExitStack() as stack:
        mounts = {t: stack.enter_context(mtcfs_mount(root / f"m{i}", {"size": "4G"},
                                                     env={"PYTHONPATH": str(trees[t])}))
                  for i, t in enumerate(labels)}
        pids = {t: daemon_pid(m) for t, m in mounts.items()}
        first = [] if args.no_warm_mount else [stack.enter_context(
            mtcfs_mount(root / "warm", {"size": "4G"}, env={"PYTHONPATH": str(trees[labels[0]])}))]
        for m in first + list(mounts.values()):
            f = m.mnt / "f.bin"
            write_file(f, size, UniqueData(seed=7))
            wait_until(lambda f=f: mtcfs_state(f) in ("local", "backed-up"), 300, f"{f} sealed")
        for rep in range(args.reps):
            for t in labels[rep % len(labels):] + labels[:rep % len(labels)]:
                drop_caches()
                c0 = cpu_seconds(pids[t])
                secs, n = read_file(mounts[t].mnt / "f.bin")
                c1 = cpu_seconds(pids[t])
                assert n == size, (t, n, size)
                samples[t]["gbps"].append(gbps(size, secs) or 0.0)
                samples[t]["cpu_ms_per_mib"].append((c1 - c0) * 1000 / args.size)
                if args.write:
                    w = mounts[t].mnt / "w.bin"
                    c0 = cpu_seconds(pids[t])
                    secs = write_file(w, size, UniqueData(seed=100 + rep))
                    c1 = cpu_seconds(pids[t])
                    samples[t]["write_gbps"].append(gbps(size, secs) or 0.0)
                    samples[t]["write_cpu_ms_per_mib"].append((c1 - c0) * 1000 / args.size)
                    wait_until(lambda w=w: mtcfs_state(w) in ("local", "backed-up"), 300,
                               f"{w} sealed")
                    w.unlink()
    print_table(f"cold read of {args.size} MiB, {args.reps} repeats, interleaved",
                samples, "")
    if args.write:
        print_table(f"sequential write of {args.size} MiB (+ fsync, close), {args.reps}"
                    " repeats, interleaved", samples, "write_")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.json or REPO / "bench-results" / f"ab-{stamp}.json"
    write_json(out, {"machine": machine_info(), "git": git_state(), "size_mib": args.size,
                     "reps": args.reps, "trees": {t: str(d) for t, d in trees.items()},
                     "samples": samples, "when": time.time()})
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
