#!/usr/bin/env python3
"""mtcfs chaos run: several daemons on this machine, a save loop, a seeded schedule of faults.

    python examples/chaos.py                                   # 4 nodes, scope=job and node, 30 faults each
    python examples/chaos.py --seed 7 --scope job --minutes 20  # the long form (docs/reliability.md)
    python examples/chaos.py --seed 7 --faults 200 --backup gcs

What it does (needs root or FUSE permissions, like any mtcfs mount): mounts ``--nodes``
daemons peering over loopback (``scope=node`` or ``scope=job``, ``replicas=1``, a ``file://``
backup tier, or ``gs://`` on the gcp-storage-emulator behind a flaky proxy), saves
checkpoints DCP-style through the mounts, and injects faults drawn from ``--seed``: SIGKILL
of a daemon with a replacement on a wiped store or a restart on the same one, SIGSTOP and
SIGCONT, network partitions through the daemons' fault hook, a chunk corrupted in a RAM
tier, a replica store, the backup tier or all of them, and backup outages. Files are read
back and compared byte for byte all along, every read under a bound (tests/support/chaos.py,
``READ_BOUND_S``). At the end it prints a table per scope (faults by kind, steps committed,
bytes verified, EIO reads and why, the longest wait, invariant violations) and every
violation with the daemons' log lines. The exit status is 1 if any invariant was violated.

The same seed replays the same faults and the same bytes; docs/reliability.md lists the
invariants and the figures of one long run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for p in (str(REPO), str(REPO / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

from mtcfs.core.faultin import FETCH_DEADLINE_S  # noqa: E402
from support.chaos import (  # noqa: E402
    BOUND_MARGIN_S, FAULT_KINDS, READ_BOUND_S, ChaosConfig, run_chaos,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1, help="seed of the faults and the data (1)")
    ap.add_argument("--nodes", type=int, default=4, help="daemons (4)")
    ap.add_argument("--scope", choices=("node", "job", "both"), default="both",
                    help="scope=node, scope=job, or one run of each (both)")
    ap.add_argument("--faults", type=int, help="faults per scope (default 30 unless "
                    "--minutes is given)")
    ap.add_argument("--minutes", type=float, help="inject faults for this long per scope")
    ap.add_argument("--backup", choices=("file", "gcs"), default="file",
                    help="backup tier: file:// (default) or gs:// on the gcp-storage-emulator")
    ap.add_argument("--kinds", default=",".join(FAULT_KINDS),
                    help=f"fault kinds to draw from (default all: {','.join(FAULT_KINDS)})")
    ap.add_argument("--file-size", type=int, default=2_500_000,
                    help="bytes per rank file, about (2500000)")
    ap.add_argument("--read-timeout", type=float, default=FETCH_DEADLINE_S,
                    help=f"the mounts' read_timeout, s (default {FETCH_DEADLINE_S:g})")
    ap.add_argument("--read-bound", type=float, default=None,
                    help=f"invariant: no read waits longer, s (default: the larger of "
                         f"read_timeout and 60 s, plus {BOUND_MARGIN_S:g} s: "
                         f"{READ_BOUND_S:.0f} s at the default read_timeout)")
    ap.add_argument("--strict-local-ram", action="store_true",
                    help="also read files through the node whose RAM copy was corrupted "
                         "(mtcfs serves its own RAM unverified: expect violations)")
    ap.add_argument("--quiet", action="store_true", help="no event log while it runs")
    a = ap.parse_args(argv)
    if os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):
        print("chaos: needs root or access to /dev/fuse", file=sys.stderr)
        return 2
    faults = a.faults if a.faults is not None or a.minutes is not None else 30
    kinds = tuple(k for k in a.kinds.split(",") if k)
    scopes = ["node", "job"] if a.scope == "both" else [a.scope]
    results = []
    t0 = time.monotonic()
    for scope in scopes:
        cfg = ChaosConfig(seed=a.seed, nodes=a.nodes, scope=scope, faults=faults,
                          minutes=a.minutes, backup=a.backup, kinds=kinds,
                          file_size=a.file_size, read_timeout_s=a.read_timeout,
                          read_bound_s=a.read_bound,
                          strict_local_ram=a.strict_local_ram, verbose=not a.quiet)
        print(f"=== chaos: scope={scope}, seed {a.seed}, {a.nodes} nodes", flush=True)
        res = run_chaos(cfg)
        results.append(res)
        print()
        print(res.report())
        if not res.ok:
            print(res.events[-1])
        print(flush=True)
    bad = sum(len(r.violations) for r in results)
    print(f"chaos: {len(results)} run(s) in {time.monotonic() - t0:.0f} s, "
          f"{sum(sum(r.faults.values()) for r in results)} faults, {bad} violation(s): "
          f"{'PASS' if bad == 0 else 'FAIL'}")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
