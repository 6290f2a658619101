"""Run the one-node mtcfs benchmarks: ``python -m benchmarks.run [--quick] [--only ...]``.

Prints a table per benchmark and the PASS/MISS of each target, and writes everything
(machine, settings, raw samples, medians, checks) to ``bench-results/<timestamp>.json``.
See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import (GiB, MiB, REPO, BenchResult, git_state, human, machine_info,
                               write_json)

BENCHES = ("io", "dcp", "backup", "rss")

#: (full, quick) sizes in bytes.
SIZES = {
    "io": (2 * GiB, 256 * MiB),
    "dcp": (1 * GiB, 256 * MiB),
    "backup": (1 * GiB, 64 * MiB),  # the emulator takes 4 MiB objects at only ~30 MB/s
    "rss": ([1 * GiB, 8 * GiB], [256 * MiB, 1 * GiB]),
}


def render(res: BenchResult) -> str:
    cols = res.columns
    rows = [cols] + res.rows
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(cols))]
    out = [f"\n{res.title}  ({res.seconds:.0f}s)"]
    for j, r in enumerate(rows):
        out.append("  " + "  ".join(str(c).ljust(widths[i]) if i == 0 else str(c).rjust(widths[i])
                                    for i, c in enumerate(r)))
        if j == 0:
            out.append("  " + "  ".join("-" * w for w in widths))
    for c in res.checks:
        verdict = ({True: "info: within", False: "info: over", None: "info: n/a"} if c.info
                   else {True: "PASS", False: "MISS", None: "n/a "})[c.ok]
        val = "-" if c.value is None else f"{c.value:.2f}"
        out.append(f"  [{verdict}] {c.name}: {val} (target {c.op} {c.threshold:.2f})"
                   + (f"  {c.detail}" if c.detail else ""))
    for n in res.notes:
        out.append(f"  note: {n}")
    return "\n".join(out)


def report(res: BenchResult, key: str, json_path: str | None) -> Path:
    """Print ``res`` as a table, write it with the machine's description to ``json_path``
    (default ``bench-results/<key>-<timestamp>.json``) and say where; that path."""
    print(render(res))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(json_path) if json_path else REPO / "bench-results" / f"{key}-{stamp}.json"
    write_json(out, {"machine": machine_info(), "result": res.to_json()})
    print(f"\nresults: {out}")
    return out


def reps_base_main(argv: list[str] | None, module: str, doc: str | None, key: str,
                   run: Callable[[int, Path | None], BenchResult]) -> int:
    """The command line of a benchmark run as ``run(reps, base)`` (``--reps``, ``--base``,
    ``--json``): parse, time, :func:`report` under ``key``; the exit status."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--base", type=Path,
                   help="also mount the code of this tree (a git worktree) as mtcfs-base")
    p.add_argument("--json", help=f"output file (default bench-results/{key}-<time>.json)")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    res = run(a.reps, a.base)
    res.seconds = time.monotonic() - t0
    report(res, key, a.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small sizes, no 8 GiB run (< 2 min)")
    p.add_argument("--only", nargs="+", choices=BENCHES, help="run only these benchmarks")
    p.add_argument("--reps", type=int, default=3, help="repeats per measurement (median)")
    p.add_argument("--no-prefault", action="store_true",
                   help="do not pre-touch RAM before timed writes (see common.prefault)")
    p.add_argument("--out", default=str(REPO / "bench-results"), help="JSON output directory")
    a = p.parse_args(argv)
    if os.geteuid() != 0:
        print("note: not root: cold reads (drop_caches) and read-ahead tuning are skipped",
              file=sys.stderr)
    which = a.only or list(BENCHES)
    idx = 1 if a.quick else 0
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = Path(a.out) / f"{stamp}{'-quick' if a.quick else ''}.json"
    info = machine_info()
    print(f"mtcfs benchmarks ({'quick' if a.quick else 'full'}), {a.reps} repeats, "
          f"{info.get('nproc')} CPUs ({info.get('cpu_model', '?')}), "
          f"{info.get('mem_total_gib')} GiB RAM, kernel {info.get('kernel')}, "
          f"load {', '.join(f'{x:.2f}' for x in info['loadavg'])}, git {info['git']['head']}",
          flush=True)
    doc = {"started": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.run"]
                               + (argv if argv is not None else sys.argv[1:])),
           "quick": a.quick, "reps": a.reps, "prefault": not a.no_prefault, "machine": info,
           "results": {}, "errors": {}}
    failed = False
    t_all = time.perf_counter()
    for name in which:
        size = SIZES[name][idx]
        shown = human(size) if isinstance(size, int) else ", ".join(map(human, size))
        print(f"\n>>> {name} ({shown})", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            if name == "io":
                from benchmarks import bench_io
                res = bench_io.run(size, a.reps, touch=not a.no_prefault)
            elif name == "dcp":
                from benchmarks import bench_dcp
                res = bench_dcp.run(size, a.reps, touch=not a.no_prefault)
            elif name == "backup":
                from benchmarks import bench_backup
                res = bench_backup.run(size, a.reps)
            else:
                from benchmarks import bench_rss
                res = bench_rss.run(size)
        except Exception as exc:  # report, keep going with the other benchmarks
            failed = True
            traceback.print_exc()
            doc["errors"][name] = f"{type(exc).__name__}: {exc}"
            print(f"\n{name}: FAILED: {exc}", flush=True)
            continue
        res.seconds = time.perf_counter() - t0
        doc["results"][name] = res.to_json()
        print(render(res), flush=True)
        write_json(out_path, doc)  # partial results survive a later crash
    doc["seconds"] = round(time.perf_counter() - t_all, 1)
    doc["machine"]["loadavg_end"] = os.getloadavg()
    doc["machine"]["git_end"] = git_state()
    if doc["machine"]["git_end"] != info["git"]:
        print(f"warning: the tree changed during the run: {info['git']} -> "
              f"{doc['machine']['git_end']}", flush=True)
    checks = [c for r in doc["results"].values() for c in r["checks"]]
    n_pass = sum(1 for c in checks if c["pass"] is True)
    n_miss = sum(1 for c in checks if c["pass"] is False)
    doc["summary"] = {"pass": n_pass, "miss": n_miss, "errors": list(doc["errors"])}
    write_json(out_path, doc)
    print(f"\n{n_pass} PASS, {n_miss} MISS"
          + (f", {len(doc['errors'])} benchmark(s) FAILED" if doc["errors"] else "")
          + f" in {doc['seconds']:.0f}s; results in {out_path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
